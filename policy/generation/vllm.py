"""Rollout on vLLM (`rollout.backend=vllm`): a colocated engine in the training process that
samples from the policy's current weights.

`VLLMEngine` holds an in-process `vllm.LLM` (V1 multiprocessing off, so the engine's worker lives
in this process and `collective_rpc` reaches it). Weights reach it without a disk round-trip:
`push(model)` streams the training model's HF-named tensors into the live engine
(`model_runner.reload_weights`); the model's own `load_weights` is not used because the CPU backend
re-lays out its weights after loading. Prompts go in as token ids encoded exactly as the `hf`
backend encodes them, and completions come back as token ids, so a `Rollout` is the same object
whichever backend made it; `generate_groups(engine, ...)` in policy/generation/rollout.py
dispatches here.

What vLLM's sampler returns never reaches the loss: the loss's log-probs are recomputed by the
training model. The log-probs vLLM reports for its sampled tokens (`Rollout.sampler_logprobs`)
serve only the drift check `rollout/logprob_diff` (mean |vLLM - training| over completion
tokens).

Memory is ordered so that vLLM's KV pool is never mapped beside another large user of the GPU
(docs/rollout.md, "Sleep and wake"): the engine sleeps (`sleep`, vLLM's level 2) at the end of
every generation phase, before a gather of the ZeRO-3 policy, scoring, reward-model training or
an update; a push wakes only the weights, and a generation wakes the KV cache. An engine that
slept while holding a checkpoint reloads it from disk when next asked to generate.

Tested vLLM versions: `TESTED_VLLM` (pyproject's `vllm` extra); the engine checks the installed
one when it is made.

A process holds one engine (`engine_for`), which every stage reuses: vLLM keeps its parallel
state in module globals, and an engine's shutdown tears it down, torch.distributed's process group
included, under any other engine and under the training engine (on a GPU each engine would also
claim its own memory share). A stage over another checkpoint of the
same architecture loads that checkpoint's weights into the engine (`load`); another architecture
or other settings (dtype, memory) are refused with an error naming them, since replacing the
engine would shut the first one down.

Sampling is seeded once, when the engine starts (per-request seeds fail on the CPU backend), so a
resumed run samples from a fresh engine state: with `vllm`, resume redoes nothing finished but is
not bitwise identical to an uninterrupted run (the `hf` backend is).
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import time
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from configs.schema import VLLM_LORA_RANKS
from policy.generation.rollout import Rollout, mask_after_eos
from policy.stage import VLLMSettings
from runtime.lora import iter_weights, save_adapter
from runtime.models import end_token_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The vLLM versions this project is tested on (pyproject.toml's `vllm` extra pins the same range;
# docs/rollout.md has the lock set): the CPU build's 0.32 in `make test`. Below the floor the
# in-memory push cannot be called (its `weights_iterator` arrived with vLLM's layerwise reload).
TESTED_VLLM = ">=0.32,<0.33"


def check_vllm(version: str, reload_weights=None) -> None:
    """Refuse a vLLM below `TESTED_VLLM` or whose model runner's `reload_weights` takes no
    `weights_iterator` (the push would fail at the first optimizer step), warn above it; the
    message names the installed version and the tested range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    release = Version(Version(version).base_version)
    tested = SpecifierSet(TESTED_VLLM)
    takes_iterator = reload_weights is None or \
        "weights_iterator" in inspect.signature(reload_weights).parameters
    floor = min(Version(s.version) for s in tested if s.operator == ">=")
    if release < floor or not takes_iterator:
        raise RuntimeError(
            f"rollout.backend=vllm: vLLM {version} is installed; this project pushes weights "
            f"with the model runner's reload_weights(weights_iterator=...), tested on vLLM "
            f"{TESTED_VLLM}: pip install -e '.[vllm]' (docs/rollout.md)")
    if release not in tested:
        warnings.warn(f"rollout.backend=vllm: vLLM {version} is installed, outside the tested "
                      f"range {TESTED_VLLM} (docs/rollout.md)", stacklevel=2)


def sleep_mode_supported() -> bool:
    """vLLM's sleep mode needs CUDA (its allocator maps and unmaps device memory)."""
    return torch.cuda.is_available()


def _installed_vllm() -> tuple[str, object]:
    """The installed vLLM's version and its model runner's `reload_weights` (None where that
    module does not import here)."""
    import vllm

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        reload_weights = GPUModelRunner.reload_weights
    except (ImportError, AttributeError):
        reload_weights = None
    return vllm.__version__, reload_weights


