"""The recipes (configs/recipes/): every recipe's advantages and objective on one batch against
numbers computed by hand, its paper's settings, how a recipe composes with any base config, and
every shipped recipe running a step."""

import math

import pytest
import torch

from configs import load_config
from runtime.tracking import read_metrics
from configs.loader import ConfigError, RECIPE_KEYS, recipes
from iteration.resolve import resolve
from policy.algorithms.grpo import advantage_step
from policy.math.losses import POLICY_LOSSES
from policy.rewards import Scores

from small_runs import run_recipe, weights_differ
from recipe_batch import LENGTHS, REWARDS, WIDTH, batch_rollout, recipe_config


# Group 1 by hand: mean 1/3, population std sqrt(2)/3; r - mean = 2/3, -1/3, -1/3.
STD = math.sqrt(2) / 3
NORMALISED = [(2 / 3) / STD, (-1 / 3) / STD, (-1 / 3) / STD, 0.0, 0.0, 0.0]
CENTRED = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
# Per-token log-ratios log(pi/pi_old): every token of sample i has ratio RATIO[i].
RATIO = [1.5, 0.7, 1.1, 1.0, 1.0, 1.0]


def _objective_terms(adv, eps_low, eps_high):
    """min(r A, clip(r) A) of one token of each sample, by hand."""
    return [min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a) for r, a in zip(RATIO, adv)]


def _by_hand(name):
    """(advantages [6], objective) of each recipe on the batch above, written out."""
    if name in ("grpo", "r1", "c3po"):
        adv = NORMALISED
    elif name in ("dr_grpo", "gpg"):
        adv = CENTRED
    elif name == "dapo":
        adv = NORMALISED
    elif name == "cispo":
        adv = NORMALISED
    else:
        raise KeyError(name)
    if name == "gpg":
        adv = [a * 6 / (6 - 3) for a in adv]  # alpha = B / (B - M) = 6 / 3
    terms = _objective_terms(adv, 0.2, 0.28 if name == "dapo" else 0.2)
    n = LENGTHS
    if name == "grpo":  # 1/G sum_i 1/|o_i| sum_t: each sample's token mean is its term
        return adv, sum(terms) / 6
    if name == "r1":  # 1/G sum_i sum_t
        return adv, sum(t * k for t, k in zip(terms, n)) / 6
    if name == "dr_grpo":  # 1/(G * max_tokens) sum_i sum_t
        return adv, sum(t * k for t, k in zip(terms, n)) / (6 * WIDTH)
    if name == "dapo":  # only group 1 is kept (dynamic sampling): 1/sum |o_i| over its tokens
        return adv, sum(t * k for t, k in zip(terms[:3], n[:3])) / sum(n[:3])
    if name == "gpg":  # sum A log pi / sum |o_i|, log pi = log(ratio) with pi_old = 1
        return adv, sum(a * math.log(r) * k for a, r, k in zip(adv, RATIO, n)) / sum(n)
    if name == "cispo":  # sg(min(r, 1.28)) A log pi / sum |o_i|
        return adv, sum(min(r, 1.28) * a * math.log(r) * k
                        for a, r, k in zip(adv, RATIO, n)) / sum(n)
    # c3po: Phi = 0.5 * 2 * 3 * 4 = 12 >= all 11 tokens, so every token is in Psi; / Phi
    return adv, sum(t * k for t, k in zip(terms, n)) / 12


@pytest.mark.parametrize("name", ["grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po"])
def test_each_recipe_objective_and_advantages_by_hand(name):
    cfg = recipe_config(name)
    g = cfg.policy
    rollout = batch_rollout()
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    batch = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                           rollout, resolve(cfg).method, g.group_size)
    adv, objective = _by_hand(name)
    assert batch.advantages[:, 0].tolist() == pytest.approx(adv, abs=1e-5)
    # Token advantages: the sample's advantage on its tokens, 0 on padding.
    assert (batch.advantages[rollout.completion_mask == 0] == 0).all()
    old = torch.zeros(6, WIDTH, dtype=torch.float64)  # pi_old = 1, so log pi = log(ratio)
    new = torch.tensor(RATIO, dtype=torch.float64).log()[:, None].expand(6, WIDTH)
    out = POLICY_LOSSES[g.loss].fn(new, old, None, batch.advantages.double(),
                                   batch.loss_mask.double(), clip_eps_low=g.clip_eps,
                                   clip_eps_high=g.clip_eps_high, beta=g.beta,
                                   num_sequences=batch.num_sequences,
                                   num_tokens=batch.num_tokens, max_tokens=WIDTH)
    assert -out.loss.item() == pytest.approx(objective, rel=1e-5)


def test_recipe_settings_are_the_papers():
    dapo = recipe_config("dapo")
    assert (dapo.policy.beta, dapo.policy.clip_eps, dapo.policy.clip_eps_high,
            dapo.policy.loss) == (0.0, 0.2, 0.28, "dapo")
    assert dapo.grpo.dynamic_sampling and dapo.grpo.overlong_filter
    assert dapo.grpo.overlong_buffer_share == 0.2
    gpg = recipe_config("gpg")
    assert (gpg.policy.loss, gpg.grpo.scale_by_std, gpg.grpo.zero_group_correction,
            gpg.policy.beta) == ("gpg", False, True, 0.0)
    grpo = recipe_config("grpo").policy
    assert (grpo.beta, grpo.clip_eps, grpo.mu, grpo.loss) == (0.04, 0.2, 1, "grpo")
    rft = load_config("configs/tiny.yaml", [], recipe="online_rft")
    assert (rft.policy.supervision, rft.policy.beta, rft.iterate.reward) == ("rft", 0.0, "rule")
    assert recipe_config("offline_rft").policy.algorithm == "offline_rft"


