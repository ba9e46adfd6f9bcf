"""The policy: rollout, advantages, GRPO losses and loop, SFT warm start, evaluation.

Imports only `runtime/` and `configs/`: rewards come in as callables (policy.rewards.RewardFn).
"""
