"""LoRA through peft: an adapter on a model that trains, the model's merged weights (for an export,
a vLLM push), and the reference a LoRA policy needs no second copy for.

`with_adapter` wraps a loaded transformers model in a peft `PeftModel` whose only trainable
parameters are the adapter's (and the `modules_to_save` a reward model's head needs). The frozen
base is still there, so the reference policy of a stage that starts from the loaded model is that
same module with the adapter off (`AdapterOff`), not a second copy. `iter_weights` gives the
weights `merge_and_unload` would give, under the base model's own names, one tensor at a time
(a vLLM push streams them: no second copy of the model exists at once, and under ZeRO-3 one
module is gathered at a time), each computed beside
the module (W + B A * scale, peft's own `get_delta_weight`) rather than merged into it and
unmerged again: the frozen base never moves, so a push every step leaves it bitwise what was
loaded.
An export of a LoRA model is the merged plain model: every later stage, `igrpo score`, vLLM and
plain transformers load it as any other checkpoint (docs/lora.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSettings:
    """What `with_adapter` needs of a `LoraConfig` (configs/schema.py)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: str

    @classmethod
    def of(cls, config) -> "LoraSettings | None":
        """The settings of a `model.lora` or `rm.lora` block; None where LoRA is off
        (rank 0)."""
        if config is None or not config.rank:
            return None
        return cls(int(config.rank), float(config.alpha), float(config.dropout),
                   str(config.target_modules))

    def targets(self):
        """peft's `target_modules`: "all-linear" (every linear layer but the output head), or
        the named modules (comma-separated suffixes, e.g. `q_proj,v_proj`)."""
        if self.target_modules == ALL_LINEAR:
            return ALL_LINEAR
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]


def is_adapted(model) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) is a peft model."""
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def with_adapter(model, lora: LoraSettings, *, task_type: str = "CAUSAL_LM",
                 modules_to_save: list[str] | None = None, announce: str = "policy"):
    """`model` wrapped in a fresh LoRA adapter (peft's `get_peft_model`): the adapter's B is 0,
    so the wrapped model computes what `model` computes until its first update. Prints, on the
    main rank, the trainable parameters and their share (`announce` names the model)."""
    from peft import LoraConfig, get_peft_model

    from runtime.dist import is_main

    # A trained head (a token classifier's `score`) trains whole, so no adapter goes on it
    # (peft's "all-linear" spares only a causal LM's output layer).
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.targets(), task_type=task_type,
                        modules_to_save=modules_to_save, exclude_modules=modules_to_save)
    try:
        adapted = get_peft_model(model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"lora.target_modules={lora.target_modules!r}: {err}") from err
    trainable, total = trainable_share(adapted)
    if is_main():
        print(f"[igrpo] {announce}: LoRA rank {lora.rank}, alpha {lora.alpha:g} on "
              f"{lora.target_modules}: {trainable:,} of {total:,} parameters train "
              f"({100 * trainable / max(total, 1):.2f}%)", flush=True)
    return adapted


def trainable_share(model) -> tuple[int, int]:
    """(trainable parameters, all parameters) of `model`; under ZeRO-3 a partitioned
    parameter counts its full size (`ds_numel`)."""
    def size(p):
        return int(getattr(p, "ds_numel", p.numel()))

    params = list(model.parameters())
    return sum(size(p) for p in params if p.requires_grad), sum(size(p) for p in params)


def merged_weights(model) -> dict[str, torch.Tensor]:
    """`iter_weights` as a dict (for an export)."""
    return dict(iter_weights(model))


@torch.no_grad()
def iter_weights(model, gather=None):
    """The model's weights as a plain transformers checkpoint names them (its `state_dict()`
    order), (name, tensor) one at a time: a peft model's base weights with every LoRA layer's
    W + B A * scale in place of W (what `merge_and_unload` gives), made only when its turn comes
    (a push streams them, so no second copy of the model exists at once), a trained head
    (`modules_to_save`) under its own name, and none of the adapter's tensors. The module is not
    changed.

    `gather(params)` (a context manager; `runtime.engine.module_gather`) makes one module's
    parameters whole while its tensors are taken: a LoRA layer's with its adapter, any other
    module's own. Under ZeRO-3 it gathers them, so at most one module is whole at a time, and
    every rank must draw the stream to its end together. Without it (or below ZeRO-3) call this
    where the weights are whole. A tensor stays valid after its module is released (DeepSpeed
    rebinds a released parameter's data rather than freeing what it held), so a consumer may
    keep it: vLLM's reload holds a fused layer's pieces (q, k, v; gate, up) until the last
    arrives, so a push holds up to three of a layer's weights at once (`igrpo plan` counts
    it)."""
    from peft.tuners.lora import LoraLayer

    module = getattr(model, "module", model)
    base = module.get_base_model() if is_adapted(module) else module
    gather = gather or _whole
    kept = set(base.state_dict())  # the names a checkpoint has (no non-persistent buffers)
    inside, seen = None, set()
    for prefix, sub in base.named_modules():
        if inside is not None and prefix.startswith(inside):
            continue  # a LoRA layer's submodules, taken with it
        lora = isinstance(sub, LoraLayer)
        inside = f"{prefix}." if lora else inside
        owned = list(sub.named_parameters()) if lora else [
            *sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        items = []
        for name, tensor in owned:
            full = f"{prefix}.{name}" if prefix else name
            key = _checkpoint_name(full)
            if full in kept and key is not None and key not in seen:  # (a tied weight once)
                seen.add(key)
                items.append((key, tensor))
        if not items:
            continue
        with gather([t for _, t in owned if isinstance(t, torch.nn.Parameter)]):
            for key, tensor in items:
                yield key, _merged(sub, tensor) if lora and key == f"{prefix}.weight" else tensor


def _checkpoint_name(key: str) -> str | None:
    """A peft state-dict key under the plain model's name, or None for the adapter's own
    tensors and a trained head's frozen original."""
    if ".lora_" in key or ".original_module." in key:
        return None
    if ".modules_to_save." in key:  # a reward model's trained head: the trained copy
        return key.replace(".modules_to_save.default", "")
    return key.replace(".base_layer.", ".")


