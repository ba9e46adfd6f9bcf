"""Iterative GRPO, DeepSeekMath's Algorithm 1: the project's main job.

Launch: `igrpo iterate --config configs/tiny.yaml` (one process), or
`torchrun --nproc_per_node N -m igrpo iterate --config ...`. Re-running the same command on an
existing run folder continues from the last finished unit (see `runs/<name>/manifest.json`).

    warm start (SFT)                          -> policy_0
    sample policy_0, label (ORM: final answer; PRM: Math-Shepherd) -> train ORM_0, PRM_0
    for k = 1..I:
        if k > 1: sample policy_{k-1}, label, refresh ORM/PRM on the new data + replay (10%)
                  compare each refreshed RM with the one it replaces on policy_{k-1}'s samples
        reference <- policy_{k-1}                   # the reference reset
        GRPO for policy.steps with the current RMs   -> policy_k
        evaluate policy_k (greedy, mean@k, maj@k, pass@k with 95% intervals) and the RMs

Departure from the paper's listing, same computation: the refresh after iteration k is run at the
start of iteration k+1, so the last iteration does not train reward models nothing will use.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

from iteration import stages
from iteration.manifest import Manifest
from iteration.replay import WORKED, composition, load_iteration, refresh_set, save_iteration
from configs import ConfigError
from iteration.resolve import Resolved, loop_reward_problem, make_reward, stage_folder
from iteration.stages import KINDS
from iteration.summary import change_from, plot_accuracy, step_means, watch_ends, write_summary
from policy.algorithms.sft import train_sft
from process_supervision.label import label_statistics
from reward_model.examples import as_orm, worked_examples, worked_orm_examples
from reward_model.train import train_reward_model
from runtime.data import Splits
from runtime.dist import broadcast_from_main, is_main
from runtime.memory import memory_phase
from runtime.models import load_tokenizer
from runtime.seeds import derive_seed
from runtime.tracking import MetricsLogger, read_metrics


class IterationRun:
    """The units of Algorithm 1 over one run folder; each returns JSON-able outputs."""

    def __init__(self, w: Resolved, run_path: Path, base_policy: Path, splits: Splits,
                 make_logger: Callable[[str], MetricsLogger], config_yaml: str):
        """`w`: the resolved config; `make_logger(stage)` opens the metrics logger (JSONL +
        wandb) of a training stage."""
        self.w, self.run, self.base = w, run_path, base_policy
        self.splits, self.make_logger, self.config_yaml = splits, make_logger, config_yaml
        self.manifest = Manifest(run_path / "manifest.json", w.seed, write=is_main())
        self.policy_folder = stage_folder(run_path, w.algorithm)
        """Where the policy stages go (`grpo/iteration-K`, `ppo/iteration-K`, ...)."""
        problem = loop_reward_problem(w)
        if problem:
            raise ConfigError(problem)
        if w.evals.prm_benchmark:  # a bad benchmark file stops the run before any work
            stages.prm_benchmark(w.evals.prm_benchmark)

    # -- units -----------------------------------------------------------------------------
    def warm_start(self) -> dict:
        if not self.w.sft.enabled:  # Algorithm 1 proper: the given (instruct) policy as it is
            return {"policy": self._rel(self.base)}
        logger = self.make_logger("sft")
        try:
            best = train_sft(self.w.stage, self.w.sft, self.run, self.base,
                             self.splits.sft, self.splits.val, logger, self.config_yaml)
        finally:
            logger.close()
        return {"policy": self._rel(best)}

    def label(self, k: int, policy: str) -> dict:
        """Sample `policy` on this iteration's RM questions; label for the ORM and the PRM."""
        w = self.w
        with memory_phase("labelling"):
            labelled = stages.label(w, policy, self._rm_questions(k),
                                    self.run / "labels" / f"iteration-{k}", k)
        prm_examples = [x.example(soft=w.label.soft) for x in labelled]
        save_iteration(self.run / "replay" / "prm", k, prm_examples)
        save_iteration(self.run / "replay" / "orm", k,
                       as_orm([x.example(soft=False) for x in labelled], w.data.step_separator))
        return label_statistics(labelled)

    def reward_model(self, kind: str, k: int) -> dict:
        """Train (k = 0) or refresh (k > 0, continuing from RM_{k-1}) on new data + replay."""
        it = self.w.iterate
        init = self.base_rm_init() if k == 0 or it.refresh_from == "base" else \
            self._abs(self.manifest.outputs(f"rm-{kind}/{k - 1}")["path"])
        # The first training also reads worked solutions of the SFT set (`rm.worked_solutions`):
        # true labels that teach a small backbone the tagged layout. A refresh draws its 10%
        # replay from earlier iterations' samples and `iterate.refresh_worked_solutions` of
        # those worked solutions together (iteration/replay.py).
        n_worked = self.w.rm.settings.worked_solutions if k == 0 else it.refresh_worked_solutions
        worked = self._worked(kind, n_worked)
        if k == 0:
            rows = load_iteration(self.run / "replay" / kind, 0) + [(WORKED, ex) for ex in worked]
        else:
            rows = refresh_set(self.run / "replay" / kind, k, it.replay_fraction,
                               self.w.seed, worked)
        epochs = it.refresh_epochs if k > 0 and it.refresh_epochs else None
        examples = [ex for _, ex in rows]
        path = self._train_rm(f"rm-{kind}/iteration-{k}", self.w.rm, init, examples, epochs)
        out = {"path": self._rel(path), "composition": composition(rows, k)}
        size = self.w.rm.settings.ensemble
        if size > 1 and kind == self._rewarded_kind():
            # GRPO's reward model as an ensemble (reward_model/ensemble.py): members 1..K-1 on
            # the same rows, each its own seed (data order, validation split, new weights),
            # a refresh continuing each member from its own last iteration
            members = [out["path"]]
            for m in range(1, size):
                start = init if k == 0 or it.refresh_from == "base" else self._abs(
                    self._scorer_paths(kind, k - 1)[m])
                spec = replace(self.w.rm, seed=derive_seed(self.w.seed, "ensemble", m))
                members.append(self._rel(self._train_rm(f"rm-{kind}/iteration-{k}-member-{m}",
                                                        spec, start, examples, epochs)))
            out["members"] = members
        return out

    def _scorer_paths(self, kind: str, k: int) -> list[str]:
        """RM_k's members (an ensemble's, `rm.ensemble`), refused if it holds another count."""
        paths = self.manifest.outputs(f"rm-{kind}/{k}").get("members") or []
        if len(paths) != self.w.rm.settings.ensemble:
            raise ConfigError(f"rm.ensemble={self.w.rm.settings.ensemble}, but rm-{kind}/{k} of "
                              f"{self.run} holds {max(1, len(paths))} reward model(s): a run "
                              "keeps the ensemble it started with")
        return paths

    def _train_rm(self, name: str, spec, init, examples: list, epochs: float | None) -> Path:
        """One reward model trained into `<run>/<name>` (its final folder returned)."""
        logger = self.make_logger(name)
        try:
            with memory_phase("reward models"):
                return train_reward_model(spec, self.run / name, init, examples, logger,
                                          self.config_yaml, epochs=epochs)
        finally:
            logger.close()

    def _worked(self, kind: str, n: int) -> list:
        """The first `n` SFT worked solutions as `kind` examples: step by step against the
        question for the PRM, by the final answer for the ORM (as the policy's samples are)."""
        if not n:
            return []
        records = self.splits.sft[:n]
        if kind == "orm":
            return worked_orm_examples(records, self.w.stage.evaluation.timeout_s,
                                       self.w.data.step_separator)
        return worked_examples(records)

    def grpo(self, k: int, policy: str, rm_iteration: int, segment: int = 0,
             steps: int | None = None, offset: int = 0, online_init: str | None = None) -> dict:
        """GRPO from `policy` with the reference reset to it, rewarded by the current RMs
        (RM_{rm_iteration}), from step `offset` of the RL question stream on (where the previous
        GRPO unit left it). `segment` > 0: the `steps` left of iteration k after a guard fired
        `refresh` (`<policy folder>/iteration-K.J`). With `rm.online` the ORM learns during the
        stage, started from `online_init` (the previous GRPO unit's; default RM_{rm_iteration}),
        and its export is the unit's `online_rm`."""
        tokenizer = load_tokenizer(policy, self.w.stage.model)
        folder = f"{self.policy_folder}/iteration-{k}" + (f".{segment}" if segment else "")
        logger = self.make_logger(folder)
        try:
            final = self.w.policy_trainer(offset, self._policy_after(0), steps)(
                self.run, policy, self._reward(tokenizer, rm_iteration, online_init),
                self.splits.rl,
                self.splits.eval, logger, self.config_yaml, out_name=folder,
                reference_path=policy, evaluate_ends=False)  # eval/{k-1} and eval/k do that
        finally:
            logger.close()
        done = self.run / folder / "done.json"  # (the main rank wrote it)
        done = broadcast_from_main(json.loads(done.read_text()) if is_main() else None)
        drawn = done.get("question_steps", done["steps"])  # (offline RFT: its sampling steps)
        online = self.run / folder / "online-rm"
        return {"policy": self._rel(final), "reference": self._rel(policy),
                "question_steps": [offset, offset + int(drawn)],
                **({"online_rm": self._rel(online)} if self.w.rm.settings.online else {}),
                **({"guard": done["guard"]} if "guard" in done else {})}

    def evaluate(self, k: int, policy: str, rm_iteration: int) -> dict:
        """Held-out accuracy of the policy, and the reward models' step metrics and best-of-N:
        the questions spread over the ranks, the same entry on every rank."""
        w = self.w
        with memory_phase("evaluation: sampling"):
            model, tokenizer = stages.load_policy(w, policy)
            metrics = stages.evaluate(w, model, tokenizer, self.splits.eval,
                                      progress=is_main(),
                                      outcomes_path=self.run / "eval" / f"iteration-{k}.json")
        entry = {"iteration": k, "policy": self._rel(policy),
                 "eval": {key.removeprefix("eval/"): v for key, v in metrics.items()},
                 **stages.reward_model_report(w, self._scorers(rm_iteration), model,
                                              tokenizer, self.splits.eval)}
        if rm_iteration > 0 and w.rm.settings.bon_questions:
            entry["refresh"] = self.manifest.outputs(f"refresh-check/{rm_iteration}")
        # What the reward models that judged this iteration trained on: new, replayed, worked.
        entry["reward_model_data"] = {
            kind: self.manifest.outputs(f"rm-{kind}/{rm_iteration}").get("composition")
            for kind in KINDS}
        if k > 0 and is_main():  # (the main rank wrote the outcomes it compares)
            entry["grpo"] = self._grpo_means(k)
            entry["watch"] = watch_ends(self._grpo_rows(k))
            entry["change"] = change_from(self.run / "eval" / "iteration-0.json",
                                          self.run / "eval" / f"iteration-{k}.json")
        logger = self.make_logger("eval")  # wandb: the held-out metrics against the iteration
        logger.rewind(k - 1)  # (an eval unit redone after a crash logs its row once)
        logger.log({key: v for key, v in metrics.items() if not isinstance(v, str)}, step=k)
        logger.close()
        return broadcast_from_main(entry)

    def refresh_check(self, k: int, policy: str) -> dict:
        """The refreshed reward models RM_k against the ones they replace, RM_{k-1}, on the
        samples of the policy they will judge next (`policy`, at GRPO's temperature): in-group
        AUROC, best-of-N pick, and (synthetic task) step accuracy against the step oracle; the
        same samples for both (`rm.bon_questions` held-out questions x `rm.bon_samples`)."""
        model, tokenizer = stages.load_policy(self.w, policy)
        previous, refreshed = self._scorers(k - 1), self._scorers(k)
        return stages.refresh_report(self.w, previous, refreshed, model, tokenizer,
                                     self.splits.eval)

    # -- the loop ----------------------------------------------------------------------------
    def units(self) -> list[tuple[str, Callable[[], dict]]]:
        """(name, work) of every unit of the run as far as the manifest decides it, in the order
        `run_all` runs them. A labelling round r (`label/r`, `rm-*/r`, `refresh-check/r`) labels
        the policy of the unit before it and refreshes the reward models: one before each
        iteration after the first (`iterate.refresh`), and one after a GRPO unit whose guard
        fired `refresh` (`watch.guard`) with steps left, followed by a GRPO unit for them
        (`grpo/K.J`). A unit reads what it starts from out of the manifest when it runs."""
        units = [("sft", self.warm_start),
                 ("label/0", lambda: self.label(0, self._policy_after(0))),
                 *((f"rm-{kind}/0", partial(self.reward_model, kind, 0)) for kind in KINDS),
                 ("eval/0", lambda: self.evaluate(0, self._policy_after(0), 0))]
        round_, source, last_grpo = 0, "sft", None
        for k in range(1, self.w.iterate.iterations + 1):
            if k > 1 and self.w.iterate.refresh:
                round_ += 1
                units += self._round_units(round_, source)
            # (single-stage GRPO keeps the first reward models, unless a guard refreshed them)
            segment, left = 0, self.w.stage.policy.steps
            while True:
                name = f"grpo/{k}" + (f".{segment}" if segment else "")
                units.append((name, partial(self._grpo_unit, k, source, last_grpo, round_,
                                            segment, left)))
                source = last_grpo = name
                ran = self._refresh_fired(name)
                if ran is None or ran >= left:
                    break
                left, segment, round_ = left - ran, segment + 1, round_ + 1
                units += self._round_units(round_, name)
            units.append((f"eval/{k}", partial(self._evaluate_unit, k, source, round_)))
        return units

    def _round_units(self, r: int, source: str) -> list[tuple[str, Callable[[], dict]]]:
        """Labelling round r on the policy of unit `source`: label, refresh both reward models,
        compare them with the ones they replace."""
        return [(f"label/{r}", lambda: self.label(r, self._policy_of(source))),
                *((f"rm-{kind}/{r}", partial(self.reward_model, kind, r)) for kind in KINDS),
                (f"refresh-check/{r}", lambda: self.refresh_check(r, self._policy_of(source)))]

    def _refresh_fired(self, name: str) -> int | None:
        """The steps GRPO unit `name` ran if its guard fired `refresh`, else None (or not run)."""
        if not self.manifest.done(name):
            return None
        outputs = self.manifest.outputs(name)
        if outputs.get("guard", {}).get("action") != "refresh":
            return None
        first, last = outputs["question_steps"]
        return last - first

    def plan(self) -> list[str]:
        """Every unit of the run as far as it is decided, in the order `run_all` runs them."""
        return [name for name, _ in self.units()]

    def run_all(self) -> list[dict]:
        """Run (or, finished, read back) every unit in order, planning again after each (a
        fired guard adds units); the summary and the accuracy plot are rewritten after each
        evaluation."""
        iterations, ran = [], set()
        while True:
            units = self.units()
            todo = [(name, work) for name, work in units if name not in ran]
            if not todo:
                return iterations
            name, work = todo[0]
            outputs = self.manifest.run(name, work, [n for n, _ in units])
            ran.add(name)
            if name.startswith("eval/"):
                iterations.append(outputs)
                self._write(iterations)

    def _policy_of(self, unit: str) -> str:
        return self._abs(self.manifest.outputs(unit)["policy"])

    def _policy_after(self, k: int) -> str:
        """The policy at the end of iteration k: the warm start's (k = 0) or its last GRPO
        unit's."""
        return self._policy_of("sft" if k == 0 else self._grpo_units(k)[-1])

    def _grpo_units(self, k: int) -> list[str]:
        """Iteration k's finished GRPO units, in order (`grpo/K`, then `grpo/K.1`, ...)."""
        names, segment = [], 0
        while self.manifest.done(name := f"grpo/{k}" + (f".{segment}" if segment else "")):
            names.append(name)
            segment += 1
        return names

    def _grpo_unit(self, k: int, source: str, last_grpo: str | None, rms: int, segment: int,
                   steps: int) -> dict:
        offset = 0 if last_grpo is None else self._question_end(last_grpo)
        online = None if last_grpo is None else self.manifest.outputs(last_grpo).get("online_rm")
        return self.grpo(k, self._policy_of(source), rms, segment, steps, offset,
                         online and self._abs(online))

    def _question_end(self, unit: str) -> int:
        """Where GRPO unit `unit` left the RL question stream (a run recorded before the
        stream walked on: after its iteration's `policy.steps`)."""
        outputs = self.manifest.outputs(unit)
        if "question_steps" in outputs:
            return outputs["question_steps"][1]
        return int(unit.split("/")[1].split(".")[0]) * self.w.stage.policy.steps

    def _evaluate_unit(self, k: int, source: str, rms: int) -> dict:
        return self.evaluate(k, self._policy_of(source), rms)

    # -- helpers -----------------------------------------------------------------------------
    def base_rm_init(self) -> str:
        return stages.rm_backbone(self.w, self._abs(self.manifest.outputs("sft")["policy"]))

    def _rm_questions(self, k: int):
        return stages.label_questions(self.splits.rl, self.w.label.questions, k)

    def _scorers(self, rm_iteration: int, kinds=KINDS, members: bool = False) -> dict:
        """{kind: RM_{rm_iteration}'s scorer}; with `members`, an ensemble's scorers as a list
        (`rm.ensemble`; its first member is the reward model the reports read)."""
        out = {}
        for kind in kinds:
            if members and self.w.rm.settings.ensemble > 1 and kind == self._rewarded_kind():
                out[kind] = [stages.load_scorer(self.w, self._abs(p))
                             for p in self._scorer_paths(kind, rm_iteration)]
            else:
                out[kind] = stages.load_scorer(self.w, self._abs(
                    self.manifest.outputs(f"rm-{kind}/{rm_iteration}")["path"]))
        return out

    def _rewarded_kind(self) -> str:
        """The reward model GRPO reads: the PRM under process supervision, else the ORM."""
        return "prm" if self.w.per_step else "orm"

    def _reward(self, policy_tokenizer, rm_iteration: int, online_init: str | None = None):
        """GRPO's reward in the loop (`iterate.reward`): the reward model of its supervision
        (RM_{rm_iteration}; with `rm.online` learning from `online_init`, default
        RM_{rm_iteration}),
        or the rule."""
        warm = self._policy_after(0)
        if self.w.rm.settings.online and online_init is None:  # implicit: rm.path or warm start
            online_init = (self.w.rm.settings.path or warm) \
                if self.w.rm.settings.family == "implicit" else \
                self._abs(self.manifest.outputs(f"rm-orm/{rm_iteration}")["path"])
        return make_reward(self.w, policy_tokenizer, self.w.iterate.reward,
                           lambda kinds: self._scorers(rm_iteration, kinds, members=True),
                           online_init, warm)

    def _grpo_rows(self, k: int) -> list[dict]:
        """Iteration k's GRPO step rows, over its units in order."""
        folders = [f"iteration-{name.split('/')[1]}" for name in self._grpo_units(k)]
        return [r for folder in folders
                for r in read_metrics(self.run / self.policy_folder / folder / "metrics.jsonl")
                if "train/loss" in r]

    def _grpo_means(self, k: int) -> dict:
        """GRPO metrics averaged over iteration k's steps (the watch's keys apart: `watch`)."""
        # Wall-clock numbers stay in metrics.jsonl: the summary holds what the seed determines.
        return step_means(self._grpo_rows(k), skip=("eval/", "time/", "watch/"))

    def _rel(self, path) -> str:
        """Paths in the manifest and summary are relative to the run folder (relocatable); a
        policy from outside it (a hub id, another folder) is kept as it was given."""
        try:
            return str(Path(path).resolve().relative_to(self.run.resolve()))
        except ValueError:
            return str(path)

    def _abs(self, rel: str) -> str:
        inside = self.run / rel
        return str(inside) if inside.exists() else rel

    def _write(self, iterations: list[dict]) -> None:
        if is_main():
            write_summary(self.run / "summary.json", iterations)
            steps = [self._grpo_rows(it["iteration"]) for it in iterations if it["iteration"]]
            plot_accuracy(self.run / "accuracy.png", iterations, steps)
