"""The order of vLLM's sleep and wake against the training side's memory users, driven through a
GRPO stage and an `igrpo iterate` on a recording stand-in for vLLM (tests/helpers/recording_vllm.py,
its sleep mode on as on a GPU): vLLM's KV pool is never mapped while a module of the ZeRO-3
policy is gathered, while a reward model scores or trains, while the policy updates or while it
is exported; a push wakes only vLLM's weights and gathers the policy a module at a time (never
whole), and the KV cache wakes after the last module is released.
(On a GPU each of those beside the pool was an out-of-memory risk the memory plan did not count:
docs/rollout.md, "Sleep and wake".)"""

import pytest

import recording_vllm
from recording_vllm import EVENTS, recorded, recording

VLLM = ["rollout.backend=vllm", "run.wandb_mode=disabled", "inspect.every=0"]
NEVER_BESIDE_THE_POOL = {"gather", "module", "score", "update", "rm-train", "rm-score",
                         "rm-online", "export"}


@pytest.fixture
def recorder(monkeypatch):
    """The stand-in installed and every memory user of the training side recorded."""
    import iteration.loop
    import iteration.stages
    import policy.algorithms.grpo
    import policy.engines
    import policy.sampling
    import reward_model.report
    from reward_model.implicit import OnlineImplicitPRM
    from reward_model.online import OnlineORM
    from runtime.training import StageLoop

    recording_vllm.install(monkeypatch)
    gather = policy.engines.gathered_for_generation
    monkeypatch.setattr(policy.engines, "gathered_for_generation",
                        lambda engine: recorded("gather", gather(engine)))
    module_gather = policy.engines.module_gather  # a push's: one module at a time

    def recorded_modules(engine):
        inner = module_gather(engine)
        return lambda params: recorded("module", inner(params))

    monkeypatch.setattr(policy.engines, "module_gather", recorded_modules)
    monkeypatch.setattr(policy.sampling, "score_step", recording("score", policy.sampling.score_step))
    monkeypatch.setattr(policy.algorithms.grpo, "update_step",
                        recording("update", policy.algorithms.grpo.update_step))
    monkeypatch.setattr(iteration.loop, "train_reward_model",
                        recording("rm-train", iteration.loop.train_reward_model))
    monkeypatch.setattr(iteration.stages, "labelled_report",
                        recording("rm-score", iteration.stages.labelled_report))
    monkeypatch.setattr(reward_model.report, "solution_scores",
                        recording("rm-score", reward_model.report.solution_scores))
    monkeypatch.setattr(StageLoop, "finish", recording("export", StageLoop.finish))
    for learner in (OnlineORM, OnlineImplicitPRM):
        monkeypatch.setattr(learner, "learn", recording("rm-online", learner.learn))
    return EVENTS


def _beside_the_pool(events) -> list[str]:
    return [name for name, kv, _ in events if name in NEVER_BESIDE_THE_POOL and kv]


def _names(events) -> list[str]:
    """The events' names, each push's run of module gathers (gathered, then released, one at a
    time) as one "modules"."""
    names = [name for name, _, _ in events]
    out = []
    for i, name in enumerate(names):
        if name == "module":
            assert names[i + 1] == "module-end", "two modules gathered at once"
            if not out or out[-1] != "modules":
                out.append("modules")
        elif name != "module-end":
            out.append(name)
    return out


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4", "model.lora.alpha=8"],
                                  ["model.lora.rank=4", "model.lora.alpha=8",
                                   "rollout.lora_push=adapter"]],
                         ids=["full", "lora", "lora-adapter"])
