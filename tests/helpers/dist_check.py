"""One GRPO step or one reward-model step, run under `torchrun` with any number of processes;
tests/test_distributed.py compares 1 process against 2 (ZeRO-2 and ZeRO-3) on the same global batch.

    torchrun --nproc_per_node 2 tests/helpers/dist_check.py grpo OUT BASE ZERO_STAGE [KEY=VALUE ...]
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py ppo OUT BASE ZERO_STAGE
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py rm OUT BASE ZERO_STAGE DATA.jsonl
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py world OUT
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py metrics OUT
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py shards OUT
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py vllm OUT      (in the vLLM venv)
    torchrun --nproc_per_node 2 tests/helpers/dist_check.py push OUT

Rollouts are greedy (policy.temperature=0), so they do not depend on how questions are spread over
ranks; the process reward cuts every completion into 3-token steps and scores each step from its
tokens and index, so advantages are non-zero although a greedy group's samples are identical. Each rank
writes the advantage tensor the loss received to OUT/advantages-rank<r>.pt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from small_config import SMALL  # noqa: E402

GRPO = [*SMALL, "policy.steps=1", "policy.questions_per_step=4", "policy.group_size=4",
        "policy.temperature=0", "policy.max_new_tokens=10", "policy.eval_every=0", "policy.mu=2",
        "inspect.every=0", "deepspeed.micro_batch_size=4", "run.wandb_mode=disabled",
        "run.threads=1", "policy.supervision=process", "eval.k=1", "data.eval_questions=2"]
RM = [*SMALL, "rm.kind=prm", "rm.batch_size=8", "rm.epochs=1", "rm.eval_every=0",
      "rm.val_fraction=0", "deepspeed.micro_batch_size=2", "run.wandb_mode=disabled",
      "run.threads=1"]

ONLINE = ["policy.supervision=outcome", "policy.reward=rm", "rm.online=true", "rm.online_lr=1e-2",
          "rm.lm_weight=0", "rm.likelihood_feature=false", "rm.extra_layers_from=[]",
          "policy.mu=1", "policy.temperature=1.0", "policy.rollout_questions=1",
          "policy.lr=1e-2", "deepspeed.adam_eps=1e-3", "rm.score_batch_size=4"]
"""GRPO rewarded by an online ORM started from the base model (its step tag added), at rates
that move both models, sampled at temperature 1 (the groups' rewards spread). The ORM scores a
group at a time, the same batches on any number of ranks: the random base's scores spread by
1e-3 within a group, so the group-normalised advantages would turn another padding's last bits
into differences Adam carries to the weights."""
IMPLICIT = ["rm.family=implicit", "policy.supervision=process", "policy.steps=2",
            "rm.implicit_beta=0.5"]
"""PRIME's implicit PRM instead (pi_phi and pi_ref both the base: its rewards are 0 until its
first step, so the second GRPO step is the one rewarded by it)."""
PRIME = [*IMPLICIT, "rm.online_update=before", "grpo.process_credit=prime",
         "grpo.process_weight=1.0"]
"""PRIME's own settings: the implicit PRM steps on the checks before it scores, and the check's
outcome advantage joins the sum form's."""


class ChunkStepReward:
    """Steps of 3 tokens; a step's reward is the parity of its token-id sum plus its index (a
    random model's greedy text repeats itself: the index keeps the rewards varied), plus
    `shift` (an ensemble's second member); the "final-answer check" is the parity of the whole
    completion's token-id sum."""

    def __init__(self, shift: int = 0):
        self.shift = shift

    def __call__(self, records, rollout, correct=None):
        from policy.rewards import Scores
        from runtime.steps import pad_steps

        values, ends, correct = [], [], []
        for i in range(len(rollout.texts)):
            ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            correct.append(sum(ids) % 2 == 0)
            cut = list(range(2, len(ids), 3)) or [len(ids) - 1]
            if cut[-1] != len(ids) - 1:
                cut.append(len(ids) - 1)
            values.append([float((sum(ids[max(0, e - 2):e + 1]) + k * (1 + self.shift)) % 2)
                           for k, e in enumerate(cut)])
            ends.append(cut)
        step_rewards, step_mask, step_end = pad_steps(values, ends)
        return Scores(rewards=step_rewards.sum(-1), correct=torch.tensor(correct),
                      step_rewards=step_rewards, step_mask=step_mask, step_end_index=step_end)


