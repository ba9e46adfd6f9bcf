"""The shipped reward-model base (scripts/build_rm_base.py): what its recipe says, the numbers it
recorded, and its depth as reward training finds it."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from configs import load_config
from configs.loader import BUNDLED
from reward_model.backbone import ADDED_LAYERS_KEY, added_layer_parameters, decoder_layers, \
    deepen, heldout_lm
from runtime.models import load_causal_lm

BASE = BUNDLED / "tiny_rm_base"
WARM = BUNDLED / "tiny_warm_start"
ROOT = Path(__file__).resolve().parents[1]


def test_shipped_rm_base_is_what_its_recipe_says():
    recipe = json.loads((BASE / "recipe.json").read_text())
    digest = hashlib.sha256((BASE / "model.safetensors").read_bytes()).hexdigest()
    assert digest == recipe["sha256"]["model.safetensors"]
    assert recipe["commands"][1].startswith("igrpo sft --config configs/tiny.yaml")
    assert "sft_slip_share: 0.4" in recipe["config"]  # the task's text, both students
    base = json.loads((BASE / "config.json").read_text())
    warm = json.loads((WARM / "config.json").read_text())
    assert base["num_hidden_layers"] == 2 * warm["num_hidden_layers"] == 8
    assert base[ADDED_LAYERS_KEY] == 4 and base["hidden_size"] == warm["hidden_size"]
    assert load_config("configs/tiny.yaml", ["rm.init_path=bundled:tiny_rm_base"]) \
        .rm.init_path == str(BASE)


def test_rm_base_reproduces_its_recorded_numbers_and_is_not_the_warm_start():
    recipe = json.loads((BASE / "recipe.json").read_text())["heldout_lm"]
    cfg = load_config("configs/tiny.yaml")
    measured = heldout_lm(BASE, cfg.data, cfg.run.seed)
    for text in ("right", "slipped"):
        got, recorded = measured[text], recipe["base"][text]
        assert (got["solutions"], got["tokens"]) == (recorded["solutions"], recorded["tokens"])
        assert got["nll_per_token"] == pytest.approx(recorded["nll_per_token"], rel=1e-4)
        assert got["token_accuracy"] == pytest.approx(recorded["token_accuracy"], abs=1e-3)
        # Trained on: not the deepened warm start's function any more.
        assert got["nll_per_token"] != pytest.approx(recipe["warm_start"][text]["nll_per_token"],
                                                     rel=1e-3)


def test_the_base_is_deepened_already_and_its_added_layers_were_trained():
    model = load_causal_lm(BASE, device="cpu")
    assert deepen(model, [0, 1, 2, 3]) == 0  # `rm.extra_layers_from` beside the base: a no-op
    layers = decoder_layers(model)
    assert len(layers) == 8
    added = added_layer_parameters(model)
    assert [id(p) for p in added] == [id(p) for layer in list(layers)[4:]
                                      for p in layer.parameters()]
    # The added layers were trained: their output projections are no longer zero.
    assert all(float(layer.self_attn.o_proj.weight.detach().abs().max()) > 0
               for layer in list(layers)[4:])


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rebuild_checks_fail_a_rebuild_that_differs_and_pass_the_shipped_numbers():
    recipe = json.loads((BASE / "recipe.json").read_text())["heldout_lm"]
    shipped, warm = recipe["base"], recipe["warm_start"]
    check = _script("build_rm_base").check_failures
    assert check(shipped, {"base": shipped, "warm_start": warm}) == 0
    assert check(shipped, {"base": warm, "warm_start": warm}) == 1  # training did nothing
    halfway = {text: {"nll_per_token": (shipped[text]["nll_per_token"]
                                        + 0.6 * (warm[text]["nll_per_token"]
                                                 - shipped[text]["nll_per_token"]))}
               for text in ("right", "slipped")}
    assert check(shipped, {"base": halfway, "warm_start": warm}) == 1
    # The warm start's check: its own held-out outcomes against themselves pass; a change whose
    # interval leaves out 0 fails.
    warm_check = _script("build_warm_start")
    same = warm_check.change_from(WARM / "heldout.json", WARM / "heldout.json")
    assert warm_check.check_failures(same) == 0
    assert warm_check.check_failures({**same, "mean_at_k": {"diff": -0.05, "lo": -0.08,
                                                            "hi": -0.02}}) == 1
