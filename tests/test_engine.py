"""runtime/engine.py: the optimizer DeepSpeed is given. `deepspeed.fused_adam` runs torch's fused
AdamW kernel and trains to the same weights as the default loop, up to rounding, under ZeRO-0
(fp32) and ZeRO-2 (bf16); bf16 gradients accumulate in float32 under ZeRO-2 and ZeRO-3.
runtime/dist.py: how a finished rank of a several-process CPU job ends."""

import pytest
import torch

from configs.schema import DeepSpeedConfig
from runtime.engine import build_engine, checked_backward, deepspeed_config, engine_step
from runtime.tiny_model import build_model, build_tokenizer


def _trained(fused: bool, stage: int, bf16: bool) -> tuple[list[torch.Tensor], object]:
    tokenizer = build_tokenizer(())
    model = build_model(tokenizer, 16, 1, 2, 32, 64, seed=0)
    if bf16:
        model = model.to(torch.bfloat16)
    engine = build_engine(model, DeepSpeedConfig(zero_stage=stage, bf16=bf16, fused_adam=fused),
                          lr=1e-2, micro_batch_size=2, grad_accum=1)
    ids = torch.tensor([[5, 6, 7, 8], [8, 7, 6, 5]])
    for _ in range(3):
        logits = engine(input_ids=ids).logits.float()
        checked_backward(engine, logits.logsumexp(-1).mean() - logits[..., 3].mean(), "step")
        engine_step(engine, "step")
    return [p.detach().float().clone() for p in engine.module.parameters()], engine


@pytest.mark.parametrize("stage,bf16", [(0, False), (2, True)])
def test_fused_adam_trains_to_the_default_loops_weights(stage, bf16):
    fused, engine = _trained(True, stage, bf16)
    plain, _ = _trained(False, stage, bf16)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # under a ZeRO wrapper
    assert isinstance(inner, torch.optim.AdamW) and inner.defaults["fused"] is True
    start = [p.detach().float() for p in build_model(build_tokenizer(()), 16, 1, 2, 32, 64,
                                                       seed=0).parameters()]
    moved = sum(float((a - b).abs().max()) for a, b in zip(plain, start))
    assert moved > 1e-2  # three steps at lr 1e-2 moved the weights
    tolerance = 1e-2 if bf16 else 1e-6  # (bf16 weights: one rounding step of the copy)
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, atol=tolerance, rtol=0)


@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_adam_eps_bounds_what_a_gradients_last_bits_move(eps):
    """`deepspeed.adam_eps`, as DeepSpeed is given it: one AdamW step at lr 1e-2 on a weight
    whose gradient is a cancellation near zero (1e-9, in a tensor of RMS ~1e-3), and on that
    gradient one float32 ulp of the RMS (1.19e-10) lower, as another reduction order may give
    it. The first step is lr * g / (|g| + eps). By hand, eps = 1e-8: 1e-2 * 1e-9 / 1.1e-8 =
    9.09e-4 against 1e-2 * 8.81e-10 / 1.0881e-8 = 8.10e-4, 1e-4 apart (a hundred times a 1e-6
    tolerance, from one ulp); eps = 1e-3: both ~10 g, 1.2e-9 apart (at most lr / eps per unit
    of gradient)."""
    params = deepspeed_config(DeepSpeedConfig(adam_eps=eps), lr=1e-2, micro_batch_size=1,
                              grad_accum=1)["optimizer"]["params"]

    def stepped(gradient: float) -> float:
        weight = torch.nn.Parameter(torch.tensor([0.5, 0.5]))
        optimizer = torch.optim.AdamW([weight], lr=params["lr"], betas=params["betas"],
                                      eps=params["eps"], weight_decay=params["weight_decay"])
        weight.grad = torch.tensor([1e-3, gradient])
        optimizer.step()
        return 0.5 - float(weight.detach()[1])

    ulp = torch.finfo(torch.float32).eps * 1e-3
    if eps == 1e-8:
        assert stepped(1e-9) == pytest.approx(9.09e-4, rel=1e-3)
        assert stepped(1e-9) - stepped(1e-9 - ulp) == pytest.approx(9.9e-5, rel=0.02)
    else:
        assert abs(stepped(1e-9) - stepped(1e-9 - ulp)) <= 1e-2 / eps * ulp * 1.01


def test_finish_process_leaves_one_process_and_a_failure_alone():
    """`finish_process` ends only a finished rank of a several-process gloo job: in one process
    (rank 0 of 1) it returns the code, whatever it is, and the group stays."""
    import torch.distributed as dist

    from runtime.dist import finish_process, init_distributed

    init_distributed()
    assert finish_process(0) == 0 and finish_process(2) == 2
    assert dist.is_initialized() and dist.get_world_size() == 1


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradients_accumulate_in_float32_under_zero_2_and_3(stage):
    """32 micro-batches of a bf16 model, one optimizer step: the accumulated gradient's norm
    (DeepSpeed's, before clipping) is within 1.5e-4 of the float64 sum of the same bf16
    micro-batch gradients. Accumulated in bf16 (DeepSpeed's default, the model's dtype) it was
    2.1e-4 off on this model; in float32, 5.6e-5."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    reference = [p.detach().to(torch.bfloat16).double() for p in model.parameters()]
    engine = build_engine(model.to(torch.bfloat16), DeepSpeedConfig(zero_stage=stage, bf16=True),
                          lr=1e-3, micro_batch_size=1, grad_accum=32)
    inputs = torch.randn(32, 1, 64, generator=torch.Generator().manual_seed(1))
    for x in inputs:
        checked_backward(engine, engine(x.to(torch.bfloat16)).float().sum(), "step")
        engine_step(engine, "step")
    w1, b1, w2, b2 = (p.requires_grad_() for p in reference)
    for x in inputs:  # float64, from the same bf16 weights and inputs (the losses are summed)
        ((x.to(torch.bfloat16).double() @ w1.T + b1) @ w2.T + b2).sum().backward()
    exact = torch.sqrt(sum((p.grad ** 2).sum() for p in reference))
    assert abs(float(engine.get_global_grad_norm()) / float(exact) - 1) < 1.5e-4
