"""DeepSpeed engines and the distributed setup, the same on one CPU process and on many GPUs.

Launch with `torchrun`/`deepspeed` for many processes; a plain `python` process is rank 0 of 1.
On CPU, set DS_ACCELERATOR=cpu (the CLI does it when no GPU is present) and gloo is the backend.
"""

from __future__ import annotations

import atexit
import contextlib
import math

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


def deepspeed_config(ds, *, lr: float | list[float], micro_batch_size: int,
                     grad_accum: int, decay_steps: int = 0) -> dict:
    """The DeepSpeed JSON config for one engine, from a `DeepSpeedConfig` and derived numbers;
    `lr` is one rate, or one per parameter group. `decay_steps` > 0: after the warm-up the rate
    falls linearly to 0 at that optimizer step (DeepSpeed's WarmupDecayLR)."""
    base_lr = lr[0] if isinstance(lr, list) else lr
    _, world_size = world()
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param and ds.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": ds.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": ds.bf16},
        # bf16 under ZeRO-2/3: a step's 16-32 micro-batch gradients summed in float32, not bf16
        **({"data_types": {"grad_accum_dtype": "fp32"}} if ds.bf16 and ds.zero_stage >= 2
           else {}),
        "optimizer": {"type": "AdamW", "params": {
            "lr": base_lr, "weight_decay": ds.weight_decay, "betas": [0.9, 0.999], "eps": ds.adam_eps,
            "torch_adam": True, **({"fused": True} if ds.fused_adam else {})}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.warmup_steps > 0 or decay_steps > 0:
        # (DeepSpeed's schedules warm up over at least 2 steps: rate 0, then half the rate.)
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_type": "linear",
                  "warmup_num_steps": max(1, ds.warmup_steps)}
        if decay_steps > 0:
            if decay_steps <= ds.warmup_steps:
                raise ValueError(f"the lr decay ends at step {decay_steps}, not after the "
                                 f"warm-up (deepspeed.warmup_steps={ds.warmup_steps})")
            params["total_num_steps"] = decay_steps
        config["scheduler"] = {"type": "WarmupDecayLR" if decay_steps > 0 else "WarmupLR",
                               "params": params}
    return config


def build_engine(model, ds, *, lr: float, micro_batch_size: int, grad_accum: int,
                 lr_by_param: dict[int, float] | None = None, decay_steps: int = 0):
    """Wrap `model` in a DeepSpeed training engine (optimizer, schedule, clipping, ZeRO).
    `lr_by_param` (id(parameter) -> rate) gives those parameters their own learning rate;
    `decay_steps` > 0 decays every rate linearly to 0 at that step."""
    import deepspeed

    init_distributed()
    params = [p for p in model.parameters() if p.requires_grad]
    rates = sorted({lr, *(lr_by_param or {}).values()}, key=lambda r: r != lr)
    groups = [{"params": [p for p in params if (lr_by_param or {}).get(id(p), lr) == rate],
               "lr": rate} for rate in rates]
    config = deepspeed_config(ds, lr=rates if len(rates) > 1 else lr,
                              micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                              decay_steps=decay_steps)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups if len(groups) > 1
                                      else params, config=config)
    if ds.zero_stage == 0 and engine.dp_world_size == 1:
        # Alone, DeepSpeed's reduce flattens every gradient, all-reduces it with itself and
        # copies it back: the same numbers, 6% of a small reward model's step.
        engine.enable_backward_allreduce = False
    return engine


def build_inference_engine(model, ds):
    """A frozen model (the reference) for forward passes only: under ZeRO-3 a DeepSpeed engine
    without optimizer whose weights are partitioned too (and offloaded to CPU with
    `deepspeed.offload_param`); otherwise the plain module in eval mode. Every rank must call
    it the same number of times under ZeRO-3 (each forward gathers layer by layer)."""
    model = model.eval().requires_grad_(False)
    if ds.zero_stage != 3:
        return model
    import deepspeed

    zero: dict = {"stage": 3}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": ds.micro_batch_size, "zero_optimization": zero,
              "bf16": {"enabled": ds.bf16}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # (DeepSpeedEngine.eval returns None, not the engine)
    return engine


