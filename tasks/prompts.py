"""How a question becomes the policy's prompt, and how a solution splits into steps.

One `PromptFormat` per run, built from `data.*` by `prompt_format`: the prompt template (a name
from `PROMPT_TEMPLATES` or a literal holding `{question}`), optionally wrapped in the tokenizer's
chat template as one user turn, and the separator that ends each solution step. `encode_prompts`
tokenises prompts the way the model expects: BOS where its tokenizer adds one (Llama, DeepSeek),
none where it adds none (Qwen2, GPT-2), and never twice (a chat template writes its own).
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_TEMPLATES = {
    "plain": "{question}\n",
    # DeepSeekMath §2.2 / §4.2: the chain-of-thought instruction of its SFT and RL data.
    "boxed": "{question}\nPlease reason step by step, and put your final answer within \\boxed{}.\n",
}
"""Named prompt templates `data.prompt_template` may name instead of spelling one out."""


def resolve_template(template: str) -> str:
    """A named template's text, or `template` itself; it must hold `{question}`."""
    text = PROMPT_TEMPLATES.get(template, template)
    if "{question}" not in text:
        raise ValueError(f"data.prompt_template={template!r}: not one of "
                         f"{sorted(PROMPT_TEMPLATES)} and holds no '{{question}}'")
    return text


@dataclass(frozen=True)
class PromptFormat:
    template: str = "{question}\n"
    """The prompt text, `{question}` replaced by the question (other braces are kept as they are:
    `\\boxed{}` needs no escaping)."""
    chat: bool = False
    """Wrap the filled template in the tokenizer's chat template, as one user turn."""
    step_separator: str = "\n"
    """What ends a solution step (the policy writes one step a line by default)."""

    def prompt(self, tokenizer, question: str) -> str:
        text = self.template.replace("{question}", question)
        if not self.chat:
            return text
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"data.chat_template=true, but the tokenizer "
                             f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    def prompts(self, tokenizer, records) -> list[str]:
        """The prompt of each record (anything with a `question`)."""
        return [self.prompt(tokenizer, r.question) for r in records]

    def join(self, steps) -> str:
        """Steps as the policy writes them."""
        return self.step_separator.join(steps)

    def prefix(self, steps) -> str:
        """Steps 1..k as a prefix the policy continues from (each closed by the separator)."""
        return "".join(step + self.step_separator for step in steps)


def prompt_format(data) -> PromptFormat:
    """The run's `PromptFormat`, from a `DataConfig`."""
    return PromptFormat(resolve_template(data.prompt_template), data.chat_template,
                        data.step_separator)


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each prompt with the special tokens the tokenizer adds to an input (a BOS for
    Llama-family tokenizers), except where the text already starts with the BOS token (a
    rendered chat template), so no prompt gets two."""
    bos = getattr(tokenizer, "bos_token", None)
    out = []
    for text in texts:
        add = not (bos and text.startswith(bos))
        out.append(tokenizer(text, add_special_tokens=add)["input_ids"])
    return out
