"""The online ORM (`rm.online`, reward_model/online.py): it scores a step's samples before it
learns from them (a sample's reward does not read its own check), its reward is P(+) at the
solution's tag computed by hand from the model's logits, its update's loss is the binary
cross-entropy of those scores against the checks, and the update moves the scores toward the
checks. Two processes equal one under ZeRO-2/3: tests/test_distributed.py; a kill resumes
bitwise under every ZeRO stage: tests/test_zero_stages.py; never beside vLLM's pool:
tests/test_vllm_memory_order.py."""

import math
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
    # the implicit PRM: online only, GRPO's outcome or process reward, beta > 0; it starts from
    # the warm start when rm.path is empty
    with pytest.raises(ConfigError, match="rm.family=implicit without rm.online"):
        load_config("configs/tiny.yaml", [*IMPLICIT, "rm.online=false"])
    with pytest.raises(ConfigError, match="rm.family=implicit with policy.algorithm=grpo and "
                                          "policy.supervision=rft"):
        load_config("configs/tiny.yaml", [*IMPLICIT, "policy.supervision=rft"])
    with pytest.raises(ConfigError, match="rm.online with grpo.gold_share=0.5"):
        load_config("configs/tiny.yaml", [*IMPLICIT, "grpo.process_credit=anchored",
                                          "grpo.gold_share=0.5"])
    with pytest.raises(ConfigError, match="rm.implicit_beta = 0.0"):
        load_config("configs/tiny.yaml", [*IMPLICIT, "rm.implicit_beta=0"])
    assert grpo_reward_problem(resolve(load_config("configs/tiny.yaml", IMPLICIT))) is None
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


# -- PRIME's implicit PRM (reward_model/implicit.py) ------------------------------------------

IMPLICIT = [*ONLINE, "rm.family=implicit", "policy.supervision=process", "rm.implicit_beta=0.5"]


def test_implicit_token_and_step_rewards_and_loss_by_hand():
    """r_t = beta (log pi_phi - log pi_ref) on completion tokens; a step's reward sums its
    tokens' (after the previous step's end, through its own); the loss is the cross-entropy of
    sigmoid(sum_t r_t) against the outcome label."""
    from reward_model.implicit import implicit_loss_sum, step_sums, token_rewards

    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.4, -0.6, -0.8]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -3.0], [-0.2, -0.2, -0.2, -0.2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    r = token_rewards(logp, ref, mask, 0.1)
    torch.testing.assert_close(r, torch.tensor([[0.05, -0.1, 0.0, 0.0],
                                                [0.0, -0.02, -0.04, -0.06]]))
    ends = torch.tensor([[0, 2, 0], [1, 2, 3]])
    steps = torch.tensor([[True, True, False], [True, True, True]])
    torch.testing.assert_close(step_sums(r, ends, steps),
                               torch.tensor([[0.05, -0.1, 0.0], [-0.02, -0.04, -0.06]]))
    labels = torch.tensor([1.0, 0.0])
    # logits -0.05 and -0.12: -log sigmoid(-0.05) - log(1 - sigmoid(-0.12))
    expected = math.log(1 + math.exp(0.05)) + math.log(1 + math.exp(-0.12))
    assert float(implicit_loss_sum(logp, ref, mask, labels, 0.1)) == pytest.approx(expected)


def _rollout(tokenizer, texts, group_size=2):
    """A rollout of `texts` (completions of QUESTIONS' prompts, `group_size` each), prompts
    left-padded and completions right-padded as the sampler leaves them, each ending in EOS."""
    from policy.generation.rollout import Rollout

    prompts = [tokenizer(q)["input_ids"] for q, _ in QUESTIONS for _ in range(group_size)]
    done = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for t in texts]
    width_p, width_c, pad = max(map(len, prompts)), max(map(len, done)), tokenizer.pad_token_id
    return Rollout(torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts]),
                   torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
                   torch.tensor([c + [pad] * (width_c - len(c)) for c in done]),
                   torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in done]),
                   list(texts), torch.zeros(len(texts), dtype=torch.bool), group_size)


def _completion_logprobs_by_hand(path, rollout) -> torch.Tensor:
    """[N, T] log p(token) of each completion token under the model in `path`, one row at a
    time without padding."""
    from runtime.models import load_causal_lm

    model = load_causal_lm(path).eval()
    out = torch.zeros(rollout.completion_ids.shape)
    for i in range(len(rollout.texts)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
        done = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        ids = torch.cat([prompt, done])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].log_softmax(-1)
        for t, token in enumerate(done.tolist()):
            out[i, t] = logits[len(prompt) + t - 1, token]
    return out


