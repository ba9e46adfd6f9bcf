"""Greedy held-out accuracy per number of operations on the synthetic task.

    python experiments/accuracy_by_ops.py CHECKPOINT [--samples N] [--ops K] [--limit Q] [overrides...]

The held-out questions are those of `configs/tiny.yaml` with the overrides (e.g. `data.max_ops=5
data.sft_max_ops=4 eval.max_new_tokens=144 data.eval_questions=400`). For each operation count it
prints the greedy accuracy and how many steps the policy wrote on average, which tells a policy
that stops early (writes fewer steps than the question has) from one that miscalculates.
`--samples N` adds N samples a question at `eval.temperature`: their accuracy, pass@N and the share
that write as many steps as the question has operations (what GRPO with G=N has to learn from); `--ops K` keeps questions with K operations only,
`--limit Q` the first Q of them.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from policy.generation.rollout import generate_groups  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from tasks.grading import answers_match, extract_final_answer  # noqa: E402
from runtime.steps import split_steps  # noqa: E402
from tasks.synthetic import ANSWER_PREFIX  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--samples", type=int, default=0)
    parser.add_argument("--ops", type=int, default=0)
    parser.add_argument("--limit", type=int, default=0)
    args, overrides = parser.parse_known_args()
    cfg = load_config("configs/tiny.yaml", overrides)
    if cfg.data.source != "synthetic":
        raise SystemExit("accuracy_by_ops: data.source must be synthetic (operations are known)")
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    records = [r for r in load_splits(cfg.data, cfg.run.seed).eval
               if not args.ops or len(r.solution_steps) - 1 == args.ops]
    records = records[:args.limit or None]
    model = load_causal_lm(args.checkpoint, cfg.model).eval()
    tokenizer = load_tokenizer(args.checkpoint, cfg.model)

    def grade(texts: list[str], gold: str) -> tuple[list[bool], list[int]]:
        """Right or not, and steps written (lines before the answer line), per text."""
        answers = [extract_final_answer(t) for t in texts]
        right = [a is not None and answers_match(a, gold, cfg.eval.grade_timeout_s) for a in answers]
        return right, [sum(not s.startswith(ANSWER_PREFIX) for s in split_steps(t)) for t in texts]

    rows = defaultdict(lambda: defaultdict(list))  # ops -> measure -> values
    per_call = max(1, cfg.eval.batch_size // max(1, args.samples))
    for start in range(0, len(records), per_call):
        chunk = records[start:start + per_call]
        prompts = prompt_format(cfg.data).prompts(tokenizer, chunk)
        greedy = generate_groups(model, tokenizer, prompts, 1,
                                 max_new_tokens=cfg.eval.max_new_tokens, greedy=True)
        sampled = generate_groups(model, tokenizer, prompts, args.samples,
                                  max_new_tokens=cfg.eval.max_new_tokens,
                                  temperature=cfg.eval.temperature) if args.samples else None
        for q, rec in enumerate(chunk):
            ops = len(rec.solution_steps) - 1  # the last step is the answer line
            row = rows[ops]
            right, written = grade([greedy.texts[q]], rec.answer)
            row["greedy"] += right
            row["written"] += written
            if sampled:
                right, written = grade(sampled.texts[q * args.samples:(q + 1) * args.samples],
                                       rec.answer)
                row["sample"].append(sum(right) / len(right))
                row["pass"].append(any(right))
                row["all_steps"].append(sum(w >= ops for w in written) / len(written))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    head = "ops  questions  greedy  steps written"
    print(head + (f"  sample acc  pass@{args.samples}  samples writing all steps" if args.samples else ""))
    for ops in sorted(rows):
        row = rows[ops]
        line = f"{ops:>3}  {len(row['greedy']):>9}  {mean(row['greedy']):6.3f}  {mean(row['written']):13.2f}"
        if args.samples:
            line += f"  {mean(row['sample']):10.4f}  {mean(row['pass']):7.3f}  {mean(row['all_steps']):25.4f}"
        print(line)
    every = [v for row in rows.values() for v in row["greedy"]]
    print(f"all  {len(every):>9}  {mean(every):6.3f}")


if __name__ == "__main__":
    main()
