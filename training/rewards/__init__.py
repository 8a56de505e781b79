"""Rewards computed by a program rather than a reward model: `--reward_fn builtin:NAME`,
`module:function` or `path/to/file.py:function`.

- `functions`: the `RewardFunction` interface, `load_reward_fn` (spec -> callable), the registry of
  built-ins and `score_answers` (a batch of answers -> a reward tensor);
- `verifiers`: the built-ins `builtin:math` (final number equals metadata["answer"]) and
  `builtin:format` (the final-answer sentence appears exactly once).
A new built-in is one function decorated `@BUILTIN_REWARD_FUNCTIONS.register("name")`.
"""
from training.rewards import verifiers
from training.rewards.functions import BUILTIN_REWARD_FUNCTIONS, RewardFunction, load_reward_fn, score_answers
from training.rewards.verifiers import final_number, format_reward, math_reward

__all__ = [
    "BUILTIN_REWARD_FUNCTIONS",
    "RewardFunction",
    "final_number",
    "format_reward",
    "load_reward_fn",
    "math_reward",
    "score_answers",
    "verifiers",
]