def step_metrics() -> dict:
    """GRPO's and PPO's step metrics of a fixed batch of 6 questions x G = 2 whose samples
    differ in length, reward, truncation, entropy, values and returns, this rank taking its
    questions' rows as GRPO deals them (a contiguous share)."""
    from types import SimpleNamespace

    from policy.algorithms.grpo import StepBatch, log_step
    from policy.batch import UpdateStats
    from policy.actor_critic import Targets, value_metrics
    from policy.rewards import Scores
    from policy.generation.rollout import Rollout
    from runtime.dist import world

    rank, size = world()
    n, width = 12, 6
    lengths = torch.tensor([1, 6, 3, 2, 6, 5, 4, 1, 2, 6, 3, 3])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.tensor([1., 0., 0., 0., 1., 1., 0.5, 0., 1., 0., 0., 1.])
    normalised = (rewards.view(-1, 2) - rewards.view(-1, 2).mean(-1, keepdim=True)).view(-1, 1)
    rows = slice(rank * n // size, (rank + 1) * n // size)
    groups = slice(rank * n // 2 // size, (rank + 1) * n // 2 // size)
    rollout = Rollout(torch.ones(n, 3, dtype=torch.long)[rows],
                      torch.tensor([[0, 1, 1]] * n)[rows], torch.ones(n, width,
                                                                   dtype=torch.long)[rows],
                      mask[rows], ["x"] * (rows.stop - rows.start), (lengths == width)[rows], 2)
    scores = Scores(rewards[rows], correct=(rewards == 1)[rows])
    batch = StepBatch(normalised[rows], normalised[rows], (torch.arange(n) % 5 != 0)[rows],
                      torch.tensor([False, True, False, False, False, False])[groups],
                      mask[rows], 0.0, 0.0)
    stats = {"loss": 0.5, "kl": 0.1, "clip": 0.2, "clip_high": 0.1, "grad_norm": 1.0,
             "skipped": 0.0, "entropy": mask[rows] * torch.arange(n)[rows, None], "nll": 0.3,
             "value_loss": 0.4, "critic_grad_norm": 2.0}
    update = UpdateStats(**{k: v for k, v in stats.items()
                            if k in {f.name for f in dataclasses.fields(UpdateStats)}})
    metrics = log_step(rollout, scores, rewards[rows], batch, update,
                       SimpleNamespace(group_size=2, mu=1, tis_cap=0.0),
                       {"rollout": 2.0, "scoring": 0.5, "update": 1.0})
    # PPO's: token returns, values and log-probs that differ from row to row and token to token
    grid = torch.arange(n * width, dtype=torch.float32).view(n, width)
    targets = Targets(grid, torch.sin(grid), torch.cos(grid) * 3, grid, grid % 7 - 3, mask,
                      float(mask.sum()))
    part = Targets(*(t[rows] for t in dataclasses.astuple(targets)[:-1]), targets.num_tokens)
    ended = torch.arange(n)[rows] % 3 != 1  # T-PPO scores only the rows that ended
    ppo = value_metrics(rollout, rewards[rows][ended], (rewards == 1)[rows][ended], part,
                        torch.sin(grid[rows]) - 0.1 * grid[rows] % 2, stats)
    return {**metrics, **{f"ppo:{k}": v for k, v in ppo.items()}}


def sharded_phases(out: Path) -> dict:
    """The phases that only generate or score, on the shipped warm start over this process's
    world: evaluation, sampling for labels, Math-Shepherd labelling, best-of-N and a reward
    model's step metrics. Returns what each computed, and the questions and prefixes each rank
    generated for (every rank's lists gathered)."""
    from configs.loader import BUNDLED
    from policy.generation import rollout
    from policy.evaluate import evaluate_policy
    from process_supervision import label, sampling
    from process_supervision.label import Labeller, label_in_shards
    from process_supervision.sampling import sample_solutions
    from reward_model import report
    from reward_model.examples import synthetic_step_examples
    from reward_model.score import TagScorer
    from runtime.data import load_splits
    from runtime.dist import gather_objects
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks.prompts import prompt_format
    from configs import load_config

    prompts: list[str] = []

    def counting(model, tokenizer, batch, group_size, **kwargs):
        prompts.extend(batch)
        return rollout.generate_groups(model, tokenizer, batch, group_size, **kwargs)

    for module in (sys.modules["policy.evaluate"], sampling, label, report):
        module.generate_groups = counting
    warm = BUNDLED / "tiny_warm_start"
    cfg = load_config("configs/tiny.yaml", [])
    model, tokenizer = load_causal_lm(warm).eval(), load_tokenizer(warm)
    fmt = prompt_format(cfg.data)
    records = load_splits(cfg.data, 0).eval[:8]
    torch.manual_seed(1234)  # (each chunk is seeded: what ran before must not matter)
    metrics = evaluate_policy(model, tokenizer, records, fmt, k=4, temperature=1.0,
                              max_new_tokens=112, batch_size=4, outcomes_path=out / "eval.json")
    solutions = sample_solutions(model, tokenizer, records[:6], fmt, 2, 112, 1.0,
                                 questions_per_batch=2, seed=5)
    labelled = label_in_shards(Labeller(model, tokenizer, fmt, 2, 112, 1.0, prefixes_per_batch=4),
                               solutions, out / "shards", shard_size=3, seed=7)
    scorer = TagScorer(model, tokenizer, "ки", 256, batch_size=4)
    steps = report.labelled_report(scorer, synthetic_step_examples(records, 3))
    best = report.best_of_n_report(model, tokenizer, records[:4], fmt, {"prm": (scorer, "prm")},
                                   "min", 4, 1.0, 112, questions_per_batch=2, seed=0)
    return {"eval": metrics, "solutions": [list(x.steps) for x in solutions],
            "labels": [[list(x.hard), list(x.soft)] for x in labelled], "rm": steps,
            "bon": best, "prompts_by_rank": gather_objects(prompts),
            "nonfinite": gather_objects(nonfinite_on_the_last_rank(cfg)),
            **stepwise_rows(out)}


def stepwise_rows(out: Path) -> dict:
    """A stepwise file read over the ranks (each checks its chunks): its rows, and the error
    every rank stops with when the bad row lies in another rank's chunk."""
    from process_supervision.formats import read_step_rows, to_math_shepherd
    from runtime.data import DataError
    from runtime.dist import barrier, gather_objects, is_main

    good, bad = out / "rows.jsonl", out / "bad.jsonl"
    if is_main():
        lines = [json.dumps(dict(zip(("input", "label"), to_math_shepherd(
            f"Q{i % 4}", [f"a{i}", f"b{i}"], [1, i % 2])))) for i in range(10)]
        good.write_text("\n".join(lines) + "\n")
        lines[7] = json.dumps({"input": "no tag here", "label": "no tag here"})
        bad.write_text("\n".join(lines) + "\n")
    barrier()
    rows, _ = read_step_rows(str(good), chunk_rows=3)
    try:
        read_step_rows(str(bad), chunk_rows=3)
        error = ""
    except DataError as err:
        error = str(err).replace(str(out), "OUT")
    return {"rows": [[list(ex.steps), list(ex.labels)] for ex in rows],
            "row_questions": rows.questions, "bad_row": gather_objects(error)}


def nonfinite_on_the_last_rank(cfg) -> str:
    """How each rank stops when only the last rank's loss is NaN (checked_backward)."""
    from runtime.dist import world
    from runtime.engine import build_engine, checked_backward

    rank, size = world()
    engine = build_engine(torch.nn.Linear(2, 1), cfg.deepspeed, lr=0.1, micro_batch_size=1,
                          grad_accum=1)
    loss = engine(torch.ones(1, 2)).sum() * (float("nan") if rank == size - 1 else 1.0)
    try:
        checked_backward(engine, loss, "check")
    except FloatingPointError as err:
        return f"rank {rank}: " + str(err).split(": ", 1)[1].split(";")[0]
    return f"rank {rank}: went on"


def vllm_ranks() -> dict:
    """Each rank's colocated vLLM engine (run in the vLLM venv): how it was launched, its seed,
    the same prompt sampled on every rank, and greedy completions after this rank pushed
    weights of its own (rank 1: noise added to the warm start's output layer)."""
    from configs import load_config
    from configs.loader import BUNDLED
    from policy.generation.rollout import generate_groups
    from iteration.resolve import resolve
    from policy.generation.vllm import engine_for, launch_settings
    from runtime.dist import gather_objects, world
    from runtime.models import load_causal_lm, load_tokenizer

    rank, _ = world()
    warm = BUNDLED / "tiny_warm_start"
    cfg = load_config("configs/tiny.yaml", ["rollout.backend=vllm", "rollout.kv_cache_gb=1"])
    engine = engine_for(resolve(cfg).stage.vllm, warm)
    tokenizer = load_tokenizer(warm)
    prompt = ["12+34*5-6=?\n"]
    sampled = generate_groups(engine, tokenizer, prompt, 8, max_new_tokens=40).texts
    model = load_causal_lm(warm)
    with torch.no_grad():  # this rank's own weights: rank 1 adds noise to the output layer
        noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight.add_(0.5 * rank * noise)
    engine.push(model)
    greedy = generate_groups(engine, tokenizer, prompt * 4, 1, max_new_tokens=40,
                             greedy=True).texts
    local = generate_groups(model, tokenizer, prompt * 4, 1, max_new_tokens=40,
                            greedy=True).texts
    return {"launch": gather_objects(launch_settings()),
            "seed": gather_objects(engine.made_for[1]["seed"]),
            "sampled": gather_objects(sampled), "greedy": gather_objects(greedy),
            "transformers_greedy": gather_objects(local)}


def zero3_push_stream() -> dict:
    """The weight stream a vLLM push draws from a ZeRO-3 engine (`iter_weights` gathering a
    module at a time through `module_gather`) over this process's world, for the shipped warm
    start whole and under a LoRA adapter whose B is random (seeded alike on every rank): its
    keys, those whose tensor differs from the whole model's merged weights in this process
    before partitioning, the most parameter values made whole at once beyond what ZeRO-3 keeps
    whole anyway (its small persistent parameters), the model's largest module (a LoRA layer
    with its adapter), and all of its values."""
    from peft.tuners.lora import LoraLayer

    from configs import load_config
    from configs.loader import BUNDLED
    from configs.schema import LoraConfig
    from iteration.resolve import resolve
    from runtime.engine import build_engine, module_gather
    from runtime.lora import LoraSettings, iter_weights, merged_weights, save_adapter, with_adapter
    from runtime.models import load_causal_lm
    from safetensors.torch import load_file

    ds = resolve(load_config("configs/tiny.yaml", ["deepspeed.zero_stage=3"])).stage.deepspeed
    result = {}
    for kind in ("full", "lora"):
        model = load_causal_lm(BUNDLED / "tiny_warm_start", train=True)
        if kind == "lora":
            torch.manual_seed(0)  # A's initialisation, alike on every rank (as a stage seeds)
            model = with_adapter(model, LoraSettings.of(LoraConfig(rank=4, alpha=8.0)))
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        reference = {k: v.clone() for k, v in merged_weights(model).items()}
        adapter = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" in k}
        largest = max(sum(p.numel() for p in m.parameters(recurse=isinstance(m, LoraLayer)))
                      for m in model.modules())
        engine = build_engine(model, ds, lr=1e-3, micro_batch_size=1, grad_accum=1)
        params = list(engine.module.parameters())

        def whole() -> int:  # a partitioned ZeRO-3 parameter holds no values (numel 0)
            return sum(p.numel() for p in params)

        kept, keys, differ, most = whole(), [], [], 0
        for key, tensor in iter_weights(engine.module, module_gather(engine)):
            most = max(most, whole() - kept)
            keys.append(key)
            if not torch.equal(tensor, reference[key]):
                differ.append(key)
        if kind == "lora":  # `rollout.lora_push=adapter`: the adapter alone, as peft saves it
            folder = Path(tempfile.mkdtemp())
            save_adapter(engine.module, folder, module_gather(engine))
            differ += adapter_differs(adapter, load_file(folder / "adapter_model.safetensors"))
        result[kind] = {"keys": keys, "reference_keys": list(reference), "differ": differ,
                        "most_whole": most, "largest_module": largest,
                        "total": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
                        "partitioned": kept < sum(int(p.ds_numel) for p in params)}
        del engine
    return result


def adapter_differs(adapter: dict, saved: dict) -> list[str]:
    """The adapter tensors (a peft model's `lora_` state-dict entries) that peft's saved file
    lacks or holds otherwise (it names them without the adapter's name, `default`); and
    "adapter: none saved" where it holds none."""
    named = {k.replace(".default", ""): v for k, v in adapter.items()}
    out = [k for k, v in named.items() if k not in saved or not torch.equal(saved[k], v)]
    return out + (["adapter: none saved"] if not saved else [])


def perturb_gradients(ulps: float) -> None:
    """Before every optimizer step, add to each gradient tensor noise of `ulps` float32 units in
    the last place of its RMS (seeded by the rank): what another reduction order (more ranks,
    other kernels) may change. Comparisons of weights across process counts must hold under it
    on any CPU."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    noise = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    ulp = torch.finfo(torch.float32).eps

    def perturb(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.grad.numel():
                    rms = param.grad.float().pow(2).mean().sqrt()
                    param.grad.add_(torch.randn(param.grad.shape, generator=noise)
                                    .to(param.grad) * rms * ulp * ulps)

    register_optimizer_step_pre_hook(perturb)


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    from configs import load_config
    from runtime.dist import gather_objects, init_distributed, is_main, world
    from runtime.tracking import MetricsLogger

    torch.set_num_threads(1)
    if os.environ.get("DIST_CHECK_GRAD_ULPS"):
        perturb_gradients(float(os.environ["DIST_CHECK_GRAD_ULPS"]))
    if kind == "world":  # what a stage sees when nothing initialised the process group
        out.mkdir(parents=True, exist_ok=True)
        (out / f"world-rank{os.environ['RANK']}.txt").write_text(repr(world()))
        return
    init_distributed()
    if kind == "metrics":
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(step_metrics()))
        return
    if kind == "vllm":
        out.mkdir(parents=True, exist_ok=True)
        result = vllm_ranks()
        if is_main():
            (out / "vllm.json").write_text(json.dumps(result))
        return
    if kind == "push":
        out.mkdir(parents=True, exist_ok=True)
        result = gather_objects(zero3_push_stream())
        if is_main():
            (out / "push.json").write_text(json.dumps(result))
        return
    if kind == "shards":
        out.mkdir(parents=True, exist_ok=True)
        result = sharded_phases(out)
        if is_main():
            (out / "shards.json").write_text(json.dumps(result))
        return
    rank, _ = world()
    base, stage = sys.argv[3], sys.argv[4]
    overrides = [f"run.root={out}", f"deepspeed.zero_stage={stage}"]
    logger = MetricsLogger(out / "metrics.jsonl", config={}, mode="disabled", project="",
                           name="", enabled=is_main())
    torch.manual_seed(0)
    if kind == "ppo":  # PPO with its critic, process rewards at the steps' last tokens
        from iteration.resolve import resolve
        from runtime.data import load_splits

        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides, "ppo.critic_lr=1e-3"],
                          recipe="ppo")
        splits = load_splits(cfg.data, 0)
        resolve(cfg).train_policy(out, base, ChunkStepReward(), splits.rl, splits.eval, logger, "")
    elif kind in ("gspo", "dpo", "online_dpo"):  # the recipe, sampled at temperature 1
        from iteration.resolve import resolve
        from runtime.data import load_splits

        # DPO: a second step, whose reference (the starting policy) differs from the policy.
        # At lr 1e-2 AdamW's eps bounds how far a gradient's rounding can move a weight (lr/eps
        # per unit, `deepspeed.adam_eps`): 10 here, 1e6 at the default 1e-8, where another
        # reduction order's last bits on a near-zero gradient move it by ~lr.
        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides, "policy.mu=1",
                                                "policy.temperature=1.0", "policy.rollout_questions=1",
                                                "policy.lr=1e-2", "deepspeed.adam_eps=1e-3",
                                                f"policy.steps={1 + ('dpo' in kind)}", *sys.argv[5:]],
                          recipe=kind)
        splits = load_splits(cfg.data, 0)
        resolve(cfg).train_policy(out, base, ChunkStepReward(), splits.rl, splits.eval, logger, "")
    elif kind in ("grpo-online", "grpo-online-lora", "grpo-implicit", "grpo-prime"):
        # learning from its samples (the ORM whole, or under a LoRA adapter)
        from iteration.resolve import make_reward, resolve
        from runtime.data import load_splits
        from runtime.models import load_tokenizer

        # Adam's eps bounds what a gradient's last bits can move a weight (see gspo above).
        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides, *ONLINE, *{
            "grpo-implicit": IMPLICIT, "grpo-prime": PRIME,
            "grpo-online-lora": ["rm.lora.rank=4", "rm.lora.alpha=8"]}.get(kind, []),
                                                  *sys.argv[5:]])
        w = resolve(cfg)
        splits = load_splits(cfg.data, 0)
        w.train_policy(out, base, make_reward(w, load_tokenizer(base, w.stage.model), "rm",
                                              online_init=base, online_reference=base),
                       splits.rl, splits.eval, logger, "")
    elif kind == "grpo":
        from iteration.resolve import resolve
        from policy.algorithms import grpo as grpo_module
        from policy.math.losses import POLICY_LOSSES
        from runtime.data import load_splits

        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides, *sys.argv[5:]])
        spec = POLICY_LOSSES["grpo"]
        seen = []

        def recording(logprobs, old, ref, advantages, mask, **kw):
            seen.append(advantages.detach().clone())
            return spec.fn(logprobs, old, ref, advantages, mask, **kw)

        POLICY_LOSSES["grpo"] = dataclasses.replace(spec, fn=recording)
        splits = load_splits(cfg.data, 0)
        reward = ChunkStepReward()
        if cfg.rm.ensemble > 1:  # two members that disagree on some steps, by their aggregate
            from reward_model.ensemble import EnsembleReward
            from reward_model.losses import STEP_AGGREGATORS

            reward = EnsembleReward([ChunkStepReward(shift) for shift in range(cfg.rm.ensemble)],
                                    cfg.rm.ensemble_aggregate, cfg.rm.ensemble_lambda,
                                    STEP_AGGREGATORS["min"])
        grpo_module.train_grpo(resolve(cfg).stage, resolve(cfg).method, out, base, reward,
                               splits.rl, splits.eval, logger, "")
        first_update = seen[:len(seen) // cfg.policy.mu]  # the same tensors again for update 2
        torch.save(torch.cat(first_update), out / f"advantages-rank{rank}.pt")
    else:
        from iteration.resolve import resolve
        from process_supervision.formats import read_step_rows
        from reward_model.train import train_reward_model

        cfg = load_config("configs/tiny.yaml", [*RM, *overrides, *sys.argv[6:]])
        examples, _ = read_step_rows(sys.argv[5])
        train_reward_model(resolve(cfg).rm, out / "rm", base, examples, logger, "")


if __name__ == "__main__":
    from runtime.dist import finish_process

    main()
    finish_process(0)  # as the CLI ends: a rank that finished its work exits with 0
