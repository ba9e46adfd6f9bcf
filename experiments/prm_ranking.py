"""Why a PRM read the paper's way (P(+) at the tag) does not rank a question's samples: controls.

    python experiments/prm_ranking.py --out runs/prm-ranking [--controls baseline grouped ...]

Samples the shipped warm start 16 times on 640 training questions and 64 held-out ones (the RL
pool, from indexes 20,000 and 40,000; temperature 1), labels every step with its true correctness
(the task's oracle, `tasks.synthetic.step_correctness`), then trains one PRM per control with
`igrpo train-rm` (the tiny config, `rm.likelihood_feature=false`, one epoch, lr 3e-4) and scores
the held-out samples with P(+) at the tags. Per control: in-group AUROC (the mean over questions
with right and wrong samples of the AUROC of the solutions' `min` step scores within the
question) with a 95% bootstrap interval over questions, the pooled AUROC over all solutions, step
accuracy against the oracle, and the best-of-16 pick beside majority voting and a random pick.
Before any training, the label check: every encoded tag sits on the tag token, one per step, and
carries the oracle's label. Controls (each a change from `baseline`, the tiny config's PRM):

  baseline       pointwise loss on the tags, hard labels, the warm start as the backbone
  grouped        a question's samples side by side in the batches (`rm.group_by_question`)
  pairwise       grouped, plus the within-question pairwise loss (`rm.pairwise_weight=1`)
  no_lm          without the auxiliary next-token loss (`rm.lm_weight=0`)
  deeper         the 4 layers doubled (`rm.extra_layers_from=[0,1,2,3]`, added layers at 1e-3)
  random_init    a freshly initialised tiny model instead of the warm start
  quarter        a quarter of the samples (160 questions x 16)
  ms_hard        the quarter labelled the paper's way instead of by the oracle: Math-Shepherd
                 with the warm start as completer (the tiny config's `label.*`), hard labels
  ms_soft        the same completions, soft labels (the share that reached the answer)
  worked         no policy samples: as many SFT worked solutions (40% of them slip at every
                 carry and borrow), labelled step by step against the question
  deeper_quarter deeper, on the quarter
  deeper_worked  deeper, on as many worked solutions as the quarter has samples
  base           deeper, from the shipped reward-model base (runtime/bundled/tiny_rm_base)
  base_quarter   the base, on the quarter
  likelihood     no training: the warm start's lowest token log-likelihood over the solution

Writes `<out>/results.json` and `<out>/table.md`; finished controls are kept and skipped on a
rerun, and invocations with different `--controls` may run side by side once the samples exist.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from policy.generation.rollout import generate_groups  # noqa: E402
from process_supervision.formats import StepExample, write_math_shepherd_jsonl  # noqa: E402
from reward_model.encoding import encode, ensure_tag_token, tag_tokens  # noqa: E402
from reward_model.evaluate import auroc, best_of_n, step_metrics  # noqa: E402
from reward_model.score import TagScorer  # noqa: E402
from tasks import synthetic  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from tasks.grading import extract_final_answer  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import encode_prompts, prompt_format  # noqa: E402
from runtime.steps import split_steps  # noqa: E402

WARM = "runtime/bundled/tiny_warm_start"
TAG = "ки"
TRAIN = ["rm.likelihood_feature=false", "rm.epochs=1", "rm.lr=3e-4", "rm.val_fraction=0.05",
         "rm.eval_every=0", "run.wandb_mode=disabled", "run.threads=1"]
DEEPER = ("rm.extra_layers_from=[0,1,2,3]", "rm.new_layer_lr=1e-3")
BASE = "runtime/bundled/tiny_rm_base"


@dataclass(frozen=True)
class Control:
    """A change from `baseline`: training overrides, which rows (`all` or the first `quarter`),
    whose labels (`oracle`, Math-Shepherd `ms_hard` / `ms_soft`, or SFT `worked` solutions in
    place of the samples), and the backbone (`warm` start, `random` init, or the reward-model
    `base`); `overrides=None` is the untrained likelihood score."""
    overrides: tuple[str, ...] | None = None
    rows: str = "all"
    labels: str = "oracle"
    init: str = "warm"

    def __post_init__(self):
        for key, allowed in (("rows", ("all", "quarter")), ("init", ("warm", "random", "base")),
                             ("labels", ("oracle", "ms_hard", "ms_soft", "worked"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"Control.{key}={getattr(self, key)!r}: one of {allowed}")


CONTROLS = {
    "baseline": Control(()),
    "grouped": Control(("rm.group_by_question=true",)),
    "pairwise": Control(("rm.group_by_question=true", "rm.pairwise_weight=1.0")),
    "no_lm": Control(("rm.lm_weight=0",)),
    "deeper": Control(DEEPER),
    "random_init": Control((), init="random"),
    "quarter": Control((), rows="quarter"),
    "ms_hard": Control((), rows="quarter", labels="ms_hard"),
    "ms_soft": Control((), rows="quarter", labels="ms_soft"),
    "worked": Control((), labels="worked"),
    "deeper_quarter": Control(DEEPER, rows="quarter"),
    "deeper_worked": Control(DEEPER, rows="quarter", labels="worked"),
    "base": Control(DEEPER, init="base"),
    "base_quarter": Control(DEEPER, rows="quarter", init="base"),
    "likelihood": Control(None),
}


def sample(policy, records, samples: int, seed: int):
    """[(question, steps, oracle labels, final answer)] * samples per record, in record order."""
    torch.manual_seed(seed)
    cfg = load_config("configs/tiny.yaml", [])
    model, tokenizer = load_causal_lm(policy).eval(), load_tokenizer(policy)
    out = []
    for start in range(0, len(records), 16):
        chunk = records[start:start + 16]
        rollout = generate_groups(model, tokenizer, prompt_format(cfg.data).prompts(tokenizer, chunk),
                                  samples, max_new_tokens=112, temperature=1.0)
        for q, rec in enumerate(chunk):
            for text in rollout.texts[q * samples:(q + 1) * samples]:
                steps = split_steps(text) or ["(empty)"]
                truth = synthetic.step_correctness(rec.question, steps)
                out.append({"question": rec.question, "steps": steps,
                            "labels": [float(t) for t in truth], "answer": extract_final_answer(text),
                            "prompt": prompt_format(cfg.data).prompts(tokenizer, [rec])[0],
                            "text": text})
    return out


def worked_rows(n: int):
    """`n` worked solutions of the SFT set as rows, each step labelled against the question."""
    from reward_model.examples import worked_examples

    splits = load_splits(load_config("configs/tiny.yaml", []).data, 0)
    return [{"question": ex.question, "steps": list(ex.steps), "labels": list(ex.labels)}
            for ex in worked_examples(splits.sft[:n])]


def math_shepherd_rows(rows, records, cache: Path, soft: bool):
    """`rows` (16 per record, in record order) with Math-Shepherd labels (the warm start
    completing every step prefix, the tiny config's `label.*`) in place of the oracle's; the
    completions are made once into `cache`."""
    from process_supervision.label import Labeller, Solution, label_in_shards

    cfg = load_config("configs/tiny.yaml", [])
    lab = cfg.label
    labeller = Labeller(load_causal_lm(WARM).eval(), load_tokenizer(WARM), prompt_format(cfg.data),
                        lab.num_completions, lab.max_new_tokens, lab.temperature,
                        cfg.eval.grade_timeout_s, lab.prefixes_per_batch)
    solutions = [Solution(records[i // 16], tuple(r["steps"])) for i, r in enumerate(rows)]
    assert all(x.record.question == r["question"] for x, r in zip(solutions, rows))
    labelled = label_in_shards(labeller, solutions, cache, lab.shard_size, seed=0)
    return [{**r, "labels": list(x.soft if soft else x.hard)} for r, x in zip(rows, labelled)]


def examples_of(rows):
    return [StepExample(r["question"], tuple(r["steps"]), tuple(r["labels"])) for r in rows]


def label_check(rows, tokenizer) -> dict:
    """Every labelled position of the encoded examples is a tag token, there is one per step, and
    its target is the oracle's label."""
    tags = tag_tokens(tokenizer, TAG)
    examples = examples_of(rows)
    bad_tag = bad_count = bad_label = steps = 0
    for start in range(0, len(examples), 256):
        chunk = examples[start:start + 256]
        batch = encode(tokenizer, chunk, tags, TAG, 256)
        for row, ex in enumerate(chunk):
            at = batch.label_mask[row].nonzero().flatten()
            steps += len(ex.steps)
            bad_count += len(at) != len(ex.steps)
            bad_tag += int((batch.input_ids[row, at] != tags.tag_id).sum())
            bad_label += sum(float(batch.targets[row, p]) != y for p, y in zip(at.tolist(), ex.labels))
    return {"solutions": len(examples), "steps": steps, "solutions_with_missing_tags": bad_count,
            "labels_off_the_tag": bad_tag, "labels_not_the_oracle": bad_label}


def slip_kind(row) -> tuple[str, int | None]:
    """("right" | "carry or borrow" | "other", the first wrong step's index) of a sample."""
    k = next((i for i, y in enumerate(row["labels"]) if y < 0.5), None)
    if k is None:
        return "right", None
    chain = synthetic.true_chain(row["question"])
    if k < len(chain):
        value, op, n, result = chain[k]
        slipped = synthetic.slipped_result(value, op, n)
        if slipped != result and row["steps"][k].strip() == synthetic.render_step(value, op, n, slipped):
            return "carry or borrow", k
    return "other", k


def by_kind(rows, step_scores) -> dict:
    """Per kind of sample: how many there are, and the share the PRM gets right (a wrong sample:
    its first wrong step below 0.5; a right one: every step at 0.5 or more)."""
    found: dict = {}
    for row, scores in zip(rows, step_scores):
        kind, k = slip_kind(row)
        hit = min(scores, default=0.0) >= 0.5 if kind == "right" else \
            k is not None and k < len(scores) and scores[k] < 0.5
        n, h = found.get(kind, (0, 0))
        found[kind] = (n + 1, h + hit)
    return {kind: {"samples": n, "found": h / n} for kind, (n, h) in found.items()}


def ranking(rows, step_scores, per_question: int, seed: int = 0) -> dict:
    """In-group AUROC (mean over questions, 95% bootstrap interval over questions), pooled AUROC,
    step accuracy against the oracle, best-of-N."""
    solution = [min(s) if s else 0.0 for s in step_scores]
    right = [r["labels"][-1] >= 0.5 for r in rows]
    groups = [range(i, i + per_question) for i in range(0, len(rows), per_question)]
    within = [auroc([solution[i] for i in g], [right[i] for i in g]) for g in groups
              if 0 < sum(right[i] for i in g) < per_question]
    rng = random.Random(seed)
    boot = sorted(sum(rng.choice(within) for _ in within) / len(within) for _ in range(2000))
    bon = best_of_n([[right[i] for i in g] for g in groups], [[solution[i] for i in g] for g in groups],
                    [[rows[i]["answer"] for i in g] for g in groups], seed)
    steps = step_metrics(step_scores, [r["labels"] for r in rows])
    return {"in_group_auroc": sum(within) / len(within), "ci": [boot[50], boot[1949]],
            "by_kind": by_kind(rows, step_scores),
            "questions": len(within), "pooled_auroc": auroc(solution, right),
            "step_accuracy": steps["step_accuracy"], "step_auroc": steps["auroc"],
            "bon_pick": bon["rm_pick"], "majority": bon["majority"], "random": bon["random"]}


def likelihood_scores(rows, policy):
    """Per solution, one 'step score': the lowest log-likelihood the policy gives any token of
    its own solution (in its own layout)."""
    model, tokenizer = load_causal_lm(policy).eval(), load_tokenizer(policy)
    out = []
    with torch.no_grad():
        for r in rows:
            prompt = encode_prompts(tokenizer, [r["prompt"]])[0]
            ids = prompt + tokenizer(r["text"], add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append([float(lp[len(prompt) - 1:].min())])
    return out


def train(out: Path, name: str, rows, init: str) -> Path:
    data = out / f"{name}.jsonl"
    write_math_shepherd_jsonl(data, examples_of(rows))
    cmd = [sys.executable, "-m", "igrpo", "train-rm", "--config", "configs/tiny.yaml",
           f"run.root={out}", f"run.name={name}", "rm.kind=prm", f"rm.init_path={init}",
           f"rm.data_path={data}", *TRAIN, *CONTROLS[name].overrides]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out / name / "rm-prm" / "final"


def control_rows(name: str, rows, out: Path, questions: int):
    """The training rows of control `name` from the sampled ones."""
    control = CONTROLS[name]
    if control.rows == "quarter":
        rows = rows[:len(rows) // 4]
    if control.labels in ("ms_hard", "ms_soft"):
        rl = load_splits(load_config("configs/tiny.yaml", []).data, 0).rl
        rows = math_shepherd_rows(rows, rl[20000:20000 + questions], out / "math-shepherd",
                                  control.labels == "ms_soft")
    if control.labels == "worked":
        rows = worked_rows(len(rows))
    return rows


def backbone(name: str, out: Path) -> str:
    """The folder control `name` trains from."""
    init = CONTROLS[name].init
    if init == "random":
        from runtime.tiny_model import build_tiny

        return str(build_tiny(out / "random-init", load_config("configs/tiny.yaml", []).model.tiny,
                              0, extra_tokens=(TAG,)))
    return BASE if init == "base" else WARM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/prm-ranking")
    p.add_argument("--controls", nargs="*", default=list(CONTROLS))
    p.add_argument("--questions", type=int, default=640)
    a = p.parse_args()
    torch.set_num_threads(2)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "samples.json"
    if not cache.exists():
        rl = load_splits(load_config("configs/tiny.yaml", []).data, 0).rl
        cache.write_text(json.dumps({"train": sample(WARM, rl[20000:20000 + a.questions], 16, 0),
                                     "heldout": sample(WARM, rl[40000:40064], 16, 1)}))
    data = json.loads(cache.read_text())
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if "label_check" not in results:
        tokenizer, model = load_tokenizer(WARM), load_causal_lm(WARM)
        ensure_tag_token(tokenizer, model, TAG, True)
        results["label_check"] = {k: label_check(data[k], tokenizer) for k in ("train", "heldout")}
        results_path.write_text(json.dumps(results, indent=1))
    for name in a.controls:
        if name in results:
            continue
        started = time.perf_counter()
        held = data["heldout"]
        if CONTROLS[name].overrides is None:
            scores = likelihood_scores(held, WARM)
        else:
            final = train(out, name, control_rows(name, data["train"], out, a.questions),
                          backbone(name, out))
            scores = TagScorer.from_pretrained(final, TAG, 256).score(examples_of(held))
        result = {**ranking(held, scores, 16), **dataclasses.asdict(CONTROLS[name]),
                  "minutes": (time.perf_counter() - started) / 60}
        # Read again before writing: another invocation may be running other controls.
        results = {**json.loads(results_path.read_text()), name: result}
        results_path.write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results[name]), flush=True)
    lines = ["| control | in-group AUROC [95%] | pooled AUROC | step accuracy | BoN pick | majority "
             "| random | minutes |", "|---|---|---|---|---|---|---|---|"]
    for name in CONTROLS:
        if name in results:
            r = results[name]
            lines.append(f"| {name} | {r['in_group_auroc']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] "
                         f"| {r['pooled_auroc']:.3f} | {r['step_accuracy']:.3f} | {r['bon_pick']:.3f} "
                         f"| {r['majority']:.3f} | {r['random']:.3f} | {r['minutes']:.1f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(results["label_check"]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
