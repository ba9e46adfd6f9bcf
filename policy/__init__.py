"""The policy, one room per concern:

    algorithms/   one loop per algorithm (grpo, ppo, tppo, offline_rft, sft) and TRAINERS
    kit.py        the stage kit they share: engines, sampler, seeded rollout, scoring, evaluator
    critic.py     the value model and its targets (ppo, tppo)
    math/         advantages, losses, value: pure functions over tensors
    generation/   the decoding loop, packed log-probs, the vLLM engine
    rewards.py    the reward contract (RewardFn) and the rule reward
    evaluate.py   held-out greedy, mean@k, maj@k, pass@k; inspection.py: per-step advantages

Imports only `runtime/` and `configs/`: rewards come in as callables (policy.rewards.RewardFn).
"""
