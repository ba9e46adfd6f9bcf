"""The process group: launch, rank and world size, collectives, a finished rank's exit. The same on one
CPU process (rank 0 of 1) and on many GPUs.

Launch with `torchrun`/`deepspeed` for many processes; a plain `python` process is rank 0 of 1.
On CPU, set DS_ACCELERATOR=cpu (the CLI does it when no GPU is present) and gloo is the backend.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_TIMEOUT_MINUTES = 60.0
"""How long a collective waits for every rank before the run stops (`run.dist_timeout_minutes`;
DeepSpeed's own default is 10 minutes)."""


def init_distributed(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """Initialise torch.distributed once; a launcher-less process becomes rank 0 of 1. A
    collective that waits longer than `timeout_minutes` for a rank stops the run."""
    from datetime import timedelta

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # DeepSpeed would JIT-load its CPU shared-memory all-reduce op here, under a file lock in
        # ~/.cache/torch_extensions: a process killed while holding it leaves the lock behind
        # and every later run waits on it forever. gloo's all-reduce is all the CPU path needs.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_available() and dist.is_initialized():
        # Someone else started it (an in-process vLLM engine): a single process is rank 0 of 1.
        if dist.get_world_size() == 1:
            os.environ.setdefault("LOCAL_RANK", "0")
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if backend == "nccl":  # before any collective: NCCL's object collectives use this device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, verbose=False,
                               timeout=timedelta(minutes=timeout_minutes))
    if backend == "gloo":
        # Leave the group before the interpreter exits: gloo's threads torn down with the
        # process can abort a rank that is exiting cleanly (a config error's exit code 2 read
        # as -6). NCCL is left alone: destroying it with work in flight on an error exit can block.
        atexit.register(_leave_group)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def finish_process(code: int) -> int:
    """`code`, or, for a rank of a several-process gloo job whose work succeeded (`code` 0), an
    exit with 0 here: wait for every rank (gloo's barrier also waits for this rank's work still
    in flight, such as a ZeRO-3 prefetch), leave the group, flush, and end the process without
    the interpreter's teardown. Left to the interpreter, a rank that had finished its work
    aborted now and then at exit ("terminate called without an active exception", SIGABRT: a
    finished run read as a failure). A failure's exit, one process and NCCL are left alone."""
    import sys

    if code != 0 or "torch" not in sys.modules:  # a failure, or a command that never joined
        return code
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or \
            dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return code
    dist.barrier()
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # closed or no stream
            stream.flush()
    os._exit(0)


def world() -> tuple[int, int]:
    """(rank, world size). A process that a launcher started as one of several (`WORLD_SIZE` >
    1) joins the process group here if nothing has joined it yet: a stage called directly, not
    through the CLI, must not run as if it were alone while DeepSpeed averages over the ranks."""
    import torch.distributed as dist

    if (dist.is_available() and not dist.is_initialized()
            and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        init_distributed()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return world()[0] == 0


def collective_device():
    """Where a collective's tensors live: this rank's GPU under NCCL (a process group made with
    `nccl` alone has no CPU backend), the CPU under gloo."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_sum(value: float) -> float:
    """Sum of a per-rank number over all ranks (the number itself on one process)."""
    return global_sums([value])[0]


def global_sums(values: list[float]) -> list[float]:
    """Each per-rank number summed over all ranks, in one collective (the numbers themselves on
    one process)."""
    import torch
    import torch.distributed as dist

    if world()[1] == 1:
        return list(values)
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64,
                          device=collective_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_rows(*tensors):
    """Each per-rank tensor concatenated along dim 0 over the ranks, in rank order, on CPU, on
    every rank (the tensors themselves in one process): one collective for all of them, so a
    step's metrics describe the whole batch and not rank 0's share. Every rank must call it."""
    if world()[1] == 1:
        return list(tensors)
    import torch

    parts = gather_objects([t.detach().cpu() for t in tensors])
    return [torch.cat([part[i] for part in parts]) for i in range(len(tensors))]


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    import torch.distributed as dist

    if world()[1] > 1:
        device = collective_device()
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def broadcast_from_main(obj):
    """`obj` as rank 0 has it, on every rank."""
    import torch.distributed as dist

    if world()[1] == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_to_main(obj) -> list | None:
    """[rank 0's obj, rank 1's, ...] on rank 0, None on the others (`[obj]` in one process):
    what only the main rank writes need not travel to every rank."""
    import torch.distributed as dist

    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1] if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_objects(obj) -> list:
    """[rank 0's obj, rank 1's, ...] on every rank (`[obj]` in one process)."""
    import torch.distributed as dist

    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out
