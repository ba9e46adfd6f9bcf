"""The stages of Algorithm 1 as functions of the resolved config (`iteration.resolve.Resolved`):
the one API the command line (igrpo.py) and the outer loop (iteration/loop.py) both call, so
that a stage run alone computes what the same stage computes inside `igrpo iterate`.

    load_policy       a policy checkpoint (or a vLLM engine over it) and its tokenizer
    label_questions   the RL questions whose samples iteration k labels
    label             sample a policy, label every step Math-Shepherd style
    rm_backbone       what a first reward model trains from
    load_scorer       a reward model, read at its tags
    evaluate          held-out greedy, mean@k, maj@k, pass@k, and with a step oracle trace
                      accuracy and the lucky-answer rate (with intervals)
    reward_model_report   step metrics on known first errors, and best-of-N on policy samples
    refresh_report    refreshed reward models against the ones they replace, on the policy's samples
"""

from __future__ import annotations

from pathlib import Path

from iteration.resolve import Resolved
from policy.generation.rollout import rest
from process_supervision.label import Labeller, label_in_shards
from process_supervision.sampling import sample_solutions
from reward_model.examples import as_orm, synthetic_step_examples
from reward_model.report import best_of_n_report, labelled_report
from runtime.data import MathRecord
from runtime.dist import is_main
from runtime.models import load_causal_lm, load_tokenizer
from runtime.seeds import derive_seed

KINDS = ("orm", "prm")


def load_policy(w: Resolved, path: str | Path):
    """(sampler, tokenizer) of a checkpoint, for the stages that only generate from it
    (labelling, evaluation, best-of-N): the model in eval mode, loaded with the config's model
    options (dtype, attention, trust_remote_code), or with `rollout.backend=vllm` a vLLM engine
    over it (both go through policy.generation.rollout.generate_groups)."""
    model = w.stage.model
    if w.stage.vllm is not None:
        from policy.generation.vllm import engine_for

        return engine_for(w.stage.vllm, path), load_tokenizer(path, model)
    return load_causal_lm(path, model).eval(), load_tokenizer(path, model)


def label_questions(rl: list[MathRecord], per_iteration: int, k: int) -> list[MathRecord]:
    """Iteration k's questions: disjoint slices from the end of the RL pool (GRPO draws its
    questions from the whole pool in a seeded order)."""
    if (k + 1) * per_iteration > len(rl):
        raise ValueError(f"labelling round {k} needs {per_iteration} more RL questions "
                         f"(label.questions) than the {len(rl)} of the RL split hold after "
                         f"{k} rounds; raise data.rl_questions or lower label.questions")
    return rl[len(rl) - (k + 1) * per_iteration:len(rl) - k * per_iteration]


def label(w: Resolved, policy: str | Path, questions: list[MathRecord], out: Path, k: int = 0):
    """Sample `policy` on `questions` (`label.samples_per_question` each) and label every step
    prefix Math-Shepherd style with `label.completer` (default: the same policy). Shards are
    kept in `out`, so an interrupted run resumes them. Returns the labelled solutions."""
    lab, fmt = w.label, w.stage.prompts
    model, tokenizer = load_policy(w, policy)
    solutions = sample_solutions(model, tokenizer, questions, fmt, lab.samples_per_question,
                                 lab.max_new_tokens, lab.temperature, out / "solutions.jsonl",
                                 seed=derive_seed(w.seed, "label", k))
    if lab.completer:
        model, tokenizer = load_policy(w, lab.completer)
    labeller = Labeller(model, tokenizer, fmt, lab.num_completions, lab.max_new_tokens,
                        lab.temperature, w.stage.evaluation.timeout_s, lab.prefixes_per_batch)
    labelled = label_in_shards(labeller, solutions, out / "shards", lab.shard_size,
                               progress=is_main(), seed=derive_seed(w.seed, "label", k))
    rest(model)  # what runs next (reward-model training) has the GPU without vLLM's pool
    return labelled


def rm_backbone(w: Resolved, warm_start: str | Path) -> str | Path:
    """A first reward model trains from `rm.init_path`, else from the warm start (the paper
    initialises its reward models from the SFT model)."""
    return w.rm.settings.init_path or warm_start


def load_scorer(w: Resolved, path: str | Path):
    """The reward model in `path`, of any family (`reward_model/families.py`), scored through
    vLLM's pooling runner under `rm.backend=vllm`."""
    from reward_model.vllm_scorer import load_scorer as load

    return load(path, w.rm.settings, w.stage.model, w.rm.pooled)


