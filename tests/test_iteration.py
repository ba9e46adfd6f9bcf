"""The outer loop (Algorithm 1) on a very small config: files, replay, reference reset, resume."""

import json

import pytest

import igrpo
from eval_checks import check_against_outcomes
from iteration.replay import historical_count, load_iteration, refresh_set, save_iteration
from process_supervision.formats import StepExample
from runtime.tracking import read_metrics
from small_config import ITERATE
from small_config import SMALL as BASE

SMALL = [*BASE, *ITERATE]


def _rows(n, origin):
    return [StepExample(f"q{origin}-{i}", ("a",), (1.0,), f"s{origin}:{i}") for i in range(n)]


def test_refresh_set_holds_the_historical_fraction(tmp_path):
    for k, n in enumerate([40, 30, 30]):
        save_iteration(tmp_path, k, _rows(n, k))
    rows = refresh_set(tmp_path, 2, fraction=0.25, seed=0)
    origins = [o for o, _ in rows]
    assert origins.count(2) == 30
    assert len(rows) - origins.count(2) == historical_count(30, 0.25) == 10
    assert len(rows) == 40 and (len(rows) - 30) / len(rows) == 0.25
    assert set(origins) <= {0, 1, 2}
    assert refresh_set(tmp_path, 2, 0.25, seed=0) == rows  # deterministic by seed
    assert refresh_set(tmp_path, 2, 0.25, seed=1) != rows
    assert [o for o, _ in load_iteration(tmp_path, 1)] == [1] * 30
    with pytest.raises(ValueError, match="replay_fraction"):
        historical_count(10, 1.0)


def _iterate(root, *extra):
    return igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={root}", *SMALL,
                       *extra])


