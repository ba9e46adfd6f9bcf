"""The built-in offline task: seeded multi-step arithmetic word problems.

A problem is a start value and a chain of operations applied in order:

    Start with 7. Add 3. Multiply by 2. Subtract 4.

and its worked solution is one step a line, each restating the operation it carries out, then a
final answer line:

    Add 3: 7+3=10
    Multiply by 2: 10*2=20
    Subtract 4: 20-4=16
    The answer is 16

Restating the operation makes "which operation comes next" a copy of the text that follows the
previous one in the question, which a few-million-parameter model learns in minutes on 2 CPU cores;
the arithmetic (values up to 99, operands up to 9) is what it then gets partly right. Every step is
checkable, so `corrupt_solution` produces solutions whose first wrong step is known: later stages
measure process-label accuracy against that ground truth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ANSWER_PREFIX = "The answer is "
MAX_VALUE = 99
MAX_OPERAND = 9
_CLAUSES = {"+": "Add {n}", "-": "Subtract {n}", "*": "Multiply by {n}"}
_VERBS = {"Add": "+", "Subtract": "-", "Multiply by": "*"}


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[str, ...]
    """Worked solution, one step a line; the last step is the final answer line."""
    answer: int


OPERATIONS = "+-*"
"""Every operation a problem may ask for; `operations="+-"` leaves out multiplication: additions
and subtractions only, whose carry and borrow slips (+-10) can cancel, where a slip before a
multiplication is multiplied with it."""


def _random_op(rng: random.Random, value: int, operations: str = OPERATIONS) -> tuple[str, int]:
    """A random operation that keeps the running value in [1, MAX_VALUE]: an addition, a
    subtraction, or where `operations` has `*`, a multiplication."""
    choices = ((["+"] if value < MAX_VALUE else []) + (["-"] if value > 1 else [])
               + (["*"] if "*" in operations and 2 <= value <= MAX_VALUE // 2 else []))
    op = rng.choice(choices)
    if op == "+":
        return op, rng.randint(1, min(MAX_OPERAND, MAX_VALUE - value))
    if op == "-":
        return op, rng.randint(1, min(value - 1, MAX_OPERAND))
    return op, rng.randint(2, min(4, MAX_VALUE // value))


def _apply(value: int, op: str, n: int) -> int:
    return value + n if op == "+" else value - n if op == "-" else value * n


def render_step(value: int, op: str, n: int, result: int) -> str:
    """`Add 3: 7+3=10`."""
    return f"{_CLAUSES[op].format(n=n)}: {value}{op}{n}={result}"


def make_problem(rng: random.Random, min_ops: int, max_ops: int,
                 operations: str = OPERATIONS) -> Problem:
    value = rng.randint(2, 20)
    question = [f"Start with {value}."]
    steps = []
    for _ in range(rng.randint(min_ops, max_ops)):
        op, n = _random_op(rng, value, operations)
        result = _apply(value, op, n)
        question.append(_CLAUSES[op].format(n=n) + ".")
        steps.append(render_step(value, op, n, result))
        value = result
    steps.append(f"{ANSWER_PREFIX}{value}")
    return Problem(" ".join(question), tuple(steps), value)


def make_problems(seed: int, count: int, min_ops: int = 2, max_ops: int = 4,
                  operations: str = OPERATIONS) -> list[Problem]:
    """`count` problems, the same for the same seed (and `operations`)."""
    rng = random.Random(seed)
    return [make_problem(rng, min_ops, max_ops, operations) for _ in range(count)]


def true_chain(question: str) -> list[tuple[int, str, int, int]]:
    """(value, op, operand, result) of each operation the question asks for."""
    sentences = question.rstrip(".").split(". ")
    value = int(sentences[0].removeprefix("Start with "))
    chain = []
    for sentence in sentences[1:]:
        verb, n = sentence.rsplit(" ", 1)
        op = _VERBS[verb]
        result = _apply(value, op, int(n))
        chain.append((value, op, int(n), result))
        value = result
    return chain


def step_correctness(question: str, steps: list[str] | tuple[str, ...]) -> list[bool]:
    """Ground truth for a (possibly model-written) solution: is each step still on track?

    A step is correct when it and every step before it are exactly the true solution's steps
    (right operation, operand carried over, result). Once a step goes wrong every later step is
    wrong too (the gold answer can no longer be reached from it): the Math-Shepherd notion of a
    step's correctness.
    """
    chain = true_chain(question)
    truth = [render_step(*link) for link in chain] + [f"{ANSWER_PREFIX}{chain[-1][3]}"]
    out, on_track = [], True
    for k, step in enumerate(steps):
        on_track = on_track and k < len(truth) and step.strip() == truth[k]
        out.append(on_track)
    return out


def carries(value: int, op: str, n: int) -> bool:
    """Does this step carry (an addition whose units overflow) or borrow (a subtraction whose
    units underflow)?"""
    return (op == "+" and value % 10 + n >= 10) or (op == "-" and value % 10 < n)


def slipped_result(value: int, op: str, n: int) -> int:
    """`value op n` with the tens digit left as it was: the carry or borrow forgotten."""
    if op == "*" or not carries(value, op, n):
        return _apply(value, op, n)
    units = (value % 10 + n) % 10 if op == "+" else (value % 10 - n) % 10
    return value // 10 * 10 + units


def carry_slip_solution(problem: Problem) -> tuple[str, ...]:
    """The worked solution of a student who forgets to carry and to borrow: every step that
    carries or borrows keeps the tens digit (`Add 5: 27+5=22`, `Subtract 5: 32-5=37`), and the
    next steps compute correctly from the wrong value. A slip moves the value by a multiple of
    ten, so later steps carry exactly where the right solution's do: the slips land on the same
    steps whatever came before. Solutions with no carry or borrow come back unchanged."""
    value = true_chain(problem.question)[0][0]
    steps = []
    for _, op, n, _ in true_chain(problem.question):
        result = slipped_result(value, op, n)
        steps.append(render_step(value, op, n, result))
        value = result
    steps.append(f"{ANSWER_PREFIX}{value}")
    return tuple(steps)


def corrupt_solution(problem: Problem, rng: random.Random) -> tuple[tuple[str, ...], int]:
    """A wrong solution whose first wrong step is known: (steps, first_wrong_index).

    One computation step goes wrong, either in its result (an arithmetic slip) or in the operand
    it reads from the question (a reading slip); later steps compute correctly from the wrong
    value, as a model that slipped once would, so the final answer is wrong too.
    """
    chain = true_chain(problem.question)
    k = rng.randrange(len(chain))
    steps = list(problem.steps[:k])
    value = chain[k][0]
    for j in range(k, len(chain)):
        _, op, n, true_result = chain[j]
        if j == k and rng.random() < 0.5:
            n = max(1, n + rng.choice([-1, 1]) * rng.randint(1, 3))
            if n == chain[j][2]:
                n += 1
        result = _apply(value, op, n)
        if j == k and result == true_result:  # a slip must change the value
            result += rng.choice([-1, 1]) * rng.randint(1, 10)
        steps.append(render_step(value, op, n, result))
        value = result
    steps.append(f"{ANSWER_PREFIX}{value}")
    return tuple(steps), k
