"""Runtime shared by every stage: data and grading, the tiny offline model, DeepSpeed engines,
run folders and metrics. Heavy libraries (deepspeed, wandb, transformers) load where used."""