@contextmanager
def _whole(params):
    yield


def _merged(layer, weight: torch.Tensor) -> torch.Tensor:
    """W + B A * scale of `layer`'s active adapters (peft's `get_delta_weight`), a new tensor."""
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def save_adapter(model, out_dir, gather=None) -> None:
    """peft's `save_pretrained` of `model`'s adapter alone (its config and tensors, what vLLM's
    `LoRARequest` reads) into `out_dir`; `gather` (`runtime.engine.module_gather`) makes the
    adapter's tensors whole under ZeRO-3 (every rank together), the frozen base staying
    partitioned."""
    module = getattr(model, "module", model)
    adapter = [p for name, p in module.named_parameters() if ".lora_" in name]
    with gather(adapter) if gather else _whole(adapter):
        module.save_pretrained(out_dir)


def save_merged(model, out_dir) -> None:
    """`save_pretrained` of `model`'s merged weights as a plain transformers checkpoint (the
    base model's config and class; no adapter files)."""
    module = getattr(model, "module", model)
    base = module.get_base_model()
    base.save_pretrained(out_dir, state_dict=merged_weights(module), safe_serialization=True)


class AdapterOff(torch.nn.Module):
    """The reference policy of a LoRA stage that starts from its loaded model: the policy's
    own module with its adapter off (peft's `disable_adapter`), i.e. the frozen base. It holds
    no weights of its own; called as a module (forward log-probs, no gradient), it runs the
    policy's module, which under ZeRO-3 gathers layer by layer as the policy's forward does."""

    def __init__(self, engine):
        super().__init__()
        self._engine = [engine]  # (a list: not registered as a submodule, never saved)

    @property
    def policy(self):
        return getattr(self._engine[0], "module", self._engine[0])

    def forward(self, *args, **kwargs):
        with self.disabled() as module:
            return module(*args, **kwargs)

    @contextmanager
    def disabled(self):
        """The policy's module with the adapter off inside the block."""
        module = self.policy
        with module.disable_adapter():
            yield module

    @property
    def config(self):
        return self.policy.config

    @property
    def device(self):
        return next(self.policy.parameters()).device


ADAPTER_CLASSES = {"TOKEN_CLS": "AutoModelForTokenClassification",
                   "SEQ_CLS": "AutoModelForSequenceClassification",
                   "CAUSAL_LM": "AutoModelForCausalLM"}
"""The transformers class an adapter's base is loaded as, by peft's `task_type`."""


def is_adapter_folder(path) -> bool:
    """Whether `path` holds a peft adapter (its `adapter_config.json`) rather than a model."""
    from pathlib import Path

    return (Path(path) / "adapter_config.json").is_file()


def merge_adapter_folder(path, out_dir, trust_remote_code: bool = False):
    """A peft adapter folder (e.g. a LoRA PRM trained elsewhere) merged onto the base its
    `adapter_config.json` names and saved as a plain checkpoint in `out_dir` (with the adapter
    folder's tokenizer, else the base's). Returns `out_dir`. A token classifier's head saved
    with the adapter (`modules_to_save`) is kept; its label count is read from it."""
    from pathlib import Path

    import transformers
    from peft import PeftConfig, PeftModel
    from safetensors import safe_open

    path, out_dir = Path(path), Path(out_dir)
    config = PeftConfig.from_pretrained(str(path))
    task = str(getattr(config, "task_type", "") or "CAUSAL_LM").split(".")[-1]
    if task not in ADAPTER_CLASSES:
        raise ValueError(f"{path / 'adapter_config.json'}: task_type {task!r}; expected one of "
                         f"{', '.join(ADAPTER_CLASSES)}")
    base_path = config.base_model_name_or_path
    if not base_path:
        raise ValueError(f"{path / 'adapter_config.json'}: no base_model_name_or_path to merge "
                         "the adapter onto")
    extra = {}
    weights = path / "adapter_model.safetensors"
    if task != "CAUSAL_LM" and weights.exists():
        with safe_open(str(weights), "pt") as f:  # the head's rows: its label count
            heads = [k for k in f.keys() if ".modules_to_save." in k and k.endswith("weight")]
            if heads:
                extra["num_labels"] = f.get_slice(heads[0]).get_shape()[0]
    auto = getattr(transformers, ADAPTER_CLASSES[task])
    base = auto.from_pretrained(base_path, trust_remote_code=trust_remote_code, **extra)
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_source = path if (path / "tokenizer_config.json").exists() else base_path
    transformers.AutoTokenizer.from_pretrained(str(tokenizer_source),
                                               trust_remote_code=trust_remote_code
                                               ).save_pretrained(out_dir)
    return out_dir