@pytest.mark.slow
def test_iterate_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    from iteration.loop import IterationRun

    # Uninterrupted run.
    assert _iterate(tmp_path / "a") == 0
    run = tmp_path / "a" / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    its = summary["iterations"]
    assert [it["iteration"] for it in its] == [0, 1, 2]
    for it in its:
        check_against_outcomes(it["eval"], run / "eval" / f"iteration-{it['iteration']}.json")
        assert "prm/step_accuracy" in it["rm"] and "prm_pick" in it["bon"]
        # The synthetic task has a step oracle: trace accuracy, checked against each sample.
        assert "trace_accuracy" in it["eval"] and "trace_metrics" not in it["eval"]
        assert "sample_trace" in json.loads(
            (run / "eval" / f"iteration-{it['iteration']}.json").read_text())
    assert "trace_accuracy" in its[2]["change"]
    # The held-out metrics per iteration also go to wandb's `eval` run (metrics.jsonl beside it).
    assert [r["step"] for r in read_metrics(run / "eval" / "metrics.jsonl")] == [0, 1, 2]
    assert "train/kl" in its[1]["grpo"] and "reward/mean" in its[2]["grpo"]
    assert (run / "accuracy.png").stat().st_size > 1000
    manifest = json.loads((run / "manifest.json").read_text())["units"]
    assert all(u["state"] == "done" for u in manifest.values())
    for name in ("sft", "label/0", "rm-orm/0", "rm-prm/0", "grpo/1", "label/1", "rm-prm/1",
                 "refresh-check/1", "grpo/2", "eval/2"):
        assert name in manifest, name
    # The refreshed reward models beside the ones they replace, on the GRPO-1 policy's samples.
    assert "refresh" not in its[1] and its[2]["refresh"] == manifest["refresh-check/1"]["outputs"]
    for kind in ("prm", "orm"):
        assert set(its[2]["refresh"][kind]) == {"previous", "refreshed", "change"}
        assert set(its[2]["refresh"][kind]["refreshed"]) == {"group_auroc", "pick", "step_accuracy"}
    for kind in ("orm", "prm"):
        for k in (0, 1):
            assert (run / f"rm-{kind}" / f"iteration-{k}" / "final" / "model.safetensors").exists()
    for k in (1, 2):
        assert (run / "grpo" / f"iteration-{k}" / "final" / "model.safetensors").exists()
    assert (run / "replay" / "prm" / "iteration-1.jsonl").exists()
    # The stage commands find what iterate wrote: eval takes the last iteration's policy (the
    # same greedy accuracy as the loop measured), eval-rm the newest reward models.
    stage_args = ["--config", "configs/tiny.yaml", f"run.root={tmp_path / 'a'}", *SMALL]
    assert igrpo.main(["eval", *stage_args]) == 0
    report = json.loads((run / "eval" / "grpo-iteration-2.json").read_text())
    assert report["checkpoint"] == str(run / "grpo" / "iteration-2" / "final")
    assert report["eval/greedy_accuracy"] == its[2]["eval"]["greedy_accuracy"]
    assert igrpo.main(["eval-rm", *stage_args]) == 0
    rm_report = json.loads((run / "eval" / "reward_models.json").read_text())
    assert "prm/step_accuracy" in rm_report and "orm/step_accuracy" in rm_report
    # The refresh set of iteration 1 holds the configured historical fraction.
    refresh = manifest["rm-prm/1"]["outputs"]["composition"]
    assert refresh["replayed"] == historical_count(refresh["new"], 0.25) > 0
    # Worked SFT solutions join the first training (rm.worked_solutions=8), not this refresh
    # (iterate.refresh_worked_solutions=0 here).
    assert manifest["rm-prm/0"]["outputs"]["composition"]["worked"] == 8
    assert refresh["worked"] == 0
    # summary.json says what the reward models of each iteration trained on.
    first = its[0]["reward_model_data"]["prm"]
    assert first["worked"] == 8 and first["replayed"] == 0 and first["new"] > 0
    assert its[2]["reward_model_data"]["prm"] == refresh
    # The likelihood weights: fitted at iteration 0 (worked solutions are right, samples wrong);
    # the refresh's samples of a random model are all wrong, so the refit is refused and the
    # weights stay (unguarded, the fit saturated and every sample scored ~2e-8: no GRPO signal).
    fits = [[r for r in read_metrics(run / "rm-prm" / f"iteration-{k}" / "metrics.jsonl")
             if "rm/calibration_kept" in r][-1] for k in (0, 1)]
    assert fits[0]["rm/calibration_kept"] == 0.0 and fits[0]["rm/calibration_fit_wrong"] > 0
    assert fits[1]["rm/calibration_kept"] == 1.0 and fits[1]["rm/calibration_fit_right"] == 0
    assert fits[1]["rm/calibration_bias"] == fits[0]["rm/calibration_bias"]
    # Reference reset: each iteration's reference is the policy it starts from ...
    assert manifest["grpo/1"]["outputs"]["reference"] == manifest["sft"]["outputs"]["policy"]
    assert manifest["grpo/2"]["outputs"]["reference"] == manifest["grpo/1"]["outputs"]["policy"]
    for k in (1, 2):
        rows = [r for r in read_metrics(run / "grpo" / f"iteration-{k}" / "metrics.jsonl")
                if "train/kl" in r]
        # ... so the KL to it is exactly 0 before the first update, and not after it.
        assert rows[0]["train/kl"] == 0.0
        assert rows[1]["train/kl"] > 0.0
        # The loop's eval units evaluate the policies; GRPO does not evaluate them again.
        assert not any("eval/greedy_accuracy" in r for r in
                       read_metrics(run / "grpo" / f"iteration-{k}" / "metrics.jsonl"))

    # The RL question stream walks on: iteration 2's GRPO draws where iteration 1's stopped, no
    # question twice (256 RL questions, 2 x 2 steps x 2 questions); the ids are in every row.
    drawn = {k: [q for r in read_metrics(run / "grpo" / f"iteration-{k}" / "metrics.jsonl")
                 for q in r["watch/question_ids"]] for k in (1, 2)}
    assert len(drawn[1]) == len(drawn[2]) == 4 and len(set(drawn[1] + drawn[2])) == 8
    assert [manifest[f"grpo/{k}"]["outputs"]["question_steps"] for k in (1, 2)] == [[0, 2], [2, 4]]
    # The watch's first and last 5-step means of each iteration in summary.json.
    assert its[1]["watch"]["watch/gold"]["first"] == its[1]["grpo"]["reward/accuracy"]
    assert its[2]["watch"]["watch/kl_init"]["first"] > 0  # iteration 2 starts off the warm start
    # The accuracy plot gains its second panel: gold, proxy and in-group AUROC per GRPO step.
    import matplotlib.pyplot as plt

    assert plt.imread(run / "accuracy.png").shape[1] == 1200  # two 6-inch panels at 100 dpi
    # Every rollout traced: one parquet file a step, 2 questions x G = 4 rows each, read by
    # pandas and datasets as they are.
    import datasets
    import pandas

    trace = run / "grpo" / "iteration-2" / "trace"
    assert sorted(p.name for p in trace.iterdir()) == ["step-000001.parquet",
                                                        "step-000002.parquet"]
    frame = pandas.read_parquet(trace)
    assert len(frame) == 16 and list(frame["question_id"]) == [q for q in drawn[2] for _ in range(4)]
    loaded = datasets.load_dataset("parquet", data_files=str(trace / "*.parquet"), split="train")
    assert loaded.num_rows == 16 and len(loaded[0]["tokens"]) == len(loaded[0]["token_advantages"])

    # A run killed between units, then re-run with the same command, ends the same.
    calls = {"n": 0}
    original = IterationRun.grpo

    def crash_on_second_grpo(self, k, *args):
        calls["n"] += 1
        if k == 2:
            raise KeyboardInterrupt("killed")
        return original(self, k, *args)

    monkeypatch.setattr(IterationRun, "grpo", crash_on_second_grpo)
    with pytest.raises(KeyboardInterrupt):
        _iterate(tmp_path / "b")
    monkeypatch.setattr(IterationRun, "grpo", original)
    assert _iterate(tmp_path / "b") == 0
    resumed = json.loads((tmp_path / "b" / "tiny" / "summary.json").read_text())
    assert resumed == summary

    # A changed config refuses to resume, naming the key.
    capsys.readouterr()
    assert _iterate(tmp_path / "b", "policy.beta=0.1") == 2
    assert "policy.beta" in capsys.readouterr().err


