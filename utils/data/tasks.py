"""Generated tasks with checkable answers: `--data_path task:NAME[?OPTION=VALUE&...]`, no download.

A task generates its records from its own `seed` option, independent of `--seed`, so the problems
are the same whatever the training seed; `--data_split` and `--eval_fraction` then shard them like
any other source. Each record gives one sample: the question as the user turn, a short worked
solution as `chosen`, the same solution with a slip as `rejected`, and metadata
{"answer", "task", ...} for step 3's verifiers. Every solution ends in `FINAL_ANSWER_TEMPLATE`.
Options are integers; a task is one entry of `TASKS`.

`task:arithmetic` options: `difficulty` (1-5, default 2), `size` (at most this many problems,
default 2000; a level with fewer distinct problems gives all of them), `seed` (default 0).
Levels (a "two-digit" number is 10-99, a "digit" multiplier 2-9):
1. a + b, a and b 0-9 (100 distinct problems).
2. a + b or a - b of two two-digit numbers, a >= b for subtraction (12,195 distinct).
3. a ± b ± c of three two-digit numbers; the answer may be negative (2,916,000 distinct).
4. a * b ± c: a and c two-digit, b a digit (129,600 distinct).
5. a * b ± c * d: a and c two-digit, b and d digits; the answer may be negative (1,036,800 distinct).
The solution writes one "x op y = z" per step, left to right (products first); e.g. level 3:
"37 + 48 = 85, 85 - 19 = 66. The answer is 66." The slip adds ±1, ±2 or ±10 to one step's result
(the last: a wrong final sum; an earlier one: a wrong intermediate carried to the end).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from utils.errors import UserError

from .samples import USER, Sample

TASK_PREFIX = "task:"
FINAL_ANSWER_TEMPLATE = "The answer is {}."
SLIP_SIZES = (1, 2, 10)


@dataclass(frozen=True)
class Problem:
    """One generated record."""

    question: str
    solution: str
    wrong_solution: str
    metadata: dict


@dataclass(frozen=True)
class Task:
    """`generate(**options)` gives the problems; `options` maps each option name to its default."""

    generate: Callable[..., list[Problem]]
    options: Mapping[str, int]


@dataclass(frozen=True)
class Ref:
    """The result of an earlier step of a solution."""

    step: int


Step = tuple  # (left, op, right): operands are ints or `Ref`s, op one of "+", "-", "*"
_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def _two_digit(rng: random.Random) -> int:
    return rng.randint(10, 99)


def _digit_factor(rng: random.Random) -> int:
    return rng.randint(2, 9)


def _sign(rng: random.Random) -> str:
    return rng.choice("+-")


def _level_1(rng: random.Random) -> list[Step]:
    return [(rng.randint(0, 9), "+", rng.randint(0, 9))]


def _level_2(rng: random.Random) -> list[Step]:
    a, b, op = _two_digit(rng), _two_digit(rng), _sign(rng)
    if op == "-" and a < b:
        a, b = b, a
    return [(a, op, b)]


def _level_3(rng: random.Random) -> list[Step]:
    return [(_two_digit(rng), _sign(rng), _two_digit(rng)), (Ref(0), _sign(rng), _two_digit(rng))]


def _level_4(rng: random.Random) -> list[Step]:
    return [(_two_digit(rng), "*", _digit_factor(rng)), (Ref(0), _sign(rng), _two_digit(rng))]


def _level_5(rng: random.Random) -> list[Step]:
    first, second = (_two_digit(rng), "*", _digit_factor(rng)), (_two_digit(rng), "*", _digit_factor(rng))
    return [first, second, (Ref(0), _sign(rng), Ref(1))]


# difficulty -> (draw the steps of one problem, how many distinct problems the level has)
LEVELS: dict[int, tuple[Callable[[random.Random], list[Step]], int]] = {
    1: (_level_1, 10 * 10),
    2: (_level_2, 90 * 90 + 90 * 91 // 2),
    3: (_level_3, 90**3 * 4),
    4: (_level_4, 90 * 8 * 90 * 2),
    5: (_level_5, (90 * 8) ** 2 * 2),
}


def _results(steps: list[Step], slip_step: int | None = None, slip: int = 0) -> list[int]:
    """Each step's result; `slip` is added to step `slip_step`'s and carried into later steps."""
    results: list[int] = []
    for index, (left, op, right) in enumerate(steps):
        values = [results[x.step] if isinstance(x, Ref) else x for x in (left, right)]
        results.append(_APPLY[op](*values) + (slip if index == slip_step else 0))
    return results


def _expression(steps: list[Step], index: int) -> str:
    """Step `index` written out with the steps it refers to inlined (the levels need no parentheses)."""
    left, op, right = steps[index]
    return " ".join(_expression(steps, x.step) if isinstance(x, Ref) else str(x) for x in (left, op, right))


def _question(steps: list[Step]) -> str:
    return f"Compute {_expression(steps, len(steps) - 1)}."


def _solution(steps: list[Step], results: list[int]) -> str:
    lines = []
    for (left, op, right), result in zip(steps, results):
        shown = [results[x.step] if isinstance(x, Ref) else x for x in (left, right)]
        lines.append(f"{shown[0]} {op} {shown[1]} = {result}")
    return ", ".join(lines) + ". " + FINAL_ANSWER_TEMPLATE.format(results[-1])


def _slipped_results(steps: list[Step], rng: random.Random) -> list[int]:
    """The results with one plausible slip; a wrong non-negative result stays non-negative."""
    slip_step = rng.randrange(len(steps))
    slip = rng.choice(SLIP_SIZES) * rng.choice((1, -1))
    correct = _results(steps)[slip_step]
    if correct >= 0 > correct + slip:
        slip = -slip
    return _results(steps, slip_step, slip)


def generate_arithmetic(difficulty: int, size: int, seed: int) -> list[Problem]:
    """Up to `size` distinct problems of level `difficulty` (see the module docstring), in generation order."""
    if difficulty not in LEVELS:
        raise UserError(f"task:arithmetic difficulty must be one of {', '.join(map(str, LEVELS))}, not {difficulty}")
    if size < 1:
        raise UserError(f"task:arithmetic size must be at least 1, not {size}")
    draw, distinct = LEVELS[difficulty]
    rng = random.Random(seed)
    problems: dict[str, Problem] = {}
    while len(problems) < min(size, distinct):
        steps = draw(rng)
        question = _question(steps)
        if question in problems:
            continue
        results = _results(steps)
        metadata = {"answer": str(results[-1]), "task": "arithmetic", "difficulty": difficulty}
        problems[question] = Problem(question, _solution(steps, results), _solution(steps, _slipped_results(steps, rng)), metadata)
    return list(problems.values())


TASKS: dict[str, Task] = {
    "arithmetic": Task(generate_arithmetic, {"difficulty": 2, "size": 2000, "seed": 0}),
}


def is_task_spec(text: str) -> bool:
    return text.startswith(TASK_PREFIX)


def parse_task_spec(text: str) -> tuple[str, dict[str, int]]:
    """`task:NAME?OPTION=VALUE&...` -> (NAME, every option of the task, defaults filled in)."""
    name, _, query = text[len(TASK_PREFIX) :].partition("?")
    if name not in TASKS:
        raise UserError(f"unknown task '{name}' in '{text}'; choose one of: {', '.join(TASK_PREFIX + n for n in TASKS)}")
    options = dict(TASKS[name].options)
    given: set[str] = set()
    for pair in query.split("&") if query else ():
        key, sep, value = pair.partition("=")
        if not sep or key not in options or key in given:
            raise UserError(
                f"bad option '{pair}' in '{text}': give each of {', '.join(options)} at most once as OPTION=INTEGER, "
                f"e.g. {TASK_PREFIX}{name}?" + "&".join(f"{k}={v}" for k, v in options.items())
            )
        try:
            options[key] = int(value)
        except ValueError:
            raise UserError(f"option {key} of {TASK_PREFIX}{name} must be an integer, not '{value}'") from None
        given.add(key)
    return name, options


def canonical_task_spec(text: str) -> str:
    """The spec with every option written out in a fixed order, so equal tasks have equal names."""
    name, options = parse_task_spec(text)
    return f"{TASK_PREFIX}{name}?" + "&".join(f"{key}={value}" for key, value in sorted(options.items()))


def load_task_problems(text: str) -> list[Problem]:
    name, options = parse_task_spec(text)
    return TASKS[name].generate(**options)


def parse_task_problem(record: Problem, group: int) -> list[Sample]:
    """The sample of one generated problem (the `parse` of a task source)."""
    turn = {"role": USER, "content": record.question}
    return [Sample((turn,), record.solution, record.wrong_solution, group, record.metadata)]
