"""`train.py`'s command line: which steps, which models, which deployment; everything else goes to the steps."""
from __future__ import annotations

import argparse
from typing import Any

from transformers import HfArgumentParser

from .config import PipelineConfig, StepFlags, args_field, output_field
from .runner import run_pipeline
from .steps import STEPS, split_step_args, step_args_flags

EPILOG = f"""\
Any other flag is passed to every step of the run whose CLI accepts it (e.g. --data_path,
--seed, --max_steps, --learning_rate; --sft_only_data_path to step 1 only); a flag that no step
accepts is an error. To give a flag
to one step only, use {step_args_flags()} with a quoted string, e.g.
--step3-args "--actor_learning_rate 1e-6" (write --stepN-args=--flag=value for a single token).
Flags given by the user come after the deployment's planned settings, so they override them.
"""


class _DashedArgumentParser(HfArgumentParser):
    """HfArgumentParser giving each field only its dashed flag (--actor-model, not also --actor_model).

    The underscore spellings are the steps' own flags (step 3's --actor_zero_stage, every step's
    --output_dir): train.py passes those through to the steps that accept them.
    """

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        dashed = [name for name in names if not ("_" in name and name.replace("_", "-") in names)]
        return super().add_argument(*dashed, **kwargs)


def build_parser() -> HfArgumentParser:
    """train.py's parser; its usage line names the command as it was run (`train.py`, or the `rlhf-train` console
    script)."""
    return _DashedArgumentParser(
        (PipelineConfig, StepFlags),
        description="Run the three RLHF steps (SFT, reward model, PPO) one after another.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


def parse_config(argv: list[str] | None = None) -> PipelineConfig:
    """train.py's flags into a `PipelineConfig`; the flags it does not know are kept for the steps."""
    config, step_flags, extra = build_parser().parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False)
    config.extra_args = extra
    config.step_args = {number: split_step_args(getattr(step_flags, args_field(spec)), f"--{spec.name}-args")
                        for number, spec in STEPS.items()}
    config.step_outputs = {number: getattr(step_flags, output_field(spec), None) for number, spec in STEPS.items()}
    return config


def run(argv: list[str] | None = None) -> dict:
    """Parse `train.py`'s flags and run the pipeline; returns its summary (see `run_pipeline`)."""
    return run_pipeline(parse_config(argv))
