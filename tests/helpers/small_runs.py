"""Small training runs the algorithm and recipe tests share: a seeded random reward (every group
has signal), a recipe run on the small model, and a weight comparison."""

import torch

from configs import load_config
from iteration.resolve import resolve
from policy.rewards import Scores
from runtime.data import load_splits
from runtime.models import load_causal_lm
from runtime.tiny_model import build_tiny
from runtime.tracking import MetricsLogger

from small_config import SMALL


class RandomReward:
    """Seeded random rewards, right = reward >= 0.5; raises on call `crash_at` (a crash)."""

    def __init__(self, crash_at: int = 0):
        self.gen, self.calls, self.crash_at = torch.Generator().manual_seed(0), 0, crash_at

    def __call__(self, records, rollout):
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("simulated crash")
        rewards = torch.rand(len(records), generator=self.gen)
        return Scores(rewards=rewards, correct=rewards >= 0.5)


def run_recipe(tmp_path, recipe: str | None, *extra: str, reward=None):
    """`recipe` over the small config (outcome supervision, a save every step) from a tiny
    random model built once in `tmp_path/base`; returns (base, final export). Metrics go to
    `tmp_path/m.jsonl`."""
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.eval_every=0",
                                            "run.wandb_mode=disabled", "policy.supervision=outcome",
                                            "policy.save_every=1", *extra], recipe=recipe)
    splits = load_splits(cfg.data, 0)
    base = tmp_path / "base"
    if not (base / "config.json").exists():
        build_tiny(base, cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    final = resolve(cfg).train_policy(tmp_path, base, reward or RandomReward(), splits.rl,
                         splits.eval[:2], logger, "", evaluate_ends=False)
    return base, final


def weights_differ(a, b) -> bool:
    """Both folders load; some tensor of b differs from a's."""
    wa, wb = load_causal_lm(a).state_dict(), load_causal_lm(b).state_dict()
    assert wa.keys() == wb.keys()
    return any(not torch.equal(wa[k], wb[k]) for k in wa)
