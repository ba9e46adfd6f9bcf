"""Sample a policy on synthetic training questions and label every step with its true correctness.

    python experiments/policy_step_labels.py --policy runs/learning/seed0/sft/best --questions 640 \
        --out policy_samples.jsonl
    igrpo train-rm --config configs/tiny.yaml rm.kind=prm rm.data_path=policy_samples.jsonl ...

Writes Math-Shepherd JSONL: a PRM trained on the policy's own samples without the completer's
cost. On the synthetic task a step's true correctness is known (`tasks.synthetic`), and
Math-Shepherd hard estimates agree with it on 95.7% of steps (docs/reward_models.md), so this
stands in for labelling by completion. Questions come from the RL pool (from index `--offset`, 20,000), never
from the held-out split.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from policy.generation.rollout import generate_groups  # noqa: E402
from process_supervision.formats import StepExample, write_math_shepherd_jsonl  # noqa: E402
from tasks import synthetic  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.steps import split_steps  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--questions", type=int, default=640)
    p.add_argument("--samples", type=int, default=16, help="samples per question")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offset", type=int, default=20000,
                   help="first question of the RL pool used (held-out sets: a range of their own)")
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(a.seed)
    cfg = load_config("configs/tiny.yaml", [])
    records = load_splits(cfg.data, 0).rl[a.offset:a.offset + a.questions]
    model, tokenizer = load_causal_lm(a.policy).eval(), load_tokenizer(a.policy)
    examples, right, started = [], 0, time.perf_counter()
    for start in range(0, len(records), 16):
        chunk = records[start:start + 16]
        rollout = generate_groups(model, tokenizer,
                                  prompt_format(cfg.data).prompts(tokenizer, chunk), a.samples, max_new_tokens=112,
                                  temperature=1.0)
        for q, rec in enumerate(chunk):
            for text in rollout.texts[q * a.samples:(q + 1) * a.samples]:
                steps = split_steps(text)
                if not steps:
                    continue
                truth = synthetic.step_correctness(rec.question, steps)
                right += truth[-1]
                examples.append(StepExample(rec.question, tuple(steps),
                                            tuple(float(t) for t in truth), rec.source_id))
        print(f"{start + len(chunk)}/{len(records)} questions", flush=True)
    write_math_shepherd_jsonl(a.out, examples)
    print(f"{len(examples)} samples, {right / max(len(examples), 1):.3f} right, "
          f"{time.perf_counter() - started:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
