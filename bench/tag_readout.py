"""Peak memory of reading a reward model's tag scores at Qwen2.5's 151,936-token vocabulary: the
full [B, L, V] logits against the output layer's `+` and `-` rows alone
(`reward_model.score.two_row_head`), side by side, each in a fresh process.

    python bench/tag_readout.py [--batch 8] [--length 1024] [--dtype float32]

The model is a random 2-layer Qwen2 (hidden 64) with the real vocabulary, so the logits dominate
as they do at 7B; the number is the growth of the process's peak RSS over the forward pass.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from transformers import Qwen2Config, Qwen2ForCausalLM
from reward_model.encoding import TagTokens
from reward_model.score import tag_margins
from reward_model.losses import tag_logit_margin
mode, batch, length, dtype = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=4096, tie_word_embeddings=True)
model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
tags = TagTokens(tag_id=5, plus_id=10, minus_id=11)
ids = torch.randint(0, 151936, (batch, length))
mask = torch.ones_like(ids)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    if mode == "full":
        margin = tag_logit_margin(model(input_ids=ids, attention_mask=mask).logits, 10, 11)
    else:
        margin = tag_margins(model, ids, mask, tags)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"mb": (after - before) / 1024, "checksum": float(margin.float().sum())}))
"""


def run(mode: str, ns) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), mode, str(ns.batch),
                           str(ns.length), ns.dtype], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    ns = parser.parse_args()
    full, rows = run("full", ns), run("two rows", ns)
    print(f"| read-out | peak RSS growth (MB), {ns.batch} x {ns.length} tokens, {ns.dtype} |")
    print("| --- | --- |")
    print(f"| full logits [B, L, V] | {full['mb']:.0f} |")
    print(f"| `+` and `-` rows | {rows['mb']:.0f} |")
    print(f"full / rows: {full['mb'] / max(rows['mb'], 1e-9):.0f}x; same margins: "
          f"{abs(full['checksum'] - rows['checksum']) <= 1e-3 * abs(full['checksum']) + 1e-3}")


if __name__ == "__main__":
    main()
