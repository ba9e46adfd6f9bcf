"""Strict config loading: schema defaults <- YAML file <- CLI dotlist, checked before any work."""

from __future__ import annotations

import difflib
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.schema import VLLM_LORA_RANKS, Config

CONFIG_DIR = Path(__file__).resolve().parent

# The losses whose convention divides advantages by no group std (policy/math/losses.py,
# `std_normalised_advantages=False`; tests/test_configs.py holds the two in step): with them
# `grpo.scale_by_std=true` would be dropped without a word, so it is refused.
UNSCALED_LOSSES = ("dr_grpo", "gpg")

# String fields with a closed set of values; checked once here so a typo fails at start-up.
CHOICES = {
    "run.wandb_mode": ("offline", "online", "disabled"),
    "data.source": ("synthetic", "gsm8k", "math"),
    "data.operations": ("+-*", "+-"),
    "model.dtype": ("float32", "bfloat16"),
    "deepspeed.zero_stage": (0, 1, 2, 3),
    "policy.loss": ("grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po", "gspo", "gspo_token"),
    "policy.algorithm": ("grpo", "offline_rft", "ppo", "t_ppo", "dpo", "online_dpo"),
    "ppo.critic_init": ("policy", "reward_model"),
    "policy.supervision": ("outcome", "process", "rft"),
    "grpo.process_credit": ("sum", "min", "anchored", "prime"),
    "policy.reward": ("rule", "step_oracle", "rm"),
    "rm.kind": ("prm", "orm"),
    "rm.family": ("", "tag_lm", "token_classification", "sequence_classification", "implicit"),
    "rm.online_update": ("after", "before"),
    "rm.ensemble_aggregate": ("mean", "worst", "uncertainty"),
    "rm.activation": ("softmax", "sigmoid"),
    "rollout.backend": ("hf", "vllm"),
    "rollout.lora_push": ("merged", "adapter"),
    "rm.truncation": ("end", "steps", "drop"),
    "rm.backend": ("hf", "vllm"),
    "iterate.reward": ("rm", "rule", "step_oracle"),
    "iterate.refresh_from": ("previous", "base"),
    "watch.guard": ("off", "warn", "stop", "refresh"),
    "rm.aggregate": ("min", "prod", "last", "mean"),
    "model.attn_implementation": ("", "sdpa", "eager", "flash_attention_2"),
    "model.tiny.architecture": ("llama", "qwen2", "mistral", "gpt_neox"),
}


# A recipe (configs/recipes/NAME.yaml) owns these keys: they are reset to the schema's defaults
# (DeepSeekMath's GRPO) before the recipe's file applies, so that a recipe means the same over
# any base config. Scale settings (model, lr, batch, lengths, G) stay the base config's.
RECIPE_DIR = CONFIG_DIR / "recipes"
RECIPE_KEYS = tuple(f"policy.{key}" for key in (
    "algorithm", "loss", "beta", "clip_eps", "clip_eps_high", "mu", "mini_batches")) + tuple(
    f"grpo.{key}" for key in (
        "scale_by_std", "dynamic_sampling", "dynamic_sampling_max_rounds", "overlong_filter",
        "overlong_buffer_share", "overlong_penalty", "zero_group_correction",
        "token_budget_share")) + tuple(
    f"ppo.{key}" for key in ("gamma", "lam_actor", "lam_critic", "length_adaptive_alpha",
                             "value_clip", "whiten_advantages", "value_pretrain_steps",
                             "positive_nll_weight", "window_share"))


