"""A LoRA policy handed to vLLM as an adapter (`rollout.lora_push=adapter`), in a process of its
own (a process holds one vLLM engine, made here with vLLM's LoRA support on):

    python tests/helpers/vllm_adapter.py OUT      (in the vLLM venv)

Writes OUT/adapter.json: greedy completions of 32 held-out prompts from the engine before and
after the adapter of k = 3 SFT steps was pushed, and plain transformers' on the merged export;
then two GRPO steps of a LoRA policy sampled under its pushed adapters, with truncated
importance sampling: their metrics rows, and which weights its export moved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

LORA = ["rollout.backend=vllm", "rollout.kv_cache_gb=1", "model.lora.rank=8",
        "model.lora.alpha=16", "rollout.lora_push=adapter"]


def greedy_rows(model, tokenizer, prompts) -> list[list[int]]:
    from policy.generation.rollout import generate_groups

    r = generate_groups(model, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    return [r.completion_ids[i][r.completion_mask[i].bool()].tolist() for i in range(len(prompts))]


def pushed_adapter(out: Path) -> dict:
    """The engine's greedy completions under no adapter, under the SFT-stepped adapter, and
    transformers' on the merged export."""
    from configs import load_config
    from configs.schema import LoraConfig
    from iteration.resolve import resolve
    from policy.generation.vllm import engine_for
    from runtime.checkpoint import save_pretrained
    from runtime.lora import LoraSettings, with_adapter
    from runtime.models import load_causal_lm
    from test_vllm import _held_out_prompts, _sft_steps

    cfg = load_config("configs/tiny.yaml", LORA)
    path = cfg.model.policy_path
    engine = engine_for(resolve(cfg).stage.vllm, path)
    tokenizer, fmt, splits, prompts = _held_out_prompts(cfg)
    model = with_adapter(load_causal_lm(path, cfg.model, train=True),
                         LoraSettings.of(LoraConfig(rank=8, alpha=16)))
    before = greedy_rows(engine, tokenizer, prompts)
    _sft_steps(model, tokenizer, splits, fmt, lr=1e-2)
    engine.push_adapter(model)
    ours = greedy_rows(engine, tokenizer, prompts)
    merged = load_causal_lm(save_pretrained(model, tokenizer, out / "merged"), cfg.model)
    return {"before": before, "adapter": ours, "transformers": greedy_rows(merged, tokenizer,
                                                                           prompts),
            "files": sorted(p.name for p in Path(engine.adapter.lora_path).iterdir())}


def grpo_under_the_adapter(out: Path) -> dict:
    from configs import load_config
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.models import load_causal_lm
    from runtime.tracking import MetricsLogger, read_metrics

    cfg = load_config("configs/tiny.yaml", [
        *LORA, f"run.root={out}", "policy.steps=2", "policy.questions_per_step=2",
        "policy.group_size=8", "policy.supervision=outcome", "policy.lr=1e-3",
        "policy.eval_every=0", "run.wandb_mode=disabled", "inspect.every=0",
        "policy.tis_cap=2.0"])
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(out / "m.jsonl", config={}, mode="disabled", project="", name="")
    start = cfg.model.policy_path
    final = resolve(cfg).train_policy(out / "grpo", start, RuleReward(), splits.rl, splits.eval,
                                      logger, "", evaluate_ends=False)
    rows = [r for r in read_metrics(out / "m.jsonl") if "train/loss" in r]
    before, after = load_causal_lm(start).state_dict(), load_causal_lm(final).state_dict()
    return {"rows": rows, "moved": sorted(k for k in after if not torch.equal(before[k],
                                                                                after[k]))}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result = {"push": pushed_adapter(out), "grpo": grpo_under_the_adapter(out)}
    (out / "adapter.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
