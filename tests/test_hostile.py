"""Hostile model output: every verdict in time, nothing executed, memory bounded, the run goes on."""

import time

import pytest
import torch

from hostile_corpus import INJECTIONS, hostile_outputs
from policy.rewards import RuleReward
from policy.generation.rollout import Rollout
from process_supervision.oracle import StepOracleReward
from runtime.data import MathRecord
from tasks.grading import answers_match, extract_final_answer, grade, too_costly
from runtime.tiny_model import build_tokenizer

TIMEOUT_S = 1
VERDICT_LIMIT_S = 3 * TIMEOUT_S
"""A verdict's limit: the gold parse, the answer parse and the comparison each get TIMEOUT_S."""


def _peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def test_canary_is_live(tmp_path):
    """The canary really detects execution: an eval-based parser (sympy's parse_expr, which
    math-verify uses for plain expressions) runs the first payload and creates it."""
    from sympy.parsing.sympy_parser import parse_expr

    canary = tmp_path / "canary"
    parse_expr(INJECTIONS[0].replace("{canary}", str(canary)))
    assert canary.exists()


def test_hostile_corpus_grader_and_reward_path(tmp_path):
    canary = tmp_path / "canary"
    labelled = hostile_outputs(str(canary))
    outputs = [text for _, text in labelled]
    assert len(outputs) >= 200
    peak_before = _peak_rss_mb()
    slowest, slowest_text, verdicts = 0.0, "", []
    for text in outputs:
        started = time.perf_counter()
        verdicts.append(grade(text, "3", timeout_s=TIMEOUT_S))
        elapsed = time.perf_counter() - started
        if elapsed > slowest:
            slowest, slowest_text = elapsed, text[:60]
        assert elapsed < VERDICT_LIMIT_S, (f"{elapsed:.2f}s", text[:80])
    print(f"\n{len(outputs)} hostile outputs; slowest verdict {slowest:.3f}s on {slowest_text!r}; "
          f"{sum(verdicts)} judged equal to 3")
    assert not canary.exists()
    # Only honest spellings of 3 may pass (e.g. '3.', '+3', '3\\%', nested boxes, '(1+2)'):
    # no injection, tower, look-alike digit, broken LaTeX or megabyte string.
    passed = [(kind, text) for (kind, text), v in zip(labelled, verdicts) if v]
    assert {kind for kind, _ in passed} <= {"many_boxed", "misc", "shell", "control"}, passed
    assert all(extract_final_answer(text).isascii() for _, text in passed)
    # The reward path: the rule reward over a rollout of the same texts, and the step oracle
    # (a rollout is bounded by max_new_tokens, so the megabyte strings only reach the grader).
    bounded = [t for t in outputs if len(t) <= 10_000]
    rollout = Rollout(torch.zeros(len(bounded), 1, dtype=torch.long),
                      torch.ones(len(bounded), 1, dtype=torch.long),
                      torch.zeros(len(bounded), 1, dtype=torch.long),
                      torch.ones(len(bounded), 1, dtype=torch.long), bounded,
                      torch.zeros(len(bounded), dtype=torch.bool), 1)
    records = [MathRecord("Start with 1. Add 2.", "3", ("Add 2: 1+2=3", "The answer is 3"),
                          "synthetic:0:0")] * len(bounded)
    scores = RuleReward(timeout_s=TIMEOUT_S)(records, rollout)
    assert scores.rewards.tolist() == [float(v) for t, v in zip(outputs, verdicts)
                                       if len(t) <= 10_000]
    tokenizer = build_tokenizer(())
    decodable = [t for t in bounded if _utf8(t)]  # a decoder never yields lone surrogates
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] or [tokenizer.pad_token_id]
           for t in decodable]
    width = max(len(i) for i in ids)
    completion = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    texts = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    n = len(texts)
    oracle_rollout = Rollout(rollout.prompt_ids[:n], rollout.prompt_mask[:n], completion, mask,
                             texts, rollout.truncated[:n], 1)
    oracle = StepOracleReward(tokenizer, timeout_s=TIMEOUT_S)(records[:len(texts)],
                                                              oracle_rollout)
    assert torch.isfinite(oracle.rewards).all() and torch.isfinite(oracle.step_rewards).all()
    assert not canary.exists()
    assert _peak_rss_mb() - peak_before < 500  # memory stays bounded
    # The process goes on: normal grading still works (the time-limit signals were restored).
    assert grade("Add 2: 1+2=3\nThe answer is 3", "3") and answers_match("\\frac{1}{2}", "0.5")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@pytest.mark.parametrize("answer, costly", [
    ("9^{9^{9^9}}", True), ("2^{3^{4}}", True), ("10**10**10", True), ("x^{12345}", True),
    ("100000!", True), ("(10^{100})!", True), ("3\x00", True), ("{" * 13 + "}" * 13, True),
    ("x^2+y^2", False), ("e^{x^2}", False), ("2^{10}", False), ("(n+1)!", False),
    ("\\frac{1}{2}", False), ("10!", False),
])
def test_too_costly_screen(answer, costly):
    assert too_costly(answer) is costly
