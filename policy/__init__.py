"""The policy, one room per concern:

    algorithms/      one loop per algorithm (grpo, ppo, tppo, dpo, offline_rft, sft) and TRAINERS
    stage.py         what a loop is handed: PolicyStage and each method's spec (GRPOSpec, ...)
    sampling.py      engines, the sampler, the seeded rollout, scoring, the evaluator
    supervised.py    supervised fine-tuning's tensors and step (SFT, offline RFT)
    batch.py         a step's StepBatch and its mini-batches
    actor_critic.py  the value-based family's critic, targets and actor step (ppo, tppo)
    math/            advantages, losses, reward shaping, value: pure functions over tensors
    generation/      the decoding loop, packed log-probs, the vLLM engine
    rewards.py       the reward contract (RewardFn) and the rule reward
    evaluate.py      held-out greedy, mean@k, maj@k, pass@k; inspection.py: per-step advantages

Imports only `tasks/`, `runtime/` and `configs/`: rewards come in as callables
(policy.rewards.RewardFn), settings as objects (policy.stage), never the whole config.
"""
