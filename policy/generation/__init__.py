"""The generation engines: the decoding loop every `hf` rollout runs (rollout.py), the packed
log-probs of the update (logprobs.py) and the colocated vLLM engine (vllm.py). Everything that
samples from a policy (GRPO's rollout, evaluation, Math-Shepherd labelling, best-of-N) goes
through `rollout.generate_groups`."""
