"""Adversarial model outputs for the grader and the reward path (used by tests/test_hostile.py).

`hostile_outputs(canary)` returns over 200 completions: enormous powers and factorials, deep
nesting, megabyte strings, unbalanced LaTeX, control characters, code-injection payloads aimed at
`canary` (a file a successful injection would create), shell snippets, unicode look-alikes and
many `\\boxed{}`. Each payload is also placed in the three places a final answer is read from.
"""

from __future__ import annotations

INJECTIONS = [
    "__import__('pathlib').Path('{canary}').touch()",
    "__import__('os').system('touch {canary}')",
    "__import__('subprocess').call(['touch', '{canary}'])",
    "exec(\"open('{canary}', 'w').write('x')\")",
    "eval(\"__import__('pathlib').Path('{canary}').touch()\")",
    "(lambda: __import__('pathlib').Path('{canary}').touch())()",
    "open('{canary}', 'w')",
    "compile('open(\"{canary}\",\"w\")', 'x', 'exec')",
    "globals()['__builtins__']['open']('{canary}', 'w')",
    "().__class__.__base__.__subclasses__()",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{canary}'])",
    "getattr(__import__('os'), 'system')('touch {canary}')",
    "__import__('builtins').open('{canary}', 'w')",
    "Symbol('x').__class__.__init__.__globals__['__builtins__']['open']('{canary}', 'w')",
    "Integer(1).__reduce_ex__(2)",
    "import os; os.system('touch {canary}')",
    "\"; __import__('os').system('touch {canary}'); \"",
    "\\input{{canary}}",
    "\\immediate\\write18{touch {canary}}",
    "\\def\\x{\\x}\\x",
    "{{ config.__class__.__init__.__globals__['os'].system('touch {canary}') }}",
    "${__import__('os').system('touch {canary}')}",
]
SHELL = [
    "$(touch {canary})", "`touch {canary}`", "; touch {canary}", "&& touch {canary}",
    "| sh -c 'touch {canary}'", "1; rm -rf / --no-preserve-root", "$((1+2))", "${IFS}touch${IFS}{canary}",
    ":(){ :|:& };:", "1 > {canary}", "cat /etc/passwd", "\\x74ouch {canary}",
]
HUGE = [
    "9^{9^{9^9}}", "9^{9^9}", "10^{10^{10}}", "2^{2^{2^{2^{2}}}}", "99999999^{99999999}",
    "9**9**9**9", "10**10**10", "(10^{100})!", "100000!", "\\sqrt{2}^{10^{10}}", "x^{10^{10}}-1",
    "e^{10^{10}}", "\\sum_{n=1}^{10^{12}} n", "\\prod_{k=1}^{10^{9}} k", "10^{1000000}",
    "\\binom{10^{9}}{10^{8}}", "\\int_0^1 e^{x^{99}} dx", "1e999999", "10^{-10^{10}}",
    "\\lim_{n\\to\\infty} (1+1/n)^{n^{n}}", "\\Gamma(10^{9})", "2^{3^{4^{5}}}", "(2^{64})^{2^{64}}",
]
NESTED = (
    ["\\frac{1}{" * d + "2" + "}" * d for d in (8, 30, 200, 2000)]
    + ["{" * d + "1" + "}" * d for d in (13, 100, 5000)]
    + ["(" * d + "1" + ")" * d for d in (13, 100, 5000)]
    + ["\\sqrt{" * d + "2" + "}" * d for d in (20, 500)]
    + ["\\left(" * d + "1" + "\\right)" * d for d in (20, 300)]
)
UNBALANCED = [
    "\\frac{1}{2", "\\frac{1", "{{{{", "}}}}", "\\left( 1", "1 \\right)", "\\begin{matrix} 1 & 2",
    "\\end{array}", "$1", "$$", "\\sqrt{", "\\boxed{", "\\boxed{1", "\\frac{}{}", "\\\\\\\\",
    "^^^^", "_{_{_{", "\\", "\\begin{cases} x & y", "\\text{", "\\mathrm{\\mathrm{\\mathrm{",
    "\\frac{\\frac{\\frac{", "]]]]", "\\left[ \\right)", "1/0", "0/0", "\\infty - \\infty",
]
CONTROL = [
    "3\x00", "\x00" * 100, "3\x1b[31m", "\x07\x08\x0b\x0c", "3\r\n4", "\ufeff3", "3\u200b",
    "\u202e3\u202c", "3\x7f", "\x00\\boxed{3}",
]
UNICODE = [
    "３", "\u0663", "\u09e9", "²", "³", "Ⅲ", "𝟑", "𝟛", "3\u0301", "\u0417",  # fullwidth, Arabic-Indic...
    "O", "О", "l", "ⅼ", "−3", "–3", "3️⃣", "∞", "½", "⅓", "٣٫٥", "𝔵^{2}", "x\u0336", "ℯ",
    "\ud800", "3" + "\u0300" * 500, "🙂" * 1000, "\U0010ffff", "３ + ４", "٣",
]
MANY_BOXED = [
    "\\boxed{1}" * 5000, "\\boxed{" * 1000, "\\boxed{\\boxed{\\boxed{3}}}",
    "".join(f"\\boxed{{{i}}}" for i in range(3000)), "\\boxed{}" * 100, "\\boxed{3} \\boxed{}",
    "\\fbox{3}" * 200, "\\boxed{3}\\boxed{4}", "\\boxed{" + "}" * 50, "\\boxed{3}}}}}}",
]
MEGABYTE = [
    "9" * 1_000_000, "{" * 1_000_000, "\\frac{1}{2}" * 90_000, "a" * 1_000_000,
    "The answer is " * 70_000, "\n" * 1_000_000,
]
MISC = [
    "", " ", "The answer is", "The answer is ", "####", "NaN", "nan", "inf", "-inf", "None",
    "True", "null", "undefined", "3.0000000000000000000000000000001", "0x3", "0b11", "3j",
    "1,000,000,000,000,000,000,000", "-0", "+3", "3.", ".3e1", "1e308*10", "\\text{three}",
    "x = 3", "3 \\text{ apples}", "3\\%", "\\$3", "3^\\circ", "\\pm 3",
]
WRAPPERS = ("\\boxed{{x}}", "The answer is {x}", "#### {x}")


def hostile_outputs(canary: str) -> list[tuple[str, str]]:
    """(category, completion) pairs: every payload in every wrapper (megabyte strings in two:
    they cost time, not variety)."""
    categories = {
        "injection": [p.replace("{canary}", canary) for p in INJECTIONS],
        "shell": [p.replace("{canary}", canary) for p in SHELL],
        "huge": HUGE, "nested": NESTED, "unbalanced": UNBALANCED, "control": CONTROL,
        "unicode": UNICODE, "many_boxed": MANY_BOXED, "misc": MISC,
    }
    outputs = [(name, w.replace("{x}", p)) for name, payloads in categories.items()
               for p in payloads for w in WRAPPERS]
    outputs += [("megabyte", m) for m in MEGABYTE]
    outputs += [("megabyte", f"The answer is {m}") for m in MEGABYTE]
    return outputs
