"""T-PPO (policy/algorithms/tppo.py): windows carry unfinished sequences and filter ended ones,
and a crash resumes the same sequences bitwise."""

import pytest
import torch
from safetensors.torch import load_file

from runtime.tracking import read_metrics

from small_runs import RandomReward, run_recipe


def test_tppo_windows_carry_unfinished_sequences_and_filter_ended_ones(tmp_path):
    """T-PPO with a 4-token window of a 12-token budget: each step trains only its window's
    tokens, sequences still running carry over (with their tokens) and ended ones leave; the
    pool is saved with the state, so a crash resumes the same sequences bitwise."""
    from policy.algorithms.tppo import fill_pool, window_rollout

    pool, nxt = fill_pool([{"k": 0, "tokens": [5, 6]}], 3, 7)
    assert pool == [{"k": 0, "tokens": [5, 6]}, {"k": 7, "tokens": []}, {"k": 8, "tokens": []}]
    assert nxt == 9
    # a row that ended with EOS (id 1), one that ran out of tokens (budget 4), one running on
    rollout, window, ended = window_rollout(0, 1, [[9, 9], [9], [9, 9]], [[5, 6], [], [7]],
                                            [[8, 1], [4, 4, 4, 4], [3]], ["a", "b", "c"], 4, 1)
    assert ended.tolist() == [True, True, False]
    assert rollout.truncated.tolist() == [False, True, False]
    assert window.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert rollout.prompt_ids.tolist() == [[9, 9], [0, 9], [9, 9]]

    window_args = ("policy.steps=3", "ppo.window_share=0.34")  # 4 tokens of 12
    _, final_a = run_recipe(tmp_path / "straight", "t_ppo", *window_args)
    rows = read_metrics(tmp_path / "straight" / "m.jsonl")
    assert all(0 < r["tppo/window_tokens"] <= 8 * 4 for r in rows)
    assert sum(r["tppo/ended"] for r in rows) > 0 and rows[0]["tppo/carried"] > 0
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(crashed, "t_ppo", *window_args, reward=_CountingCrash(rows, crash_step=3))
    _, final_b = run_recipe(crashed, "t_ppo", *window_args, reward=_CountingCrash(rows, skip=2))
    for name in ("final", "critic"):
        a = load_file(str(final_a.parent / name / "model.safetensors"))
        b = load_file(str(final_b.parent / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


class _CountingCrash(RandomReward):
    """RandomReward's stream, called only for steps where some sequence ended: crashes at the call
    of step `crash_step`, or starts `skip` steps into the stream (the calls those steps made,
    found from the straight run's metrics)."""

    def __init__(self, rows, crash_step: int = 0, skip: int = 0):
        super().__init__()
        calls = [(r["step"], int(r["tppo/ended"])) for r in rows if r["tppo/ended"] > 0]
        steps = [step for step, _ in calls]
        self.crash_at = steps.index(crash_step) + 1 if crash_step in steps else 0
        for step, ended in calls:
            if step <= skip:  # the draws those steps made: one per ended sequence
                self(["q"] * ended, None)
        self.calls = 0
