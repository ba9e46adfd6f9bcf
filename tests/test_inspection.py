"""Advantage inspection: the table and heatmap show exactly the advantages the loss used."""

import dataclasses
import json
import re

import pandas
import pytest
import torch
from datasets import load_dataset

from configs import load_config
from policy import inspection
from policy.math.advantages import normalised_step_rewards
from policy.math.losses import POLICY_LOSSES
from policy.rewards import Scores, grade_samples
from policy.generation.rollout import Rollout
from iteration.resolve import resolve
from runtime.data import MathRecord, load_splits
from runtime.steps import pad_steps, split_steps, step_end_token_indices
from runtime.tiny_model import build_tiny
from runtime.models import load_tokenizer
from runtime.tracking import MetricsLogger
from wandb_offline import read_offline_run
from small_config import SMALL


class _VariedStepReward:
    """Process reward with varied, deterministic step scores (so advantages are not all 0)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, records, rollout):
        values, ends = [], []
        for i, text in enumerate(rollout.texts):
            ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            steps = split_steps(text)
            values.append([(len(s) * 7 + k) % 5 / 4 for k, s in enumerate(steps)])
            ends.append(step_end_token_indices(self.tokenizer, ids, text))
        step_rewards, step_mask, step_end = pad_steps(values, ends)
        rewards = step_rewards.masked_fill(~step_mask, 0).sum(-1)
        return Scores(rewards=rewards, correct=grade_samples(records, rollout.texts),
                      step_rewards=step_rewards, step_mask=step_mask, step_end_index=step_end)


def _capture_loss(monkeypatch) -> list[torch.Tensor]:
    captured = []
    spec = POLICY_LOSSES["grpo"]

    def recording(logprobs, old, ref, advantages, mask, **kw):
        captured.append(advantages.detach().clone())
        return spec.fn(logprobs, old, ref, advantages, mask, **kw)

    monkeypatch.setitem(POLICY_LOSSES, "grpo", dataclasses.replace(spec, fn=recording))
    return captured


def _sample_rows(rows):
    """Rollout row index of each table row: groups in order of appearance, G from the config."""
    groups = list(dict.fromkeys(r["question_id"] for r in rows))
    return [groups.index(r["question_id"]) * 4 + r["sample"] for r in rows]


@pytest.mark.parametrize("supervision", ["process", "outcome", "rft", "anchored"])
def test_table_and_html_match_the_advantages_the_loss_used(tmp_path, monkeypatch, supervision):
    """`anchored`: process supervision in the anchored credit form (its normalised values carry
    the outcome part in an extra column; the table shows the steps' own)."""
    credit = ["policy.supervision=process", "grpo.process_credit=anchored"] \
        if supervision == "anchored" else [f"policy.supervision={supervision}"]
    cfg = load_config("configs/tiny.yaml", [
        f"run.root={tmp_path}", *SMALL, "policy.steps=2", "policy.eval_every=0",
        "policy.max_new_tokens=40", "deepspeed.micro_batch_size=8", "inspect.every=1",
        "inspect.groups=2", "inspect.samples=4", *credit, "run.wandb_mode=offline"])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    tokenizer = load_tokenizer(base)
    captured = _capture_loss(monkeypatch)
    torch.manual_seed(0)  # the rollout samples from the global RNG: fix it for this test
    logger = MetricsLogger(tmp_path / "grpo" / "metrics.jsonl", config={"grpo": {"x": 1}},
                           mode="offline", project="igrpo-test", name="inspect")
    resolve(cfg).train_policy(tmp_path, base, _VariedStepReward(tokenizer), splits.rl, splits.eval[:2],
               logger, "")
    logger.close()
    assert len(captured) == 2  # one micro-batch, mu = 1, two steps
    offline_dir = next((tmp_path / "grpo" / "wandb").glob("offline-run-*"))
    history = read_offline_run(offline_dir)["history"]
    multi_step, rft_values = 0, set()
    for step in (1, 2):
        advantages = captured[step - 1]
        assert advantages.abs().sum() > 0  # the varied reward gives real signal
        table = tmp_path / "grpo" / "inspect" / f"step-{step:06d}.jsonl"
        rows = [json.loads(line) for line in table.read_text().splitlines()]
        assert {r["sample"] for r in rows} == {0, 1, 2, 3}
        # The same table through pandas and datasets.
        assert len(pandas.read_json(table, lines=True)) == len(rows)
        assert load_dataset("json", data_files=str(table), split="train").num_rows == len(rows)
        by_sample: dict[int, list[dict]] = {}
        for i, row in zip(_sample_rows(rows), rows):
            by_sample.setdefault(i, []).append(row)
            span = advantages[i, row["token_start"]:row["token_end"] + 1]
            assert len(span) > 0 and torch.allclose(span, torch.full_like(span, row["advantage"]),
                                                    atol=1e-6)
        for i, steps in by_sample.items():
            assert [s["step_index"] for s in steps] == list(range(len(steps)))
            # Steps tile the completion: contiguous token ranges up to its last real token.
            assert steps[0]["token_start"] == 0
            for a, b in zip(steps, steps[1:]):
                assert b["token_start"] == a["token_end"] + 1
            multi_step += len(steps) > 1
            if supervision == "process":  # A_k = sum of normalised rewards of steps >= k
                norm = [s["normalised_reward"] for s in steps]
                for k, s in enumerate(steps):
                    assert s["advantage"] == pytest.approx(sum(norm[k:]), abs=1e-5)
            elif supervision == "anchored":  # A_k = o + 0.5 clip(v~_k): o one per sample
                outcome = {round(s["advantage"] - 0.5 * min(max(s["normalised_reward"], -1), 1),
                                 5) for s in steps}
                assert len(outcome) == 1
            else:
                assert len({round(s["advantage"], 6) for s in steps}) == 1
            if supervision == "rft":  # online RFT: 1 on a sample judged right, else 0
                assert steps[0]["advantage"] == float(steps[0]["final_reward"] >= 0.5)
                rft_values.add(steps[0]["advantage"])
        # The wandb table (offline run files) holds the same rows.
        logged = next(h for h in history if h["_step"] == step)
        wandb_table = json.loads((offline_dir / "files" / logged["inspect/advantages/path"])
                                 .read_text())
        assert wandb_table["columns"] == list(inspection.COLUMNS)
        for got, want in zip(wandb_table["data"], rows):
            assert dict(zip(wandb_table["columns"], got)) == pytest.approx(want)
        # The HTML marks every step boundary once, and exists in the run folder and in wandb.
        page = table.with_suffix(".html").read_text()
        assert page.count("class='step-end'") == len(rows)
        wandb_page = (offline_dir / "files" / logged["inspect/tokens/path"]).read_text()
        assert wandb_page.count("class='step-end'") == len(rows)
        assert logged["inspect/token_advantages/_type"] == "histogram"
        # Outcome advantages sum to 0 over a group, and so do the normalised step rewards.
        if supervision != "rft":  # no baseline there
            assert logged["train/advantage_group_sum"] == pytest.approx(0, abs=1e-4)
    assert multi_step >= 2  # the check above really covered step boundaries
    assert supervision != "rft" or rft_values == {0.0, 1.0}  # both kinds of sample were seen


def test_rows_by_hand():
    """Two samples of one group, process supervision: rows from hand-set rewards and step ends."""
    tokenizer = type("T", (), {"decode": lambda self, ids, skip_special_tokens=True:
                               "".join(chr(97 + i) for i in ids)})()
    completion = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    rollout = Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                      completion, mask, ["abcd", "efg"], torch.zeros(2, dtype=torch.bool), 2)
    # Sample 0: steps end at tokens 1 and 3 (rewards 1, 0); sample 1: one step ending at 2 (1).
    scores = Scores(rewards=torch.tensor([0.0, 1.0]), correct=torch.tensor([False, True]),
                    step_rewards=torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
                    step_mask=torch.tensor([[True, True], [True, False]]),
                    step_end_index=torch.tensor([[1, 3], [2, 0]]))
    normalised = normalised_step_rewards(scores.step_rewards, scores.step_mask, 2, eps=0.0)
    # Rewards (1, 0, 1): mean 2/3, population std sqrt(2)/3 -> +0.7071, -1.4142, +0.7071.
    assert normalised[0].tolist() == pytest.approx([0.70711, -1.41421], abs=1e-4)
    assert normalised[1, 0].item() == pytest.approx(0.70711, abs=1e-4)
    assert inspection.group_sum_check(normalised, 2) == pytest.approx(0, abs=1e-6)
    advantages = torch.tensor([[-0.70711, -0.70711, -1.41421, -1.41421], [0.70711] * 3 + [0.0]])
    records = [MathRecord("q", "1", ("1",), "synthetic:0:7")] * 2
    rows = inspection.advantage_rows(5, records, rollout, scores, scores.rewards, advantages,
                                     normalised, tokenizer, [0, 1], True, "process")
    assert [(r["sample"], r["step_index"], r["step_text"], r["token_start"], r["token_end"])
            for r in rows] == [(0, 0, "ab", 0, 1), (0, 1, "cd", 2, 3), (1, 0, "efg", 0, 2)]
    assert [r["advantage"] for r in rows] == pytest.approx([-0.70711, -1.41421, 0.70711])
    assert [r["step_score"] for r in rows] == [1.0, 0.0, 1.0]
    assert rows[0]["question_id"] == "synthetic:0:7" and rows[2]["correct"] is True
    page = inspection.render_html(5, records, rollout, advantages, rows, tokenizer, [0, 1],
                                  "process")
    assert page.count("class='step-end'") == 3
    assert len(re.findall(r"title='token \d+, A=", page)) == 7  # every real token, no padding
    assert "rgba(210,50,50" in page and "rgba(34,160,70" in page  # red and green both used


def test_wandb_run_hygiene(tmp_path, capsys):
    """Stage runs are grouped by run name, carry the config verbatim, print how to sync, and log
    checkpoints as artifacts only when asked."""
    config = {"run": {"name": "demo"}, "grpo": {"beta": 0.04}}
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    for opt_in in (False, True):
        logger = MetricsLogger(tmp_path / f"rm-{opt_in}" / "metrics.jsonl", config=config,
                               mode="offline", project="igrpo-test", name="demo-rm-prm/iteration-0",
                               group="demo", job_type="rm-prm", log_checkpoints=opt_in)
        logger.log({"rm/loss": 0.5}, step=1)
        logger.log_checkpoint(checkpoint, "demo-rm-prm-iteration-0")
        logger.close()
        offline = read_offline_run(next((tmp_path / f"rm-{opt_in}" / "wandb")
                                        .glob("offline-run-*")))
        assert offline["run"] == {"name": "demo-rm-prm/iteration-0", "group": "demo",
                                  "job_type": "rm-prm"}
        assert {k: v for k, v in offline["config"].items() if k != "_wandb"} == config
        assert offline["artifacts"] == (["demo-rm-prm-iteration-0"] if opt_in else [])
    assert capsys.readouterr().out.count("wandb sync ") == 2