def test_manifest_eta_counts_each_unfinished_unit_as_its_kind_took(tmp_path):
    from iteration.manifest import Manifest

    m = Manifest(tmp_path / "manifest.json")
    m.units = {"label/0": {"state": "done", "started": 0.0, "finished": 30.0},
               "grpo/1": {"state": "done", "started": 30.0, "finished": 130.0},
               "eval/1": {"state": "done", "started": 130.0, "finished": 150.0}}
    plan = ["label/0", "grpo/1", "eval/1", "label/1", "rm-prm/1", "grpo/2", "eval/2"]
    # label 30 + rm (no rm yet: the mean of all, 50) + grpo 100 + eval 20.
    assert m.eta(plan) == 200.0
    assert Manifest(tmp_path / "other.json").eta(plan) is None
    m.units = {"sft": {"state": "done", "started": 0.0, "finished": 0.01}}  # nothing to do
    assert m.eta(plan) is None


@pytest.mark.slow
def test_iterate_runs_ppo_with_a_critic_from_the_reward_model(tmp_path):
    """Algorithm 1 with PPO in GRPO's place: under `iterate` the reward is the PRM, and the
    critic starts from it (its head the PRM's '+' minus '-' rows), refreshed each iteration."""
    import torch
    from safetensors.torch import load_file

    from runtime.models import load_tokenizer

    assert _iterate(tmp_path, "--recipe", "ppo", "ppo.critic_init=reward_model",
                    "iterate.iterations=1", "policy.supervision=process") == 0
    run = tmp_path / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert [entry["iteration"] for entry in summary["iterations"]] == [0, 1]
    metrics = [json.loads(line) for line in open(run / "ppo" / "iteration-1" / "metrics.jsonl")]
    assert metrics and all("critic/value_loss" in row for row in metrics)
    head = load_file(str(run / "ppo" / "iteration-1" / "critic" / "model.safetensors"))[
        "score.weight"][0]
    # the PRM the GRPO stage was rewarded by: its '+' minus '-' rows, where the head started
    prm = run / "rm-prm" / "iteration-0" / "final"
    tokenizer = load_tokenizer(prm)
    rows = load_file(str(prm / "model.safetensors"))["model.embed_tokens.weight"]  # tied head
    start = rows[tokenizer.convert_tokens_to_ids("+")] - rows[tokenizer.convert_tokens_to_ids("-")]
    assert torch.nn.functional.cosine_similarity(head, start, dim=0) > 0.9
    assert not torch.equal(head, start)  # and the critic trained


