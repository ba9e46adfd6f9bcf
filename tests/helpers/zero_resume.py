"""Every stage's training state under every ZeRO stage, fp32 and bf16, saved and loaded back into
fresh engines: run under `torchrun`, tests/test_zero_stages.py reads what it writes.

    torchrun --nproc_per_node 2 tests/helpers/zero_resume.py OUT BASE KIND[,KIND...] PRECISION[,...]

For each stage kind (sft, rm, grpo, ppo: PPO with its critic, grpo_online, grpo_implicit and
grpo_prime: GRPO with its online ORM, implicit PRM, or the implicit PRM in PRIME's order;
grpo_lora, sft_lora and ppo_lora: those stages of a LoRA policy; rm_lora: a LoRA token classifier) and
ZeRO stage 0-3, the stage runs twice from the same base model: straight through its 2 optimizer steps, and with a crash raised
right after the state of step 1 is saved, then called again, which builds every engine afresh,
loads that state and takes step 2. Each run's final export lands in
OUT/<precision>/<kind>-z<stage>-<mode>/, and OUT/<precision>/<kind>-z<stage>.json records both
runs' logged rows and the step the second call of the crashed run started from.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from dist_check import GRPO, IMPLICIT, ONLINE, PRIME, RM, ChunkStepReward  # noqa: E402

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "policy.lr=1e-3", "sft.lr=1e-3"]
STEPS = {  # overrides that make each stage 2 optimizer steps, saved after each
    "sft": ["sft.epochs=0.5", "sft.batch_size=16", "sft.eval_every=1", "data.val_questions=4",
            "eval.max_new_tokens=6", "deepspeed.micro_batch_size=4"],
    "rm": ["rm.epochs=2", "rm.save_every=1", "rm.lm_weight=0"],  # tag rows alone, as on GPUs
    "grpo": ["policy.steps=2", "policy.save_every=1", "policy.mu=1", "policy.temperature=1.0",
             "policy.rollout_questions=1"],
    "ppo": ["policy.steps=2", "policy.save_every=1", "policy.mu=1", "ppo.critic_lr=1e-3"],
    "grpo_online": ["policy.steps=2", "policy.save_every=1", *ONLINE],
    "grpo_implicit": ["policy.steps=2", "policy.save_every=1", *ONLINE, *IMPLICIT],
    "grpo_prime": ["policy.steps=2", "policy.save_every=1", *ONLINE, *PRIME],
    "grpo_lora": ["policy.steps=2", "policy.save_every=1", "policy.mu=1", "policy.temperature=1.0",
                  "policy.rollout_questions=1", *LORA],
    "sft_lora": ["sft.epochs=0.5", "sft.batch_size=16", "sft.eval_every=1",
                 "data.val_questions=4", "eval.max_new_tokens=6", "deepspeed.micro_batch_size=4",
                 "sft.export_final=true", "sft.lr_decay=false", *LORA],
    "ppo_lora": ["policy.steps=2", "policy.save_every=1", "policy.mu=1", "ppo.critic_lr=1e-3",
                 *LORA],
    "grpo_online_lora": ["policy.steps=2", "policy.save_every=1", *ONLINE, "rm.lora.rank=4",
                         "rm.lora.alpha=8"],
    "rm_lora": ["rm.epochs=2", "rm.save_every=1", "rm.lm_weight=0", "rm.lr=1e-3",
                "rm.family=token_classification", "rm.likelihood_feature=false",
                "rm.extra_layers_from=[]", "rm.lora.rank=4", "rm.lora.alpha=8"],
}
PRECISION = {"fp32": [], "bf16": ["deepspeed.bf16=true", "model.dtype=bfloat16"]}


class Crash(RuntimeError):
    """Raised right after a state is saved: the process dies there, as a SIGKILL would."""


def run_stage(kind: str, out: Path, base: str, overrides: list[str], logger) -> Path:
    from configs import load_config
    from runtime.data import load_splits

    torch.manual_seed(0)
    if kind in ("sft", "sft_lora"):
        from iteration.resolve import resolve
        from policy.algorithms.sft import train_sft

        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides])
        splits = load_splits(cfg.data, 0)
        return train_sft(resolve(cfg).stage, cfg.sft, out, base, splits.sft[:64], splits.val,
                         logger, "")
    if kind in ("rm", "rm_lora"):
        from iteration.resolve import resolve
        from process_supervision.formats import StepExample
        from reward_model.train import train_reward_model

        cfg = load_config("configs/tiny.yaml", [*RM, *overrides])
        examples = [StepExample(f"Start with {i}. Add 1.", (f"Add 1: {i}+1={i + 1 + i % 2}",
                                                             f"The answer is {i + 1 + i % 2}"),
                                (float(i % 2 == 0),) * 2, f"row{i}") for i in range(8)]
        return train_reward_model(resolve(cfg).rm, out / "rm", base, examples, logger, "")
    from iteration.resolve import make_reward, resolve

    if kind in ("grpo_online", "grpo_online_lora", "grpo_implicit", "grpo_prime"):
        # two engines resume
        from runtime.models import load_tokenizer

        w = resolve(load_config("configs/tiny.yaml", [*GRPO, *overrides]))
        splits = load_splits(w.data, 0)
        reward = make_reward(w, load_tokenizer(base, w.stage.model), "rm", online_init=base,
                             online_reference=base)
        return w.train_policy(out, base, reward, splits.rl, splits.eval, logger, "")
    cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides],
                      recipe="ppo" if kind.startswith("ppo") else None)
    splits = load_splits(cfg.data, 0)
    return resolve(cfg).train_policy(out, base, ChunkStepReward(), splits.rl, splits.eval, logger, "")


def main() -> None:
    from runtime import training
    from runtime.dist import init_distributed, is_main
    from runtime.tracking import MetricsLogger, read_metrics

    root, base, kinds, precisions = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    init_distributed()
    save = training.StageLoop.save
    crash_after = {"step": None}

    def saving(trainer) -> None:
        save(trainer)
        if trainer.step == crash_after["step"]:
            raise Crash(f"crashed after saving step {trainer.step}")

    training.StageLoop.save = saving
    init = training.StageLoop.__init__
    started_at = []  # the step each StageLoop starts from (a resumed one: its saved step)

    def starting(trainer, *args, **kwargs) -> None:
        init(trainer, *args, **kwargs)
        started_at.append(trainer.step)

    training.StageLoop.__init__ = starting
    for precision, kind in ((p, k) for p in precisions.split(",") for k in kinds.split(",")):
        out = root / precision
        for stage in (0, 1, 2, 3):
            rows = {}
            for mode in ("straight", "resumed"):
                folder = out / f"{kind}-z{stage}-{mode}"
                overrides = [*STEPS[kind], *PRECISION[precision], f"run.root={folder}",
                             f"deepspeed.zero_stage={stage}", "run.threads=1"]

                def logger():
                    return MetricsLogger(folder / "metrics.jsonl", config={}, mode="disabled",
                                         project="", name="", enabled=is_main())

                crash_after["step"] = 1 if mode == "resumed" else None
                try:
                    run_stage(kind, folder, base, overrides, logger())
                    assert mode == "straight", "the crash was not reached"
                except Crash:
                    crash_after["step"] = None
                    del started_at[:]
                    run_stage(kind, folder, base, overrides, logger())
                    rows["resumed_from"] = started_at[-1]  # (PPO: the critic pretrains none)
                if is_main():
                    rows[mode] = read_metrics(folder / "metrics.jsonl")
            if is_main():
                (out / f"{kind}-z{stage}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    from runtime.dist import finish_process

    main()
    finish_process(0)  # as the CLI ends: a rank that finished its work exits with 0
