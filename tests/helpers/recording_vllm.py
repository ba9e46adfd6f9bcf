"""A recording stand-in for the `vllm` package: `LLM` keeps the memory states vLLM's sleep mode
moves (its weights and its KV pool, each mapped or not), samples with the hf decoding loop, loads
pushed weights into its own copy of the model, and writes every call into `EVENTS` beside the
pool's state. The test installs it as `sys.modules["vllm"]` and records the training side's
gathers, scorings, updates and reward-model trainings into the same list, so that one list says
what held the GPU at once.
"""

from __future__ import annotations

import contextlib
import sys
import types
from types import SimpleNamespace

import torch

EVENTS: list[tuple[str, bool, bool]] = []
"""(event, KV pool mapped, weights mapped) in the order they happened."""
LOGPROBS: list = []
"""Each generate call's `SamplingParams.logprobs` (None: vLLM computes none)."""


class LLM:
    current: "LLM | None" = None
    made: list = []
    """Every engine made: a policy's generation engine, and a PRM's pooling engine
    (`runner="pooling"`: its backbone's hidden states, `encode`)."""

    def __init__(self, model: str, seed: int = 0, runner: str = "generate", **kwargs):
        from runtime.models import load_causal_lm

        self.model = load_causal_lm(model).eval()  # (a token classifier: its backbone + a head)
        self.weights = self.kv = True
        self.pooling = runner == "pooling"
        LLM.made.append(self)
        if not self.pooling:
            LLM.current = self
        record("create:pooling" if self.pooling else "create")

    def encode(self, prompts, pooling_task=None, use_tqdm=False):
        assert self.pooling and pooling_task == "token_embed"
        assert self.weights and self.kv, "encode with the pooling engine's memory asleep"
        record("encode")
        with torch.no_grad():
            return [SimpleNamespace(outputs=SimpleNamespace(data=self.model.model(
                input_ids=torch.tensor([p["prompt_token_ids"]])).last_hidden_state[0]))
                for p in prompts]

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        from policy.generation.rollout import decode

        assert self.weights and self.kv, "generate with vLLM's memory asleep"
        record("generate" if lora_request is None else "generate:adapter")
        LOGPROBS.append(params.logprobs)
        model = self.model if lora_request is None else self._adapted(lora_request)
        outputs = []
        ends = list(params.stop_token_ids)
        for prompt in prompts:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            tokens, _ = decode(model, ids, torch.ones_like(ids), params.n, params.max_tokens,
                               ends, ends[0], temperature=max(params.temperature, 1e-3),
                               greedy=params.temperature == 0.0)
            samples = []
            for row in tokens.tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in ends), None)
                samples.append(SimpleNamespace(
                    token_ids=row[:cut] if cut else row, logprobs=None, stop_reason=None,
                    finish_reason="stop" if cut else "length"))
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs

    def _adapted(self, request):
        """The held weights with the request's adapter merged (peft), read from its folder
        once per id, as vLLM reads a new adapter."""
        import copy

        from peft import PeftModel

        if getattr(self, "adapter_id", None) != request.lora_int_id:
            base = copy.deepcopy(self.model)
            self.adapter_model = PeftModel.from_pretrained(base, request.lora_path)
            self.adapter_model = self.adapter_model.merge_and_unload().eval()
            self.adapter_id = request.lora_int_id
        return self.adapter_model

    def sleep(self, level: int = 1):
        assert level == 2 and not self.pooling  # (a pooling engine never sleeps: one allocator)
        self.weights = self.kv = False
        record("sleep")

    def wake_up(self, tags=None):
        for tag in tags or ["weights", "kv_cache"]:
            setattr(self, "weights" if tag == "weights" else "kv", True)
            record(f"wake:{tag}" + (":pooling" if self.pooling else ""))

    def collective_rpc(self, method, kwargs=None, **_):
        assert method == "reload_weights" and self.weights, "reload into unmapped weights"
        weights = dict(kwargs["weights_iterator"])
        # (vLLM's reload takes the checkpoint's own names: an adapter's would be refused)
        unexpected = self.model.load_state_dict(weights, strict=False).unexpected_keys
        assert not unexpected, f"names the model does not have: {unexpected[:3]}"
        self.adapter_id = None  # (an adapter is merged onto the weights held now)
        record("reload")

    def reset_prefix_cache(self):
        pass


def record(event: str) -> None:
    """`event` beside whether the policy's generation engine holds its KV pool and its weights
    mapped (a pooling engine's own state is in its events: it maps its pool only to encode)."""
    llm = LLM.current
    EVENTS.append((event, bool(llm and llm.kv), bool(llm and llm.weights)))


@contextlib.contextmanager
def recorded(event: str, inner=None):
    """Record `event` on entry (and `<event>-end` on exit) around `inner`'s context."""
    record(event)
    with (inner if inner is not None else contextlib.nullcontext()) as value:
        yield value
    record(f"{event}-end")


def recording(event: str, fn):
    """`fn`, recording `event` before each call."""
    def wrapped(*args, **kwargs):
        record(event)
        return fn(*args, **kwargs)
    return wrapped


def install(monkeypatch) -> None:
    """Make `import vllm` give this stand-in (version 0.32.0), its sleep mode usable."""
    package = types.ModuleType("vllm")
    package.__version__ = "0.32.0"
    package.LLM = LLM
    package.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    package.inputs = inputs
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_int_id, lora_path: SimpleNamespace(
        lora_name=name, lora_int_id=lora_int_id, lora_path=lora_path)
    lora.request = request
    package.lora = lora
    config = types.ModuleType("vllm.config")
    config.PoolerConfig = lambda **kw: SimpleNamespace(**kw)
    package.config = config
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    from policy.generation import vllm as engine_module

    monkeypatch.setattr(engine_module, "sleep_mode_supported", lambda: True)
    monkeypatch.setattr(engine_module, "_ENGINE", None)
    EVENTS.clear()
    LOGPROBS.clear()
    LLM.current = None
    LLM.made.clear()
    from reward_model import vllm_scorer

    monkeypatch.setattr(vllm_scorer, "_POOL", None)
