"""The training-loop skeleton SFT, reward-model and GRPO training share, and the seeded order
every one of them draws its batches from.

A stage folder `out` holds `state/` (DeepSpeed's resumable state), `done.json` once the stage is
finished, and the stage's exports. `StageLoop` loads the state, drops the metric rows a crash
logged past it, shows a progress bar with an ETA, runs micro-batches through checked backward
passes, saves, exports and writes the done file; the trainers supply the losses and metrics.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from runtime.checkpoint import (export, load_companion_state, load_training_state,
                                prune_companion_state, save_companion_state, save_training_state)
from runtime.dist import broadcast_from_main, is_main
from runtime.engine import checked_backward, engine_step
from runtime.rundir import atomic_write_json


def seeded_order(n: int, seed: int, groups: list[list[int]] | None = None) -> list[int]:
    """0..n-1 in an order fixed by `seed`; with `groups` (lists of indices), the groups are
    shuffled and each stays together."""
    rng = random.Random(seed)
    if groups is None:
        order = list(range(n))
        rng.shuffle(order)
        return order
    groups = list(groups)
    rng.shuffle(groups)
    return [i for group in groups for i in group]


def epoch_slice(n: int, step: int, per_step: int, seed: int,
                groups: list[list[int]] | None = None,
                lengths: list[int] | None = None) -> tuple[int, list[int]]:
    """(epoch, indices) of `step`: consecutive slices of a seeded order, reshuffled each epoch
    (`seed + epoch` seeds the epoch's order); with `lengths`, grouped by length
    (`length_grouped`)."""
    epoch, index = divmod(step, max(1, n // per_step))
    # One permutation an epoch, not one a step (0.24 s a step at 400K rows). The cache holds
    # what it was built from, so their ids cannot be reused while it is kept.
    key = (n, seed + epoch, per_step, id(groups), id(lengths))
    cached = _EPOCH_ORDERS.pop(key, None)
    if cached is None or cached[0] is not groups or cached[1] is not lengths:
        order = seeded_order(n, seed + epoch, groups)
        if lengths is not None:
            order = length_grouped(order, lengths, per_step, seed + epoch)
        cached = (groups, lengths, order)
    _EPOCH_ORDERS[key] = cached  # (now the newest)
    while len(_EPOCH_ORDERS) > 4:
        _EPOCH_ORDERS.pop(next(iter(_EPOCH_ORDERS)))
    return epoch, cached[2][index * per_step:(index + 1) * per_step]


def length_grouped(order: list[int], lengths: list[int], per_step: int, seed: int,
                   window: int = 64) -> list[int]:
    """`order` with each window of `window` batches sorted by length (longest first) and cut
    into batches, the full batches of the window then shuffled (seeded): a batch holds rows of
    similar lengths, so it pads little, while which rows meet stays random. A permutation of
    `order`; the batches stay aligned at multiples of `per_step` (a short last one stays last)."""
    rng = random.Random(seed)
    out: list[int] = []
    span = per_step * window
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: -lengths[i])
        batches = [chunk[k:k + per_step] for k in range(0, len(chunk), per_step)]
        full = [b for b in batches if len(b) == per_step]
        rng.shuffle(full)
        out += [i for b in full + batches[len(full):] for i in b]
    return out


_EPOCH_ORDERS: dict = {}  # the orders of the last few (n, seed, groups), oldest first


def stage_done(out: Path) -> bool:
    return (out / "done.json").exists()


class StageLoop:
    """One resumable training stage in `out`: `state["step"]` counts finished optimizer steps.

        trainer = StageLoop(out, engine, logger, total_steps, desc="sft")
        while trainer.running():
            ...  # build the step's batch
            grad_norm = trainer.backward(grad_accum, micro_batch_size, loss_of, where)
            trainer.advance()
            ...  # metrics, evaluation; trainer.save() when due; trainer.log(metrics)
        trainer.finish(tokenizer, final_dir, config_yaml, done={...})
    """

    def __init__(self, out: Path, engine, logger, total_steps: int, *, desc: str,
                 fresh_state: dict | None = None, max_seconds: float = 0.0,
                 companions: dict | None = None):
        """`max_seconds` > 0: a wall-clock budget; the stage stops after the step that spends
        it (the seconds are part of the saved state, so a resumed stage spends what is left).
        `companions`: name -> a second training engine (PPO's critic), saved and restored with
        the main one (`<out>/state-<name>`)."""
        self.out, self.engine, self.logger, self.total_steps = out, engine, logger, total_steps
        self.companions = dict(companions or {})
        self.state = load_training_state(engine, out / "state") or {"step": 0,
                                                                    **(fresh_state or {})}
        if self.state["step"]:
            for name, other in self.companions.items():
                load_companion_state(other, out / f"state-{name}", self.state["step"])
        self.max_seconds = max_seconds
        self._clock = time.perf_counter()
        # Rows a crash logged past the saved state are redone: drop them.
        logger.rewind(self.state["step"] if self.state["step"] else -1)
        self.bar = tqdm(total=total_steps, initial=self.state["step"], desc=desc,
                        disable=not is_main())
        self.stopped = False

    @property
    def step(self) -> int:
        return self.state["step"]

    def running(self) -> bool:
        over = self.max_seconds and self.state.get("seconds", 0.0) >= self.max_seconds
        return self.state["step"] < self.total_steps and not self.stopped and not over

    def backward(self, micro_batches: int, micro_batch_size: int,
                 loss_of: Callable[[slice, int], object], where: str,
                 grad_norm: float = 0.0, engine=None) -> float:
        """For each micro-batch: `loss_of(rows, index)`, a checked backward pass and the engine
        step (DeepSpeed steps the optimizer at the accumulation boundary). Returns the last
        gradient norm reported (`grad_norm` if none was). `engine`: a companion instead of the
        main engine."""
        engine = engine or self.engine
        for mb in range(micro_batches):
            rows = slice(mb * micro_batch_size, (mb + 1) * micro_batch_size)
            at = f"{where}, micro-batch {mb + 1}"
            checked_backward(engine, loss_of(rows, mb), at)
            norm = engine_step(engine, at)
            grad_norm = norm if norm is not None else grad_norm
        return grad_norm

    def advance(self) -> int:
        """One optimizer step done: returns the new step count."""
        now = time.perf_counter()
        # every rank counts rank 0's seconds, so that all stop after the same step
        self.state["seconds"] = self.state.get("seconds", 0.0) + broadcast_from_main(
            now - self._clock)
        self._clock = now
        self.state["step"] += 1
        self.bar.update(1)
        return self.state["step"]

    def restart_clock(self) -> None:
        """What ran since the last step (or the loop's start) is not the stage's: its seconds
        do not count toward the wall-clock budget."""
        self._clock = time.perf_counter()

    def due(self, every: int) -> bool:
        """At every `every`-th step, and at the last one."""
        return (every and self.step % every == 0) or self.step == self.total_steps

    def save(self) -> None:
        for name, other in self.companions.items():
            save_companion_state(other, self.out / f"state-{name}", self.step)
        save_training_state(self.engine, self.out / "state", self.state)
        for name in self.companions:
            prune_companion_state(self.out / f"state-{name}", self.step)

    def log(self, metrics: dict, media: dict | None = None, step: int | None = None) -> None:
        self.logger.log(metrics, step=self.step if step is None else step, media=media)

    def finish(self, tokenizer, export_dir: Path | None, config_yaml: str, done: dict,
               files: dict[str, str] | None = None) -> None:
        """Close the bar, export the model (unless `export_dir` is None) with `files` beside it
        (name -> text: a model card) and write done.json."""
        self.bar.close()
        if export_dir is not None:
            export(self.engine, tokenizer, export_dir, config_yaml, files)
        if is_main():
            atomic_write_json(self.out / "done.json", done)
