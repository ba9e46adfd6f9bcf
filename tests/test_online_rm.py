"""The online ORM (`rm.online`, reward_model/online.py): it scores a step's samples before it
learns from them (a sample's reward does not read its own check), its reward is P(+) at the
solution's tag computed by hand from the model's logits, its update's loss is the binary
cross-entropy of those scores against the checks, and the update moves the scores toward the
checks. Two processes equal one under ZeRO-2/3: tests/test_distributed.py; a kill resumes
bitwise under every ZeRO stage: tests/test_zero_stages.py; never beside vLLM's pool:
tests/test_vllm_memory_order.py."""

from types import SimpleNamespace

import pytest
import torch

from configs import ConfigError, load_config
from iteration.resolve import grpo_reward_problem, make_reward, resolve
from runtime.data import MathRecord
from runtime.tiny_model import build_tiny
from runtime.training import StageLoop

from small_config import SMALL

ONLINE = [*SMALL, "policy.supervision=outcome", "policy.reward=rm", "rm.online=true",
          "rm.online_lr=1e-3", "rm.lm_weight=0", "rm.likelihood_feature=false",
          "rm.extra_layers_from=[]", "policy.questions_per_step=2", "policy.group_size=2",
          "deepspeed.micro_batch_size=4", "run.wandb_mode=disabled"]
QUESTIONS = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
TEXTS = ["2 + 3 = 5\nThe answer is 5", "2 + 3 = 6\nThe answer is 6",
         "4 + 4 = 8\nThe answer is 8", "4 + 4 = 9\nThe answer is 9"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config("configs/tiny.yaml", SMALL)
    return build_tiny(tmp_path_factory.mktemp("base") / "tiny", cfg.model.tiny, 0,
                      extra_tokens=(cfg.rm.step_tag,))


def _rows(answers) -> list[MathRecord]:
    """Each question's record twice (its two samples), with the gold answers `answers`."""
    return [MathRecord(q, a, (), f"q{i}") for i, ((q, _), a) in enumerate(zip(QUESTIONS, answers))
            for _ in range(2)]


def _backward(micro_batches, micro_batch_size, loss_of, where, grad_norm=0.0, engine=None):
    """`StageLoop.backward` on a companion engine (it reads nothing else of the loop)."""
    return StageLoop.backward(SimpleNamespace(engine=engine), micro_batches, micro_batch_size,
                              loss_of, where, grad_norm, engine)


def _by_hand(base, texts, rows, tag) -> torch.Tensor:
    """P(+) at the tag after each whole solution: sigmoid(logit['+'] - logit['-']) of the base
    model's forward on the Math-Shepherd text, one row at a time."""
    from process_supervision.formats import to_math_shepherd
    from runtime.models import load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm(base).eval(), load_tokenizer(base)
    plus, minus, tag_id = (tokenizer.convert_tokens_to_ids(t) for t in ("+", "-", tag))
    out = []
    for rec, text in zip(rows, texts):
        ids = tokenizer(to_math_shepherd(rec.question, (text,), None, tag)[0])["input_ids"]
        at = max(i for i, t in enumerate(ids) if t == tag_id)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, at]
        out.append(torch.sigmoid(logits[plus] - logits[minus]))
    return torch.stack(out)


