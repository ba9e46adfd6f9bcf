"""A LoRA policy's two ways into vLLM, side by side: its merged weights streamed into vLLM's own
(`rollout.lora_push=merged`, the default) against its adapter alone, served by vLLM's LoRA
support (`rollout.lora_push=adapter`). Run it with the vLLM venv's python:

    .venv-vllm/bin/python bench/lora_push.py [--steps 5] [--rounds 2] [--rank 16]
                                             [--model bundled|wide] [--group-size 16]

Each run is one GRPO stage sampled by vLLM's CPU build, from the same start (configs/tiny.yaml,
2 questions x G a step, the rule reward), with a rank-`--rank` LoRA on every linear layer, in a
process of its own (a process holds one vLLM engine; an adapter-serving one is made with LoRA
on), the two ways alternating for `--rounds` rounds. Per run, the medians over the steps after
the first: `time/weight_push` (seconds handing the step's weights or adapter over),
`rollout/tokens_per_s`, `time/rollout` and `time/step`; and the process's peak RSS.
`--model wide`: bench/lora_vs_full.py's random 8-layer 1024-wide Llama (103M parameters).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lora_vs_full import alternate, wide_model  # noqa: E402



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", choices=("bundled", "wide"), default="bundled")
    parser.add_argument("--group-size", type=int, default=16)
    args = parser.parse_args()

    from configs.loader import BUNDLED

    work = Path(tempfile.mkdtemp(prefix="lora-push-"))
    start = BUNDLED / "tiny_warm_start" if args.model == "bundled" else wide_model(work / "wide")
    common = [f"policy.steps={args.steps}", "policy.eval_every=0",
              f"policy.group_size={args.group_size}", "policy.questions_per_step=2",
              "policy.supervision=outcome", "run.wandb_mode=disabled", "inspect.every=0",
              "policy.save_every=1000", "rollout.backend=vllm", "rollout.kv_cache_gb=1",
              f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}",
              "policy.lr=5e-4"]
    arms = {"merged": ["rollout.lora_push=merged"], "adapter": ["rollout.lora_push=adapter"]}
    summary = alternate(arms, common, start, args.rounds, work,
                        ["time/weight_push", "rollout/tokens_per_s", "time/rollout", "time/step"])
    merged, adapter = summary["merged"], summary["adapter"]
    print(f"\nmodel {args.model}, rank {args.rank}, G = {args.group_size}, {args.rounds} rounds "
          f"of {args.steps} steps; medians (adapter / merged):")
    for key in merged:
        ratio = adapter[key] / merged[key] if merged[key] else float("nan")
        print(f"  {key:<22} merged {merged[key]:10.4g}   adapter {adapter[key]:10.4g}   "
              f"ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
