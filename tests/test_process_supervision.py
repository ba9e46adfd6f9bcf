"""Steps and their token positions, Math-Shepherd estimates, resumable labelling."""

import pytest

from configs.schema import TinyModelConfig
from process_supervision.label import (Labeller, Solution, estimates, label_in_shards,
                                       label_statistics, prefix_prompt)
from runtime.steps import split_steps, step_char_ends, step_end_token_indices
from runtime.data import synthetic_records
from runtime.tiny_model import build_tiny
from runtime.models import load_causal_lm, load_tokenizer
from tasks.prompts import PromptFormat

SOLUTION = "7+3=10\n10*2=20\nThe answer is 20"


def test_split_and_char_ends():
    assert split_steps("a=1\n\nb=2\n") == ["a=1", "b=2"]
    # "7+3=10\n" ends at its newline (6); "10*2=20\n" at 14; the last step at the last char.
    assert step_char_ends(SOLUTION) == [6, 14, len(SOLUTION) - 1]


def _bpe_with_boundary_merges():
    """A byte-level BPE trained so that tokens straddle the newline between steps."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([SOLUTION] * 200 + ["0\nThe 10\n20\n"] * 200, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


def test_step_end_indices_bpe_with_merges_across_boundary():
    tok = _bpe_with_boundary_merges()
    enc = tok(SOLUTION, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    straddling = [(a, b) for a, b in spans if a < b and "\n" in SOLUTION[a:b]
                  and SOLUTION[a:b] != "\n"]
    assert straddling, "the test tokenizer should merge across a step boundary"
    # Expected from the tokenizer's own offsets: the token whose span holds each step's end.
    want = [next(t for t, (a, b) in enumerate(spans) if a <= c < b)
            for c in step_char_ends(SOLUTION)[:-1]] + [len(ids)]
    got = step_end_token_indices(tok, ids + [tok.eos_token_id], SOLUTION)
    assert got == want


def test_estimates_by_hand():
    prefix = "7+3=10\n"
    continuations = ["10*2=20\nThe answer is 20", "10*2=21\nThe answer is 21",
                     "10*2=20\nThe answer is 20", "no answer"]
    assert estimates(prefix, continuations, "20") == (1.0, 0.5)
    assert estimates(prefix, ["The answer is 3"] * 3, "20") == (0.0, 0.0)


def test_prefix_prompt():
    assert prefix_prompt(PromptFormat(), None, "Q", ("a", "b", "c"), 2) == "Q\na\nb\n"
    # Another template and step separator: `{question}` filled, other braces kept as they are.
    fmt = PromptFormat("{question} in \\boxed{}:", step_separator="\n\n")
    assert prefix_prompt(fmt, None, "Q", ("a", "b", "c"), 2) == "Q in \\boxed{}:a\n\nb\n\n"


class _InterruptAfter(Labeller):
    def __init__(self, *args, stop_after_calls, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_after_calls = stop_after_calls

    def _complete(self, prompts, greedy):
        if self.generate_calls >= self.stop_after_calls:
            raise KeyboardInterrupt
        return super()._complete(prompts, greedy)


def test_resume_recomputes_nothing_finished(tmp_path):
    path = build_tiny(tmp_path / "m", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                       intermediate_size=64), seed=0)
    model, tok = load_causal_lm(path).eval(), load_tokenizer(path)
    records = synthetic_records(0, 6, 2, 3)
    solutions = [Solution(r, r.solution_steps) for r in records]
    kwargs = dict(fmt=PromptFormat(), num_completions=2, max_new_tokens=8,
                  temperature=1.0, prefixes_per_batch=100)
    # One generate call per shard (all its prefixes fit one batch); 3 shards of 2 solutions.
    interrupted = _InterruptAfter(model, tok, stop_after_calls=2, **kwargs)
    with pytest.raises(KeyboardInterrupt):
        label_in_shards(interrupted, solutions, tmp_path / "shards", 2, progress=False)
    assert len(list((tmp_path / "shards").glob("shard-*.jsonl"))) == 2
    resumed = Labeller(model, tok, **kwargs)
    labelled = label_in_shards(resumed, solutions, tmp_path / "shards", 2, progress=False)
    assert resumed.generate_calls == 1  # only the unfinished shard
    assert [x.steps for x in labelled] == [s.steps for s in solutions]
    # Reference solutions are right: their last label is 1 whatever the completer does.
    assert all(x.hard[-1] == 1.0 and x.soft[-1] == 1.0 for x in labelled)
    stats = label_statistics(labelled)
    assert stats["label/solutions"] == 6


def test_batched_equals_per_prefix_with_greedy(tmp_path):
    path = build_tiny(tmp_path / "m", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                       intermediate_size=64), seed=1)
    model, tok = load_causal_lm(path).eval(), load_tokenizer(path)
    solutions = [Solution(r, r.solution_steps) for r in synthetic_records(1, 4, 2, 3)]
    labeller = Labeller(model, tok, PromptFormat(), 1, 8, 1.0, prefixes_per_batch=100)
    batched = labeller.label(solutions, greedy=True, batched=True)
    calls = labeller.generate_calls
    single = labeller.label(solutions, greedy=True, batched=False)
    assert calls == 1 and labeller.generate_calls - calls == sum(len(s.steps) - 1
                                                                  for s in solutions)
    assert [x.hard for x in batched] == [x.hard for x in single]
    assert [x.soft for x in batched] == [x.soft for x in single]


def test_streamed_step_ends_equal_the_prefix_search_on_any_tokens():
    """The one-pass streaming decode (checked by two prefix decodes a step) finds the token
    ending each step exactly where the binary search over prefix decodes finds it: on GPT-2's
    byte-level BPE, for sampled-looking token sequences that split multi-byte characters (é, 中,
    an emoji) across tokens and end with EOS, and for random tokens with many line breaks."""
    import random

    from runtime import steps
    from runtime.tiny_model import tiny_tokenizer

    tok = tiny_tokenizer("gpt2")

    def searched(ids, text):
        saved, steps.streamed_lengths = steps.streamed_lengths, lambda *a: None
        try:
            return steps.step_end_token_indices(tok, ids, text)
        finally:
            steps.streamed_lengths = saved

    rng = random.Random(0)
    cases = [tok("\n".join(f"{i} + é 中文 🙂 = {rng.randint(1, 99)}" for i in range(12)),
                 add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    cases += [[rng.choice([198, rng.randrange(50257)]) for _ in range(60)] for _ in range(50)]
    for ids in cases:
        text = tok.decode(ids, skip_special_tokens=True)
        found = step_end_token_indices(tok, ids, text)
        assert found == searched(ids, text)
    assert steps.streamed_lengths(tok, cases[0]) is not None  # the streamed path ran
