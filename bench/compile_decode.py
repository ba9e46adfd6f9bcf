"""torch.compile of one decoding step against eager, on transformers' full-length StaticCache
(static shapes: inductor fails on this stack with dynamic ones), greedy, the shipped warm start.

    python bench/compile_decode.py [--rows 64] [--threads 2]

Prints ms per generated token for eager and compiled (after its first, compiling, pass) and the
compile time; a batch size that changes (rows leaving the batch) compiles again.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from transformers import StaticCache

    from runtime.models import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    model = load_causal_lm(root / "runtime/bundled/tiny_warm_start").eval()
    prompt, new = 60, 112
    ids = torch.randint(5, 90, (args.rows, prompt), generator=torch.Generator().manual_seed(0))

    def per_token(step) -> float:
        cache = StaticCache(config=model.config, max_cache_len=prompt + new)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt))
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            started = time.perf_counter()
            for i in range(new):
                logits = step(input_ids=token, past_key_values=cache,
                              cache_position=torch.tensor([prompt + i])).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - started) / new * 1e3

    eager = min(per_token(model) for _ in range(2))
    compiled_step = torch.compile(model.forward, dynamic=False)
    started = time.perf_counter()
    per_token(compiled_step)
    compile_s = time.perf_counter() - started
    compiled = min(per_token(compiled_step) for _ in range(2))
    print(f"{args.rows} rows: eager {eager:.1f} ms/token, compiled {compiled:.1f} ms/token "
          f"(compiled / eager {compiled / eager:.2f}x), first compiled pass {compile_s:.1f} s")


if __name__ == "__main__":
    main()