def colocated_llm_class(needed_by: str):
    """vLLM's `LLM`, set up to run in this process beside training (V1 multiprocessing off, so
    its worker is in this process and is handed this process's tensors; the CPU backend's
    thread pinning off, so the training code keeps its threads), its version checked;
    `needed_by` names the setting that asked for it where vLLM is missing."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                      f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}; the colocated "
                      "engine needs it 0 (the push hands it this process's tensors): set to 0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # In-process on the CPU backend, vLLM would pin this process's OpenMP threads: the
    # training code shares them, so the threads stay as run.threads set them.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        from vllm import LLM
    except ImportError as err:
        raise ImportError(f"{needed_by} needs vLLM: pip install -e '.[vllm]' "
                          "(README: Rollout on vLLM)") from err
    check_vllm(*_installed_vllm())
    return LLM


class VLLMEngine:
    """A vLLM engine over `model_path` for sampling G completions per prompt."""

    def __init__(self, model_path: str | Path, *, dtype: str, max_model_len: int, seed: int,
                 gpu_memory_fraction: float = 0.3, kv_cache_gb: float = 0.0,
                 prefix_caching: bool = True, sleep: bool = False, cuda_graphs: bool = True,
                 lora_rank: int = 0):
        """`seed`: this rank's (each rank's engine samples its own stream); `sleep`: on a GPU,
        `sleep()` frees the engine's memory for a training update; `cuda_graphs`: on a GPU,
        decoding runs captured CUDA graphs (vLLM's `enforce_eager=False`); `lora_rank` > 0:
        vLLM's LoRA support on, one adapter of that rank at a time (`push_adapter`)."""
        LLM = colocated_llm_class("rollout.backend=vllm")
        gpu = torch.cuda.is_available()
        # On the CPU backend the memory fraction is of the machine's RAM (despite its name).
        kwargs = dict(model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
                      enforce_eager=not (gpu and cuda_graphs),
                      enable_prefix_caching=prefix_caching,
                      gpu_memory_utilization=gpu_memory_fraction,
                      **launch_settings(), **({"enable_sleep_mode": sleep} if gpu else {}))
        if kv_cache_gb:
            kwargs.update(kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
        if lora_rank:
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_rank))
        self.llm = LLM(**kwargs)
        self.adapter = self.adapter_version = None  # (a LoRARequest, the version it holds)
        self._adapters, self._adapter_dir = 0, None
        self.can_sleep = sleep and sleep_mode_supported()
        self.push_seconds = 0.0
        self.asleep = self.weights_awake = False
        self.made_for = None  # (architecture, settings), set by engine_for
        self.version = ("checkpoint", str(model_path))
        self._source = None  # (path, config, trust_remote_code) of a loaded checkpoint

    def sync(self, model, version, gather=None, adapter: bool = False) -> "VLLMEngine":
        """Push `model`'s weights (with `adapter`, its LoRA adapter alone: `push_adapter`)
        unless the engine already holds `version` of them."""
        if adapter:
            if version != self.adapter_version:
                self.push_adapter(model, gather)
                self.adapter_version = version
        elif version != self.version:
            self.push(model, gather)
            self.version = version
        return self

    def push_adapter(self, model, gather=None) -> None:
        """Hand vLLM a LoRA policy's adapter alone, to be served on the base weights the engine
        holds (the stage's starting checkpoint): written by peft (`save_pretrained`, its
        tensors gathered under ZeRO-3 by `gather`) to this process's own temporary folder,
        and sampled with from the next generation on as a new `LoRARequest` (a new id, so vLLM
        reads it again). The seconds it took are added to `push_seconds`."""
        from vllm.lora.request import LoRARequest

        started = time.perf_counter()
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="igrpo-vllm-adapter-")
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        save_adapter(model, self._adapter_dir, gather)
        self._adapters += 1
        self.adapter = LoRARequest(f"policy-{self._adapters}", self._adapters,
                                   self._adapter_dir)
        self.push_seconds += time.perf_counter() - started

    def push(self, model, gather=None) -> None:
        """Load the training model's current weights into the engine (in memory); the seconds
        it took are added to `push_seconds`. `gather` (`runtime.engine.module_gather`) makes
        each module whole in turn (ZeRO-3); without it the weights must be whole already."""
        started = time.perf_counter()
        # one tensor at a time, one module gathered at a time: a LoRA policy's merged weights
        # are made as vLLM takes them, and vLLM's loaders copy each before the next is drawn
        self._reload((name, tensor.detach()) for name, tensor in iter_weights(model, gather))
        self.version = self.adapter = self.adapter_version = None
        self.push_seconds += time.perf_counter() - started

    def load(self, model_path: str | Path, hf_config: PretrainedConfig,
             trust_remote_code: bool = False) -> None:
        """Load a saved checkpoint's weights (its safetensors files; `hf_config` its
        transformers config) into the engine."""
        self._reload(_checkpoint_tensors(model_path, hf_config, trust_remote_code))
        self.version = ("checkpoint", str(model_path))
        self.adapter = self.adapter_version = None  # a checkpoint's weights, served alone
        self._source = (model_path, hf_config, trust_remote_code)

    def sleep(self) -> None:
        """At the end of a generation phase (GPU, `rollout.sleep`): free the engine's weights and
        KV cache (vLLM's level 2: nothing is kept; pushed weights are pushed again before the next
        generation, a checkpoint is reloaded from disk). A no-op on the CPU or when asleep."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self.weights_awake = True, False
            if not self.holds_checkpoint():
                self.version = None  # pushed weights are gone: the next sync pushes them
            # vLLM's adapter slot is freed too: the next sync hands the adapter over anew
            self.adapter = self.adapter_version = None

    def holds_checkpoint(self, path: str | Path | None = None) -> bool:
        """Whether the engine's weights are a saved checkpoint's (`path`'s, where given)."""
        held = self.version
        return isinstance(held, tuple) and (path is None or held == ("checkpoint", str(path)))

    def wake(self) -> None:
        """Before generating: the weights back (a slept checkpoint reloaded from disk), then the
        KV cache."""
        if not self.asleep:
            return
        if not self.weights_awake:
            if self._source is None or not self.holds_checkpoint(self._source[0]):
                raise RuntimeError("the vLLM engine slept (level 2: its weights are gone) and "
                                   "was asked to generate before any weights were pushed")
            self._reload(_checkpoint_tensors(*self._source))  # (an adapter pushed since stays)
        self._wake(["kv_cache"])
        self.asleep = False

    def _wake(self, tags: list[str]) -> None:
        torch.cuda.empty_cache()  # what PyTorch's allocator holds, back for vLLM's pool
        self.llm.wake_up(tags=tags)

    def _reload(self, weights) -> None:
        """Load (HF name, tensor) pairs, a list or a stream, into the engine's weights."""
        if self.asleep and not self.weights_awake:
            self._wake(["weights"])  # asleep, the weights' memory is unmapped
            self.weights_awake = True

        # The worker's entry (it sets vLLM's current config around the model runner's reload);
        # in-process (no multiprocessing), so the tensors are handed over, not serialised.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        try:
            self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys/values
        except AttributeError:
            pass

    def generate_groups(self, tokenizer, prompts: list[str], group_size: int, *,
                        max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                        greedy: bool = False, logprobs: bool = False) -> Rollout:
        """`group_size` completions per prompt, grouped prompt by prompt, as a `Rollout`; with
        `logprobs`, vLLM's log-probs of the sampled tokens (`Rollout.sampler_logprobs`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from tasks.prompts import encode_prompts

        self.wake()
        ids = encode_prompts(tokenizer, prompts)
        ends = end_token_ids(tokenizer)
        params = SamplingParams(n=group_size, max_tokens=max_new_tokens,
                                temperature=0.0 if greedy else temperature,
                                top_p=1.0 if greedy else top_p, top_k=-1 if not greedy else 1,
                                stop_token_ids=ends, logprobs=0 if logprobs else None,
                                detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params,
                                    use_tqdm=False,
                                    **({"lora_request": self.adapter} if self.adapter else {}))
        rows, reported = [], []
        for out in outputs:
            for sample in out.outputs:
                tokens = list(sample.token_ids)
                entries = list(sample.logprobs or [])
                if sample.finish_reason == "stop" and (not tokens or tokens[-1] not in ends):
                    # stopped at an end token without returning it: the one it names (its EOS
                    # when it names none), never one it did not sample
                    stopped = sample.stop_reason
                    tokens.append(stopped if isinstance(stopped, int) else ends[0])
                rows.append(tokens)
                reported.append([entry[token].logprob if entry and token in entry else 0.0
                                 for token, entry in zip(tokens, entries + [None])])
        rollout = _as_rollout(ids, rows, tokenizer, group_size)
        if not logprobs:
            return rollout
        width = rollout.completion_ids.shape[1]
        sampled = torch.tensor([row + [0.0] * (width - len(row)) for row in reported])
        return replace(rollout, sampler_logprobs=sampled * rollout.completion_mask)


def _as_rollout(prompt_ids: list[list[int]], completions: list[list[int]], tokenizer,
                group_size: int) -> Rollout:
    """Left-padded prompts (each repeated G times) and right-padded completions."""
    pad, eos = tokenizer.pad_token_id, end_token_ids(tokenizer)
    width_p = max(len(p) for p in prompt_ids)
    width_c = max(1, max(len(c) for c in completions))
    prompts = [p for p in prompt_ids for _ in range(group_size)]
    prompt = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    mask, truncated = mask_after_eos(completion, eos)
    real = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    mask = mask * real
    completion = torch.where(mask.bool(), completion, torch.full_like(completion, pad))
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(prompt, prompt_mask, completion, mask, texts, truncated, group_size)


def _checkpoint_tensors(model_path: str | Path, hf_config: PretrainedConfig,
                        trust_remote_code: bool = False):
    """(HF name, tensor) of every weight of a saved checkpoint, streamed from its safetensors
    files one tensor at a time. A weight saved once for two names (tied input and output
    embeddings) comes under both, as the training model's `state_dict` gives it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(local_folder(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to load into the vLLM "
                                "engine (save the checkpoint with safe_serialization)")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            where.update((name, file) for name in handle.keys())
    with torch.device("meta"):  # the architecture's parameter names, no weights
        skeleton = AutoModelForCausalLM.from_config(hf_config,
                                                    trust_remote_code=trust_remote_code)
    first, tied = {}, []
    for name, param in skeleton.state_dict(keep_vars=True).items():
        source = first.setdefault(id(param), name)
        if name not in where and source in where:
            tied.append((name, source))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
    for name, source in tied:
        with safe_open(str(where[source]), framework="pt") as handle:
            yield name, handle.get_tensor(source)


