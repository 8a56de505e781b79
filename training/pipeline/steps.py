"""The step registry: each step as the pipeline sees it (its entry point, the models it starts from,
where its model lands, how a deployment plans it), and how flags given to `train.py` are routed to
the steps that accept them. A new step is one entry in `STEPS`."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from training.core.model_loading import resolve_model_path
from training.core.reward_model import is_reward_model_dir
from utils.data.args import STEP1_ONLY_FLAGS
from utils.errors import UserError

from .deployment import DPO_STEP, Model, ModelSizes, Target, Workload, plan_dpo, plan_reward, plan_rlhf, plan_sft
from .plans import DPOPlan, RLHFPlan, StepPlan, SupervisedPlan

StepMain = Callable[[list[str]], dict]
Planner = Callable[[Target, ModelSizes, Workload], StepPlan]


@dataclass(frozen=True)
class StepEntry:
    """A step's main and the builder of its CLI's parser (what its flags are read from)."""

    main: StepMain
    build_parser: Callable[[], argparse.ArgumentParser]


@dataclass(frozen=True)
class ModelInput:
    """A model flag of a step: it carries `model`, from step `from_step`'s output, or with none from
    train.py's --actor-model/--reward-model. `reward_fn_replaces`: with --reward_fn, the step runs without
    it when that output is neither made by this run nor already there."""

    flag: str
    model: Model
    from_step: int | None = None
    reward_fn_replaces: bool = False


def has_model(path: str | os.PathLike) -> bool:
    """Whether `path` (a model folder, a run folder, the embedded model's name) holds a saved model."""
    return (Path(resolve_model_path(str(path))) / "config.json").is_file()


@dataclass(frozen=True)
class StepOutput:
    """Where a step's model lands in its run folder and how to tell it was saved.

    For an output a later step takes, `points_at` says (in messages) and `flag_help` (in --help) what
    --NAME-output may name instead when the step is not run.
    """

    what: str
    check: Callable[[str | os.PathLike], bool]
    subdir: str | None = None  # None: the run folder itself, which `check` resolves
    points_at: str = ""
    flag_help: str = ""

    def saved_in(self, folder: str | os.PathLike) -> bool:
        return self.check(os.path.join(folder, self.subdir) if self.subdir else folder)


@dataclass(frozen=True)
class StepSpec:
    """One step: `name` names its run folder, its log and its --NAME-args/--NAME-output flags;
    `planner` gives its `plan` for a deployment; `zero_stage_fields` names the plan field that
    --actor-zero-stage/--reward-zero-stage set."""

    number: int
    name: str
    title: str
    module: str
    inputs: tuple[ModelInput, ...]
    output: StepOutput
    plan: type[StepPlan]
    planner: Planner
    zero_stage_fields: Mapping[Model, str]

    def entry(self) -> StepEntry:
        module = importlib.import_module(self.module)
        return StepEntry(module.main, module.build_parser)

    def script(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise UserError(f"step {self.number}'s script ({self.module}) is not installed; reinstall the project")
        return Path(spec.origin)


STEPS: dict[int, StepSpec] = {spec.number: spec for spec in (
    StepSpec(
        1, "step1", "supervised fine-tuning", "step1_sft.main",
        inputs=(ModelInput("--model_name_or_path", Model.ACTOR),),
        output=StepOutput("model", has_model, points_at="a step-1 run folder or a fine-tuned model",
                          flag_help="its run folder or a fine-tuned model for step 3's actor"),
        plan=SupervisedPlan, planner=plan_sft, zero_stage_fields={Model.ACTOR: "zero_stage"},
    ),
    StepSpec(
        2, "step2", "reward model", "step2_reward.main",
        inputs=(ModelInput("--model_name_or_path", Model.REWARD),),
        output=StepOutput("reward model", is_reward_model_dir, points_at="a step-2 run folder",
                          flag_help="its run folder for step 3's critic and reward model"),
        plan=SupervisedPlan, planner=plan_reward, zero_stage_fields={Model.REWARD: "zero_stage"},
    ),
    StepSpec(
        3, "step3", "RLHF (PPO, GRPO, ...)", "step3_rlhf.main",
        inputs=(ModelInput("--actor_model_name_or_path", Model.ACTOR, from_step=1),
                ModelInput("--critic_model_name_or_path", Model.REWARD, from_step=2, reward_fn_replaces=True)),
        output=StepOutput("actor", has_model, subdir="actor"),
        plan=RLHFPlan, planner=plan_rlhf,
        zero_stage_fields={Model.ACTOR: "actor_zero_stage", Model.REWARD: "critic_zero_stage"},
    ),
    StepSpec(
        DPO_STEP, "dpo", "DPO (instead of steps 2 and 3)", "step2_reward.dpo.main",
        inputs=(ModelInput("--model_name_or_path", Model.ACTOR, from_step=1),),
        output=StepOutput("model", has_model),
        plan=DPOPlan, planner=plan_dpo, zero_stage_fields={Model.ACTOR: "zero_stage"},
    ),
)}

_NUMBER = re.compile(r"-?\d+(\.\d*)?([eE]-?\d+)?")
# flags every step's CLI takes (the data flags are shared) that one step alone reads, the others refusing them
ONE_STEP_FLAGS = {f"--{flag}": 1 for flag in STEP1_ONLY_FLAGS}


def step_args_flags() -> str:
    """`--step1-args/--step2-args/...`, for messages."""
    return "/".join(f"--{spec.name}-args" for spec in STEPS.values())


def accepted_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option strings a step's CLI accepts, from its parser (argparse's or HfArgumentParser)."""
    return frozenset(option for action in parser._actions for option in action.option_strings)


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


def flag_value(tokens: Sequence[str], flag: str) -> str | None:
    """The value the last `flag VALUE` / `flag=VALUE` in `tokens` gives (None when the flag is absent)."""
    value = None
    for group in group_flags(tokens):
        name, _, inline = group[0].partition("=")
        if name == flag:
            value = inline or (group[1] if len(group) > 1 else "")
    return value


def drop_flag(tokens: Sequence[str], flag: str) -> list[str]:
    """`tokens` without each `flag`, `flag VALUE` and `flag=VALUE` in them."""
    return [token for group in group_flags(tokens) if group[0].partition("=")[0] != flag for token in group]


def route_extra_flags(
    tokens: Sequence[str], steps: Sequence[int], options: Mapping[int, frozenset[str]],
    read_by_train_py: frozenset[str] = frozenset(),
) -> dict[int, list[str]]:
    """Give each flag (with its values) to every step in `steps` whose CLI accepts it; one of `ONE_STEP_FLAGS` to its
    step alone.

    A flag no step accepts is an error, so a typo fails before hours of training rather than after; unless
    train.py reads it itself (`--reward_fn` picks every step's data).
    """
    routed: dict[int, list[str]] = {step: [] for step in steps}
    for group in group_flags(tokens):
        flag = group[0].split("=", 1)[0]
        takers = [step for step in steps if flag in options[step] and ONE_STEP_FLAGS.get(flag, step) == step]
        if flag in ONE_STEP_FLAGS and not takers:
            raise UserError(f"{flag} is read by step {ONE_STEP_FLAGS[flag]} only, which this run does not run; drop it")
        if not takers and flag not in read_by_train_py:
            names = ", ".join(str(step) for step in steps)
            raise UserError(
                f"{flag} is not a flag of train.py nor of step(s) {names}; check the spelling "
                f"(run the step's main.py --help) or target one step with {step_args_flags()}"
            )
        for step in takers:
            routed[step].extend(group)
    return routed


def split_step_args(value: str | None, flag: str = "--stepN-args") -> list[str]:
    try:
        return shlex.split(value) if value else []
    except ValueError as err:  # an unclosed quote
        raise UserError(f"{flag} {value!r} does not split into flags ({err}); check its quotes") from None
