"""The positional bias of each process credit form: the mean token advantage at each step position
in groups whose samples are all right, where outcome supervision gives every token 0.

A reward model whose step scores fall step by step by construction (the likelihood feature's
running minimum) hands, under DeepSeekMath's pooled normalisation, the early steps of an all-right
group positive advantages and the answer line negative ones: the policy is pushed on where a step
sits, not on whether it is right. This samples the policy (`model.policy_path`) on RL questions,
G samples each, scores them with a PRM, and prints, for every form of `PROCESS_CREDIT`, the mean
advantage of each step position (the advantage at the step's last token) over the all-right
groups' samples, and over the other groups' for contrast.

    python scripts/credit_bias.py --prm runs/tiny/rm-prm/iteration-0/final     # ~5 min, 2 cores
    python scripts/credit_bias.py --prm ... --no-carry     # questions without a carry or borrow

The run's PRM reads the policy's samples exactly as GRPO's reward does (`policy.supervision=process`,
`rm.aggregate`), with the config's group size and temperature.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import load_config  # noqa: E402
from iteration import stages  # noqa: E402
from policy.generation.rollout import generate_groups  # noqa: E402
from policy.math.advantages import PROCESS_CREDIT, GroupNorm  # noqa: E402
from iteration.resolve import make_reward, resolve  # noqa: E402
from tasks import synthetic  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402


def step_position_means(advantages: torch.Tensor, step_mask: torch.Tensor,
                        step_end_index: torch.Tensor, rows: torch.Tensor,
                        from_end: bool = False) -> list[float]:
    """Mean over `rows` ([N] bool) of the advantage at the last token of step j, per position j
    (with `from_end`, counted from the sample's last step: 0 is its answer line); only samples
    that have a step j count; NaN where none does."""
    index = step_end_index.clamp(min=0, max=advantages.shape[1] - 1)
    at_end = advantages.gather(1, index)
    if from_end:  # right-align each sample's steps
        count = step_mask.sum(-1, keepdim=True)
        order = (count - 1 - torch.arange(step_mask.shape[1])).clamp(min=0)
        at_end = torch.where(step_mask, at_end, 0.0).gather(1, order)
        step_mask = torch.arange(step_mask.shape[1]) < count
    means = []
    for j in range(step_mask.shape[1]):
        real = step_mask[:, j] & rows
        means.append(float(at_end[real, j].mean()) if real.any() else float("nan"))
    return means


def sample_and_score(cfg, prm: str, records) -> tuple:
    """(step_rewards, step_mask, step_end_index [N, S], correct [N], completion width T): the
    policy's G samples of each record, scored by the PRM as GRPO's process reward scores them."""
    w = resolve(cfg)
    model, tokenizer = stages.load_policy(w, cfg.model.policy_path)
    reward = make_reward(w, tokenizer, "rm", lambda kinds: {"prm": stages.load_scorer(w, prm)})
    g, fmt = cfg.policy, prompt_format(cfg.data)
    found: dict = {}
    for start in range(0, len(records), 2):
        chunk = records[start:start + 2]
        rollout = generate_groups(model, tokenizer, fmt.prompts(tokenizer, chunk), g.group_size,
                                  max_new_tokens=g.max_new_tokens, temperature=g.temperature)
        scores = reward([r for r in chunk for _ in range(g.group_size)], rollout)
        for key in ("step_rewards", "step_mask", "step_end_index", "correct"):
            found.setdefault(key, []).append(getattr(scores, key))
        found.setdefault("width", []).append(rollout.completion_ids.shape[1])
        print(f"[credit_bias] {start + len(chunk)}/{len(records)} questions sampled and scored",
              flush=True)
    steps = max(t.shape[1] for t in found["step_mask"])

    def cat(key, fill):
        return torch.cat([torch.nn.functional.pad(t, (0, steps - t.shape[1]), value=fill)
                          for t in found[key]])

    return (cat("step_rewards", 0.0).float(), cat("step_mask", False), cat("step_end_index", 0),
            torch.cat(found["correct"]), max(found["width"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prm", required=True, help="a trained PRM (e.g. rm-prm/iteration-0/final)")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--no-carry", action="store_true",
                        help="only questions with no carry or borrow (synthetic task), which the "
                             "warm start gets all right far more often: more all-right groups")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, ["policy.supervision=process", *args.overrides])
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(cfg.run.threads)
    g, p = cfg.grpo, cfg.policy
    records = resolve(cfg).splits().rl
    if args.no_carry:
        records = [r for r in records if not any(
            synthetic.carries(v, op, n) for v, op, n, _ in synthetic.true_chain(r.question))]
    records = records[:args.questions]
    step_rewards, step_mask, step_end, correct, width = sample_and_score(cfg, args.prm, records)
    all_right = correct.view(-1, p.group_size).all(-1).repeat_interleave(p.group_size)
    norm = GroupNorm(p.group_size, g.scale_by_std, g.std_unbiased, g.std_eps, g.min_reward_std)
    table = {"questions": len(records), "no_carry": args.no_carry, "group_size": p.group_size,
             "all_right_groups": int(all_right.sum()) // p.group_size, "forms": {}}
    for name, credit in PROCESS_CREDIT.items():
        advantages, _ = credit.estimate(step_rewards, step_mask, step_end, correct, width, norm,
                                        g.process_weight)
        table["forms"][name] = {
            "all_right": step_position_means(advantages, step_mask, step_end, all_right),
            "all_right_from_end": step_position_means(advantages, step_mask, step_end, all_right,
                                                      from_end=True),
            "others": step_position_means(advantages, step_mask, step_end, ~all_right)}
    print(f"{table['all_right_groups']} of {len(records)} groups all right; mean advantage at "
          "the end of step j from the first (from_end: from the answer line back)")
    for name, rows in table["forms"].items():
        for which, means in rows.items():
            print(f"{name:>9} {which:>18}: " + " ".join(f"{m:+.2f}" for m in means))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), **table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
