"""Answer grading: extract a final answer, decide equivalence with math-verify under a time limit.

Model text is never passed to eval/exec/sympify: plain numbers are compared exactly with
`fractions.Fraction`; everything else goes through math-verify's LaTeX parser only (its plain
expression extractor calls sympy's `parse_expr`, which evaluates Python, so it is used for trusted
gold answers alone). Parsing and verification each run under a signal-based time limit, and
answers whose evaluation could outrun it inside C code (power towers, huge exponents or
factorials, deep nesting, control characters) are judged wrong before any parsing.
"""

from __future__ import annotations

import re
from fractions import Fraction

ANSWER_PATTERNS = (
    re.compile(r"[Tt]he (?:final )?answer is[:\s]*\$?([^\n$]*?)\$?\s*\.?\s*$", re.MULTILINE),
    re.compile(r"####\s*([^\n]+)"),
)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)  # no look-alike digits
MAX_ANSWER_CHARS = 200
"""Longer 'answers' are judged wrong without parsing: no real final answer is that long."""
MAX_NESTING = 12
"""Deeper brace/parenthesis nesting is judged wrong without parsing."""
_COSTLY = (
    re.compile(r"(?:\^|\*\*)\s*[{(]?\s*\d+\s*(?:\^|\*\*)"),  # numeric power towers: 9^{9^9}
    re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{4,}"),       # exponents of 1000 and more
    re.compile(r"\d{4,}\s*[})]?\s*!"),                       # factorials of 1000 and more
    re.compile(r"\([^()]*\^[^()]*\)\s*!"),                   # factorials of powers: (10^{100})!
    re.compile(r"[\x00-\x08\x0b-\x1f\x7f]"),                 # control characters
)


def too_costly(answer: str) -> bool:
    """Would evaluating this answer risk outrunning the time limit? (Judged wrong unparsed.)"""
    depth = deepest = 0
    for char in answer:
        if char in "{(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})":
            depth -= 1
    return deepest > MAX_NESTING or any(p.search(answer) for p in _COSTLY)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer a solution states: `\\boxed{}`, else 'The answer is X', else '#### X'."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in ANSWER_PATTERNS:
        matches = pattern.findall(text)
        if matches:
            return matches[-1].strip()
    return None


def _as_number(text: str) -> Fraction | None:
    cleaned = text
    for noise in ("\\!", "\\,", "\\ ", ",", "\\$", "$"):  # LaTeX thin spaces, thousands, dollars
        cleaned = cleaned.replace(noise, "")
    cleaned = cleaned.strip()
    if _NUMBER.fullmatch(cleaned):
        return Fraction(cleaned)
    return None


def answers_match(predicted: str, gold: str, timeout_s: int = 2) -> bool:
    """Is the predicted final answer equivalent to the gold one?"""
    if len(predicted) > MAX_ANSWER_CHARS or too_costly(predicted):
        return False
    pred_num, gold_num = _as_number(predicted), _as_number(gold)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    from math_verify import LatexExtractionConfig, parse, verify

    try:
        gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout_s)
        pred_parsed = parse(_as_latex(predicted), extraction_config=[LatexExtractionConfig()],
                            parsing_timeout=timeout_s)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    except Exception:  # math-verify raises on pathological input; that answer is simply wrong
        return False


def _as_latex(answer: str) -> str:
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def grade(completion: str, gold: str, timeout_s: int = 2) -> bool:
    """Is the final answer stated in `completion` equivalent to `gold`?"""
    predicted = extract_final_answer(completion)
    return predicted is not None and answers_match(predicted, gold, timeout_s)
