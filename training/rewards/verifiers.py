"""The built-in verifiers: rewards from checking an answer's text against the row's metadata.

The final answer of a text is the number of its last marker: the final-answer sentence of the
tasks (`utils.data.tasks.FINAL_ANSWER_TEMPLATE`, "The answer is N."; case and the period are not
checked here), "#### N" (GSM8K) or "\\boxed{N}"; without a marker, the text's last number.
Numbers may carry a sign, thousands separators ("1,234") and decimals; they compare by value
("3.50" equals "3.5").
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from training.rewards.functions import BUILTIN_REWARD_FUNCTIONS
from utils.data.tasks import FINAL_ANSWER_TEMPLATE
from utils.errors import UserError

# a sign only when not glued to a word or number ("85-19" holds 85 and 19), "1,234" grouped by threes
NUMBER = r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)"
ANSWER_PREFIX, ANSWER_SUFFIX = FINAL_ANSWER_TEMPLATE.split("{}")
_MARKERS = (
    re.compile(re.escape(ANSWER_PREFIX.strip()) + rf"\s*:?\s*({NUMBER})", re.IGNORECASE),
    re.compile(rf"####\s*({NUMBER})"),
    re.compile(rf"\\boxed\{{\s*({NUMBER})\s*\}}"),
)
_ANY_NUMBER = re.compile(NUMBER)
# no digit after the suffix: "The answer is 3.14" must not pass as "The answer is 3" and its period
_FINAL_SENTENCE = re.compile(re.escape(ANSWER_PREFIX) + f"({NUMBER})" + re.escape(ANSWER_SUFFIX) + r"(?!\d)")
NO_ANSWERS = (
    "builtin:math needs each prompt's expected answer in its metadata, but this data has no answers: "
    "use a task source (e.g. --data_path task:arithmetic) or give your rows a metadata column such as "
    '{"answer": "42"}'
)


def _value(number: str) -> Decimal:
    return Decimal(number.replace(",", "").replace("\u2212", "-"))


def final_number(text: str) -> Decimal | None:
    """The value of `text`'s final answer (see the module docstring); None when it holds no number."""
    marked = [match for pattern in _MARKERS for match in pattern.finditer(text)]
    if marked:
        return _value(max(marked, key=lambda match: match.start()).group(1))
    numbers = _ANY_NUMBER.findall(text)
    return _value(numbers[-1]) if numbers else None


def expected_answer(metadata: Mapping[str, Any] | None) -> Decimal:
    """The value of `metadata["answer"]`, or a `UserError` saying the data has no (numeric) answers."""
    answer = (metadata or {}).get("answer")
    if answer is None:
        raise UserError(NO_ANSWERS)
    text = str(answer).strip()
    if isinstance(answer, bool) or not re.fullmatch(NUMBER, text):
        raise UserError(f"builtin:math compares numbers, but a row's metadata answer is {answer!r}; give numeric answers")
    return _value(text)


@BUILTIN_REWARD_FUNCTIONS.register("math")
def math_reward(prompt: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the answer's final number equals metadata["answer"], else 0.0."""
    expected = expected_answer(metadata)
    return float(final_number(answer) == expected)


@BUILTIN_REWARD_FUNCTIONS.register("format")
def format_reward(prompt: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the answer states the final-answer sentence ("The answer is N.") exactly once, else 0.0."""
    return float(answer.count(ANSWER_PREFIX.strip()) == 1 and _FINAL_SENTENCE.search(answer) is not None)
