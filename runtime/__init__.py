"""Runtime shared by every stage: data loading and splits, seeds (`seeds.derive_seed`), the tiny
offline model, DeepSpeed engines, the stage loop (`training.StageLoop`) and its checkpoints, run
folders and metrics. The task itself (problems, prompts, grading) is in `tasks/`. Heavy
libraries (deepspeed, wandb, transformers) load where used."""
