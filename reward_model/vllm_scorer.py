"""Token-classification PRMs scored through vLLM's pooling runner (`rm.backend=vllm`).

vLLM serves no generic `*ForTokenClassification` model, so the PRM is split where its
architecture splits: vLLM runs the backbone as a pooling model (`runner="pooling"`,
`convert="embed"`, the `token_embed` task without normalisation: every token's final hidden
state), and the classifier's head, a single linear layer, is applied here to the hidden states
vLLM returns. The engine is made once per process over the checkpoint's own config (its
architecture read as the matching causal LM, random weights: `load_format="dummy"`), and each
checkpoint's backbone weights are streamed into it from its safetensors files (a later
checkpoint of the same architecture, a refreshed PRM, reloads them in place), so no copy of the
model is written; scorers of other checkpoints (an ensemble's members, the ORM beside the PRM)
share the engine, each reloading its own weights when another's are in it. It lives beside the
policy's generation engine in the same process, its KV cache `rm.vllm_kv_cache_gb` (a
prefill-only engine needs one batch's tokens), and stays resident: vLLM's sleep mode has one
allocator per process, so its sleep and wake would move the policy engine's memory too. On a
GPU its weights and KV cache are held beside training throughout (not measured on a GPU here,
and not counted by `igrpo plan`).

The read-out is the transformers scorer's own (`reward_model.families.read_class` at each
step's separator): `tests/test_vllm.py` checks the scores equal the transformers forward's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from process_supervision.formats import StepExample
from reward_model.families import (FamilyError, Reading, TokenClassScorer, architectures,
                                   load_reward_model, read_class)

HEADS = ("score", "classifier")
"""The head's module name in transformers' token classifiers."""


def _head_and_backbone(path: Path) -> tuple[torch.nn.Linear, list[str]]:
    """(the classifier's head as a float32 linear layer, the names of the backbone's weights in
    the checkpoint's safetensors files)."""
    from safetensors import safe_open

    weights, backbone = {}, []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.split(".")[0] in HEADS:
                    weights[name.split(".", 1)[1]] = handle.get_tensor(name).float()
                else:
                    backbone.append(name)
    if "weight" not in weights:
        raise FamilyError(f"{path}: rm.backend=vllm reads a token classifier whose head is a "
                          f"linear `score` or `classifier` in *.safetensors; found none")
    head = torch.nn.Linear(weights["weight"].shape[1], weights["weight"].shape[0],
                           bias="bias" in weights)
    head.load_state_dict(weights)
    return head.eval(), backbone


def _backbone_tensors(path: Path):
    """(name, tensor) of the checkpoint's weights but its head's, one tensor at a time."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.split(".")[0] not in HEADS:
                    yield name, handle.get_tensor(name)


class PooledBackbone:
    """A vLLM pooling engine over a token classifier's backbone: every token's final hidden
    state."""

    def __init__(self, path: Path, *, dtype: str, max_model_len: int, kv_cache_gb: float,
                 trust_remote_code: bool = False):
        from vllm.config import PoolerConfig

        from policy.generation.vllm import colocated_llm_class, launch_settings

        LLM = colocated_llm_class("rm.backend=vllm")
        names = architectures(path)
        if not names or not names[0].endswith("ForTokenClassification"):
            raise FamilyError(f"{path}: rm.backend=vllm scores a *ForTokenClassification PRM; "
                              f"its config names {names}")
        causal = names[0].replace("ForTokenClassification", "ForCausalLM")
        kv_bytes = int(kv_cache_gb * 2**30)
        # Not in vLLM's sleep mode: its allocator is one per process, so a second engine's
        # sleep and wake would move the policy engine's memory too. On a GPU the share of the
        # card vLLM checks is free at start-up is this engine's own: weights, KV cache, 1 GiB.
        share = {}
        if torch.cuda.is_available():
            weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            share["gpu_memory_utilization"] = min(0.9, (weights + kv_bytes + 2**30) / torch.cuda
                                                  .get_device_properties(0).total_memory)
        self.llm = LLM(model=str(path), runner="pooling", convert="embed", load_format="dummy",
                       hf_overrides={"architectures": [causal]}, dtype=dtype,
                       pooler_config=PoolerConfig(task="token_embed", use_activation=False),
                       max_model_len=max_model_len, enforce_eager=True, seed=0,
                       trust_remote_code=trust_remote_code, kv_cache_memory_bytes=kv_bytes,
                       **share, **launch_settings())
        self.made_for = (causal, dtype, max_model_len, kv_cache_gb)
        self.path = None

    def load(self, path: Path) -> None:
        """Stream `path`'s backbone weights into the engine (in memory)."""
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": _backbone_tensors(path)})
        self.path = str(path)

    def hidden(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """[tokens, hidden] final hidden states of each row of token ids."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.encode([TokensPrompt(prompt_token_ids=r) for r in rows],
                                  pooling_task="token_embed", use_tqdm=False)
        return [out.outputs.data for out in outputs]


_POOL: PooledBackbone | None = None  # this process's pooling engine (one, as for generation)


def pooled_backbone(path: Path, *, dtype: str, max_model_len: int, kv_cache_gb: float,
                    trust_remote_code: bool = False) -> PooledBackbone:
    """This process's pooling engine, holding `path`'s backbone: made on first use, then
    reused (another checkpoint of the same architecture and settings reloads its weights;
    anything else is refused, naming what differs)."""
    global _POOL
    if _POOL is None:
        _POOL = PooledBackbone(path, dtype=dtype, max_model_len=max_model_len,
                               kv_cache_gb=kv_cache_gb, trust_remote_code=trust_remote_code)
    wanted = (architectures(path)[0].replace("ForTokenClassification", "ForCausalLM"), dtype,
              max_model_len, kv_cache_gb)
    if _POOL.made_for != wanted:
        raise RuntimeError(f"rm.backend=vllm: {path} needs a pooling engine made for {wanted} "
                           f"(architecture, dtype, max length, KV cache GB); this process's "
                           f"was made for {_POOL.made_for}")
    if _POOL.path != str(path):
        _POOL.load(path)
    return _POOL


class VLLMTokenClassScorer(TokenClassScorer):
    """`TokenClassScorer` whose backbone runs in vLLM's pooling runner (module docstring); the
    head and the read-out are the transformers scorer's."""

    def __init__(self, pool: PooledBackbone, path: Path, head: torch.nn.Linear, tokenizer,
                 max_length: int, reading: Reading, batch_size: int = 64):
        super().__init__(None, tokenizer, max_length, reading, batch_size)
        self.pool, self.path, self.head = pool, str(path), head

    @torch.no_grad()
    def score(self, examples: list[StepExample]) -> list[list[float]]:
        if self.pool.path != self.path:  # (another scorer of the process loaded its own since)
            self.pool.load(Path(self.path))
        out = []
        for start in range(0, len(examples), self.batch_size):
            batch = self.encode(examples[start:start + self.batch_size])
            rows = [ids[mask.bool()].tolist()
                    for ids, mask in zip(batch.input_ids, batch.attention_mask)]
            for row, hidden in enumerate(self.pool.hidden(rows)):
                self.head = self.head.to(hidden.device)  # (on a GPU, vLLM's device)
                margin = read_class(self.head(hidden.float()), self.reading).cpu()
                labelled = batch.label_mask[row][:len(rows[row])]
                out.append(torch.sigmoid(margin[labelled]).tolist())
        return out

    def value_init(self):
        raise FamilyError("rm.backend=vllm: the reward model's weights live in vLLM, so no "
                          "critic starts from them (set rm.backend=hf)")


def load_scorer(path, rm, model_cfg, pooled: bool, batch_size: int | None = None):
    """The reward model in `path`: `reward_model.families.load_reward_model`'s scorer, or with
    `pooled` (`rm.backend=vllm`, resolved in iteration/resolve.py) a token-classification PRM's
    `VLLMTokenClassScorer`."""
    if not pooled:
        return load_reward_model(path, rm, model_cfg, batch_size)
    from runtime.lora import is_adapter_folder, merge_adapter_folder
    from runtime.models import load_tokenizer

    if is_adapter_folder(path):  # a peft adapter: merged onto its base once, then served
        import tempfile

        path = merge_adapter_folder(path, tempfile.mkdtemp(prefix="igrpo-merged-rm-"),
                                    getattr(model_cfg, "trust_remote_code", False))

    tokenizer = load_tokenizer(path, model_cfg)
    tokenizer.padding_side = "right"
    return vllm_token_scorer(Path(path), tokenizer, rm, model_cfg,
                             batch_size or rm.score_batch_size)


def vllm_token_scorer(path: Path, tokenizer, rm, model_cfg, batch_size: int):
    """The `VLLMTokenClassScorer` of the token-classification PRM in `path`."""
    head, _ = _head_and_backbone(path)
    pool = pooled_backbone(path, dtype=getattr(model_cfg, "dtype", "float32") or "float32",
                           max_model_len=rm.max_length, kv_cache_gb=rm.vllm_kv_cache_gb,
                           trust_remote_code=getattr(model_cfg, "trust_remote_code", False))
    return VLLMTokenClassScorer(pool, path, head, tokenizer, rm.max_length, Reading.of(rm),
                                batch_size)
