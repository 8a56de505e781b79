"""Run the chosen steps in order, each one's output feeding the next, and summarise them.

Layout under the output dir: `step1/`, `step2/`, `step3/` (the steps' run folders),
`logs/stepN.log`, and `summary.json` (the table printed at the end).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from training.core.model_loading import resolve_model_path
from training.core.reward_model import is_reward_model_dir
from utils.dist import free_port
from utils.errors import UserError

from .deployment import (
    DeploymentPlan,
    DeploymentType,
    ModelSizes,
    apply_zero_overrides,
    detect_deployment,
    plan_deployment,
)
from .hardware import Hardware, detect_hardware, model_size
from .hostfile import Host, read_hostfile
from .launch import (
    Launcher,
    check_launcher_installed,
    format_command,
    launcher_env,
    run_in_process,
    run_subprocess,
)
from .steps import STEPS, StepMain, accepted_options, route_extra_flags
from .summary import StepResult, settings_table, summary_table

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PipelineConfig:
    steps: list[int]
    actor_model: str
    reward_model: str
    output_dir: Path
    deployment: DeploymentType | None = None
    actor_zero_stage: int | None = None
    reward_zero_stage: int | None = None
    hostfile: str | None = None
    step1_output: str | None = None
    step2_output: str | None = None
    dry_run: bool = False
    extra_args: list[str] = field(default_factory=list)
    step_args: dict[int, list[str]] = field(default_factory=dict)

    def run_dir(self, step: int) -> Path:
        return self.output_dir / STEPS[step].run_dir_name

    def log_path(self, step: int) -> Path:
        return self.output_dir / "logs" / f"step{step}.log"


def _has_model(path: str | Path) -> bool:
    return (Path(resolve_model_path(str(path))) / "config.json").is_file()


def _step3_inputs(config: PipelineConfig) -> tuple[str, str]:
    """The actor and critic step 3 starts from; checked now when no step of this run produces them."""
    actor = str(config.run_dir(1)) if 1 in config.steps else (config.step1_output or str(config.run_dir(1)))
    critic = str(config.run_dir(2)) if 2 in config.steps else (config.step2_output or str(config.run_dir(2)))
    if 1 not in config.steps and not _has_model(actor):
        raise UserError(
            f"step 3 needs the step-1 model, and {actor} holds none; run step 1 first "
            f"(--step 1 3), or point --step1-output at a step-1 run folder or a fine-tuned model"
        )
    if 2 not in config.steps and not is_reward_model_dir(critic):
        raise UserError(
            f"step 3 needs the step-2 reward model, and {critic} holds none; run step 2 first "
            f"(--step 2 3), or point --step2-output at a step-2 run folder"
        )
    return actor, critic


def step_argv(config: PipelineConfig, step: int, plan: DeploymentPlan, routed: Mapping[int, list[str]],
              step3_inputs: tuple[str, str] | None) -> list[str]:
    """Model and run-folder flags, then the plan's flags, then the user's (argparse keeps the last value)."""
    if step == 1:
        base = ["--model_name_or_path", config.actor_model]
    elif step == 2:
        base = ["--model_name_or_path", config.reward_model]
    else:
        assert step3_inputs is not None
        base = ["--actor_model_name_or_path", step3_inputs[0], "--critic_model_name_or_path", step3_inputs[1]]
    base += ["--output_dir", str(config.run_dir(step))]
    return base + plan.steps[step].argv() + routed.get(step, []) + config.step_args.get(step, [])


def _model_sizes(config: PipelineConfig, step3_inputs: tuple[str, str] | None) -> ModelSizes:
    actor = config.actor_model if 1 in config.steps or step3_inputs is None else step3_inputs[0]
    reward = config.reward_model if 2 in config.steps or step3_inputs is None else step3_inputs[1]
    return ModelSizes(actor=model_size(actor), reward=model_size(reward))


def _launcher(config: PipelineConfig, deployment: DeploymentType, hardware: Hardware) -> Launcher | None:
    if deployment is DeploymentType.CPU:
        return None
    check_launcher_installed()
    if deployment is DeploymentType.MULTI_NODE:
        return Launcher(deployment, hostfile=config.hostfile)
    gpus = 1 if deployment is DeploymentType.SINGLE_GPU else max(1, hardware.num_gpus)
    return Launcher(deployment, num_gpus=gpus, master_port=free_port())  # a free port: runs may share the node


def _hosts(config: PipelineConfig, deployment: DeploymentType) -> list[Host] | None:
    if deployment is not DeploymentType.MULTI_NODE:
        return None
    if not config.hostfile:
        raise UserError("--deployment-type multi_node needs --hostfile FILE (one node a line: 'worker-1 slots=8')")
    return read_hostfile(config.hostfile)


def _read_summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_output(config: PipelineConfig, step: int) -> None:
    run_dir = config.run_dir(step)
    produced = is_reward_model_dir(run_dir) if step == 2 else _has_model(run_dir / "actor" if step == 3 else run_dir)
    if not produced:
        raise UserError(f"step {step} ended without saving its model in {run_dir}; see {config.log_path(step)}")


@dataclass
class PreparedRun:
    """Everything decided before the first step starts."""

    plan: DeploymentPlan
    launcher: Launcher | None  # None: in this process
    argvs: dict[int, list[str]]
    commands: dict[int, list[str]]


def prepare_run(config: PipelineConfig, entry: Callable[[int], StepMain], hardware: Hardware) -> PreparedRun:
    """Validate the inputs (hostfile, prerequisites, flags), plan the deployment, build each step's command."""
    deployment = config.deployment or detect_deployment(hardware, config.hostfile is not None)
    hosts = _hosts(config, deployment)
    inputs = _step3_inputs(config) if 3 in config.steps else None
    routed = route_extra_flags(
        config.extra_args, config.steps, {s: accepted_options(entry(s)) for s in config.steps}
    ) if config.extra_args else {}
    plan = plan_deployment(deployment, _model_sizes(config, inputs), hardware, hosts)
    apply_zero_overrides(plan, config.actor_zero_stage, config.reward_zero_stage)
    launcher = _launcher(config, deployment, hardware)
    argvs = {step: step_argv(config, step, plan, routed, inputs) for step in config.steps}
    commands = {
        step: launcher.command(STEPS[step].script(), argvs[step]) if launcher
        else ["python", "-m", STEPS[step].module, *argvs[step]]
        for step in config.steps
    }
    return PreparedRun(plan, launcher, argvs, commands)


