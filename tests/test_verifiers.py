"""Reward functions: the built-in verifiers' edge cases, loading by spec, and batch scoring."""
import math
from decimal import Decimal

import pytest
import torch

from training.rewards import (
    BUILTIN_REWARD_FUNCTIONS,
    final_number,
    format_reward,
    load_reward_fn,
    math_reward,
    score_answers,
)
from utils.data.tasks import FINAL_ANSWER_TEMPLATE
from utils.errors import UserError

ANSWER_66 = {"answer": "66"}


@pytest.mark.parametrize(("text", "expected"), [
    ("37 + 48 = 85, 85 - 19 = 66. The answer is 66.", "66"),
    ("It is 12, no wait, 13", "13"),
    ("1,234", "1234"),
    ("a total of 1,234,567.5 dollars", "1234567.5"),
    ("-7", "-7"),
    ("it drops to \u22127 degrees", "-7"),
    ("85-19=66", "66"),
    ("66 apples.", "66"),
    ("66. Done", "66"),
    ("3.50", "3.50"),
    ("The answer is 5. Check: 5 + 1 = 6.", "5"),
    ("the answer is: -12 (I think 13)", "-12"),
    ("#### 72\nSo 80 people came.", "72"),
    ("\\boxed{1,000} and 7 more", "1000"),
    ("#### 3 ... The answer is 4. ... \\boxed{5} then 6", "5"),
    ("H2O has 3 atoms", "3"),
])
def test_final_number(text, expected):
    assert final_number(text) == Decimal(expected)


@pytest.mark.parametrize("text", ["", "no number here", "H2O", "version v2"])
def test_final_number_is_none_without_a_number(text):
    assert final_number(text) is None


@pytest.mark.parametrize(("answer", "metadata", "reward"), [
    ("The answer is 66.", ANSWER_66, 1.0),
    ("The answer is 65.", ANSWER_66, 0.0),
    ("I don't know.", ANSWER_66, 0.0),
    ("66 apples.", ANSWER_66, 1.0),
    ("66. Done", ANSWER_66, 1.0),
    ("first 66, then 67", ANSWER_66, 0.0),
    ("The answer is 66. (not 70)", ANSWER_66, 1.0),
    ("The answer is 1,234.", {"answer": "1234"}, 1.0),
    ("It is 1234", {"answer": "1,234"}, 1.0),
    ("The answer is -31.", {"answer": "-31"}, 1.0),
    ("The answer is 31.", {"answer": "-31"}, 0.0),
    ("The answer is 3.50.", {"answer": "3.5"}, 1.0),
    ("The answer is 3.5.", {"answer": 3.5}, 1.0),
    ("The answer is 66.", {"answer": 66}, 1.0),
    ("#### 66", ANSWER_66, 1.0),
    ("\\boxed{66}", ANSWER_66, 1.0),
])
def test_math_reward(answer, metadata, reward):
    assert math_reward("Compute 37 + 48 - 19.", answer, metadata) == reward


@pytest.mark.parametrize("metadata", [{}, None, {"task": "arithmetic"}, {"answer": None}])
def test_math_reward_without_answers_says_where_answers_come_from(metadata):
    with pytest.raises(UserError, match="no answers.*task:arithmetic.*metadata"):
        math_reward("q", "The answer is 1.", metadata)


@pytest.mark.parametrize("answer", ["forty-two", "", True])
def test_math_reward_rejects_non_numeric_expected_answers(answer):
    with pytest.raises(UserError, match="compares numbers"):
        math_reward("q", "The answer is 1.", {"answer": answer})


@pytest.mark.parametrize(("answer", "reward"), [
    ("37 + 48 = 85, 85 - 19 = 66. The answer is 66.", 1.0),
    ("The answer is -3.5.", 1.0),
    ("The answer is 1,234.", 1.0),
    ("The answer is 66. Really.", 1.0),
    ("The answer is 66", 0.0),
    ("The answer is 3.14", 0.0),  # the decimal point is not the sentence's period
    ("The answer is 1,234.56", 0.0),
    ("The answer is 3.14.", 1.0),
    ("the answer is 66.", 0.0),
    ("The answer is sixty-six.", 0.0),
    ("The answer is 66. The answer is 66.", 0.0),
    ("The answer is 5. The answer is unclear.", 0.0),
    ("66", 0.0),
    ("", 0.0),
])
def test_format_reward(answer, reward):
    assert format_reward("q", answer, {}) == reward


def test_format_reward_checks_the_tasks_answer_sentence():
    assert format_reward("q", FINAL_ANSWER_TEMPLATE.format(12), {}) == 1.0