# Keys that moved, old -> new: read under their old names for one release, with a warning.
RENAMED = {
    "grpo.algorithm": "policy.algorithm",
    "grpo.supervision": "policy.supervision",
    "grpo.reward": "policy.reward",
    "grpo.loss": "policy.loss",
    "grpo.steps": "policy.steps",
    "grpo.questions_per_step": "policy.questions_per_step",
    "grpo.group_size": "policy.group_size",
    "grpo.lr": "policy.lr",
    "grpo.beta": "policy.beta",
    "grpo.clip_eps": "policy.clip_eps",
    "grpo.clip_eps_high": "policy.clip_eps_high",
    "grpo.mu": "policy.mu",
    "grpo.mini_batches": "policy.mini_batches",
    "grpo.max_new_tokens": "policy.max_new_tokens",
    "grpo.temperature": "policy.temperature",
    "grpo.top_p": "policy.top_p",
    "grpo.rollout_questions": "policy.rollout_questions",
    "grpo.eval_every": "policy.eval_every",
    "grpo.save_every": "policy.save_every",
    "grpo.max_minutes": "policy.max_minutes",
    "grpo.offline_rft_sampling_share": "rft.sampling_share",
    "grpo.shuffle_rewards": "controls.shuffle_rewards",
    "grpo.zero_advantages": "controls.zero_advantages",
    "grpo.inspect_every": "inspect.every",
    "grpo.inspect_groups": "inspect.groups",
    "grpo.inspect_samples": "inspect.samples",
}


def _moved(old: str, where: str) -> str:
    """The key `old` names now, with a warning where it moved (RENAMED)."""
    new = RENAMED.get(old)
    if new is None:
        return old
    warnings.warn(f"{where}: config key {old!r} is now {new!r}; the old name is read until the "
                  "next release", FutureWarning, stacklevel=3)
    return new


def renamed_tree(tree: dict, where: str) -> dict:
    """A nested config dict with every moved key under its new name (a key set under both
    names fails: which one was meant is unclear)."""
    out: dict = {}
    keys = _flat(tree)
    for key in keys:
        new = _moved(key, where)
        if new != key and new in keys:
            raise ConfigError(f"{where}: {key!r} and {new!r} both set; keep {new!r}")
        node = out
        *parents, leaf = new.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _leaf(tree, key)
    return out