def gathered_for_generation(engine):
    """Context in which `engine.module` holds its full weights and runs as a plain module: under
    ZeRO-3 the partitions are gathered once for the whole rollout (instead of once per generated
    token, the classic slow or hanging ZeRO-3 generation) and DeepSpeed's fetch hooks are lifted,
    so a rank may generate or score alone, or for a different number of steps than the others.
    Every rank must enter it together. Yields the module; below ZeRO-3 it only does that."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext(engine.module)
    return _zero3_plain_module(engine)


@contextlib.contextmanager
def _zero3_plain_module(engine):
    # DeepSpeed's own `unwrap_model_for_generation` (0.19) lifts the per-module hooks but leaves
    # the root's start-of-forward hook, whose step reset is a collective: a rank-0-only generate
    # then waits forever for the others. Lift all of them, and restore them all afterwards.
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    stack_depth = len(parameter_offload.FWD_MODULE_STACK)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        offload._remove_module_hooks()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield engine.module
        finally:
            offload.setup_zero_stage3_hooks()
            del parameter_offload.FWD_MODULE_STACK[stack_depth:]


def current_lr(engine) -> float:
    return float(engine.get_lr()[0])


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
    import torch
    import torch.distributed as dist

    if world()[1] == 1:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor)
    return float(tensor.item())


def gather_rows(*tensors):
    """Each per-rank tensor concatenated along dim 0 over the ranks, in rank order, on CPU, on
    every rank (the tensors themselves in one process): one collective for all of them, so a
    step's metrics describe the whole batch and not rank 0's share. Every rank must call it."""
    if world()[1] == 1:
        return list(tensors)
    import torch

    parts = gather_objects([t.detach().cpu() for t in tensors])
    return [torch.cat([part[i] for part in parts]) for i in range(len(tensors))]


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


def rank_loss(loss, world_size: int):
    """The loss one rank backpropagates: its micro-batch's share of the optimizer step's loss
    times the number of ranks.

    The loss-scaling invariant, for every trainer (policy losses, the critic, DPO, SFT, reward
    models): a micro-batch's loss is normalised by the *global* counts of the optimizer step
    (sequences, tokens or labels over every micro-batch of every rank; policy/math/losses.py),
    so the micro-batch losses of all ranks sum to the step's loss. DeepSpeed averages the
    gradients over the ranks (their sum / world size) and, called with `scale_wrt_gas=False`
    (`checked_backward`), adds the micro-batches' gradients without dividing by the
    accumulation steps. Times the world size, the gradient the optimizer sees is then exactly
    the gradient of the whole step's loss, whatever the ranks, micro-batches and ZeRO stage
    (tests/test_losses.py checks it by hand)."""
    return loss * world_size


def checked_backward(engine, loss, where: str) -> None:
    """`engine.backward(loss)` after checking the loss is finite; a NaN/inf loss stops the run
    with `where` (stage, step, micro-batch) named, before any gradient reaches the optimizer."""
    import torch

    finite = bool(torch.isfinite(loss.detach()).all())
    # Every rank learns of a non-finite loss on any rank and stops with it: one rank stopping
    # alone would leave the others waiting in the backward pass's all-reduce.
    if global_sum(float(not finite)) > 0:
        owner = "the loss is " + str(loss.item()) if not finite else \
            "another rank's loss is not finite"
        raise FloatingPointError(f"{where}: {owner}; stopping before the optimizer step (the "
                                 "last checkpoint is intact: fix and re-run to resume)")
    engine.backward(loss, scale_wrt_gas=False)  # (the micro-batches' shares add: `rank_loss`)


def engine_step(engine, where: str = "") -> float | None:
    """`engine.step()`; at an optimizer step, also the global gradient norm before clipping.

    ZeRO optimizers report the norm themselves; plain (stage 0) fp32 engines do not, so it is
    measured from the module's gradients just before the step.
    """
    import torch

    norm = None
    boundary = engine.is_gradient_accumulation_boundary()
    if boundary and not engine.zero_optimization():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(norm):
            engine.zero_grad()
            raise FloatingPointError(f"{where}: the gradient norm is {norm}; the optimizer step "
                                     "was not taken")
    engine.step()
    if boundary and norm is None:
        reported = engine.get_global_grad_norm()
        norm = float(reported) if reported is not None else None
    return norm
