"""Loading models and tokenizers: every load reads the one `model.*` config.

`load_causal_lm` puts the model on this process's accelerator (cuda:LOCAL_RANK) when there is
one, in `model.dtype`, with `model.attn_implementation` and `model.trust_remote_code`; the
labeller, evaluator, reference and reward-model scorers all come through it, so none of them is
left on the CPU of a GPU machine, and no load forgets the remote-code setting.

Where stdout or stderr is a file or a pipe (a log), transformers' progress bars ("Loading
weights", downloads) are off during a load, and the main rank prints one line per model instead
(`[igrpo] loaded PATH (class, parameters, dtype) in S s`); on a terminal the bars stay.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from pathlib import Path


def accelerator():
    """This process's device: cuda:LOCAL_RANK where CUDA is available, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_tokenizer(path: str | Path, model=None):
    """Tokenizer with left padding set explicitly (save/load of a wrapped tokenizer can drop it)
    and a pad token (the EOS where the tokenizer has none). `model`: a `ModelConfig` (None =
    defaults)."""
    from transformers import AutoTokenizer

    trust = bool(model is not None and model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def end_token_ids(tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS first, then the end tokens the
    model's generation config lists (instruct models list several: Qwen2.5's `<|im_end|>` and
    `<|endoftext|>`, Llama 3's `<|eot_id|>` beside `<|end_of_text|>`), read from where the
    tokenizer was loaded (a folder, or a hub id in the local cache). Sampling stops at any of
    them, and the completion is masked after it."""
    ends = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return list(dict.fromkeys([*ends, *_generation_config_ends(str(tokenizer.name_or_path))]))


@functools.lru_cache(maxsize=64)
def _generation_config_ends(path: str) -> tuple[int, ...]:
    if not path:
        return ()
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):  # no generation_config.json there
        return ()
    ends = config.eos_token_id
    return tuple(ends) if isinstance(ends, (list, tuple)) else () if ends is None else (ends,)


def load_causal_lm(path: str | Path, model=None, *, train: bool = False, device=None):
    """A causal LM from a folder or hub id, on `device` (default: `accelerator()`), configured by
    `model` (a `ModelConfig`; None = float32, default attention, no remote code). `train`
    turns on gradient checkpointing where `model.gradient_checkpointing` asks for it."""
    from transformers import AutoModelForCausalLM

    return load_model(path, AutoModelForCausalLM, model, train=train, device=device)


def load_model(path: str | Path, auto_class, model=None, *, train: bool = False, device=None,
               **extra):
    """`auto_class.from_pretrained(path)` (any transformers Auto class: a causal LM, a token or
    sequence classifier) as `load_causal_lm` loads a causal LM; `extra` goes to
    `from_pretrained` (e.g. `num_labels`)."""
    import torch

    kwargs = dict(extra)
    if model is not None and model.attn_implementation:
        kwargs["attn_implementation"] = model.attn_implementation
    logged, started = output_is_logged(), time.perf_counter()
    with progress_bars_off(logged):
        lm = auto_class.from_pretrained(
            str(path), dtype=getattr(torch, model.dtype if model is not None else "float32"),
            trust_remote_code=bool(model is not None and model.trust_remote_code), **kwargs)
    if train and model is not None and model.gradient_checkpointing:
        if hasattr(lm, "activation_checkpointing_enable"):  # its name from transformers 5.2x
            lm.activation_checkpointing_enable({"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm = lm.to(device if device is not None else accelerator())
    if logged:
        report_load(path, lm, time.perf_counter() - started)
    return lm


def output_is_logged() -> bool:
    """stdout or stderr is not a terminal (a file or a pipe): progress bars would flood it."""
    return not all(bool(getattr(stream, "isatty", lambda: False)())
                   for stream in (sys.stdout, sys.stderr))


@contextlib.contextmanager
def progress_bars_off(off: bool = True):
    """transformers' progress bars (its "Loading weights" bar, the hub's download bars) off
    inside the block where `off`, as they were after it."""
    from transformers.utils import logging as hf_logging

    switch = off and hf_logging.is_progress_bar_enabled()
    if switch:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if switch:
            hf_logging.enable_progress_bar()


def report_load(path, lm, seconds: float) -> None:
    """The main rank's one line about a loaded model (instead of a progress bar in a log)."""
    from runtime.dist import is_main

    if not is_main():
        return
    count = sum(p.numel() for p in lm.parameters())
    size = next((f"{count / 10 ** e:.1f}{u}" for e, u in ((9, "B"), (6, "M"), (3, "K"))
                 if count >= 10 ** e), str(count))
    dtype = str(getattr(lm, "dtype", "?")).removeprefix("torch.")
    print(f"[igrpo] loaded {path} ({type(lm).__name__}, {size} params, {dtype}) in "
          f"{seconds:.1f} s", flush=True)
