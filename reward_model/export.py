"""A trained reward model as others load it: its labels named and a model card beside it.

`igrpo train-rm` exports each family in its ecosystem's layout (`save_pretrained`), and this
module adds what a reader outside the project needs to use it:

- `name_labels`: a token-classification PRM's classes named in its config (config.json's
  `id2label`/`label2id`): the class read as a right step `right_step`, the other `wrong_step`,
  instead of transformers' LABEL_0/LABEL_1. Set on the model's config before the save (under
  ZeRO-3 the config is whole on every rank: only the weights are partitioned).
- `model_card`: a Hugging Face README.md (YAML front matter, then the text) saying the family, the
  architecture, the separator or step tag and their token ids, how a step score is read, the
  prompt's layout, the training data and the final validation metrics, and a plain-transformers
  snippet that reproduces the project's step scores (tests/test_rm_export.py runs the snippet,
  taken from the card, without the project importable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reward_model.families import Reading

RIGHT_STEP, WRONG_STEP = "right_step", "wrong_step"
GENERATED = ("examples the run generated: the policy's samples labelled Math-Shepherd style "
             "(`igrpo iterate`, with replayed rows and SFT worked solutions), or synthetic "
             "solutions with a known first wrong step (`igrpo train-rm` without `rm.data_path`)")
"""The training data a card names where no file was read."""
KINDS = {"prm": ("Process reward model", "process-reward-model", "a score for each step"),
         "orm": ("Outcome reward model", "outcome-reward-model",
                 "the whole solution is one step, scored once")}
"""`rm.kind` -> (title, Hub tag, what it scores)."""


def name_labels(hf_config, label_index: int) -> dict[int, str]:
    """Name a token classifier's classes in `hf_config` (the model's transformers
    `PretrainedConfig`, not the project's): class `label_index` is `right_step`, the other of two
    `wrong_step` (of more, `LABEL_k` as transformers names them). Returns the `id2label` set."""
    n = hf_config.num_labels
    names = {i: RIGHT_STEP if i == label_index else WRONG_STEP if n == 2 else f"LABEL_{i}"
             for i in range(n)}
    hf_config.id2label = names
    hf_config.label2id = {name: i for i, name in names.items()}
    return names


@dataclass(frozen=True)
class CardFacts:
    """What a reward model's card states, besides what its tokenizer tells (token ids)."""

    token_classifier: bool
    """A token-classification PRM (TRL's layout); else the Math-Shepherd tag LM."""
    architecture: str
    """The model's class, e.g. `Qwen2ForTokenClassification`."""
    reading: Reading
    """Separator, class, activation and prompt layout (token classifier)."""
    step_tag: str
    """The Math-Shepherd tag (tag LM)."""
    kind: str
    """`rm.kind`: prm or orm."""
    max_length: int
    data: str = ""
    """The training file read; empty = examples the run generated (`GENERATED`)."""
    rows: tuple[int, int] = (0, 0)
    """(training, validation) examples."""
    optimizer_steps: int = 0
    metrics: dict = field(default_factory=dict)
    """The final validation metrics (`reward_model.evaluate.step_metrics`)."""
    init: str = ""
    """The backbone or reward model training started from."""
    calibrated: bool = False
    """The tag LM carries a fitted likelihood feature (`reward_model/likelihood_feature.py`)."""
    remote_code: bool = False
    """The architecture's code comes with the checkpoint (`model.trust_remote_code`): the
    snippet loads it with `trust_remote_code=True`."""