def local_folder(model_path: str | Path) -> Path:
    """A checkpoint's folder: `model_path` itself, or for a hub id the snapshot in the local
    Hugging Face cache (where vLLM downloaded it when the engine was made; nothing is fetched)."""
    if Path(model_path).is_dir():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model_path), local_files_only=True))


def launch_settings() -> dict:
    """How the engine joins the job: where torch.distributed runs several ranks, vLLM's
    `external_launcher` executor, so each rank's engine lives in its own process on its own
    device (cuda:LOCAL_RANK; TRL's colocate mode does the same) instead of vLLM's default
    single-process executor, which places every rank's engine on cuda:0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return {"distributed_executor_backend": "external_launcher"}
    return {}


def rank_seed(seed: int) -> int:
    """This rank's engine seed: each rank's engine samples its own stream (with one seed for
    all, ranks given the same prompt would draw the same samples)."""
    from runtime.dist import world
    from runtime.shards import chunk_seed

    return chunk_seed(seed, "vllm", world()[0])


_ENGINE: VLLMEngine | None = None  # this process's engine; see engine_for
# What makes two checkpoints interchangeable in one engine.
ARCHITECTURE_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def engine_for(vllm: VLLMSettings, model_path: str | Path) -> VLLMEngine:
    """This process's engine, holding `model_path`'s weights: made on first use, long enough for a
    prompt and the longest continuation any stage asks for (a Math-Shepherd prefix plus its
    completion included), then reused by every later stage of the process, which loads its own
    checkpoint into it. A checkpoint of another architecture, or other settings, is refused."""
    global _ENGINE
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path),
                                        trust_remote_code=vllm.trust_remote_code)
    wanted = vllm.max_prompt_tokens + vllm.policy_new_tokens + vllm.longest_new_tokens
    positions = getattr(config, "max_position_embeddings", None) or wanted
    architecture = {k: v for k, v in config.to_dict().items() if k in ARCHITECTURE_KEYS}
    settings = dict(dtype=vllm.dtype, max_model_len=min(wanted, positions),
                    seed=rank_seed(vllm.seed), gpu_memory_fraction=vllm.memory_fraction,
                    kv_cache_gb=vllm.kv_cache_gb, prefix_caching=vllm.prefix_caching,
                    sleep=vllm.sleep, cuda_graphs=vllm.cuda_graphs, lora_rank=vllm.lora_rank)
    if _ENGINE is None:
        _ENGINE = VLLMEngine(model_path, **settings)
        _ENGINE.made_for = (architecture, settings)
        _ENGINE._source = (model_path, config, vllm.trust_remote_code)
        return _ENGINE
    differ = _differences(_ENGINE.made_for, (architecture, settings))
    if differ:
        raise RuntimeError(
            f"rollout.backend=vllm: {model_path} needs a vLLM engine unlike this process's "
            f"({'; '.join(differ)}). A process holds one engine for good: vLLM's shutdown tears "
            "down torch.distributed under the training engine. Run it in a process of its own.")
    if _ENGINE.version != ("checkpoint", str(model_path)):
        _ENGINE.load(model_path, config, vllm.trust_remote_code)
    _ENGINE.adapter = _ENGINE.adapter_version = None  # a new user samples the checkpoint alone
    return _ENGINE


def _differences(made: tuple[dict, dict], wanted: tuple[dict, dict]) -> list[str]:
    """What keeps an engine made for `made` from serving `wanted` (a longer max_model_len
    serves a shorter one)."""
    out = []
    for have, need in zip(made, wanted):
        for key in sorted(set(have) | set(need)):
            if key == "max_model_len" and have[key] >= need[key]:
                continue
            if have.get(key) != need.get(key):
                out.append(f"{key} {have.get(key)!r} here, {need.get(key)!r} wanted")
    return out