def evaluate(w: Resolved, model, tokenizer, records: list[MathRecord],
             outcomes_path: Path | None = None, progress: bool = True) -> dict:
    """`eval/*` metrics of the policy on `records` at the config's k and temperature. Data
    without a step oracle has no trace metrics, and `eval/trace_metrics` says so."""
    from policy.evaluate import evaluate_policy

    e = w.stage.evaluation
    metrics = evaluate_policy(
        model, tokenizer, records, w.stage.prompts, k=e.k, temperature=e.temperature,
        max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, timeout_s=e.timeout_s,
        progress=progress, outcomes_path=outcomes_path, seed=e.seed, step_oracle=e.step_oracle,
        step_separator=e.step_separator)
    rest(model)  # what runs next (the reward models' reports) has the GPU without vLLM's pool
    if e.step_oracle is None:
        metrics["eval/trace_metrics"] = "no step oracle"
    return metrics


def prm_benchmark(path: str):
    """The rows of `eval.prm_benchmark`'s file (read once a process: a run reads them at its
    start, so that a bad file stops it before any work)."""
    from process_supervision.benchmarks import read_benchmark

    if path not in _BENCHMARKS:
        _BENCHMARKS[path] = read_benchmark(path)
    return _BENCHMARKS[path]


_BENCHMARKS: dict = {}


def refresh_report(w: Resolved, previous: dict, refreshed: dict, model, tokenizer,
                   eval_records: list[MathRecord]) -> dict:
    """Each kind's refreshed reward model beside the one it replaces, on the same samples of
    the policy they will judge (`rm.bon_questions` held-out questions x `rm.bon_samples` at
    `policy.temperature`): {kind: {"previous" | "refreshed": {"group_auroc", "pick",
    "step_accuracy" (synthetic task: against the step oracle)}, "change": {"group_auroc",
    "pick": refreshed - previous with a paired 95% bootstrap interval over the questions (the
    AUROC's over those with right and wrong samples: None without any)}}};
    {} at rm.bon_questions=0."""
    rm, p = w.rm.settings, w.stage.policy
    if not rm.bon_questions:
        return {}
    from runtime.stats import paired_difference

    scorers = {f"{kind}/{age}": (scorer, kind) for age, found in
               (("previous", previous), ("refreshed", refreshed)) for kind, scorer in found.items()}
    found = best_of_n_report(
        model, tokenizer, eval_records[:rm.bon_questions], w.stage.prompts, scorers,
        rm.aggregate, rm.bon_samples, p.temperature, p.max_new_tokens,
        w.stage.evaluation.timeout_s, seed=derive_seed(w.seed, "refresh-check"),
        oracle=w.stage.evaluation.step_oracle)
    out: dict = {"questions": min(len(eval_records), rm.bon_questions),
                 "samples": rm.bon_samples, "temperature": p.temperature}
    for name in scorers:
        kind, age = name.split("/")
        out.setdefault(kind, {})[age] = {
            key: found[f"{name}_{key}"] for key in ("group_auroc", "pick", "step_accuracy")
            if f"{name}_{key}" in found}
    for kind in refreshed:  # refreshed - previous over the same questions, paired intervals
        before = found[f"{kind}/previous_per_question"]
        after = found[f"{kind}/refreshed_per_question"]
        both = [i for i, (b, a) in enumerate(zip(before, after)) if b[1] == b[1] and a[1] == a[1]]
        out[kind]["change"] = {
            "pick": paired_difference([b[0] for b in before], [a[0] for a in after]),
            "group_auroc": paired_difference([before[i][1] for i in both],
                                             [after[i][1] for i in both]) if both else None}
    return out


def reward_model_report(w: Resolved, scorers: dict, model, tokenizer,
                        eval_records: list[MathRecord]) -> dict:
    """{"rm": step metrics of each reward model on held-out synthetic solutions whose first
    wrong step is known (synthetic task only), "benchmark": the PRM on `eval.prm_benchmark`
    (where set), "bon": best-of-N among the policy's samples (none at rm.bon_questions=0)}."""
    report: dict = {"rm": {}}
    rm = w.rm.settings
    if w.stage.evaluation.step_oracle is not None:  # the synthetic task: first errors known
        held_out = synthetic_step_examples(eval_records[:rm.eval_solutions],
                                           derive_seed(w.seed, "rm-report"))
        for kind, scorer in scorers.items():
            examples = as_orm(held_out) if kind == "orm" else held_out
            report["rm"].update({f"{kind}/{key}": v for key, v in
                                 labelled_report(scorer, examples).items()})
    if w.evals.prm_benchmark and "prm" in scorers:
        from reward_model.report import benchmark_report

        found = benchmark_report(scorers["prm"], prm_benchmark(w.evals.prm_benchmark))
        report["benchmark"] = {**found, "score": found.get("processbench/average_f1",
                                                           found.get("prmbench/prm_score"))}
    if not rm.bon_questions:
        report["bon"] = {}
        return report
    e = w.stage.evaluation
    report["bon"] = best_of_n_report(
        model, tokenizer, eval_records[:rm.bon_questions], w.stage.prompts,
        {kind: (scorer, kind) for kind, scorer in scorers.items()}, rm.aggregate,
        rm.bon_samples, e.temperature, e.max_new_tokens, e.timeout_s, seed=w.seed)
    return report