def test_the_online_orm_scores_before_it_learns_from_each_samples_check(base):
    """Two online ORMs from one start score the same four samples, one told that question 0's
    gold answer is 6: the rewards are equal (the scoring reads no check) and equal P(+) computed
    by hand; the checks differ. Each then takes its step: its loss is the mean binary
    cross-entropy of its rewards against its checks (by hand), the step lowers that loss, and
    the two ORMs now score question 0's samples apart, each toward its own labels."""
    from runtime.models import load_tokenizer

    w = resolve(load_config("configs/tiny.yaml", ONLINE))
    tokenizer = load_tokenizer(base, w.stage.model)
    rollout = SimpleNamespace(texts=TEXTS, group_size=2)
    told, flipped = _rows(["5", "8"]), _rows(["6", "8"])
    a = make_reward(w, tokenizer, "rm", online_init=base)
    b = make_reward(w, tokenizer, "rm", online_init=base)
    before_a, before_b = a(told, rollout), b(flipped, rollout)
    assert torch.equal(before_a.rewards, before_b.rewards)
    torch.testing.assert_close(before_a.rewards,
                               _by_hand(base, TEXTS, told, w.rm.settings.step_tag),
                               rtol=1e-5, atol=1e-6)
    assert before_a.correct.tolist() == [True, False, True, False]
    assert before_b.correct.tolist() == [False, True, True, False]

    def bce(p, y):
        return float(torch.nn.functional.binary_cross_entropy(p, y.float()))

    for orm, rows, before in ((a, told, before_a), (b, flipped, before_b)):
        metrics = orm.learn(rows, rollout, _backward, "test")
        assert metrics["online_rm/loss"] == pytest.approx(bce(before.rewards, before.correct),
                                                          rel=1e-5)
        assert metrics["online_rm/right_share"] == 0.5 and metrics["online_rm/grad_norm"] > 0
        after = orm(rows, rollout)
        assert bce(after.rewards, before.correct) < bce(before.rewards, before.correct)
    after_a, after_b = a(told, rollout).rewards, b(flipped, rollout).rewards
    # question 0's first sample: right for a, wrong for b; its second the other way round
    assert after_a[0] > after_b[0] and after_a[1] < after_b[1]


def test_the_online_orm_is_refused_where_it_cannot_be_the_reward(base, tmp_path):
    """Before any work: process supervision or another algorithm (the loader), a reward other
    than the ORM (`igrpo grpo`), and, under `igrpo iterate`, a refresh that would replace it;
    each message names the keys."""
    with pytest.raises(ConfigError, match="rm.online with policy.algorithm=grpo and policy."
                                          "supervision=process"):
        load_config("configs/tiny.yaml", [*ONLINE, "policy.supervision=process"])
    with pytest.raises(ConfigError, match="rm.online with rm.family=token_classification"):
        load_config("configs/tiny.yaml", [*ONLINE, "rm.family=token_classification",
                                          "rm.extra_layers_from=[]"])
    w = resolve(load_config("configs/tiny.yaml", [*ONLINE, "policy.reward=rule"]))
    assert grpo_reward_problem(w).startswith("rm.online with policy.reward=rule")
    from iteration.loop import IterationRun

    w = resolve(load_config("configs/tiny.yaml", ONLINE))
    with pytest.raises(ConfigError, match="iterate.refresh=True"):
        IterationRun(w, tmp_path, base, None, None, "")


def test_each_reward_states_the_share_of_gold_checks_it_read():
    """`reward/gold_read`: the rule, the step oracle and the online ORM read every sample's check
    (the ORM after scoring it); a frozen reward model none; the anchored form the share its gold
    budget revealed (all without one); the sum and min forms none."""
    from policy.math.advantages import PROCESS_CREDIT
    from policy.rewards import RuleReward, gold_read
    from process_supervision.oracle import StepOracleReward
    from reward_model.online import OnlineORM
    from reward_model.score import PRMReward

    frozen = PRMReward.__new__(PRMReward)
    for reward in (RuleReward(), StepOracleReward(None), OnlineORM.__new__(OnlineORM)):
        assert gold_read(reward, None, {}) == 1.0
    assert gold_read(frozen, None, {}) == 0.0
    assert gold_read(frozen, PROCESS_CREDIT["anchored"], {"reward/gold_revealed": 0.25}) == 0.25
    assert gold_read(frozen, PROCESS_CREDIT["anchored"], {}) == 1.0
    assert gold_read(frozen, PROCESS_CREDIT["min"], {"reward/gold_revealed": 0.25}) == 0.0
    assert gold_read(frozen, PROCESS_CREDIT["sum"], {}) == 0.0