def test_builtins_load_by_name_and_unknown_names_list_the_choices():
    assert load_reward_fn("builtin:math") is math_reward
    assert load_reward_fn("builtin:format") is format_reward
    assert BUILTIN_REWARD_FUNCTIONS.names() == ["format", "math"]
    with pytest.raises(UserError, match="unknown built-in reward function 'maths'.*format, math"):
        load_reward_fn("builtin:maths")


REWARD_MODULE = '''
from dataclasses import dataclass


@dataclass
class Scale:
    factor: float = 2.0

    def __call__(self, prompt, answer, metadata):
        return self.factor * len(answer)


scaled = Scale(3.0)
NOT_CALLABLE = 5


def length_reward(prompt, answer, metadata):
    return len(answer) - len(prompt) + metadata.get("bonus", 0)


class Rewards:
    @staticmethod
    def shout(prompt, answer, metadata):
        return float(answer.isupper())


def two_arguments(prompt, answer):
    return len(answer)


def keyword_only(prompt, answer, *, metadata):
    return len(answer)


def flexible(prompt, *rest, **named):
    return len(rest)
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_test.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards_for_test.py"


def test_module_function_and_file_function_load(reward_module):
    by_module = load_reward_fn("my_rewards_for_test:length_reward")
    assert by_module("ab", "abcde", {"bonus": 10}) == 13
    by_file = load_reward_fn(f"{reward_module}:length_reward")
    assert by_file("ab", "abcde", {}) == 3
    assert load_reward_fn(f"{reward_module}:scaled")("", "abcd", {}) == 12.0
    assert load_reward_fn("my_rewards_for_test:Rewards.shout")("", "LOUD", {}) == 1.0
    assert load_reward_fn("my_rewards_for_test:flexible")("", "a", {}) == 2


@pytest.mark.parametrize(("spec", "message"), [
    ("math", "must have the form builtin:NAME, module:function or path/to/file.py:function"),
    ("builtin:", "must have the form"),
    (":fn", "must have the form"),
    ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'.*PYTHONPATH"),
    ("no_such_package_xyz.sub:fn", "no module named 'no_such_package_xyz.sub'"),
    ("missing/dir/rewards.py:fn", "missing/dir/rewards.py does not exist"),
    ("my_rewards_for_test:nope", "has no attribute 'nope'"),
    ("my_rewards_for_test:Rewards.nope", "has no attribute 'Rewards.nope'"),
    ("my_rewards_for_test:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
    ("my_rewards_for_test:two_arguments",
     r"two_arguments\(prompt, answer\) cannot be called as fn\(prompt, answer, metadata\): too many"),
    ("my_rewards_for_test:keyword_only", "cannot be called as fn.*too many positional arguments"),
    ("my_rewards_for_test:Rewards", "cannot be called as fn"),
])
def test_bad_specs_are_user_errors(reward_module, spec, message):
    with pytest.raises(UserError, match=message):
        load_reward_fn(spec)


def test_a_module_that_imports_a_missing_dependency_shows_that_import(tmp_path, monkeypatch):
    (tmp_path / "needs_missing_dep_xyz.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="missing_dependency_xyz"):
        load_reward_fn("needs_missing_dep_xyz:fn")


def test_score_answers_returns_float32_scores_per_row():
    scores = score_answers(math_reward, ["q1", "q2", "q3"], ["The answer is 4.", "5", "x"],
                           [{"answer": "4"}, {"answer": "6"}, {"answer": "1"}])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 0.0]
    lengths = score_answers(lambda p, a, m: len(a) + len(m), ["a", "b"], ["xyz", "x"])
    assert lengths.tolist() == [3.0, 1.0]
    as_tensor = score_answers(lambda p, a, m: torch.tensor(0.25), ["a"], ["b"], [{}])
    assert as_tensor.tolist() == [0.25]


def test_score_answers_with_math_and_no_metadata_says_the_data_has_no_answers():
    with pytest.raises(UserError, match="no answers"):
        score_answers(math_reward, ["q"], ["1"], None)


def bad_reward(prompt, answer, metadata):
    return {"nan": math.nan, "inf": math.inf, "text": "1.0", "none": None, "huge": 1e39, "list": [1.0]}[answer]


@pytest.mark.parametrize("answer", ["nan", "inf", "text", "none", "huge", "list"])
def test_score_answers_names_a_function_that_returns_no_finite_number(answer):
    with pytest.raises(UserError, match="test_verifiers.bad_reward returned .* finite number"):
        score_answers(bad_reward, ["q"], [answer], [{}])


def test_score_answers_needs_one_prompt_and_metadata_row_per_answer():
    with pytest.raises(ValueError, match="2 prompts, 1 answers and 1 metadata"):
        score_answers(math_reward, ["a", "b"], ["1"], [{"answer": "1"}])