def _run_step(config: PipelineConfig, prepared: PreparedRun, step: int, entry: Callable[[int], StepMain]) -> StepResult:
    spec = STEPS[step]
    print(f"\n=== step {step}: {spec.title} -> {config.run_dir(step)} (log: {config.log_path(step)}) ===", flush=True)
    started = time.perf_counter()
    label = f"step {step} ({spec.title})"
    if prepared.launcher is None:
        summary = run_in_process(entry(step), prepared.argvs[step], config.log_path(step), label)
    else:
        run_subprocess(prepared.commands[step], config.log_path(step), label, env=launcher_env(REPO_ROOT))
        summary = _read_summary(config.run_dir(step))
    _check_output(config, step)
    return StepResult(step, spec.title, time.perf_counter() - started, summary)


def run_pipeline(
    config: PipelineConfig,
    entries: Mapping[int, StepMain] | None = None,
    hardware: Hardware | None = None,
) -> dict:
    """Plan, print and (unless a dry run) run the steps; returns what `summary.json` holds, or for a dry
    run the commands. `entries` replaces step mains and `hardware` the detected machine (tests)."""

    def entry(step: int) -> StepMain:
        return (entries or {}).get(step) or STEPS[step].entry()

    prepared = prepare_run(config, entry, hardware or detect_hardware())
    deployment = prepared.plan.deployment.value
    print(settings_table(prepared.plan, config.steps), flush=True)
    how = "in this process, as" if prepared.launcher is None else "with"
    print(f"\n{'would run' if config.dry_run else 'runs'} {how}:")
    for step in config.steps:
        print(f"  step {step}: {format_command(prepared.commands[step])}", flush=True)
    if config.dry_run:
        return {"deployment": deployment, "commands": prepared.commands}

    started = time.perf_counter()
    results = [_run_step(config, prepared, step, entry) for step in config.steps]
    total = time.perf_counter() - started
    print("\n" + summary_table(results, total), flush=True)
    report = {
        "deployment": deployment,
        "total_seconds": total,
        "steps": {str(r.step): {"title": r.title, "seconds": r.seconds, "summary": dict(r.summary)} for r in results},
    }
    (config.output_dir / "summary.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