class _OracleScorer:
    """A reward model that knows the truth: each step's true correctness (PRM), or whether the
    solution's final answer is the gold one (ORM). `flat` scores every step 0.5 instead."""

    def __init__(self, kind, flat=False):
        self.kind, self.flat = kind, flat

    def score(self, examples):
        from tasks import synthetic
        from runtime.steps import split_steps

        out = []
        for ex in examples:
            steps = ex.steps if self.kind == "prm" else split_steps(ex.steps[0])
            truth = synthetic.step_correctness(ex.question, steps) if steps else [False]
            out.append([0.5] * len(ex.steps) if self.flat else
                       [float(t) for t in truth] if self.kind == "prm" else [float(truth[-1])])
        return out


def test_refresh_report_compares_both_reward_models_on_the_same_policy_samples():
    """The previous and the refreshed reward models are read on the same samples of the policy:
    a model that knows each step's truth ranks every question perfectly, picks a right sample
    wherever there is one and is right on every step; a flat one ranks at chance (0.5)."""
    from configs import load_config
    from iteration import stages
    from iteration.resolve import resolve
    from runtime.data import load_splits
    from runtime.models import load_causal_lm, load_tokenizer

    cfg = load_config("configs/tiny.yaml", ["rm.bon_questions=6", "rm.bon_samples=8",
                                            "run.threads=2"])
    policy = cfg.model.policy_path
    model, tokenizer = load_causal_lm(policy).eval(), load_tokenizer(policy)
    records = load_splits(cfg.data, 0).eval
    truth = {k: _OracleScorer(k) for k in ("prm", "orm")}
    flat = {k: _OracleScorer(k, flat=True) for k in ("prm", "orm")}
    report = stages.refresh_report(resolve(cfg), flat, truth, model, tokenizer, records)
    assert (report["questions"], report["samples"], report["temperature"]) == (6, 8, 1.0)
    for kind in ("prm", "orm"):
        new, old = report[kind]["refreshed"], report[kind]["previous"]
        assert new["group_auroc"] == 1.0 and new["step_accuracy"] == 1.0
        assert old["group_auroc"] == 0.5
        # The oracle picks a right sample on each question that has one: the pass rate, which
        # a flat scorer (the first sample: a random one) does not beat.
        assert new["pick"] >= old["pick"] and new["pick"] > 0.5
        # The paired change over the same questions: +0.5 in-group AUROC on every question.
        change = report[kind]["change"]
        assert change["group_auroc"] == {"diff": 0.5, "lo": 0.5, "hi": 0.5}
        assert change["pick"]["diff"] == pytest.approx(new["pick"] - old["pick"])
        assert change["pick"]["lo"] <= change["pick"]["diff"] <= change["pick"]["hi"]
    assert report["prm"]["refreshed"]["pick"] == report["orm"]["refreshed"]["pick"]