def test_a_grpo_stage_pushes_and_scores_with_the_pool_asleep(recorder, tmp_path, lora):
    """`igrpo grpo` alone (the engine made awake by the stage): before the first optimizer step
    the engine holds the starting checkpoint, so nothing is gathered or pushed; after it, each
    rollout is sleep (the pool freed), weights woken, the push (the policy's modules gathered
    one at a time as vLLM takes their weights, the last released), KV woken, generate; vLLM
    sleeps again before the scoring, and stays asleep through the update. Only the rollouts ask
    vLLM for log-probs. A LoRA policy's push (its merged weights) keeps the same order; pushed
    as an adapter (`rollout.lora_push=adapter`), only the adapter's tensors are gathered and
    written, and the engine samples the checkpoint it holds under it."""
    import igrpo

    assert igrpo.main(["grpo", "--config", "configs/tiny.yaml", f"run.root={tmp_path}", *VLLM,
                       *lora,
                       "policy.steps=2", "policy.questions_per_step=2", "policy.group_size=4",
                       "policy.max_new_tokens=8", "eval.max_new_tokens=8", "eval.k=2",
                       "data.eval_questions=2", "policy.supervision=outcome", "policy.reward=rule",
                       "policy.eval_every=0"]) == 0
    assert _beside_the_pool(recorder) == []
    names = _names(recorder)
    first_update = names.index("update")
    # step 1: the greedy evaluation of the start and the rollout, on the checkpoint it was made
    # from; no gather, no push before the first update
    assert names[:first_update] == ["create", "generate", "generate", "sleep", "score", "update"][
        :first_update]
    assert "reload" not in names[:first_update] and "modules" not in names[:first_update]
    second = names[first_update + 1:names.index("update", first_update + 1) + 1]
    if "rollout.lora_push=adapter" in lora:  # the adapter's tensors written, then the
        # checkpoint reloaded from disk on waking and sampled under the adapter
        assert second == ["modules", "wake:weights", "reload", "wake:kv_cache",
                          "generate:adapter", "sleep", "score", "update"]
    else:
        assert second == ["wake:weights", "modules", "reload", "wake:kv_cache", "generate",
                          "sleep", "score", "update"]
    assert "gather" not in names  # the whole policy is never gathered for vLLM
    # the final sampled evaluation pushes the last step's weights; vLLM sleeps before the export
    assert names[-2:] == ["sleep", "export"]
    # vLLM computes log-probs for the rollouts only (the drift check), not for evaluation
    assert recording_vllm.LOGPROBS[:3] == [None, 0, 0] and recording_vllm.LOGPROBS[-1] is None


def test_a_prm_scored_through_vllm_encodes_with_the_policys_pool_asleep(recorder, tmp_path):
    """`rm.backend=vllm`: the PRM's pooling engine, made beside the policy's, encodes each
    step's rollouts while the policy's engine sleeps, between the scoring's start and the
    update. It is never put to sleep itself: vLLM's sleep-mode allocator is one per process,
    so its sleep and wake would move the policy engine's memory too."""
    from transformers import AutoModelForTokenClassification

    import igrpo
    from configs.loader import BUNDLED
    from runtime.models import load_tokenizer

    prm = tmp_path / "prm"
    AutoModelForTokenClassification.from_pretrained(BUNDLED / "tiny_warm_start",
                                                    num_labels=2).save_pretrained(prm)
    load_tokenizer(BUNDLED / "tiny_warm_start").save_pretrained(prm)
    assert igrpo.main(["grpo", "--config", "configs/tiny.yaml", f"run.root={tmp_path}", *VLLM,
                       "rm.family=token_classification", "rm.lm_weight=0",
                       "rm.likelihood_feature=false", "rm.extra_layers_from=[]",
                       "rm.backend=vllm", f"rm.path={prm}", "policy.reward=rm",
                       "policy.supervision=process", "policy.steps=2",
                       "policy.questions_per_step=2", "policy.group_size=4",
                       "policy.max_new_tokens=8", "eval.max_new_tokens=8", "eval.k=2",
                       "data.eval_questions=2", "policy.eval_every=0"]) == 0
    assert _beside_the_pool(recorder) == []
    names = _names(recorder)
    made = names.index("create:pooling")
    assert names[made + 1] == "reload"  # its backbone's weights streamed in
    assert not any(name.endswith(":pooling") and name != "create:pooling" for name in names)
    for step in range(2):  # each step's scoring, the policy's pool asleep
        update = [i for i, name in enumerate(names) if name == "update"][step]
        score = max(i for i in range(update) if names[i] == "score")
        assert names[score - 1] == "sleep" and names[score + 1:update + 1] == ["encode",
                                                                               "update"]
    assert names.count("encode") == 2
    assert not any(kv for name, kv, _ in recorder if name == "encode")  # the policy's pool


def test_iterate_never_holds_the_pool_beside_training_scoring_or_a_gather(recorder, tmp_path):
    """Algorithm 1 end to end (two iterations, the reward models refreshed once): labelling,
    evaluation and the refresh check end with vLLM asleep, so reward-model training, the reward
    models' reports and the next GRPO stage start without its pool; a slept engine reloads the
    checkpoint it held from disk when it is next asked to generate."""
    import igrpo
    from small_config import ITERATE, SMALL

    assert igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *SMALL, *ITERATE, *VLLM]) == 0
    assert _beside_the_pool(recorder) == []
    names = _names(recorder)
    assert names.count("rm-train") == 4 and names.count("update") == 4
    pushes = [i for i, name in enumerate(names) if name == "modules"]
    assert len(pushes) >= 2  # GRPO pushed its weights after optimizer steps
    for i in pushes:  # vLLM's weights woken, the modules gathered as it takes them, nothing else
        assert names[i - 1] == "wake:weights" and names[i + 1] == "reload"
    assert "gather" not in names  # the whole policy is never gathered for vLLM
    # checkpoints loaded from disk too (labelling, evaluation; after a sleep)
    assert any(name == "reload" and names[j - 1] != "modules" for j, name in enumerate(names))


