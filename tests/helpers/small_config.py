"""Overrides that shrink configs/tiny.yaml to seconds: a 1-layer, 32-wide model, few questions."""

SMALL = [
    "model.policy_path=", "sft.enabled=true",  # build the small model, train its SFT stage
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64", "data.sft_questions=64", "data.rl_questions=256",
    "data.eval_questions=8", "data.val_questions=8", "sft.batch_size=16", "sft.epochs=0.5",
    "sft.eval_every=1",
    "deepspeed.micro_batch_size=8", "policy.steps=2", "policy.questions_per_step=2",
    "policy.group_size=4", "policy.max_new_tokens=12", "eval.max_new_tokens=12", "eval.k=2",
    "run.threads=2", "rm.extra_layers_from=[0]", "rm.worked_solutions=8",
    "iterate.refresh_worked_solutions=0",
]

ITERATE = [
    "policy.eval_every=0", "label.questions=6", "label.samples_per_question=2",
    "label.num_completions=2", "label.max_new_tokens=12", "rm.epochs=1", "rm.batch_size=8",
    "rm.eval_solutions=8", "rm.bon_questions=4", "rm.bon_samples=4", "policy.supervision=process",
    "iterate.iterations=2", "iterate.replay_fraction=0.25", "run.wandb_mode=disabled",
]