def test_a_refresh_is_new_samples_and_ten_percent_replay_with_worked_solutions_inside(tmp_path):
    """The paper's continual training with a 10% replay: 128 new rows, and 14 drawn from the
    historical pool of 128 earlier samples and 1,000 worked solutions (the tiny config keeps
    them), not 128 + 14 + 1,000 (89% of the set not the current policy's)."""
    from iteration.replay import WORKED, composition

    save_iteration(tmp_path, 0, _rows(128, 0))
    save_iteration(tmp_path, 1, _rows(128, 1))
    worked = _rows(1000, 9)
    rows = refresh_set(tmp_path, 1, 0.1, seed=0, worked=worked)
    counts = composition(rows, 1)
    assert counts["new"] == 128 and counts["replayed"] + counts["worked"] == 14
    assert counts["new"] / len(rows) == pytest.approx(0.9, abs=0.005)
    # A uniform draw from the pool: mostly worked solutions (1000 of 1128), some samples.
    assert counts["worked"] > counts["replayed"]
    assert all(ex in worked for o, ex in rows if o == WORKED)


@pytest.mark.parametrize("levers, init, worked, epochs", [
    (["iterate.refresh_worked_solutions=0"], "rm-prm/iteration-0/final", 0, 2.0),
    (["iterate.refresh_from=base", "iterate.refresh_worked_solutions=3",
      "iterate.refresh_epochs=5"], "BASE", 3, 5.0)])
def test_a_refresh_trains_from_what_its_levers_say(tmp_path, monkeypatch, levers, init, worked,
                                                   epochs):
    """A refresh continues the reward model it replaces on the new rows + replay (the paper's;
    the tiny config also keeps 1,000 worked solutions), or with the levers restarts from the first reward models' backbone, reads worked solutions and
    trains its own epochs; the first training (k = 0) is left as it was."""
    import iteration.loop as loop_module
    from configs import load_config
    from iteration.loop import IterationRun
    from iteration.manifest import Manifest
    from iteration.resolve import resolve

    cfg = load_config("configs/tiny.yaml", ["data.sft_questions=16", "data.rl_questions=64",
                                            "rm.worked_solutions=4", "rm.init_path=BASE",
                                            *levers])
    for k, n in enumerate([40, 30]):
        save_iteration(tmp_path / "replay" / "prm", k, _rows(n, k))
    manifest = Manifest(tmp_path / "manifest.json")
    manifest.run("sft", lambda: {"policy": "policy"})
    manifest.run("rm-prm/0", lambda: {"path": "rm-prm/iteration-0/final"})
    (tmp_path / "rm-prm" / "iteration-0" / "final").mkdir(parents=True)
    seen = []

    def fake_train(spec, out, init_, examples, logger, config_yaml, epochs=None):
        seen.append((spec.settings.epochs if epochs is None else epochs, str(init_), len(examples)))
        return out / "final"

    monkeypatch.setattr(loop_module, "train_reward_model", fake_train)
    w = resolve(cfg)
    run = IterationRun(w, tmp_path, tmp_path / "policy", w.splits(),
                       lambda stage: type("L", (), {"close": lambda self: None})(), "")
    run.reward_model("prm", 0)
    out = run.reward_model("prm", 1)
    assert seen[0] == (2.0, "BASE", 40 + 4)  # the first training: its rows and 4 worked ones
    expected_init = "BASE" if init == "BASE" else str(tmp_path / init)
    # Worked solutions join the historical pool: the refresh holds 10% of replay whatever it keeps.
    assert seen[1] == (epochs, expected_init, 30 + historical_count(30, 0.1))
    assert out["composition"]["new"] == 30
    assert out["composition"]["replayed"] + out["composition"]["worked"] == 3
    assert out["composition"]["worked"] <= worked


