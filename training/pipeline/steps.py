"""The three steps as the pipeline sees them: where each one's entry point and script live, which
flags it accepts, and how flags given to `train.py` are routed to the steps that accept them."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from utils.errors import UserError

StepMain = Callable[[list[str]], dict]


@dataclass(frozen=True)
class StepSpec:
    number: int
    title: str
    module: str
    run_dir_name: str

    def entry(self) -> StepMain:
        return importlib.import_module(self.module).main

    def script(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise UserError(f"step {self.number}'s script ({self.module}) is not installed; reinstall the project")
        return Path(spec.origin)


STEPS: dict[int, StepSpec] = {
    1: StepSpec(1, "supervised fine-tuning", "step1_sft.main", "step1"),
    2: StepSpec(2, "reward model", "step2_reward.main", "step2"),
    3: StepSpec(3, "RLHF (PPO)", "step3_rlhf.main", "step3"),
}

_OPTION_LINE = re.compile(r"^\s{1,8}(-[^\s,]+(?:[^\n]*?,\s+-[^\s,]+)*)")
_NUMBER = re.compile(r"-?\d+(\.\d*)?([eE]-?\d+)?")


def accepted_options(main: StepMain) -> frozenset[str]:
    """The option strings a step's argparse CLI accepts, read from its `--help` output."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        main(["--help"])
    options: set[str] = set()
    for line in text.getvalue().splitlines():
        match = _OPTION_LINE.match(line)
        if match:
            options.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", match[1]))
    return frozenset(options)


def group_flags(tokens: Sequence[str]) -> list[list[str]]:
    """Split `--a 1 --b --c=x` into [['--a', '1'], ['--b'], ['--c=x']] (a negative number is a value)."""
    groups: list[list[str]] = []
    for token in tokens:
        if token.startswith("-") and not _NUMBER.fullmatch(token):
            groups.append([token])
        elif groups:
            groups[-1].append(token)
        else:
            raise UserError(f"unexpected argument {token!r}: flags passed through to the steps start with '--'")
    return groups


def route_extra_flags(
    tokens: Sequence[str], steps: Sequence[int], options: Mapping[int, frozenset[str]]
) -> dict[int, list[str]]:
    """Give each flag (with its values) to every step in `steps` whose CLI accepts it.

    A flag no step accepts is an error, so a typo fails before hours of training rather than after.
    """
    routed: dict[int, list[str]] = {step: [] for step in steps}
    for group in group_flags(tokens):
        flag = group[0].split("=", 1)[0]
        takers = [step for step in steps if flag in options[step]]
        if not takers:
            names = ", ".join(str(step) for step in steps)
            raise UserError(
                f"{flag} is not a flag of train.py nor of step(s) {names}; check the spelling "
                "(run the step's main.py --help) or target one step with --step1-args/--step2-args/--step3-args"
            )
        for step in takers:
            routed[step].extend(group)
    return routed


def split_step_args(value: str | None) -> list[str]:
    return shlex.split(value) if value else []