@pytest.mark.parametrize("family, order", [("tag_lm", "after"), ("implicit", "after"),
                                           ("implicit", "before")])
def test_iterate_with_an_online_reward_model_learns_after_the_update_with_the_pool_asleep(
        recorder, tmp_path, monkeypatch, family, order):
    """`rm.online` through Algorithm 1 (two iterations, no refresh), the ORM and PRIME's
    implicit PRM: each GRPO step is rollout, sleep, scoring, the policy's update, then the
    reward model's update (in PRIME's order, `rm.online_update=before`: its update inside the
    scoring, before the policy's), never beside vLLM's pool; the first stage's reward model
    starts from the ORM the loop trained (the implicit PRM: from the warm start), the second from the
    first's export (`online-rm`), which both stages write."""
    import igrpo
    from reward_model.implicit import OnlineImplicitPRM
    from reward_model.online import OnlineORM
    from small_config import ITERATE, SMALL

    learner = OnlineImplicitPRM if family == "implicit" else OnlineORM
    starts = []
    init = learner.__init__

    def starting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        starts.append(str(self.init))

    monkeypatch.setattr(learner, "__init__", starting)
    supervision = "process" if family == "implicit" else "outcome"
    assert igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *SMALL, *ITERATE, *VLLM, f"policy.supervision={supervision}",
                       "rm.online=true", f"rm.family={family}", f"rm.online_update={order}",
                       "iterate.refresh=false"]) == 0
    assert _beside_the_pool(recorder) == []
    names = [n for n in _names(recorder) if n in ("generate", "sleep", "score", "update",
                                                  "rm-online")]
    assert names.count("rm-online") == names.count("update") == 4
    step = (["sleep", "score", "update", "rm-online"] if order == "after" else
            ["sleep", "score", "rm-online", "update"])
    for at in (i for i, n in enumerate(names) if n == "update"):
        first = at - step.index("update")
        assert names[first:first + 4] == step
    run = tmp_path / "tiny"
    first = run / ("sft/best" if family == "implicit" else "rm-orm/iteration-0/final")
    assert starts == [str(first), str(run / "grpo/iteration-1/online-rm")]
    assert all((run / f"grpo/iteration-{k}/online-rm/model.safetensors").exists() for k in (1, 2))


def test_the_engine_refuses_an_untested_vllm_naming_the_version_and_the_range():
    """Made on vLLM 0.14 (whose model runner's reload_weights takes no weights_iterator), the
    engine would fail at the first push: it refuses when made, naming the installed version and
    the tested range; a runner without the argument is refused whatever the version says; above
    the range it warns."""
    from policy.generation.vllm import TESTED_VLLM, check_vllm

    def old_reload(self):  # vLLM before its layerwise reload: from disk only
        pass

    def new_reload(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        pass

    check_vllm("0.32.0", new_reload)
    check_vllm("0.32.0+cpu", new_reload)  # the CPU build's local version
    for version, reload in (("0.14.1", None), ("0.32.0", old_reload)):
        with pytest.raises(RuntimeError, match=rf"vLLM {version} is installed.*{TESTED_VLLM}"):
            check_vllm(version, reload)
    with pytest.warns(UserWarning, match="vLLM 0.33.1 is installed, outside the tested range"):
        check_vllm("0.33.1", new_reload)


def test_a_hub_id_is_read_from_its_snapshot_in_the_local_cache(monkeypatch, tmp_path):
    """A slept engine made from a hub id reloads it from the local Hugging Face cache (where vLLM
    downloaded it), never from the network; a folder is read as it is."""
    import huggingface_hub

    from policy.generation.vllm import local_folder

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: (asked.append((repo, kw)), str(tmp_path))[1])
    assert local_folder("Qwen/Qwen2.5-Math-1.5B-Instruct") == tmp_path
    assert asked == [("Qwen/Qwen2.5-Math-1.5B-Instruct", {"local_files_only": True})]
    assert local_folder(tmp_path) == tmp_path and len(asked) == 1


def test_an_environment_asking_for_vllm_multiprocessing_is_overridden(monkeypatch, warm_start):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 vLLM would put its engine core in a subprocess and
    the in-memory push would pickle the policy's tensors: the engine sets it to 0, saying so."""
    import os

    from policy.generation.vllm import VLLMEngine

    recording_vllm.install(monkeypatch)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.warns(UserWarning, match="VLLM_ENABLE_V1_MULTIPROCESSING is set to '1'"):
        VLLMEngine(warm_start, dtype="float32", max_model_len=256, seed=0)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
