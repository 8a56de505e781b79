"""`train.py`'s command line: which steps, which models, which deployment; everything else goes to the steps."""
from __future__ import annotations

import argparse
from pathlib import Path

from training.core.model_loading import EMBEDDED_MODEL_NAME

from .deployment import DeploymentType
from .runner import PipelineConfig, run_pipeline
from .steps import split_step_args

EPILOG = """\
Any other flag is passed to every step of the run whose CLI accepts it (e.g. --data_path,
--seed, --max_steps, --learning_rate); a flag that no step accepts is an error. To give a flag
to one step only, use --step1-args/--step2-args/--step3-args with a quoted string, e.g.
--step3-args "--actor_learning_rate 1e-6" (write --stepN-args=--flag=value for a single token).
Flags given by the user come after the deployment's planned settings, so they override them.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Run the three RLHF steps (SFT, reward model, PPO) one after another.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--step", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3],
                        help="which steps to run, in order (default: 1 2 3)")
    parser.add_argument("--actor-model", default=EMBEDDED_MODEL_NAME,
                        help=f"step 1's base model: hub name or local folder (default: the embedded {EMBEDDED_MODEL_NAME})")
    parser.add_argument("--reward-model", default=EMBEDDED_MODEL_NAME,
                        help=f"step 2's base model: hub name or local folder (default: {EMBEDDED_MODEL_NAME})")
    parser.add_argument("--actor-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage of step 1 and step 3's actor (default: picked by the deployment)")
    parser.add_argument("--reward-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage of step 2 and step 3's critic (default: picked by the deployment)")
    parser.add_argument("--deployment-type", choices=[d.value for d in DeploymentType], default=None,
                        help="cpu runs in this process; the others use the deepspeed launcher "
                             "(default: multi_node with --hostfile, else from the local GPU count)")
    parser.add_argument("--output-dir", default="runs/default",
                        help="holds step1/, step2/, step3/, logs/ and summary.json (default: runs/default)")
    parser.add_argument("--hostfile", default=None, help="multi_node: DeepSpeed hostfile, lines 'HOST slots=N'")
    parser.add_argument("--step1-output", default=None,
                        help="when step 1 is not run: its run folder or a fine-tuned model for step 3's actor "
                             "(default: <output-dir>/step1)")
    parser.add_argument("--step2-output", default=None,
                        help="when step 2 is not run: its run folder for step 3's critic and reward model "
                             "(default: <output-dir>/step2)")
    for step in (1, 2, 3):
        parser.add_argument(f"--step{step}-args", default=None, metavar="ARGS",
                            help=f"extra flags for step {step} only, as one quoted string")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the settings and the commands, check inputs, and stop")
    return parser


def parse_config(argv: list[str] | None = None) -> PipelineConfig:
    args, extra = build_parser().parse_known_args(argv)
    return PipelineConfig(
        steps=sorted(set(args.step)),
        actor_model=args.actor_model,
        reward_model=args.reward_model,
        output_dir=Path(args.output_dir).resolve(),
        deployment=DeploymentType(args.deployment_type) if args.deployment_type else None,
        actor_zero_stage=args.actor_zero_stage,
        reward_zero_stage=args.reward_zero_stage,
        hostfile=args.hostfile,
        step1_output=args.step1_output,
        step2_output=args.step2_output,
        dry_run=args.dry_run,
        extra_args=extra,
        step_args={step: split_step_args(getattr(args, f"step{step}_args")) for step in (1, 2, 3)},
    )


def run(argv: list[str] | None = None) -> dict:
    """Parse `train.py`'s flags and run the pipeline; returns its summary (see `run_pipeline`)."""
    return run_pipeline(parse_config(argv))
