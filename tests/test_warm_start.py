"""The task's noisy worked solutions and the shipped warm start made from them."""

import hashlib
import json

import pytest

from configs import ConfigError, load_config
from configs.loader import BUNDLED
from reward_model.examples import worked_examples
from tasks import synthetic
from runtime.data import load_splits

SHIPPED = BUNDLED / "tiny_warm_start"


def test_carry_slip_keeps_the_tens_digit_and_continues_from_the_wrong_value():
    problem = synthetic.Problem("Start with 27. Add 5. Subtract 8. Multiply by 2.",
                                ("Add 5: 27+5=32", "Subtract 8: 32-8=24", "Multiply by 2: 24*2=48",
                                 "The answer is 48"), 48)
    # 27+5 carries: 22 (not 32); 22-8 borrows: 24 (not 14); doubling is computed right. The two
    # slips cancel at the answer: right answer, two wrong steps, as mined solutions have.
    slipped = synthetic.carry_slip_solution(problem)
    assert slipped == ("Add 5: 27+5=22", "Subtract 8: 22-8=24", "Multiply by 2: 24*2=48",
                       "The answer is 48")
    assert synthetic.step_correctness(problem.question, slipped) == [False] * 4
    clean = synthetic.Problem("Start with 21. Add 5. Subtract 3.",
                              ("Add 5: 21+5=26", "Subtract 3: 26-3=23", "The answer is 23"), 23)
    assert synthetic.carry_slip_solution(clean) == clean.steps  # nothing to carry or borrow


def test_slip_share_reaches_only_the_sft_worked_solutions():
    data = load_config("configs/tiny.yaml", ["data.sft_questions=4000", "data.rl_questions=500",
                                             "data.eval_questions=100"]).data
    noisy = load_splits(data, 0)
    clean = load_splits(load_config("configs/tiny.yaml", [
        "data.sft_questions=4000", "data.rl_questions=500", "data.eval_questions=100",
        "data.sft_slip_share=0"]).data, 0)
    slipped = [n for n, c in zip(noisy.sft, clean.sft) if n.solution_steps != c.solution_steps]
    carrying = [c for c in clean.sft if synthetic.carry_slip_solution(
        synthetic.Problem(c.question, c.solution_steps, int(c.answer))) != c.solution_steps]
    assert [n.question for n in noisy.sft] == [c.question for c in clean.sft]
    assert len(slipped) / len(carrying) == pytest.approx(0.4, abs=0.03)
    assert noisy.rl == clean.rl and noisy.eval == clean.eval and noisy.val == clean.val
    with pytest.raises(ConfigError, match="sft_slip_share"):
        load_config("configs/tiny.yaml", ["data.sft_slip_share=1.5"])


def test_worked_examples_label_slipped_steps_by_the_question():
    data = load_config("configs/tiny.yaml", ["data.sft_questions=300", "data.rl_questions=50",
                                             "data.eval_questions=10"]).data
    sft = load_splits(data, 0).sft
    examples = worked_examples(sft)
    assert len(examples) == len(sft)
    wrong = [ex for ex in examples if min(ex.labels) == 0.0]
    assert wrong and all(ex.labels == tuple(float(t) for t in synthetic.step_correctness(
        ex.question, ex.steps)) for ex in examples)


def test_bundled_policy_path_resolves_and_a_missing_one_names_the_key():
    assert load_config("configs/tiny.yaml").model.policy_path == str(SHIPPED)
    with pytest.raises(ConfigError, match="model.policy_path.*bundled:nope"):
        load_config("configs/tiny.yaml", ["model.policy_path=bundled:nope"])


def test_shipped_warm_start_is_what_its_recipe_says():
    recipe = json.loads((SHIPPED / "recipe.json").read_text())
    digest = hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest()
    assert digest == recipe["sha256"]["model.safetensors"]
    assert all(c.startswith("igrpo sft --config configs/tiny.yaml") for c in recipe["commands"])
    assert all("sft_slip_share: 0.4" in config for config in recipe["configs"])
    heldout = json.loads((SHIPPED / "heldout.json").read_text())
    assert sum(heldout["greedy_accuracy"]) / len(heldout["greedy_accuracy"]) \
        == recipe["heldout"]["eval/greedy_accuracy"]


def test_the_steps_task_warm_start_brings_right_answers_through_wrong_steps():
    """configs/tiny_steps.yaml's warm start (scripts/build_warm_start.py --task steps): its
    weights are the recipe's, and on the 500 held-out questions at least 15% of its right
    answers come through a wrong step (the interval's lower end), recomputed here from every
    sample's outcome, with room for RL between mean@4 and pass@4."""
    bundle = BUNDLED / "tiny_steps_warm_start"
    recipe = json.loads((bundle / "recipe.json").read_text())
    digest = hashlib.sha256((bundle / "model.safetensors").read_bytes()).hexdigest()
    assert digest == recipe["sha256"]["model.safetensors"]
    assert all(c.startswith("igrpo sft --config configs/tiny_steps.yaml") for c in
               recipe["commands"])
    assert load_config("configs/tiny_steps.yaml").model.policy_path == str(bundle)
    heldout = json.loads((bundle / "heldout.json").read_text())
    right = [r for rows in heldout["sample_right"] for r in rows]
    trace = [t for rows in heldout["sample_trace"] for t in rows]
    lucky = sum(r and not t for r, t in zip(right, trace)) / sum(right)
    found = recipe["heldout"]
    assert len(heldout["questions"]) == found["eval/questions"] == 500
    assert lucky == pytest.approx(found["eval/lucky_answer_rate"])
    assert found["eval/lucky_answer_rate_lo"] >= 0.15
    assert found["eval/pass_at_k"] - found["eval/mean_at_k"] > 0.2


@pytest.mark.slow
def test_shipped_warm_start_reproduces_its_held_out_greedy_accuracy_exactly():
    from policy.evaluate import evaluate_policy
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks.prompts import prompt_format

    cfg = load_config("configs/tiny.yaml")
    recipe = json.loads((SHIPPED / "recipe.json").read_text())["heldout"]
    splits = load_splits(cfg.data, cfg.run.seed)
    metrics = evaluate_policy(load_causal_lm(SHIPPED, cfg.model).eval(),
                              load_tokenizer(SHIPPED, cfg.model), splits.eval,
                              prompt_format(cfg.data), k=cfg.eval.k, temperature=1.0,
                              max_new_tokens=cfg.eval.max_new_tokens,
                              batch_size=cfg.eval.batch_size, sampled=False)
    assert metrics["eval/questions"] == recipe["eval/questions"] == 500
    assert metrics["eval/greedy_accuracy"] == recipe["eval/greedy_accuracy"]
