"""Memory telemetry: what each rank's GPU holds, per phase of a run (configs/memory.py's plan) and
per step; no-ops without a GPU."""

from __future__ import annotations

import contextlib

from runtime.dist import gather_objects


def device_memory_gib() -> float | None:
    """GiB in use on this rank's GPU now, by every allocator of the process (vLLM's pool
    included, which PyTorch's own statistics do not see); None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


PHASE_PEAKS: dict[str, float] = {}
"""GiB: the most this rank's GPU held in each memory phase of the process (`memory_phase`)."""


@contextlib.contextmanager
def memory_phase(name: str):
    """Record the most this rank's GPU holds inside the block as phase `name` (the phases of
    configs/memory.py's plan; the highest over the process's blocks of that name, in
    `PHASE_PEAKS`): PyTorch's peak allocation plus what other allocators (vLLM's pool) hold. The
    blocks do not nest. A no-op without a GPU."""
    import torch

    if not torch.cuda.is_available():
        yield
        return

    def others() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) - torch.cuda.memory_reserved()

    before = others()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        peak = (torch.cuda.max_memory_allocated() + max(before, others())) / 2**30
        PHASE_PEAKS[name] = max(PHASE_PEAKS.get(name, 0.0), peak)


def memory_metrics(used_gib: float | None) -> dict:
    """`memory/device_used_gib_rank<r>` (`used_gib`, as `device_memory_gib` read it) and
    `memory/torch_peak_gib_rank<r>` (PyTorch's peak allocation) of every rank, on every rank;
    {} without a GPU. Every rank calls it."""
    import torch

    if used_gib is None:
        return {}
    rows = gather_objects((used_gib, torch.cuda.max_memory_allocated() / 2**30))
    return {key: value for r, (used, peak) in enumerate(rows)
            for key, value in ((f"memory/device_used_gib_rank{r}", used),
                               (f"memory/torch_peak_gib_rank{r}", peak))}