def test_the_implicit_prm_scores_by_hand_before_it_learns_from_each_check(base, tmp_path):
    """pi_phi (the base) against another model as pi_ref: each step's reward is beta times the
    sum of its tokens' log-ratio, computed by hand row by row, and the score sigmoid of their
    total; a second PRM told that question 0's gold answer is 6 gives the same rewards (scored
    before any label is read). Each then steps: the loss is the mean cross-entropy of the
    scores against the checks (by hand), the step lowers it, and the two now differ."""
    from runtime.models import load_tokenizer
    from runtime.steps import step_end_token_indices

    cfg = load_config("configs/tiny.yaml", IMPLICIT)
    ref_path = build_tiny(tmp_path / "ref", cfg.model.tiny, 1, extra_tokens=(cfg.rm.step_tag,))
    w = resolve(cfg)
    tokenizer = load_tokenizer(base, w.stage.model)
    rollout = _rollout(tokenizer, TEXTS)
    told, flipped = _rows(["5", "8"]), _rows(["6", "8"])
    a = make_reward(w, tokenizer, "rm", online_init=base, online_reference=ref_path)
    b = make_reward(w, tokenizer, "rm", online_init=base, online_reference=ref_path)
    sa, sb = a(told, rollout), b(flipped, rollout)
    for key in ("rewards", "step_rewards", "step_mask", "step_end_index"):
        assert torch.equal(getattr(sa, key), getattr(sb, key)), key
    r = 0.5 * (_completion_logprobs_by_hand(base, rollout)
               - _completion_logprobs_by_hand(ref_path, rollout)) * rollout.completion_mask
    for i, text in enumerate(TEXTS):
        ends = step_end_token_indices(tokenizer, rollout.completion_ids[i][
            rollout.completion_mask[i].bool()].tolist(), text)
        assert len(ends) == 2 and sa.step_end_index[i].tolist() == ends
        by_hand = [float(r[i, :ends[0] + 1].sum()), float(r[i, ends[0] + 1:ends[1] + 1].sum())]
        assert sa.step_rewards[i].tolist() == pytest.approx(by_hand, abs=1e-5)
        assert float(sa.rewards[i]) == pytest.approx(1 / (1 + math.exp(-sum(by_hand))), abs=1e-6)
    assert float(sa.step_rewards.abs().sum()) > 0.1  # the two models differ
    for prm, rows, before in ((a, told, sa), (b, flipped, sb)):
        metrics = prm.learn(rows, rollout, _backward, "test")
        bce = float(torch.nn.functional.binary_cross_entropy(before.rewards,
                                                             before.correct.float()))
        assert metrics["online_rm/loss"] == pytest.approx(bce, rel=1e-5)
        after = prm(rows, rollout)
        assert float(torch.nn.functional.binary_cross_entropy(
            after.rewards, before.correct.float())) < bce
    assert not torch.equal(a(told, rollout).rewards, b(flipped, rollout).rewards)


def test_prime_order_steps_on_each_check_before_it_scores(base, tmp_path):
    """`rm.online_update=before` (PRIME's default): scoring a step's samples first takes the
    learner's step on their checks (its loss the cross-entropy of the untouched model's scores,
    by hand), then scores with the updated weights: the rewards equal those of the same PRM
    scored after `learn`. Its rewards read their own checks: told that question 0's answer is 6,
    the rewards differ. `learn` after the policy's update only hands on that step's metrics."""
    from policy.scoring import UpdatedFirst
    from runtime.models import load_tokenizer

    cfg = load_config("configs/tiny.yaml", IMPLICIT)
    ref_path = build_tiny(tmp_path / "ref", cfg.model.tiny, 1, extra_tokens=(cfg.rm.step_tag,))
    tokenizer = load_tokenizer(base, resolve(cfg).stage.model)
    rollout = _rollout(tokenizer, TEXTS)
    told, flipped = _rows(["5", "8"]), _rows(["6", "8"])
    after = make_reward(resolve(cfg), tokenizer, "rm", online_init=base, online_reference=ref_path)
    untouched = after(told, rollout)
    stepped = after.learn(told, rollout, _backward, "test")
    expected = after(told, rollout)

    w = resolve(load_config("configs/tiny.yaml", [*IMPLICIT, "rm.online_update=before"]))
    first, flips = (make_reward(w, tokenizer, "rm", online_init=base, online_reference=ref_path)
                    for _ in range(2))
    assert isinstance(first, UpdatedFirst)
    with pytest.raises(RuntimeError, match="binds its trainer first"):
        first(told, rollout)
    for prm in (first, flips):
        prm.bind(SimpleNamespace(backward=_backward, step=0))
    got = first(told, rollout)
    for key in ("rewards", "step_rewards", "correct"):
        torch.testing.assert_close(getattr(got, key), getattr(expected, key), rtol=0, atol=1e-6)
    assert not torch.allclose(got.rewards, untouched.rewards)
    bce = float(torch.nn.functional.binary_cross_entropy(untouched.rewards,
                                                         untouched.correct.float()))
    metrics = first.learn(told, rollout, _backward, "test")
    assert metrics["online_rm/loss"] == pytest.approx(bce, rel=1e-5)
    assert metrics["online_rm/loss"] == pytest.approx(stepped["online_rm/loss"], rel=1e-6)
    assert first.learn(told, rollout, _backward, "test") == {}  # one step a GRPO step
    assert not torch.allclose(flips(flipped, rollout).rewards, got.rewards)


def test_prime_order_is_refused_under_dynamic_sampling():
    with pytest.raises(ConfigError, match="rm.online_update=before with grpo.dynamic_sampling"):
        load_config("configs/tiny.yaml", [*IMPLICIT, "rm.online_update=before",
                                          "grpo.dynamic_sampling=true"])


def test_the_online_orm_refuses_a_classifier_checkpoint(tmp_path):
    """`rm.path` holding a sequence classifier (an ORM this project only reads) is refused
    naming the folder, not loaded as a causal LM under a fresh head."""
    import json

    from reward_model.families import FamilyError

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForSequenceClassification"]}))
    w = resolve(load_config("configs/tiny.yaml", ONLINE))
    with pytest.raises(FamilyError, match=f"{tmp_path} is sequence_classification"):
        make_reward(w, None, "rm", online_init=tmp_path)