def model_card(tokenizer, facts: CardFacts) -> str:
    """The README.md of the export: front matter, the reading, the training, the snippet."""
    title, tag, scores = KINDS.get(facts.kind, ("Reward model", "reward-model", "scores"))
    if facts.token_classifier:
        family, layout, pipeline, origin = ("token_classification", "TRL PRMTrainer layout",
                                            "token-classification", "trl")
        reading, snippet = _classifier_reading(tokenizer, facts), _classifier_snippet(facts)
    else:
        family, layout, pipeline, origin = ("tag_lm", "Math-Shepherd layout", "text-generation",
                                            "math-shepherd")
        reading, snippet = _tag_reading(tokenizer, facts), _tag_snippet(facts)
    tags = [tag, "reward-model", "math", origin, "iterative-grpo"]
    return "\n".join([
        "---", "library_name: transformers", f"pipeline_tag: {pipeline}", "tags:",
        *[f"- {t}" for t in tags], "---", "",
        f"# {title} (`{family}`, {layout})", "",
        f"A {title.lower()} ({scores}), trained with `igrpo train-rm` (iterative-grpo: "
        "DeepSeekMath's RL recipe). A step's score is the probability that the step is right.",
        "", "## How it reads a solution", "", *reading,
        f"- Inputs are cut at {facts.max_length} tokens; a step whose read position falls past "
        "the cut gets no score.", "", *_training(facts), "",
        "## Step scores with plain transformers", "",
        "Run from this folder (or set `MODEL` to its Hub id):", "",
        "```python", snippet.strip(), "```", ""])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _classifier_reading(tokenizer, facts: CardFacts) -> list[str]:
    r = facts.reading
    sep = _ids(tokenizer, r.separator)
    probability = (f"softmax over the classes, class {r.label_index}" if r.activation == "softmax"
                   else f"sigmoid of class {r.label_index}'s logit")
    if r.chat_template:
        prompt = ("the tokenizer's chat template: " + ("a system turn "
                  f"{r.system_prompt!r}, then " if r.system_prompt else "")
                  + "the question as the user's turn, up to the assistant's turn "
                  "(`add_generation_prompt=True`), as Qwen2.5-Math-PRM is read")
    else:
        prompt = (f"BOS (token {tokenizer.bos_token_id}) then the question's tokens, as TRL's "
                  "PRMTrainer lays it out" if tokenizer.bos_token_id is not None
                  else "the question's tokens (the tokenizer has no BOS), as TRL's PRMTrainer "
                  "lays it out")
    return [f"- Family: `token_classification` — `{facts.architecture}` "
            "(`AutoModelForTokenClassification`), config.json's `id2label` names the classes "
            f"(class {r.label_index} = `{RIGHT_STEP}`).",
            f"- Prompt: {prompt}.",
            f"- Steps: each step's tokens, then the separator {r.separator!r} (token ids {sep}); "
            "each piece tokenised on its own, without special tokens.",
            f"- Step score: {probability}, at the separator's last token (id {sep[-1]}) after "
            "the step. TRL's PRMTrainer reads a softmax over its 2 labels, class 1, there."]


def _tag_reading(tokenizer, facts: CardFacts) -> list[str]:
    tag, plus, minus = (_ids(tokenizer, t)[-1] for t in (facts.step_tag, "+", "-"))
    lines = [f"- Family: `tag_lm` — `{facts.architecture}` (`AutoModelForCausalLM`), read as "
             "Math-Shepherd's PRMs are.",
             f"- Input: Math-Shepherd text, `{{question}} Step 1: {{step 1}} {facts.step_tag}\\n"
             f"Step 2: {{step 2}} {facts.step_tag}` ...; the tag is removed from the question and "
             "the steps, which are stripped; tokenised with the tokenizer's special tokens.",
             f"- Step tag {facts.step_tag!r} (token id {tag}); labels '+' (token id {plus}) and "
             f"'-' (token id {minus}).",
             "- Step score: P(+), a softmax over the logits of '+' and '-' at each tag token."]
    if facts.calibrated:
        lines.append("- This model carries a fitted likelihood feature (config.json "
                     "`igrpo_step_calibration`): the project's step score is the sigmoid of "
                     "`margin` x (logit '+' - logit '-') + `surprise` x (the lowest token "
                     "log-likelihood of the solution so far) + `bias`; the snippet reads P(+).")
    return lines