def _leaf(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def renamed_overrides(overrides, where: str = "command-line overrides") -> list[str]:
    """`key=value` overrides with every moved key under its new name."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        plus = "+" if key.startswith("+") else ""
        out.append(plus + _moved(key.lstrip("+"), where) + eq + value if eq else o)
    return out


def recipes() -> list[str]:
    """The names of the shipped recipes."""
    return sorted(path.stem for path in RECIPE_DIR.glob("*.yaml"))


def _apply_recipe(cfg: DictConfig, name: str) -> DictConfig:
    path = RECIPE_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"recipe {name!r}: no configs/recipes/{name}.yaml; "
                          f"the recipes are {', '.join(recipes())}")
    defaults = OmegaConf.structured(Config)
    for key in RECIPE_KEYS:
        OmegaConf.update(cfg, key, OmegaConf.select(defaults, key))
    loaded = OmegaConf.load(path)
    loaded = renamed_tree(OmegaConf.to_container(loaded), str(path))
    check_keys(_flat(loaded), str(path))
    cfg = OmegaConf.merge(cfg, loaded)
    OmegaConf.update(cfg, "run.recipe", name)
    return cfg


def _recipe_name(file_recipe: str, overrides, recipe: str | None) -> str:
    """--recipe, else a `run.recipe=` override, else the config file's (`file_recipe`)."""
    if recipe:
        return recipe
    for o in overrides:
        if o.split("=", 1)[0].lstrip("+") == "run.recipe":
            return o.split("=", 1)[1]
    return file_recipe


# Model folders shipped in runtime/bundled, named `bundled:<name>` in a config.
BUNDLED = CONFIG_DIR.parent / "runtime" / "bundled"
MODEL_PATH_KEYS = ("model.policy_path", "rm.init_path", "label.completer")


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def _resolve_bundled(cfg: DictConfig) -> None:
    """`bundled:tiny_warm_start` -> the shipped folder's absolute path, which must exist."""
    for key in MODEL_PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and value.startswith("bundled:"):
            folder = BUNDLED / value.removeprefix("bundled:")
            if not (folder / "config.json").exists():
                raise ConfigError(f"{key} = {value!r}: no model in {folder}")
            OmegaConf.update(cfg, key, str(folder))


def schema_keys(node=Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted (`policy.group_size`)."""
    out = []
    for f in fields(node):
        kind = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(kind):
            out += schema_keys(type(kind), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _flat(tree, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix.rstrip(".")]
    return [k for key, value in tree.items() for k in _flat(value, f"{prefix}{key}.")]


def check_keys(keys: list[str], where: str) -> None:
    """Each key must be in the schema; an unknown one fails in one line, with a suggestion."""
    known = schema_keys()
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else \
                "; `igrpo config show` lists every key"
            trl = key.rsplit(".", 1)[-1]  # (also under a section: rm.learning_rate)
            if trl in TRL_KEYS:
                hint = f"; that is TRL's PRMConfig name: here it is {TRL_KEYS[trl]}"
            raise ConfigError(f"{where}: unknown config key {key!r}{hint}")


TRL_KEYS = {
    "max_length": "rm.max_length", "train_on_last_step_only": "rm.train_on_last_step_only",
    "max_completion_length": "rm.max_completion_length",
    "step_separator": "rm.separator (rm.family=token_classification; the tag LM's is "
                      "rm.step_tag)",
    "learning_rate": "rm.lr", "num_train_epochs": "rm.epochs",
    "per_device_train_batch_size": "deepspeed.micro_batch_size",
    "gradient_accumulation_steps": "rm.batch_size (the global batch; the accumulation follows "
                                   "from it, the micro-batch and the ranks)",
}
"""TRL 1.13's PRMConfig names (its users' muscle memory), each with the key it maps to here."""


def _override_keys(overrides) -> list[str]:
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"command-line overrides: {o!r} is not key=value "
                              "(write policy.group_size=16, with '=' and no spaces)")
    return [o.split("=", 1)[0].lstrip("+") for o in overrides]


def _config_files(path: str | Path | None) -> list[tuple[str, DictConfig]]:
    """(name, contents) of a config file and of the files it `extends:` (a path relative to
    it), the base first; `extends` itself is dropped."""
    chain: list[tuple[str, DictConfig]] = []
    while path is not None:
        if chain and not Path(path).exists():
            raise ConfigError(f"{chain[0][0]}: extends {str(path)!r}, which does not exist")
        loaded = OmegaConf.load(path)
        base = loaded.pop("extends", None)
        chain.insert(0, (str(path), loaded))
        if base is not None and len(chain) > 8:
            raise ConfigError(f"{path}: `extends` chains more than 8 files deep (a cycle?)")
        path = None if base is None else Path(path).parent / base
    return chain


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                recipe: str | None = None) -> DictConfig:
    """Merge the schema, an optional YAML file, a recipe (`recipe`, or `run.recipe` set by the
    file or an override) and `key=value` overrides; fail naming the key."""
    cfg = OmegaConf.structured(Config)
    where = "defaults"
    try:
        for where, loaded in _config_files(path):
            loaded = renamed_tree(OmegaConf.to_container(loaded), where)
            check_keys(_flat(loaded), where)
            cfg = OmegaConf.merge(cfg, loaded)
        where = "command-line overrides"
        overrides = renamed_overrides(overrides, where)
        check_keys(_override_keys(overrides), where)
        name = _recipe_name(cfg.run.recipe, overrides, recipe)
        if name:
            where = f"recipe {name}"
            cfg = _apply_recipe(cfg, name)
            where = "command-line overrides"
        # `key=` sets an empty string (YAML would read it as null), e.g. model.policy_path=
        dotlist = [o + "''" if o.endswith("=") else o for o in overrides]
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        reason = (getattr(err, "msg", None) or str(err)).splitlines()[0]
        raise ConfigError(f"{where}: config key {key!r}: {reason}") from err
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}") from err
    except yaml.YAMLError as err:  # omegaconf's loader is a yaml SafeLoader: no python tags
        raise ConfigError(f"{where}: not a valid YAML config: {err}".replace("\n", " ")) from err
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{where}: key {key!r} = {value!r}; expected one of {allowed}")
    _check_lengths(cfg.data, cfg.policy, cfg.label, cfg.rm, where)
    _check_value_family(cfg.policy, cfg.ppo, cfg.rollout.backend, where)
    _check_mini_batches(cfg.policy, cfg.grpo.token_budget_share, where)
    _check_algorithm_options(cfg.policy, cfg.grpo, where)
    _check_watch(cfg.watch, where)
    _check_loop_reward(cfg.policy.algorithm, cfg.policy.supervision, cfg.iterate.reward, where)
    _check_reward_family(cfg.rm, cfg.ppo.critic_init, where)
    _check_online(cfg.rm, cfg.policy, cfg.grpo, where)
    _check_ensemble(cfg.rm, where)
    _check_adapters(cfg.model.lora, cfg.rm, cfg.policy, cfg.rollout, where)
    if cfg.model.dtype == "bfloat16" and not cfg.deepspeed.bf16:
        raise ConfigError(f"{where}: model.dtype=bfloat16 with deepspeed.bf16=false: AdamW would "
                          "step the bf16 weights themselves, and updates below bf16's resolution "
                          "would be lost; set deepspeed.bf16=true (fp32 master weights)")
    data = cfg.data
    if not (1 <= data.min_ops <= data.max_ops) or not (
            data.sft_max_ops == 0 or data.min_ops <= data.sft_max_ops <= data.max_ops):
        raise ConfigError(f"{where}: data.min_ops / max_ops / sft_max_ops = {data.min_ops} / "
                          f"{data.max_ops} / {data.sft_max_ops}; expected 1 <= min_ops <= max_ops "
                          "and sft_max_ops 0 (= max_ops) or within [min_ops, max_ops]")
    _resolve_bundled(cfg)
    if not 0.0 <= data.sft_slip_share < 1.0:
        raise ConfigError(f"{where}: data.sft_slip_share = {data.sft_slip_share}; expected a "
                          "share in [0, 1)")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_value_family(g, p, backend: str, where: str) -> None:
    """What the PPO family cannot combine with (checked before any work starts): `g` the
    policy section, `p` ppo's, `backend` the rollout's."""
    if g.algorithm not in ("ppo", "t_ppo"):
        return
    if g.supervision == "rft":
        raise ConfigError(f"{where}: policy.algorithm={g.algorithm} with policy.supervision=rft: "
                          "online RFT has no critic; use outcome or process supervision")
    if (p.window_share > 0) != (g.algorithm == "t_ppo"):
        raise ConfigError(f"{where}: policy.algorithm={g.algorithm} with ppo.window_share="
                          f"{p.window_share}: T-PPO (policy.algorithm=t_ppo) needs a window "
                          "share above 0, PPO (ppo) generates whole responses (0)")
    if p.window_share > 0 and (g.supervision != "outcome" or backend != "hf"):
        raise ConfigError(f"{where}: ppo.window_share={p.window_share} (T-PPO) runs with "
                          "policy.supervision=outcome and rollout.backend=hf; got "
                          f"{g.supervision} / {backend}")
    if not 0.0 <= p.lam_actor <= 1.0 or not 0.0 <= p.lam_critic <= 1.0:
        raise ConfigError(f"{where}: ppo.lam_actor / lam_critic = {p.lam_actor} / "
                          f"{p.lam_critic}; expected values in [0, 1]")


def _check_loop_reward(algorithm: str, supervision: str, reward: str, where: str) -> None:
    """`iterate.reward` must give the rewards a policy-gradient algorithm's supervision reads:
    step rewards for process supervision (the PRM or the step oracle), one per sample otherwise.
    (DPO and offline RFT judge their samples by the final answer whatever the supervision.)"""
    if algorithm not in ("grpo", "ppo", "t_ppo"):
        return
    if supervision == "process" and reward == "rule":
        raise ConfigError(f"{where}: iterate.reward=rule with policy.supervision=process: the "
                          "final-answer check gives no step rewards; use rm (the PRM) or "
                          "step_oracle")
    if supervision != "process" and reward == "step_oracle":
        raise ConfigError(f"{where}: iterate.reward=step_oracle with policy.supervision="
                          f"{supervision}: the step oracle's rewards are per step; use "
                          "policy.supervision=process")


def _check_watch(w, where: str) -> None:
    """The guard acts on the watch's window: both must be there."""
    if w.guard != "off" and not w.enabled:
        raise ConfigError(f"{where}: watch.guard={w.guard} with watch.enabled=false: the guard "
                          "acts on the watch's measures; set watch.enabled=true")
    if w.window < 1 or w.kl_init_every < 0:
        raise ConfigError(f"{where}: watch.window = {w.window}, watch.kl_init_every = "
                          f"{w.kl_init_every}; expected a window of 1 step or more and an "
                          "interval >= 0 (0: never)")


def _check_algorithm_options(p, g, where: str) -> None:
    """GSPO's losses take GRPO's group advantages; a process credit form shapes GRPO's process
    advantages; DPO takes none of GRPO's loss options (`p`: the policy section, `g`: grpo's)."""
    if g.process_credit != "sum" and (p.supervision != "process" or p.algorithm != "grpo"):
        raise ConfigError(f"{where}: grpo.process_credit={g.process_credit} with policy."
                          f"supervision={p.supervision} and policy.algorithm={p.algorithm}: a "
                          "credit form shapes GRPO's process advantages (policy.supervision="
                          "process, policy.algorithm=grpo)")
    if not 0.0 <= g.gold_share <= 1.0:
        raise ConfigError(f"{where}: grpo.gold_share = {g.gold_share}; expected a share of the "
                          "questions in [0, 1]")
    if g.gold_share < 1.0 and g.process_credit not in ("anchored", "prime"):
        raise ConfigError(f"{where}: grpo.gold_share={g.gold_share} with grpo.process_credit="
                          f"{g.process_credit}: the gold budget says which questions the "
                          "anchored (or prime) form's exact check may read; set grpo."
                          "process_credit=anchored (and policy.supervision=process)")
    if not 0.0 <= g.process_weight < float("inf"):
        raise ConfigError(f"{where}: grpo.process_weight = {g.process_weight}; expected a finite "
                          "weight >= 0")
    if p.loss in UNSCALED_LOSSES and g.scale_by_std:
        raise ConfigError(f"{where}: policy.loss={p.loss} with grpo.scale_by_std=true: "
                          f"{p.loss} does not divide advantages by the group std (its paper's "
                          "form), so the std would be dropped; set grpo.scale_by_std=false, or "
                          f"use --recipe {p.loss}")
    if p.loss in ("gspo", "gspo_token") and p.algorithm != "grpo":
        raise ConfigError(f"{where}: policy.loss={p.loss} with policy.algorithm={p.algorithm}: "
                          "GSPO's sequence ratio takes group advantages (policy.algorithm=grpo)")
    if p.algorithm not in ("dpo", "online_dpo"):
        return
    unused = {"policy.loss": p.loss != "grpo", "policy.mu": p.mu != 1,
              "grpo.dynamic_sampling": g.dynamic_sampling, "grpo.overlong_filter":
              g.overlong_filter, "grpo.token_budget_share": bool(g.token_budget_share),
              "grpo.zero_group_correction": g.zero_group_correction}
    if any(unused.values()):
        raise ConfigError(f"{where}: policy.algorithm={p.algorithm} with "
                          f"{', '.join(k for k, v in unused.items() if v)} set: DPO's loss "
                          "takes one step per batch of pairs and none of these")


def _check_mini_batches(g, token_budget_share: float, where: str) -> None:
    if g.mini_batches < 1 or g.group_size % g.mini_batches:
        raise ConfigError(f"{where}: policy.mini_batches={g.mini_batches}; expected a divisor of "
                          f"policy.group_size={g.group_size} (a mini-batch takes G/k samples of "
                          "every question)")
    if g.mini_batches > 1 and (g.algorithm != "grpo" or token_budget_share):
        raise ConfigError(f"{where}: policy.mini_batches={g.mini_batches} runs with "
                          "policy.algorithm=grpo and no token budget (token_budget_share=0); got "
                          f"{g.algorithm} / {token_budget_share}")


def _check_reward_family(rm, critic_init: str, where: str) -> None:
    """The tag LM's own options on a classifier family are a mistake, not a no-op; and
    `rm.backend`."""
    _check_rm_backend(rm, critic_init, where)
    _check_rm_truncation(rm, where)
    if rm.group_by_question and rm.group_by_length:
        raise ConfigError(f"{where}: rm.group_by_question and rm.group_by_length both set: a "
                          "batch keeps a question's solutions together, or rows of one length")
    if rm.score_shard_rows < 1:
        raise ConfigError(f"{where}: rm.score_shard_rows={rm.score_shard_rows}; expected at "
                          "least 1 row a shard")
    if rm.family in ("", "tag_lm", "implicit"):  # (implicit: the loop's own RMs are tag LMs)
        return
    tag_only = {"rm.likelihood_feature": rm.likelihood_feature, "rm.lm_weight": rm.lm_weight,
                "rm.extra_layers_from": list(rm.extra_layers_from),
                "rm.add_tag_token": rm.add_tag_token}
    set_keys = [f"{k}={v}" for k, v in tag_only.items() if v]
    if set_keys:
        raise ConfigError(f"{where}: rm.family={rm.family} with {', '.join(set_keys)}: those read "
                          "or train a causal LM at its step tag (rm.family=tag_lm)")
    if rm.label_index < 0:
        raise ConfigError(f"{where}: rm.label_index={rm.label_index}; expected a class index")


def _check_rm_truncation(rm, where: str) -> None:
    """`rm.max_completion_length`: a budget of tokens after the question, on families with a
    label per step."""
    if rm.max_completion_length < 0:
        raise ConfigError(f"{where}: rm.max_completion_length={rm.max_completion_length}; "
                          "expected 0 (no budget) or a number of tokens")
    if rm.max_completion_length and rm.family == "sequence_classification":
        raise ConfigError(f"{where}: rm.max_completion_length with rm.family="
                          "sequence_classification: that family reads its one label at the "
                          "row's last token, which a budget would cut; bound it with "
                          "rm.max_length")


def _check_ensemble(rm, where: str) -> None:
    """An ensemble (`rm.ensemble`) is of frozen reward models the outer loop trains."""
    if rm.ensemble < 1:
        raise ConfigError(f"{where}: rm.ensemble = {rm.ensemble}; expected a number of members "
                          ">= 1")
    if not 0.0 <= rm.ensemble_lambda < float("inf"):
        raise ConfigError(f"{where}: rm.ensemble_lambda = {rm.ensemble_lambda}; expected a "
                          "finite weight >= 0")
    if rm.ensemble > 1 and rm.online:
        raise ConfigError(f"{where}: rm.ensemble={rm.ensemble} with rm.online: an online "
                          "reward model is one model learning from the checks; use one or the "
                          "other")


def _check_adapters(policy_lora, rm, p, rollout, where: str) -> None:
    """`model.lora`, `rm.lora`, `policy.tis_cap` and `rollout.lora_push`."""
    _check_lora(policy_lora, "model.lora", where)
    _check_lora(rm.lora, "rm.lora", where)
    _check_rm_lora(rm, where)
    _check_tis(p, where)
    _check_lora_push(rollout, policy_lora, where)


def _check_lora(lora, key: str, where: str) -> None:
    """A LoRA block (`model.lora`, `rm.lora`): a rank >= 0, a positive alpha, a dropout in
    [0, 1), some target modules."""
    if lora.rank < 0:
        raise ConfigError(f"{where}: {key}.rank = {lora.rank}; expected 0 (off) or a rank > 0")
    if lora.rank and not 0.0 < lora.alpha < float("inf"):
        raise ConfigError(f"{where}: {key}.alpha = {lora.alpha}; expected a finite alpha > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{where}: {key}.dropout = {lora.dropout}; expected 0 <= dropout < 1")
    if lora.rank and not lora.target_modules.strip(" ,"):
        raise ConfigError(f"{where}: {key}.target_modules is empty; expected all-linear or "
                          "module names (q_proj,v_proj)")


def _check_rm_lora(rm, where: str) -> None:
    """`rm.lora` trains the offline families and the online ORM; the implicit PRM and added
    layers (which would stay frozen at their zero output) are refused."""
    if not rm.lora.rank:
        return
    if rm.family == "implicit":
        raise ConfigError(f"{where}: rm.lora with rm.family=implicit: PRIME's implicit PRM "
                          "trains whole (LoRA is built for the tag-LM and token-classification "
                          "reward models, offline and the online ORM); set rm.lora.rank=0")
    if rm.extra_layers_from:
        raise ConfigError(f"{where}: rm.lora with rm.extra_layers_from: the added layers start "
                          "at a zero output and LoRA would freeze them there; use one or the "
                          "other")


def _check_rm_backend(rm, critic_init: str, where: str) -> None:
    """`rm.backend=vllm` scores a token-classification PRM that nothing trains in place."""
    if rm.backend != "vllm":
        return
    if rm.family != "token_classification":
        raise ConfigError(f"{where}: rm.backend=vllm scores the token_classification family "
                          f"(vLLM's pooling runner); set rm.family=token_classification (it "
                          f"is {rm.family or 'unset: the loop would train tag LMs'})")
    if rm.online:
        raise ConfigError(f"{where}: rm.backend=vllm with rm.online: the online reward model "
                          "trains, and vLLM only scores; set rm.backend=hf")
    if critic_init == "reward_model":
        raise ConfigError(f"{where}: rm.backend=vllm with ppo.critic_init=reward_model: the "
                          "critic starts from the reward model's weights; set rm.backend=hf")


def _check_lora_push(rollout, lora, where: str) -> None:
    """`rollout.lora_push=adapter`: a LoRA policy sampled by vLLM, of a rank vLLM serves."""
    if rollout.lora_push != "adapter":
        return
    if not lora.rank or rollout.backend != "vllm":
        raise ConfigError(f"{where}: rollout.lora_push=adapter hands vLLM the policy's LoRA "
                          f"adapter; it needs model.lora.rank > 0 (got {lora.rank}) and "
                          f"rollout.backend=vllm (got {rollout.backend})")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"{where}: model.lora.rank = {lora.rank} with rollout.lora_push="
                          f"adapter; vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")