def test_recipe_composes_with_any_base_and_owns_its_keys(tmp_path):
    """Over the tiny and the 7B config, a recipe sets the same algorithm keys and leaves the
    base's scale alone; a base file that chose another loss is reset to the recipe's."""
    base = tmp_path / "base.yaml"
    base.write_text(open("configs/tiny.yaml").read().replace(
        "  beta: 0.04\n", "  beta: 0.5\n  loss: cispo\n") + "grpo:\n  overlong_penalty: 3.0\n")
    tiny = load_config(base, [], recipe="dapo")
    big = load_config("configs/deepseekmath_7b.yaml", [], recipe="dapo")
    for key in RECIPE_KEYS:
        section, name = key.split(".")
        assert tiny[section][name] == big[section][name], key
    assert tiny.policy.group_size == 64 and tiny.policy.lr == 2.0e-5
    assert big.policy.lr != tiny.policy.lr and tiny.run.recipe == "dapo"
    assert load_config(base, []).policy.loss == "cispo"  # the file's own without a recipe
    # the command line still wins over the recipe, and the file may name the recipe
    assert load_config("configs/tiny.yaml", ["policy.beta=0.1"], recipe="dapo").policy.beta == 0.1
    assert load_config("configs/tiny.yaml", ["run.recipe=gpg"]).policy.loss == "gpg"
    with pytest.raises(ConfigError, match="recipe 'dapoo'.*the recipes are c3po"):
        load_config("configs/tiny.yaml", [], recipe="dapoo")
    assert set(recipes()) == {"grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po",
                              "online_rft", "offline_rft", "ppo", "vc_ppo", "vapo", "t_ppo",
                              "dpo", "online_dpo", "gspo"}


@pytest.mark.parametrize("recipe", recipes())
def test_every_shipped_recipe_trains_a_step(tmp_path, recipe):
    """Each configs/recipes/*.yaml as shipped (a new one is tested by this glob) over the small
    config: its trainer takes an optimizer step with a finite loss, and the weights move
    (value pretraining cut to 1 step where the recipe asks for some; T-PPO takes 7, its windows
    of 2 of the small run's 12 tokens ending the first sequences at the 6th)."""
    pretrain = load_config("configs/tiny.yaml", recipe=recipe).ppo.value_pretrain_steps
    base, final = run_recipe(tmp_path, recipe, f"policy.steps={7 if recipe == 't_ppo' else 1}",
                             f"ppo.value_pretrain_steps={min(pretrain, 1)}")
    row = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r][-1]
    assert torch.isfinite(torch.tensor(row["train/loss"]))
    assert weights_differ(base, final)


@pytest.mark.parametrize("recipe", ["ppo", "dpo", "online_dpo", "offline_rft", "gspo"])
def test_each_policy_method_trains_a_lora_adapter(tmp_path, recipe):
    """`model.lora` in every trainer beside GRPO's (tests/test_lora.py and the distributed
    tests): PPO's actor, offline and online DPO, offline RFT's fine-tuning, GSPO's
    mini-batches each take a finite step on the adapter alone, and the merged export moved in
    the adapted layers only."""
    from safetensors.torch import load_file

    pretrain = load_config("configs/tiny.yaml", recipe=recipe).ppo.value_pretrain_steps
    base, final = run_recipe(tmp_path, recipe, "policy.steps=1", "model.lora.rank=4",
                             "model.lora.alpha=8", "policy.lr=1e-3",
                             f"ppo.value_pretrain_steps={min(pretrain, 1)}")
    row = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r][-1]
    assert torch.isfinite(torch.tensor(row["train/loss"]))
    start, end = load_file(base / "model.safetensors"), load_file(final / "model.safetensors")
    assert end.keys() == start.keys()
    moved = {k for k in end if not torch.equal(end[k], start[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved), moved


def test_each_algorithm_has_its_own_run_folder_and_older_runs_resume_in_grpo(tmp_path):
    """A policy stage writes into a folder named for `policy.algorithm`; a run made when every
    algorithm wrote into `grpo/` (its recorded config naming the algorithm, no folder of the
    algorithm's name) resumes there; a `grpo/` of another algorithm is not taken."""
    from iteration.resolve import stage_folder
    from policy.algorithms import TRAINERS

    run = tmp_path / "run"
    assert {a: stage_folder(run, a) for a in TRAINERS} == {a: a for a in TRAINERS}
    (run / "grpo").mkdir(parents=True)
    (run / "config.yaml").write_text("policy:\n  algorithm: ppo\n")
    assert stage_folder(run, "ppo") == "grpo"  # an older PPO run, recorded in the run's config
    assert stage_folder(run, "online_dpo") == "online_dpo"
    (run / "grpo" / "config.yaml").write_text("policy:\n  algorithm: grpo\n")
    assert stage_folder(run, "ppo") == "ppo"  # the folder's own config names GRPO
    (run / "grpo" / "config.yaml").write_text("policy:\n  algorithm: dpo\n")
    assert stage_folder(run, "dpo") == "grpo"
    (run / "dpo").mkdir()
    assert stage_folder(run, "dpo") == "dpo"  # once its own folder exists, always that one
    assert stage_folder(run, "grpo") == "grpo"
