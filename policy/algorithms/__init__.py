"""The policy algorithms, one self-contained loop per file, and the table the CLI and the outer
loop choose them from (`policy.algorithm`). Each file imports the shared sampling room (policy/sampling.py),
the critic (policy/actor_critic.py: the value-based ones), the math (policy/math/) and the
generation engines (policy/generation/); none imports another algorithm. Adding an algorithm
is one file and one entry below.

Every trainer has train_grpo's contract: (stage, spec, run_path, policy_path, reward_fn,
rl_records, eval_records, logger, config_yaml, out_name=<its folder>, reference_path=None,
evaluate_ends=True) -> the folder of the final export (`<run_path>/<out_name>/final`), where
`stage` is the `PolicyStage` and `spec` the method's own object (policy/stage.py), both made
once from the config by iteration/resolve.py. SFT (sft.py) trains the warm start and has its own.
"""

from __future__ import annotations

from policy.algorithms.dpo import train_dpo
from policy.algorithms.grpo import train_grpo
from policy.algorithms.offline_rft import train_offline_rft
from policy.algorithms.ppo import train_ppo
from policy.algorithms.tppo import train_tppo

TRAINERS = {
    "dpo": train_dpo,
    "grpo": train_grpo,
    "offline_rft": train_offline_rft,
    "online_dpo": train_dpo,
    "ppo": train_ppo,
    "t_ppo": train_tppo,
}
"""`policy.algorithm` -> its trainer (iteration/resolve.py pairs it with the method's spec)."""
