"""Every shipped YAML loads into the schema; typos and wrong types fail naming the key."""

import pytest

from configs import CONFIG_DIR, ConfigError, load_config
from runtime.batching import plan_grpo_batch


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    cfg = load_config(path)
    assert cfg.policy.group_size > 0


def test_paper_settings():
    cfg = load_config(CONFIG_DIR / "deepseekmath_7b.yaml")
    assert (cfg.policy.lr, cfg.rm.lr, cfg.policy.beta, cfg.policy.group_size) == (1e-6, 2e-5, 0.04, 64)
    assert cfg.policy.max_new_tokens == 1024 and cfg.policy.mu == 1
    assert cfg.policy.questions_per_step * cfg.policy.group_size == 1024
    assert cfg.iterate.replay_fraction == 0.1
    assert cfg.deepspeed.zero_stage == 3 and cfg.deepspeed.bf16


def test_unknown_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  grop_size: 8\n")
    with pytest.raises(ConfigError, match="grop_size") as err:
        load_config(bad)
    assert str(bad) in str(err.value)
    with pytest.raises(ConfigError, match="grpo.nope"):
        load_config(None, ["grpo.nope=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="policy.group_size"):
        load_config(CONFIG_DIR / "tiny.yaml", ["policy.group_size=sixteen"])


def test_bad_choice_names_the_key():
    with pytest.raises(ConfigError, match="policy.loss"):
        load_config(None, ["policy.loss=ppo"])


def test_bf16_weights_need_deepspeed_bf16():
    """bf16 weights stepped by an fp32 AdamW would lose every update below bf16's resolution:
    refused, naming both keys; with DeepSpeed's bf16 mode (fp32 master weights) accepted."""
    with pytest.raises(ConfigError, match="model.dtype=bfloat16 with deepspeed.bf16=false"):
        load_config(CONFIG_DIR / "tiny.yaml", ["model.dtype=bfloat16"])
    cfg = load_config(CONFIG_DIR / "tiny.yaml", ["model.dtype=bfloat16", "deepspeed.bf16=true"])
    assert cfg.model.dtype == "bfloat16" and cfg.deepspeed.bf16


def test_dotlist_overrides_yaml():
    cfg = load_config(CONFIG_DIR / "tiny.yaml", ["policy.group_size=16"])
    assert cfg.policy.group_size == 16


def test_batch_plan():
    plan = plan_grpo_batch(8, 64, 64, world_size=2)
    assert (plan.rank_sequences, plan.micro_batch_size, plan.grad_accum) == (256, 64, 4)
    with pytest.raises(ValueError, match="questions_per_step=3"):
        plan_grpo_batch(3, 8, 8, world_size=2)
    with pytest.raises(ValueError, match="micro_batch_size=48"):
        plan_grpo_batch(8, 8, 48, world_size=1)
    # GSPO's 4 mini-batches: an optimizer step takes a quarter of every question's samples.
    plan = plan_grpo_batch(2, 64, 64, world_size=2, mini_batches=4)
    assert (plan.global_sequences, plan.rank_sequences, plan.micro_batch_size,
            plan.grad_accum) == (32, 16, 16, 1)
    with pytest.raises(ValueError, match="mini_batches=3 does not divide policy.group_size=64"):
        plan_grpo_batch(2, 64, 64, world_size=2, mini_batches=3)
    with pytest.raises(ConfigError, match="mini_batches=3; expected a divisor of"):
        load_config(CONFIG_DIR / "tiny.yaml", ["policy.mini_batches=3"])
    with pytest.raises(ConfigError, match="policy.loss=gspo with policy.algorithm=ppo"):
        load_config(CONFIG_DIR / "tiny.yaml", ["policy.algorithm=ppo", "policy.loss=gspo"])
    with pytest.raises(ConfigError, match="online_dpo with policy.mu, grpo.dynamic_sampling set"):
        load_config(CONFIG_DIR / "tiny.yaml", ["policy.mu=2", "grpo.dynamic_sampling=true"],
                    recipe="online_dpo")
    with pytest.raises(ConfigError, match="mini_batches=4 runs with policy.algorithm=grpo"):
        load_config(CONFIG_DIR / "tiny.yaml", ["policy.algorithm=ppo"], recipe="gspo")


def test_schema_changes_alone_do_not_block_a_resume():
    """A run made before a key was added (at its default) or removed (while off) resumes; a key
    set to something else, or a removed one that was on, still counts as a change."""
    from configs.loader import diff_configs, schema_defaults

    defaults = schema_defaults()
    new = {"grpo": {"beta": 0.04, "token_budget_share": 0.0}}
    assert diff_configs({"grpo": {"beta": 0.04, "overlong_buffer": 0}}, new, defaults=defaults) == []
    assert diff_configs({"grpo": {"beta": 0.04, "overlong_buffer": 4}}, new,
                        defaults=defaults) == ["grpo.overlong_buffer"]
    assert diff_configs({"grpo": {"beta": 0.04}}, {"grpo": {"beta": 0.04,
                                                            "token_budget_share": 0.5}},
                        defaults=defaults) == ["grpo.token_budget_share"]
    # without the schema's defaults every one-sided key is a change
    assert diff_configs({"grpo": {"beta": 0.04}}, new) == ["grpo.token_budget_share"]


def test_a_config_extends_another_and_the_steps_task_is_tiny_with_its_own_data(tmp_path):
    """configs/tiny_steps.yaml is configs/tiny.yaml with longer chains of additions and
    subtractions; a file's `extends` is read first, relative to it, and a missing one is named."""
    from configs import ConfigError, load_config
    from runtime.data import load_splits

    steps = load_config("configs/tiny_steps.yaml", ["model.policy_path="])
    tiny = load_config("configs/tiny.yaml")
    assert (steps.data.min_ops, steps.data.max_ops, steps.data.operations) == (5, 7, "+-")
    assert steps.policy.group_size == tiny.policy.group_size == 64 and steps.rm.lr == tiny.rm.lr
    assert steps.run.name == "tiny-steps" and steps.policy.max_new_tokens == 160
    data = load_config("configs/tiny_steps.yaml", ["model.policy_path=", "data.sft_questions=200",
                                                   "data.rl_questions=50"]).data
    splits = load_splits(data, 0)
    for r in splits.sft + splits.eval:
        assert "Multiply" not in r.question and 6 <= len(r.solution_steps) <= 8
        # the longest prompt and worked solution fit their token budgets (one character a token)
        assert len(r.question) + 1 <= data.max_prompt_tokens
        assert len("\n".join(r.solution_steps)) + 1 <= steps.policy.max_new_tokens
    child = tmp_path / "child.yaml"
    child.write_text("extends: missing.yaml\nrun:\n  name: x\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(child)
    with pytest.raises(ConfigError, match="data.operations"):
        load_config("configs/tiny.yaml", ["data.operations=+/"])


def test_the_default_operations_draw_the_problems_they_always_drew():
    """`data.operations` left at '+-*' keeps every seeded problem as it was (the shipped warm
    start and every recorded number were made on them)."""
    from tasks import synthetic

    assert synthetic.make_problems(0, 1)[0].question == \
        "Start with 14. Add 5. Multiply by 3. Subtract 5."
    import hashlib

    text = "\n".join(p.question + "|" + "|".join(p.steps) for p in synthetic.make_problems(0, 500))
    # sha256 of the same 500 problems drawn before `operations` existed
    assert hashlib.sha256(text.encode()).hexdigest() == \
        "88337ebb37bf75ab355266a45ce8c956d1b9e13bbf796e616fee343d1fcd8504"
    assert all("Multiply" not in p.question
               for p in synthetic.make_problems(0, 50, operations="+-"))


def test_old_keys_load_as_their_new_names_with_a_warning(tmp_path):
    """The keys that moved (configs/loader.py `RENAMED`: GRPO's section split into `policy`,
    `grpo`, `rft`, `controls`, `inspect`) are read under their old names for one release, in a
    file, a recipe and on the command line, each with a warning naming the new key; a key set
    under both names fails."""
    from configs.loader import RENAMED

    assert RENAMED["grpo.steps"] == "policy.steps"
    assert RENAMED["grpo.offline_rft_sampling_share"] == "rft.sampling_share"
    assert RENAMED["grpo.inspect_every"] == "inspect.every"
    with pytest.warns(FutureWarning, match="'grpo.group_size' is now 'policy.group_size'"):
        old = load_config(CONFIG_DIR / "tiny.yaml", ["grpo.group_size=8", "grpo.beta=0.1",
                                                     "grpo.shuffle_rewards=true"])
    new = load_config(CONFIG_DIR / "tiny.yaml", ["policy.group_size=8", "policy.beta=0.1",
                                                 "controls.shuffle_rewards=true"])
    assert old == new
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("grpo:\n  steps: 7\n  inspect_every: 3\n  process_credit: min\n"
                      "  supervision: process\n  offline_rft_sampling_share: 0.25\n")
    with pytest.warns(FutureWarning, match="'grpo.inspect_every' is now 'inspect.every'"):
        cfg = load_config(legacy)
    assert (cfg.policy.steps, cfg.inspect.every, cfg.grpo.process_credit,
            cfg.policy.supervision, cfg.rft.sampling_share) == (7, 3, "min", "process", 0.25)
    both = tmp_path / "both.yaml"
    both.write_text("grpo:\n  steps: 7\npolicy:\n  steps: 8\n")
    with pytest.raises(ConfigError, match="'grpo.steps' and 'policy.steps' both set"):
        load_config(both)


@pytest.mark.parametrize("path", [*sorted(CONFIG_DIR.glob("*.yaml")),
                                  *sorted((CONFIG_DIR / "recipes").glob("*.yaml"))],
                         ids=lambda p: p.name)
def test_every_shipped_yaml_and_recipe_is_in_the_new_shape(path):
    """No shipped file sets a moved key: loading it (as a config, or as a recipe over the
    tiny one) warns about nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        if path.parent.name == "recipes":
            load_config(CONFIG_DIR / "tiny.yaml", recipe=path.stem)
        else:
            load_config(path)


def test_a_run_folder_written_with_the_old_keys_resumes():
    """A stage's recorded config.yaml from before the move differs in no key once its old
    names are read as the new ones (igrpo.py's resume check does this)."""
    from configs.loader import RENAMED, diff_configs, renamed_tree, schema_defaults, to_dict

    cfg = to_dict(load_config(CONFIG_DIR / "tiny.yaml"))
    recorded = {section: dict(values) for section, values in cfg.items()
                if section not in ("policy", "rft", "controls", "inspect")}
    for old, new in RENAMED.items():  # as a run folder made before the move holds it
        section, key = new.split(".")
        recorded["grpo"][old.split(".")[1]] = cfg[section][key]
    assert diff_configs(recorded, cfg, defaults=schema_defaults())  # the old shape differs
    with pytest.warns(FutureWarning):
        previous = renamed_tree(recorded, "grpo/config.yaml")
    assert diff_configs(previous, cfg, defaults=schema_defaults()) == []


def test_the_allowed_values_are_the_tables_keys():
    """The loader's closed sets of values are the keys of the tables the resolver looks them up
    in: a new loss, trainer, estimator, credit form or family is allowed by adding it there."""
    from configs.loader import CHOICES, UNSCALED_LOSSES
    from policy.algorithms import TRAINERS
    from policy.math.advantages import ADVANTAGE_ESTIMATORS, PROCESS_CREDIT
    from policy.math.losses import POLICY_LOSSES
    from reward_model.families import FAMILIES, ONLINE_ONLY

    assert set(CHOICES["policy.loss"]) == set(POLICY_LOSSES)
    assert set(CHOICES["policy.algorithm"]) == set(TRAINERS)
    assert set(CHOICES["policy.supervision"]) == set(ADVANTAGE_ESTIMATORS) | {"process"}
    assert set(CHOICES["grpo.process_credit"]) == set(PROCESS_CREDIT)
    assert set(CHOICES["rm.family"]) == {"", *FAMILIES, *ONLINE_ONLY}
    assert set(UNSCALED_LOSSES) == {name for name, loss in POLICY_LOSSES.items()
                                    if not loss.std_normalised_advantages}


def test_a_loss_without_the_group_std_refuses_scale_by_std():
    """Dr. GRPO and GPG divide by no group std: `grpo.scale_by_std=true` beside them would be
    dropped by the resolver, so the loader refuses it, naming both keys; their recipes (which
    set it false) load, and the resolved objective does not scale."""
    from configs import load_config
    from iteration.resolve import resolve

    for loss in ("dr_grpo", "gpg"):
        with pytest.raises(ConfigError, match=f"policy.loss={loss} with grpo.scale_by_std=true"):
            load_config("configs/tiny.yaml", [f"policy.loss={loss}"])
        cfg = load_config("configs/tiny.yaml", [f"policy.loss={loss}", "grpo.scale_by_std=false"])
        assert resolve(cfg).method.norm.scale_by_std is False
        assert load_config("configs/tiny.yaml", recipe=loss).policy.loss == loss
    assert resolve(load_config("configs/tiny.yaml", [])).method.norm.scale_by_std is True


def test_the_loops_reward_must_fit_the_supervision():
    """GRPO's process advantages need step rewards (the PRM or the step oracle) and the step
    oracle's rewards need process supervision; DPO and offline RFT judge by the final answer
    whatever the supervision says."""
    from configs import load_config
    from configs.loader import ConfigError

    with pytest.raises(ConfigError, match="iterate.reward=rule with policy.supervision=process"):
        load_config("configs/tiny.yaml", ["policy.supervision=process", "iterate.reward=rule"])
    with pytest.raises(ConfigError, match="iterate.reward=step_oracle with policy.supervision="
                                          "outcome"):
        load_config("configs/tiny.yaml", ["policy.supervision=outcome",
                                          "iterate.reward=step_oracle"])
    cfg = load_config("configs/tiny_steps.yaml", ["policy.supervision=process",
                                                  "iterate.reward=step_oracle"])
    assert cfg.iterate.reward == "step_oracle"
    dpo = load_config("configs/tiny.yaml", ["run.recipe=dpo"])
    assert (dpo.policy.supervision, dpo.iterate.reward) == ("process", "rule")


CLASSIFIER = ["rm.family=token_classification", "rm.lm_weight=0", "rm.likelihood_feature=false",
              "rm.extra_layers_from=[]"]


@pytest.mark.parametrize("overrides, message", [
    (["rm.backend=vllm", "rm.family=tag_lm"], "rm.backend=vllm scores the token_classification"),
    (["rm.backend=vllm"], "it is unset: the loop would train tag LMs"),
    (["rm.backend=vllm", *CLASSIFIER, "ppo.critic_init=reward_model"],
     "ppo.critic_init=reward_model"),
    (["rm.backend=vllm", *CLASSIFIER, "rm.online=true", "policy.reward=rm"],
     "rm.backend=vllm with rm.online"),
    (["rm.backend=onnx"], "'rm.backend' = 'onnx'"),
])
def test_rm_backend_vllm_is_refused_where_vllm_cannot_serve_it(overrides, message):
    """`rm.backend=vllm` serves a token-classification PRM that nothing trains in place."""
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config("configs/tiny.yaml", overrides)


def test_rm_lora_is_refused_for_prime_s_implicit_prm_naming_the_key():
    """`rm.lora` trains the offline reward models and the online ORM; the implicit PRM, whose
    reward is the policy-shaped model's log-ratio to its reference, trains whole."""
    with pytest.raises(ConfigError, match=r"rm\.lora with rm\.family=implicit"):
        load_config("configs/tiny.yaml", ["rm.lora.rank=4", "rm.family=implicit",
                                          "rm.online=true", "policy.reward=rm",
                                          "rm.extra_layers_from=[]"])
