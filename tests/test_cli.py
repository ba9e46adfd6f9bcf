"""The command line: each command's own help, config show, did-you-mean, unread keys."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import igrpo
from configs import ConfigError, load_config
from configs.loader import schema_keys

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("configs", "runtime", "policy", "reward_model", "process_supervision",
                       "iteration") for p in (ROOT / d).rglob("*.py")] + [ROOT / "igrpo.py"]


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        igrpo.main(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_its_own_help(capsys):
    texts = {}
    for name in igrpo.COMMANDS:
        text = _help(capsys, name, "--help")
        assert text.startswith(f"usage: igrpo {name} ")
        texts[name] = text
        if not igrpo.COMMANDS[name].sections:  # `inspect` reads a trace folder, no config
            assert "reads no config" in text and "--config" not in text
            continue
        sections = re.search(r"Config sections read: ([a-z, ]+) \(", text).group(1).split(", ")
        assert sections == list(igrpo.COMMANDS[name].sections)
        texts[name] = text
    assert len(set(texts.values())) == len(texts)
    assert "--gpus" in texts["plan"] and not any("--gpus" in t for n, t in texts.items()
                                                  if n != "plan")
    top = _help(capsys, "--help")
    assert all(f"  {name} " in top for name in igrpo.COMMANDS)


def test_config_show_prints_the_resolved_config(capsys):
    assert igrpo.main(["config", "show", "--config", "configs/tiny.yaml", "policy.lr=3e-6"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["policy"]["lr"] == 3e-6 and shown["policy"]["group_size"] == 64
    # bundled: paths are resolved to the shipped folder.
    assert shown["model"]["policy_path"].endswith("runtime/bundled/tiny_warm_start")
    # --recipe applies a named algorithm over the file; overrides still win
    assert igrpo.main(["config", "show", "--config", "configs/tiny.yaml", "--recipe", "dapo",
                       "policy.clip_eps=0.1"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["policy"]
    assert (shown["loss"], shown["clip_eps"], shown["clip_eps_high"], shown["beta"]) == \
        ("dapo", 0.1, 0.28, 0.0)
    assert igrpo.main(["config", "show", "--recipe", "nope"]) == 2
    assert "the recipes are c3po, cispo, dapo" in capsys.readouterr().err


@pytest.mark.parametrize("override,suggestion", [("policy.grop_size=8", "policy.group_size"),
                                                 ("rm.step_tg=x", "rm.step_tag"),
                                                 ("policy.betta=0.1", "policy.beta")])
def test_a_typo_gets_a_suggestion_in_one_line(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", [override])
    message = str(err.value)
    assert f"did you mean {suggestion!r}?" in message and "\n" not in message


@pytest.mark.parametrize("override,ours", [("max_length=512", "rm.max_length"),
                                           ("learning_rate=1e-5", "rm.lr"),
                                           ("max_completion_length=256",
                                            "rm.max_completion_length"),
                                           ("train_on_last_step_only=true",
                                            "rm.train_on_last_step_only"),
                                           ("rm.learning_rate=1e-5", "rm.lr")])
def test_trls_prm_config_names_point_to_ours(override, ours):
    """A TRL PRMTrainer user's key (TRL 1.13's PRMConfig) is refused naming the key it is here."""
    with pytest.raises(ConfigError, match=rf"that is TRL's PRMConfig name: here it is {ours}"):
        load_config("configs/tiny.yaml", [override])


@pytest.mark.parametrize("overrides,message", [
    (["rm.max_completion_length=-1"], r"rm.max_completion_length=-1; expected 0 \(no budget\)"),
    (["rm.max_completion_length=64", "rm.family=sequence_classification"],
     r"reads its one label at the row's last token"),
    (["rm.truncation=middle"], r"rm.truncation"),
])
def test_a_completion_budget_it_cannot_apply_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", overrides)


def test_a_typo_in_a_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  group_sise: 8\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'grpo.group_sise'; "
                                          r"did you mean 'policy.group_size'\?"):
        load_config(bad)


def test_a_space_instead_of_equals_is_named(capsys):
    assert igrpo.main(["sft", "--config", "configs/tiny.yaml", "policy.group_size", "16"]) == 2
    err = capsys.readouterr().err
    assert "'policy.group_size' is not key=value" in err and "None" not in err


def test_a_wrong_type_is_one_plain_line():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["policy.group_size=abc"])
    assert str(err.value) == ("command-line overrides: config key 'policy.group_size': Value 'abc' "
                              "of type 'str' could not be converted to Integer")


def test_a_key_the_command_does_not_read_is_warned(capsys):
    assert igrpo.unread_overrides("iterate", ["policy.reward=rule", "policy.lr=1e-5"]) == ["policy.reward"]
    assert igrpo.unread_overrides("sft", ["rm.lr=1e-4", "sft.lr=1e-3"]) == ["rm.lr"]
    assert igrpo.main(["config", "show", "policy.reward=rule"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert igrpo.main(["plan", "--config", "configs/deepseekmath_7b.yaml", "sft.lr=1e-3"]) == 0
    assert "warning: sft.lr is set but `igrpo plan` does not read it" in capsys.readouterr().err


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_key_a_shipped_yaml_sets_is_read(config):
    def flat(tree, prefix=""):
        return [k for key, v in tree.items() for k in
                (flat(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]

    tree = yaml.safe_load((ROOT / "configs" / config).read_text())
    base = tree.pop("extends", None)  # a file read before this one (configs/loader.py)
    assert base is None or (ROOT / "configs" / base).exists()
    keys = flat(tree)
    assert keys and set(keys) <= set(schema_keys())
    code = "\n".join(p.read_text() for p in SOURCES if p.name != "schema.py")
    for key in keys:
        # Some command reads its section and does not ignore it ...
        assert any(key.split(".")[0] in command.sections and key not in command.ignored
                   for name, command in igrpo.COMMANDS.items() if name != "config"), key
        # ... and some code outside the schema reads the field.
        assert re.search(rf"\.{key.split('.')[-1]}\b", code), key


def test_the_deepspeed_launchers_local_rank_is_dropped_wherever_it_is():
    strip = igrpo.strip_local_rank
    assert strip(["--local_rank=3", "iterate", "--config", "c.yaml"]) == ["iterate", "--config",
                                                                          "c.yaml"]
    assert strip(["iterate", "--local-rank", "1", "x=1"]) == ["iterate", "x=1"]


def test_a_commands_help_lists_its_keys_with_defaults_docs_and_an_example(capsys):
    text = _help(capsys, "train-rm", "--help")
    lines = text.splitlines()
    example = lines[lines.index("example:") + 1].strip()
    assert example.startswith("igrpo train-rm --config configs/")
    keys = {line.split()[0]: line for line in lines if re.match(r"  [a-z_]+\.[a-z_.]+ = ", line)}
    assert re.fullmatch(r"  rm\.data_path = '' +`igrpo train-rm`: Math-Shepherd or TRL-format .*",
                        keys["rm.data_path"])
    assert re.fullmatch(r"  rm\.family = '' +How the reward model is read .*", keys["rm.family"])
    assert re.fullmatch(r"  rm\.separator = '\\n' +Classifier families: what follows .*",
                        keys["rm.separator"])
    assert all(len(line) <= 110 for line in keys.values())
    # Ordered by section, as the command's `sections` lists them; no section it does not read.
    sections = list(dict.fromkeys(key.split(".")[0] for key in keys))
    assert sections == list(igrpo.COMMANDS["train-rm"].sections)
    assert not any(line.startswith("  policy.") for line in lines)
    # A key the command ignores is marked.
    text = _help(capsys, "iterate", "--help")
    assert re.search(r"  rm\.kind = 'prm' +\(ignored by this command", text)
    for name in igrpo.COMMANDS:
        assert f"\nexample:\n  igrpo {name} " in _help(capsys, name, "--help"), name


def test_a_model_load_in_a_log_is_one_line_not_a_progress_bar(warm_start):
    code = ("from runtime.models import load_causal_lm\n"
            f"load_causal_lm({str(warm_start)!r})\n"
            f"load_causal_lm({str(warm_start)!r}, device='cpu')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = [line for line in done.stdout.splitlines() if line.startswith("[igrpo] loaded ")]
    assert len(loaded) == 2, done.stdout
    assert re.fullmatch(rf"\[igrpo\] loaded {re.escape(str(warm_start))} \(LlamaForCausalLM, "
                        r"[\d.]+M params, float32\) in [\d.]+ s", loaded[0])
    assert "Loading weights" not in done.stdout + done.stderr
