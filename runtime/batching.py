"""Derived batch numbers, computed once and checked with readable messages (never user fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    global_sequences: int
    """Sequences per optimizer step, all ranks together."""
    rank_sequences: int
    """Sequences per optimizer step on one rank."""
    micro_batch_size: int
    """Sequences per forward/backward pass."""
    grad_accum: int
    """Micro-batches per optimizer step on one rank."""


def plan_batch(global_sequences: int, micro_batch_size: int, world_size: int, what: str) -> BatchPlan:
    """Split `global_sequences` per step over ranks and micro-batches, exactly."""
    if global_sequences % world_size:
        raise ValueError(
            f"{what}: {global_sequences} sequences per step do not split over {world_size} ranks")
    rank_sequences = global_sequences // world_size
    micro = min(micro_batch_size, rank_sequences)
    if rank_sequences % micro:
        raise ValueError(
            f"{what}: {rank_sequences} sequences per rank are not a multiple of "
            f"deepspeed.micro_batch_size={micro_batch_size}")
    return BatchPlan(global_sequences, rank_sequences, micro, rank_sequences // micro)


def plan_grpo_batch(questions_per_step: int, group_size: int, micro_batch_size: int,
                    world_size: int, mini_batches: int = 1) -> BatchPlan:
    """GRPO: all G samples of a question stay on one rank, so group statistics are exact. With
    `mini_batches` k > 1 an optimizer step takes G/k samples of every question (advantages
    computed over whole groups first), the same samples however many ranks share the step: the
    plan is a mini-batch's."""
    if questions_per_step % world_size:
        raise ValueError(
            f"policy.questions_per_step={questions_per_step} must be a multiple of the world size "
            f"{world_size} (a question's G samples stay on one rank)")
    if group_size % mini_batches:
        raise ValueError(f"policy.mini_batches={mini_batches} does not divide "
                         f"policy.group_size={group_size} (a mini-batch takes G/k samples of "
                         "every question)")
    return plan_batch(questions_per_step * group_size // mini_batches, micro_batch_size,
                      world_size, f"policy.questions_per_step={questions_per_step} x "
                      f"policy.group_size={group_size} / policy.mini_batches={mini_batches}")