def _training(facts: CardFacts) -> list[str]:
    train, val = facts.rows
    data = f"`{facts.data}`" if facts.data else GENERATED
    lines = ["## Training", "", f"- Kind: `{facts.kind}`.",
             f"- Data: {data}; {train + val} examples, {train} trained on, {val} held out for "
             "validation (split by question)."]
    if facts.init:
        lines.append(f"- Started from: `{facts.init}`.")
    lines += [f"- Optimizer steps: {facts.optimizer_steps}.", "", "## Validation (final)", ""]
    shown = {k: v for k, v in facts.metrics.items() if k != "steps"}
    if not shown:
        return lines + ["No validation split."]
    if "steps" in facts.metrics:
        lines += [f"{int(facts.metrics['steps'])} labelled steps of the {val} held-out examples; "
                  "a step is judged right where its score is >= 0.5.", ""]
    return lines + ["| metric | value |", "| --- | --- |"] + [
        f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in shown.items()]


def _classifier_snippet(facts: CardFacts) -> str:
    r, remote = facts.reading, ", trust_remote_code=True" if facts.remote_code else ""
    if r.chat_template:
        system = (f'[{{"role": "system", "content": {r.system_prompt!r}}}] + '
                  if r.system_prompt else "")
        prompt = f'''
def prompt_ids(question):
    turns = {system}[{{"role": "user", "content": question}}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
'''
    else:
        prompt = '''
def prompt_ids(question):  # BOS + the question, as TRL's PRMTrainer lays it out
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids
'''
    read = ("torch.softmax(logits, -1)[:, RIGHT]" if r.activation == "softmax"
            else "torch.sigmoid(logits[:, RIGHT])")
    return f'''
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

MODEL = "."
SEPARATOR = {r.separator!r}
RIGHT = {r.label_index}  # config.json: label2id["{RIGHT_STEP}"]
MAX_LENGTH = {facts.max_length}

tokenizer = AutoTokenizer.from_pretrained(MODEL{remote})
model = AutoModelForTokenClassification.from_pretrained(MODEL{remote}).eval()
separator = tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]

{prompt}

def step_scores(question, steps):
    """The probability that each step is right, read at its separator's last token."""
    ids, ends = prompt_ids(question), []
    for step in steps:
        ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        ends.append(len(ids) - 1)
    ids = ids[:MAX_LENGTH]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    probs = {read}
    return [probs[e].item() for e in ends if e < len(ids)]


print(step_scores("What is 3 + 4?", ["3 + 4 = 7", "The answer is 7"]))
'''


def _tag_snippet(facts: CardFacts) -> str:
    remote = ", trust_remote_code=True" if facts.remote_code else ""
    return f'''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = "."
STEP_TAG = {facts.step_tag!r}
MAX_LENGTH = {facts.max_length}

tokenizer = AutoTokenizer.from_pretrained(MODEL{remote})
model = AutoModelForCausalLM.from_pretrained(MODEL{remote}).eval()
tag, plus, minus = (tokenizer(t, add_special_tokens=False)["input_ids"][-1]
                    for t in (STEP_TAG, "+", "-"))


def step_scores(question, steps):
    """P(+) at each step's tag: the probability that the step is right."""
    body = "\\n".join(f"Step {{k + 1}}: {{s.replace(STEP_TAG, '').strip()}} {{STEP_TAG}}"
                     for k, s in enumerate(steps))
    text = question.replace(STEP_TAG, "").strip() + " " + body
    ids = tokenizer(text)["input_ids"][:MAX_LENGTH]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    at = [i for i, t in enumerate(ids) if t == tag]
    return torch.softmax(logits[at][:, [plus, minus]], -1)[:, 0].tolist()


print(step_scores("What is 3 + 4?", ["3 + 4 = 7", "The answer is 7"]))
'''
