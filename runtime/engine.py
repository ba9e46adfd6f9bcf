"""DeepSpeed engines (training and inference), their learning rate, the checked backward pass and
the loss-scaling invariant (`rank_loss`), the optimizer step. The process group is
runtime/dist.py; memory telemetry runtime/memory.py.
"""

from __future__ import annotations

import contextlib
import math

from runtime.dist import global_sum, init_distributed, world


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


def module_gather(engine):
    """`gather(params)`: a context in which one module's `params` are whole (every rank enters
    it together): DeepSpeed's `GatheredParameters` under ZeRO-3, nothing below it (the weights
    are whole already). What a weight stream that walks the model module by module
    (`runtime.lora.iter_weights`) gathers with, so a vLLM push never holds the whole policy."""
    if engine.zero_optimization_stage() != 3:
        return lambda params: contextlib.nullcontext()
    import deepspeed

    return lambda params: deepspeed.zero.GatheredParameters(params)


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