def _check_tis(p, where: str) -> None:
    """`policy.tis_cap`: 0 (off) or a cap >= 1, on GRPO's loss."""
    if p.tis_cap == 0:
        return
    if not 1.0 <= p.tis_cap < float("inf"):
        raise ConfigError(f"{where}: policy.tis_cap = {p.tis_cap}; expected 0 (off) or a cap "
                          ">= 1 (TRL's default is 3)")
    if p.algorithm != "grpo":
        raise ConfigError(f"{where}: policy.tis_cap with policy.algorithm={p.algorithm}: the "
                          "truncated importance-sampling weights are built into GRPO's loss")


def _check_online(rm, p, g, where: str) -> None:
    """The online ORM (`rm.online`) is GRPO's outcome reward, a tag-LM reward model; the
    implicit PRM (`rm.family=implicit`) is GRPO's reward for either supervision, online only."""
    if rm.family == "implicit" and not rm.online:
        raise ConfigError(f"{where}: rm.family=implicit without rm.online: the implicit PRM is "
                          "built to learn online during GRPO (set rm.online=true); training one "
                          "offline is not built yet")
    if not rm.online:
        return
    if rm.family == "implicit":
        if p.algorithm != "grpo" or p.supervision == "rft":
            raise ConfigError(f"{where}: rm.family=implicit with policy.algorithm={p.algorithm} "
                              f"and policy.supervision={p.supervision}: it rewards GRPO's "
                              "samples (outcome or process supervision)")
        if not 0.0 < rm.implicit_beta < float("inf"):
            raise ConfigError(f"{where}: rm.implicit_beta = {rm.implicit_beta}; expected a "
                              "finite beta > 0")
    elif p.algorithm != "grpo" or p.supervision != "outcome":
        raise ConfigError(f"{where}: rm.online with policy.algorithm={p.algorithm} and policy."
                          f"supervision={p.supervision}: the online ORM rewards GRPO's samples "
                          "one score each; set policy.algorithm=grpo and policy.supervision="
                          "outcome")
    if rm.family not in ("", "tag_lm", "implicit"):
        raise ConfigError(f"{where}: rm.online with rm.family={rm.family}: the online ORM trains "
                          "the tag_lm family (or set rm.family=implicit)")
    if g.gold_share < 1.0:
        raise ConfigError(f"{where}: rm.online with grpo.gold_share={g.gold_share}: the online "
                          "reward model learns from every sample's check, so the gold budget "
                          "would not hold; use one or the other")
    if rm.online_update == "before" and g.dynamic_sampling:
        raise ConfigError(f"{where}: rm.online_update=before with grpo.dynamic_sampling=true: a "
                          "refill is scored again, so the reward model would step more than "
                          "once a GRPO step; use rm.online_update=after or "
                          "grpo.dynamic_sampling=false")
    if not 0.0 <= rm.online_lr < float("inf"):
        raise ConfigError(f"{where}: rm.online_lr = {rm.online_lr}; expected a rate >= 0 (0: "
                          "rm.lr)")


