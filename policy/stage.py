"""What a policy stage is handed: the config's strings already turned into objects, once, at
start-up (`iteration/resolve.py`). A loop reads these and its explicit arguments, never the
config, so each function's signature says what it depends on.

    stage = PolicyStage(seed, policy, model, deepspeed, vllm, prompts, evaluation, shaping,
                        inspect)
    train_grpo(stage, GRPOSpec(...), run_path, policy_path, reward_fn, ...)

`PolicyStage` is what every method reads (the shared `policy` section, the model and its
engines, the sampler, the evaluator, the reward shaping); each method's own object is its spec:
`GRPOSpec` (the advantage estimator, the loss, the normaliser, the batch filters), `PPOSpec`,
`RFTSpec`; DPO's only settings are shared ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from configs.schema import (DeepSpeedConfig, InspectConfig, ModelConfig, PolicyConfig, PPOConfig,
                            WatchConfig)
from policy.math.advantages import GroupNorm, ProcessCredit
from policy.math.losses import LossOutput


@dataclass(frozen=True)
class Shaping:
    """What happens to a sample's reward before the advantages (every method): DAPO's soft
    overlong punishment (`overlong_buffer` tokens before the limit, up to `overlong_penalty`;
    0 tokens = off), the shuffled-reward control and the gold budget."""
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    shuffle: bool = False
    gold_share: float = 1.0
    """The gold budget (`grpo.gold_share`): the share of questions whose final-answer check the
    reward may read (`Scores.revealed`); 1: every question."""
    gold_seed: int = 0
    """The run seed the gold budget's draw is made from."""


@dataclass(frozen=True)
class Evaluation:
    """The held-out evaluation a stage runs (`eval` section): maj@k / pass@k over `k` samples
    at `temperature`, `batch_size` prompts per generate call; `step_oracle` grades steps where
    the task knows them (synthetic), split on `step_separator`."""
    k: int
    temperature: float
    max_new_tokens: int
    batch_size: int
    timeout_s: int
    seed: int
    step_oracle: Callable | None
    step_separator: str


@dataclass(frozen=True)
class VLLMSettings:
    """A colocated vLLM engine (`rollout.backend=vllm`): long enough for a prompt, the policy's
    solution and the longest continuation any stage asks for (`longest_new_tokens`)."""
    dtype: str
    trust_remote_code: bool
    max_prompt_tokens: int
    policy_new_tokens: int
    longest_new_tokens: int
    seed: int
    memory_fraction: float
    kv_cache_gb: float
    prefix_caching: bool
    sleep: bool
    cuda_graphs: bool
    lora_rank: int = 0
    """`rollout.lora_push=adapter`: the LoRA policy's rank, served by vLLM as an adapter (0:
    pushed merged, or no LoRA)."""


@dataclass(frozen=True)
class PolicyStage:
    """Everything a policy method reads besides its own spec."""
    seed: int
    policy: PolicyConfig
    model: ModelConfig
    deepspeed: DeepSpeedConfig
    vllm: VLLMSettings | None
    """None: the training module samples (`rollout.backend=hf`)."""
    prompts: object
    """The prompt format (`tasks.prompts.PromptFormat`)."""
    evaluation: Evaluation
    shaping: Shaping
    inspect: InspectConfig
    watch: WatchConfig
    question_offset: int = 0
    """Steps of the RL question stream that earlier stages of the run drew: step s of this stage
    draws the stream's step `question_offset + s`, so the outer loop's iterations walk on
    through the RL split instead of redrawing iteration 1's questions."""
    init_path: str | None = None
    """The run's starting policy (the outer loop's warm start), against which `watch/kl_init`
    measures across reference resets; None: the stage's own starting policy."""


@dataclass(frozen=True)
class GRPOSpec:
    """GRPO's objective: how a step's rewards become token advantages and a loss.

    `credit` (process supervision) or `estimator` (outcome, online RFT) makes the advantages
    under `norm` (whose `scale_by_std` is decided once: the `grpo.scale_by_std` key and the
    loss's own convention); `loss` is the policy loss (`POLICY_LOSSES`). The batch filters:
    DAPO's dynamic sampling (`filter_groups`: groups without signal leave the loss, and up to
    `dynamic_rounds` extra rounds refill the step) and overlong filter, GPG's zero-group
    correction, C3PO's token budget (tokens per step; None = off), and the zero-advantage
    control. `supervision` names the reward's form for what the inspection shows. The loss's
    scalars: the KL weight `beta`, the clip range [1 - clip_low, 1 + clip_high], Dr. GRPO's
    constant length `max_tokens`, and the truncated importance-sampling cap `tis_cap`."""
    loss: Callable[..., LossOutput]
    norm: GroupNorm
    beta: float = 0.04
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_tokens: int = 1024
    estimator: Callable | None = None
    credit: ProcessCredit | None = None
    process_weight: float = 0.5
    filter_groups: bool = False
    dynamic_rounds: int = 0
    overlong_filter: bool = False
    zero_group_correction: bool = False
    token_budget: int | None = None
    zero_advantages: bool = False
    supervision: str = "outcome"
    tis_cap: float = 0.0
    """Truncated importance sampling: the cap on pi_old / pi_sampler (0 = off;
    `policy/math/losses.py` `truncated_importance_weights`)."""

    @property
    def per_step(self) -> bool:
        """Process supervision: the reward scores every step."""
        return self.credit is not None


@dataclass(frozen=True)
class PPOSpec:
    """The value-based methods (PPO, VC-PPO, VAPO, T-PPO): the clipped surrogate `loss`, step
    rewards placed at each step's end (`per_step`) or the outcome at the last token, the `ppo`
    section, and whether the critic starts from the reward model (else from the policy)."""
    loss: Callable[..., LossOutput]
    per_step: bool
    settings: PPOConfig
    critic_from_reward_model: bool = False


@dataclass(frozen=True)
class RFTSpec:
    """Offline RFT: the share of `policy.max_minutes` its sampling may spend."""
    sampling_share: float = 0.5


@dataclass(frozen=True)
class DPOSpec:
    """DPO: pairs from the starting policy's samples once (`online` False) or from the current
    policy's every step; its beta is `policy.beta`."""
    online: bool = False
