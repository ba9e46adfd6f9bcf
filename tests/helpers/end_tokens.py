"""A model whose generation config lists end tokens beyond the tokenizer's EOS, for the tests of
both rollout backends (tests/test_rollout.py, tests/test_vllm.py)."""

import json

from runtime.models import load_tokenizer


def two_end_tokens(tmp_path):
    """The shipped warm start, its generation config listing '7' and '3' as end tokens beside
    the tokenizer's EOS (as Qwen2.5 lists <|im_end|> and <|endoftext|>): (folder, end ids)."""
    import shutil

    from configs.loader import BUNDLED

    folder = shutil.copytree(BUNDLED / "tiny_warm_start", tmp_path / "two_ends")
    tokenizer = load_tokenizer(folder)
    ends = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["7", "3"])]
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = ends[1:]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder, ends


def expected_stops(reference: list[list[int]], ends: list[int]) -> list[list[int]]:
    """Each unconstrained completion cut just after its first end token."""
    out = []
    for row in reference:
        cut = next((i for i, t in enumerate(row) if t in ends), len(row) - 1)
        out.append(row[:cut + 1])
    return out
