"""Safe loading and atomic saving: nothing crafted runs, nothing half-written is trusted, a full
disk stops the run with the previous checkpoint intact."""

import errno
import json
import pickle

import pytest
import torch

import igrpo
from configs import ConfigError, load_config
from configs.schema import DeepSpeedConfig
from runtime import checkpoint
from runtime.checkpoint import (CheckpointError, load_training_state, recover_export,
                                save_pretrained, save_training_state)
from runtime.engine import build_engine
from runtime.rundir import RunDir
from runtime.tiny_model import build_model, build_tokenizer
from runtime.models import load_causal_lm


class _Bomb:
    """Unpickling this runs code: it creates the canary file."""

    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (open, (self.canary, "w"))


def _engine():
    tokenizer = build_tokenizer(())
    model = build_model(tokenizer, 16, 1, 2, 32, 64, seed=0)
    return build_engine(model, DeepSpeedConfig(), lr=1e-2, micro_batch_size=1, grad_accum=1), \
        tokenizer


def _train_step(engine):
    loss = engine(input_ids=torch.tensor([[5, 6, 7]])).logits.mean()
    engine.backward(loss)
    engine.step()


def test_exports_are_safetensors_only(tmp_path):
    engine, tokenizer = _engine()
    out = save_pretrained(engine, tokenizer, tmp_path / "export", "a: 1\n")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pth"))]


def test_training_state_loads_weights_only(tmp_path):
    engine, _ = _engine()
    save_training_state(engine, tmp_path / "state", {"step": 1})
    tag = (tmp_path / "state" / "latest").read_text()
    state_file = next((tmp_path / "state" / tag).glob("*model_states.pt"))
    canary = tmp_path / "canary"
    torch.save({"module": _Bomb(str(canary))}, state_file)
    with pytest.raises(pickle.UnpicklingError):
        load_training_state(engine, tmp_path / "state")
    assert not canary.exists()


def test_kill_during_a_state_write_keeps_the_previous_state(tmp_path, monkeypatch):
    """A crash after DeepSpeed wrote the new tag but before `latest` moved to it."""
    engine, _ = _engine()
    save_training_state(engine, tmp_path / "state", {"step": 1})
    _train_step(engine)

    def crash(path, text):
        raise KeyboardInterrupt("killed while writing latest")

    monkeypatch.setattr(checkpoint, "atomic_write_text", crash)
    with pytest.raises(KeyboardInterrupt):
        save_training_state(engine, tmp_path / "state", {"step": 2})
    monkeypatch.undo()
    fresh, _ = _engine()
    assert load_training_state(fresh, tmp_path / "state") == {"step": 1}
    save_training_state(fresh, tmp_path / "state", {"step": 3})  # replaces the orphan tag
    assert [p.name for p in (tmp_path / "state").iterdir() if p.is_dir()] == ["000001"]
    assert load_training_state(fresh, tmp_path / "state") == {"step": 3}


def test_disk_full_stops_with_the_previous_state_intact(tmp_path, monkeypatch):
    engine, _ = _engine()
    save_training_state(engine, tmp_path / "state", {"step": 1})
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _train_step(engine)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"No space left on device.*000000 is intact"):
        save_training_state(engine, tmp_path / "state", {"step": 2})
    monkeypatch.undo()
    assert not (tmp_path / "state" / "000001").exists()  # the partial folder is gone
    fresh, _ = _engine()
    assert load_training_state(fresh, tmp_path / "state") == {"step": 1}
    assert all(torch.equal(before[k], v) for k, v in fresh.module.state_dict().items())


def test_interrupted_export_swap_is_recovered(tmp_path):
    engine, tokenizer = _engine()
    out = save_pretrained(engine, tokenizer, tmp_path / "best")
    out.rename(tmp_path / ".best.old")  # killed between moving the old export aside and renaming
    recover_export(tmp_path / "best")
    # The export is back where it belongs, with the engine's weights.
    loaded = load_causal_lm(tmp_path / "best").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in engine.module.state_dict().items())
    assert not (tmp_path / ".best.old").exists()


def test_remote_code_is_not_trusted_by_default(tmp_path):
    engine, tokenizer = _engine()
    out = save_pretrained(engine, tokenizer, tmp_path / "model")
    canary = tmp_path / "canary"
    (out / "evil.py").write_text(f"open({str(canary)!r}, 'w')\n"
                                 "from transformers import LlamaForCausalLM as Evil\n")
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Evil"}
    (out / "config.json").write_text(json.dumps(config))
    model = load_causal_lm(out)  # default: the custom code is ignored, the built-in class loads
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not canary.exists()


def test_yaml_python_tags_are_refused(tmp_path):
    canary = tmp_path / "canary"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"run: !!python/object/apply:os.system ['touch {canary}']\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    assert not canary.exists()


@pytest.mark.parametrize("name", ["../escape", "/etc", "a/../../escape"])
def test_run_folder_cannot_be_escaped(tmp_path, name):
    with pytest.raises(ValueError, match="outside the run folder"):
        RunDir(tmp_path / "runs", name)
    assert igrpo.main(["build-tiny", "--config", "configs/tiny.yaml",
                       f"run.root={tmp_path / 'runs'}", f"run.name={name}"]) != 0
    assert not (tmp_path / "escape").exists()
