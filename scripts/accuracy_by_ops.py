"""Greedy held-out accuracy per number of operations on the synthetic task.

    python scripts/accuracy_by_ops.py CHECKPOINT [config overrides...]

The held-out questions are those of `configs/tiny.yaml` with the overrides (e.g. `data.max_ops=5
data.sft_max_ops=4 eval.max_new_tokens=144 data.eval_questions=400`). For each operation count it
prints the greedy accuracy and how many steps the policy wrote on average, which tells a policy
that stops early (writes fewer steps than the question has) from one that miscalculates.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from policy.rollout import generate_groups  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.grading import answers_match, extract_final_answer  # noqa: E402
from runtime.steps import split_steps  # noqa: E402
from runtime.synthetic import ANSWER_PREFIX  # noqa: E402
from runtime.tiny_model import load_causal_lm, load_tokenizer  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    checkpoint, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config("configs/tiny.yaml", overrides)
    if cfg.data.source != "synthetic":
        raise SystemExit("accuracy_by_ops: data.source must be synthetic (operations are known)")
    torch.set_num_threads(cfg.run.threads)
    records = load_splits(cfg.data, cfg.run.seed).eval
    model = load_causal_lm(checkpoint, cfg.model.dtype).eval()
    tokenizer = load_tokenizer(checkpoint)
    right, written = defaultdict(int), defaultdict(list)
    for start in range(0, len(records), cfg.eval.batch_size):
        chunk = records[start:start + cfg.eval.batch_size]
        prompts = [cfg.data.prompt_template.format(question=r.question) for r in chunk]
        out = generate_groups(model, tokenizer, prompts, 1, max_new_tokens=cfg.eval.max_new_tokens,
                              greedy=True)
        for text, rec in zip(out.texts, chunk):
            ops = len(rec.solution_steps) - 1  # the last step is the answer line
            answer = extract_final_answer(text)
            right[ops] += answer is not None and answers_match(answer, rec.answer,
                                                               cfg.eval.grade_timeout_s)
            written[ops].append(sum(not s.startswith(ANSWER_PREFIX) for s in split_steps(text)))
    print("ops  questions  greedy  steps written")
    for ops in sorted(written):
        n = len(written[ops])
        print(f"{ops:>3}  {n:>9}  {right[ops] / n:6.3f}  {sum(written[ops]) / n:13.2f}")
    total = sum(len(w) for w in written.values())
    print(f"all  {total:>9}  {sum(right.values()) / total:6.3f}")


if __name__ == "__main__":
    main()
