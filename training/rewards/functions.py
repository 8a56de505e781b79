"""The reward-function interface, loading one from its `--reward_fn` spec, and scoring a batch with it.

A reward function takes (prompt text, answer text, the row's metadata) and returns a number; it
scores one generated answer. Specs: `builtin:NAME` (see `BUILTIN_REWARD_FUNCTIONS`),
`module:function` (an importable module) or `path/to/file.py:function`; `function` may be dotted
(`module:Class.method`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from utils.errors import UserError
from utils.registry import Registry

RewardFunction = Callable[[str, str, Mapping[str, Any]], float]
BUILTIN_REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("built-in reward function")
BUILTIN = "builtin"
SPEC_FORMS = "builtin:NAME, module:function or path/to/file.py:function"
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _import_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        raise UserError(f"--reward_fn {spec}: the file {path} does not exist")
    # registered under a name unique to the file, so dataclasses and pickling inside it work
    name = f"_reward_fn_{path.stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _import_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise  # the module exists but imports a missing one: its traceback says which
        raise UserError(
            f"--reward_fn {spec}: no module named '{name}'; run from the folder that holds it, add that folder "
            "to PYTHONPATH, or give the file instead: path/to/file.py:function"
        ) from None


def _attribute(module: ModuleType, dotted: str, spec: str) -> Any:
    value: Any = module
    for part in dotted.split("."):
        if not hasattr(value, part):
            raise UserError(f"--reward_fn {spec}: {module.__name__} has no attribute '{dotted}'; check the function's name")
        value = getattr(value, part)
    return value


def is_builtin(spec: str) -> bool:
    """Whether `spec` names a built-in reward function (`builtin:NAME`)."""
    return spec.startswith(BUILTIN + ":")


def load_reward_fn(spec: str) -> RewardFunction:
    """The reward function `spec` names (`builtin:NAME`, `module:function` or `path/to/file.py:function`)."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise UserError(f"--reward_fn '{spec}' must have the form {SPEC_FORMS}")
    if target == BUILTIN:
        return BUILTIN_REWARD_FUNCTIONS.get(name)
    module = _import_file(Path(target).expanduser(), spec) if target.endswith(".py") else _import_module(target, spec)
    function = _attribute(module, name, spec)
    if not callable(function):
        raise UserError(
            f"--reward_fn {spec}: '{name}' is a {type(function).__name__}, not a function taking (prompt, answer, metadata)"
        )
    _check_signature(function, spec)
    return function


def _check_signature(function: Callable, spec: str) -> None:
    """Refuse, at load, a function that cannot be called as fn(prompt, answer, metadata): it would fail
    only at the first rollout, after the models have loaded."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some C callables carry no signature: their first call tells
        return
    try:
        signature.bind("", "", {})
    except TypeError as err:
        raise UserError(
            f"--reward_fn {spec}: {describe(function)}{signature} cannot be called as fn(prompt, answer, metadata): {err}"
        ) from None


def describe(fn: Callable) -> str:
    """A reward function's name for messages: module.qualname."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _score(value: Any, fn: Callable) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or not abs(value) <= _FLOAT32_MAX:  # also false for nan and inf
        raise UserError(
            f"reward function {describe(fn)} returned {value!r} ({type(value).__name__}); "
            "it must return a finite number for every answer"
        )
    return float(value)


def score_answers(
    fn: RewardFunction,
    prompts: Sequence[str],
    answers: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
) -> torch.Tensor:
    """`fn`'s score of each answer, as a float32 tensor [B]; metadata None means {} for every row."""
    rows = [{}] * len(answers) if metadata is None else metadata
    if not len(prompts) == len(answers) == len(rows):
        raise ValueError(f"got {len(prompts)} prompts, {len(answers)} answers and {len(rows)} metadata rows")
    scores = [_score(fn(prompt, answer, row), fn) for prompt, answer, row in zip(prompts, answers, rows)]
    return torch.tensor(scores, dtype=torch.float32)
