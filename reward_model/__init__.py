"""Outcome and process reward models: causal LMs read at step tags (Math-Shepherd format),
their training loop, batched scorers for the GRPO loop, and evaluation."""
