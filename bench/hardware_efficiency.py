"""How close to the machine: a policy update step's achieved FLOP/s against this machine's fp32
matmul throughput, measured side by side in one run, on a ~20M-parameter tiny Llama.

    python bench/hardware_efficiency.py [--batch 16 --tokens 256 --repeats 5 --profile]

- machine: median FLOP/s of a 2048 x 2048 fp32 `torch.mm` (2 n^3 FLOPs each);
- update: one GRPO-style training step (forward, backward, AdamW) through the same DeepSpeed
  engine the loops use; FLOPs counted as 6 x params x tokens (forward 2, backward 4; attention
  scores are not counted, as is usual, which flatters no one at these lengths);
- forward-only (reference / old log-probs): 2 x params x tokens.
With `--profile`, the top operators of one update by self CPU time say where the rest goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def matmul_flops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - started)
    return 2 * n ** 3 / statistics.median(times)


def main() -> None:
    from configs.schema import DeepSpeedConfig
    from policy.generation.logprobs import completion_logprobs
    from runtime.engine import build_engine
    from runtime.tiny_model import build_model, build_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer(())
    model = build_model(tokenizer, hidden_size=512, num_layers=6, num_heads=8,
                        intermediate_size=1536, max_positions=1024, seed=0)
    params = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, DeepSpeedConfig(micro_batch_size=args.batch), lr=1e-5,
                          micro_batch_size=args.batch, grad_accum=1)
    ids = torch.randint(3, len(tokenizer), (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    tokens = ids.numel()

    def update():
        logprobs = completion_logprobs(engine, ids, mask, 1)
        engine.backward(-logprobs.mean())
        engine.step()

    def forward():
        with torch.no_grad():
            completion_logprobs(engine.module, ids, mask, 1)

    results = {}
    for name, fn, factor in (("update", update, 6), ("forward", forward, 2)):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        results[name] = factor * params * tokens / statistics.median(times)
    machine = matmul_flops()
    print(f"model {params / 1e6:.1f}M params, batch {args.batch} x {args.tokens} tokens, "
          f"{args.threads} threads, medians of {args.repeats}")
    print(f"{'what':<32}{'GFLOP/s':>10}{'of matmul':>11}")
    print(f"{'fp32 torch.mm 2048^2 (machine)':<32}{machine / 1e9:>10.1f}{1:>10.0%}")
    for name, value in results.items():
        print(f"{name + ' step (6 or 2 x N x D)':<32}{value / 1e9:>10.1f}{value / machine:>10.0%}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            update()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
