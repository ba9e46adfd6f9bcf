"""Where does a PRM go wrong? Per-category step accuracy on synthetic solutions, and how well a
backbone reads the tagged Math-Shepherd layout compared with its own.

    python experiments/prm_diagnosis.py --prm runs/tiny/rm-prm/final [--policy runs/tiny/sft/best]

With `--prm`: labels held-out solutions (half correct, half with one slip whose kind and position
are known) and prints the PRM's step accuracy per category: steps of clean solutions, steps before
the slip, the slip itself (arithmetic or reading), the steps after it, and the final answer line.
With `--policy`: the policy's next-token accuracy on result digits of correct solutions, written
the way it was trained ("question\\nstep\\n...") and in the Math-Shepherd layout the reward models
read ("question Step 1: step ки\\n..."): how much of the policy's arithmetic a reward model
initialised from it keeps.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from process_supervision.formats import StepExample, to_math_shepherd  # noqa: E402
from reward_model.score import TagScorer  # noqa: E402
from tasks import synthetic  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402


def labelled_with_slips(records, seed: int):
    """(example, first wrong index or None, slip kind) per record; half get one slip."""
    rng = random.Random(seed)
    out = []
    for rec in records:
        problem = synthetic.Problem(rec.question, rec.solution_steps, int(rec.answer))
        if rng.random() < 0.5:
            steps, k = synthetic.corrupt_solution(problem, rng)
            true_step = synthetic.render_step(*synthetic.true_chain(rec.question)[k])
            kind = "reading" if steps[k].split(":")[0] != true_step.split(":")[0] else "arithmetic"
        else:
            steps, k, kind = problem.steps, None, "clean"
        truth = synthetic.step_correctness(rec.question, steps)
        out.append((StepExample(rec.question, tuple(steps), tuple(float(t) for t in truth)),
                    k, kind))
    return out


def category_accuracy(scorer: TagScorer, labelled) -> dict[str, tuple[float, int]]:
    predicted = scorer.score([ex for ex, _, _ in labelled])
    hits = collections.defaultdict(lambda: [0, 0])
    for (ex, k, kind), scores in zip(labelled, predicted):
        for j, (label, score) in enumerate(zip(ex.labels, scores)):
            cat = "clean" if k is None else "before slip" if j < k else \
                f"the {kind} slip" if j == k else f"after a {kind} slip"
            if j == len(ex.labels) - 1:
                cat += " (answer line)"
            hits[cat][0] += (score >= 0.5) == (label >= 0.5)
            hits[cat][1] += 1
    return {cat: (hit / n, n) for cat, (hit, n) in sorted(hits.items())}


@torch.no_grad()
def result_digit_accuracy(model, tokenizer, texts: list[str]) -> float:
    """Greedy next-token accuracy on the digits that follow each `=`."""
    hit = total = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        tokens = tokenizer.convert_ids_to_tokens(ids)
        predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        for j in range(1, len(ids)):
            if tokens[j].isdigit() and "=" in "".join(tokens[max(0, j - 3):j]):
                hit += predicted[j - 1] == ids[j]
                total += 1
    return hit / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prm", help="a trained PRM folder")
    parser.add_argument("--policy", help="a policy folder (the reward models' backbone)")
    parser.add_argument("--solutions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg = load_config("configs/tiny.yaml")
    records = load_splits(cfg.data, args.seed).eval[:args.solutions]
    if args.prm:
        scorer = TagScorer.from_pretrained(args.prm, cfg.rm.step_tag, cfg.rm.max_length)
        print("PRM step accuracy by category:")
        for cat, (acc, n) in category_accuracy(scorer, labelled_with_slips(records, 5)).items():
            print(f"  {cat:40s} {acc:.3f}  ({n} steps)")
    if args.policy:
        model, tokenizer = load_causal_lm(args.policy).eval(), load_tokenizer(args.policy)
        own = [prompt_format(cfg.data).prompt(tokenizer, r.question)
               + prompt_format(cfg.data).join(r.solution_steps) for r in records]
        tagged = [to_math_shepherd(r.question, r.solution_steps, None, cfg.rm.step_tag)[0]
                  for r in records]
        print(f"policy next-digit accuracy: own layout {result_digit_accuracy(model, tokenizer, own):.3f}, "
              f"Math-Shepherd layout {result_digit_accuracy(model, tokenizer, tagged):.3f}")


if __name__ == "__main__":
    main()
