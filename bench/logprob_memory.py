"""Peak memory of per-token log-probs: chunked `selective_log_softmax` vs full log_softmax+gather.

    python bench/logprob_memory.py [--n 64 --t 1024 --vocab 32000 --repeats 3]

Each measurement runs in a fresh child process (so one path's peak cannot hide the other's): it
builds bf16 logits [N, T, V] (what a bf16 model returns), records its resident set size, computes
the float32 log-probs of the sampled tokens one way, and reports the peak RSS growth over the
logits themselves (Linux VmHWM, reset through /proc/self/clear_refs after the logits exist). Values are compared in the parent: they must agree to 1e-5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from policy.generation.logprobs import selective_log_softmax
n, t, v, how = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
logits = (torch.randn(n, t, v) * 3).to(torch.bfloat16)
targets = torch.randint(0, v, (n, t))

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM to the current RSS
    handle.write("5")
base = rss("VmRSS:")
if how == "full":
    out = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
else:
    out = selective_log_softmax(logits, targets)
peak = rss("VmHWM:") - base
torch.save(out[:4, :64].clone(), sys.argv[6])
print(json.dumps({"peak_bytes": peak, "logits_bytes": logits.numel() * 2}))
"""


def measure(how: str, n: int, t: int, v: int, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(n), str(t), str(v), how,
                           str(out)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--t", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    peaks: dict[str, list[int]] = {"full": [], "chunked": []}
    for _ in range(args.repeats):
        for how in peaks:
            result = measure(how, args.n, args.t, args.vocab, tmp / f"{how}.pt")
            peaks[how].append(result["peak_bytes"])
    full = torch.load(tmp / "full.pt", weights_only=True)
    chunked = torch.load(tmp / "chunked.pt", weights_only=True)
    gib = 1024 ** 3
    med = {k: statistics.median(v) for k, v in peaks.items()}
    print(f"N={args.n} T={args.t} V={args.vocab}: bf16 logits "
          f"{result['logits_bytes'] / gib:.2f} GiB (input, not counted); medians of "
          f"{args.repeats}")
    print(f"{'path':<10}{'peak GiB over the logits':>26}")
    for how, value in med.items():
        print(f"{how:<10}{value / gib:>26.3f}")
    print(f"ratio full / chunked: {med['full'] / max(med['chunked'], 1):.1f}x")
    print(f"max |difference| of the log-probs: {(full - chunked).abs().max().item():.2e} "
          f"(equal to 1e-5: {torch.allclose(full, chunked, atol=1e-5)})")


if __name__ == "__main__":
    main()