def test_labelling_completes_prefixes_with_the_policy_whose_samples_it_labels(tmp_path,
                                                                              monkeypatch):
    """With `label.completer` empty, a refresh's Math-Shepherd labels are completed by the
    policy that wrote the samples (the current one), not the warm start; a completer path
    replaces it."""
    from configs import load_config
    from iteration import stages
    from iteration.resolve import resolve

    loaded, completers = [], []
    monkeypatch.setattr(stages, "load_policy",
                        lambda w, path: (loaded.append(str(path)) or f"model:{path}", "tok"))
    monkeypatch.setattr(stages, "sample_solutions", lambda *a, **k: [])
    monkeypatch.setattr(stages, "Labeller",
                        lambda model, *a: completers.append(model) or "labeller")
    monkeypatch.setattr(stages, "label_in_shards", lambda *a, **k: [])
    cfg = load_config("configs/tiny.yaml", ["model.policy_path="])
    stages.label(resolve(cfg), "runs/x/grpo/iteration-1/final", [], tmp_path, k=1)
    assert completers == ["model:runs/x/grpo/iteration-1/final"]
    cfg = load_config("configs/tiny.yaml", ["model.policy_path=", "label.completer=warm"])
    stages.label(resolve(cfg), "runs/x/grpo/iteration-1/final", [], tmp_path, k=1)
    assert completers[-1] == "model:warm"


def test_a_fork_resumes_from_the_units_it_keeps_and_redoes_the_rest(tmp_path):
    """`iteration.manifest.fork`: the new run holds the source's kept units (replaced ones as
    done with the given outputs), without the dropped folders, the configs, wandb files and
    the finished run's summary; the source is untouched, an existing fork is left as it is,
    and a fork that died midway (its temporary folder) is redone."""
    from iteration.manifest import Manifest, fork

    src = tmp_path / "prefix"
    for rel in ("rm-prm/iteration-0/w.bin", "rm-orm/iteration-0/w.bin", "labels/iteration-0/a.jsonl",
                "iterate/config.yaml", "config.yaml", "wandb/run.wandb", "summary.json",
                "accuracy.png", "eval/iteration-0.json"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    done = {"state": "done", "started": 1.0, "finished": 2.0}
    (src / "manifest.json").write_text(json.dumps({"units": {
        "sft": {**done, "outputs": {"policy": "sft/best"}}, "label/0": {**done, "outputs": {}},
        "rm-orm/0": {**done, "outputs": {"path": "rm-orm/iteration-0"}},
        "rm-prm/0": {**done, "outputs": {"path": "rm-prm/iteration-0"}},
        "eval/0": {**done, "outputs": {}}}}))
    arm = tmp_path / "arm"
    (tmp_path / "arm.tmp").mkdir()  # a fork killed midway
    fork(src, arm, keep=lambda unit: unit != "eval/0",
         replace={"rm-prm/0": {"path": "../strong/prm"}}, drop=["rm-prm/iteration-0"])
    m = Manifest(arm / "manifest.json")
    assert set(m.units) == {"sft", "label/0", "rm-orm/0", "rm-prm/0"}
    assert m.outputs("rm-prm/0") == {"path": "../strong/prm"} and m.done("rm-prm/0")
    assert m.outputs("rm-orm/0") == {"path": "rm-orm/iteration-0"} and not m.done("eval/0")
    kept = sorted(str(p.relative_to(arm)) for p in arm.rglob("*") if p.is_file())
    assert kept == ["eval/iteration-0.json", "labels/iteration-0/a.jsonl", "manifest.json",
                    "rm-orm/iteration-0/w.bin"]
    assert (src / "rm-prm/iteration-0/w.bin").exists() and (src / "summary.json").exists()
    assert not (tmp_path / "arm.tmp").exists()
    fork(src, arm)  # done before: left as it is
    assert set(Manifest(arm / "manifest.json").units) == {"sft", "label/0", "rm-orm/0", "rm-prm/0"}