def _check_lengths(data, g, lab, rm, where: str) -> None:
    """Lengths that must agree: Math-Shepherd continuations as long as the policy's solutions,
    and reward-model inputs that hold a whole prompt plus solution (else the late steps get no
    score and the ORM scores a cut solution)."""
    from tasks.prompts import resolve_template

    try:
        resolve_template(data.prompt_template)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from err
    if not data.step_separator:
        raise ConfigError(f"{where}: data.step_separator is empty")
    if lab.max_new_tokens < g.max_new_tokens:
        raise ConfigError(f"{where}: label.max_new_tokens={lab.max_new_tokens} < "
                          f"policy.max_new_tokens={g.max_new_tokens}: Math-Shepherd continuations "
                          "must be able to write as much as the policy does")
    if rm.max_length < data.max_prompt_tokens + g.max_new_tokens:
        raise ConfigError(f"{where}: rm.max_length={rm.max_length} < data.max_prompt_tokens="
                          f"{data.max_prompt_tokens} + policy.max_new_tokens={g.max_new_tokens}: "
                          "the reward models would not see the end of a solution")


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config, verbatim, as written to run folders and checkpoints."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_dict(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def diff_configs(old: dict, new: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """Dotted keys whose values differ between two resolved configs. With the schema's
    `defaults`, a key one side lacks (the schema changed between the two) counts only if it
    was set: a key added at its default, or removed while off (0, false, empty), is no change."""
    keys = sorted(set(old) | set(new))
    out: list[str] = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        dotted = f"{prefix}{key}"
        default = (defaults or {}).get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_configs(a, b, dotted + ".", default if isinstance(default, dict) else {})
        elif defaults is not None and key not in old and b == default:
            continue
        elif defaults is not None and key not in new and key not in defaults and not a:
            continue
        elif a != b:
            out.append(dotted)
    return out


def schema_defaults() -> dict:
    """The schema's own values, as a nested dict (for `diff_configs`)."""
    return OmegaConf.to_container(OmegaConf.structured(Config))  # type: ignore[return-value]
