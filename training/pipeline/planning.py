"""A deployment's plan: each registered step's planner run for the deployment's target and the models."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from .deployment import (
    CpuQuickRun,
    DeploymentPlan,
    DeploymentType,
    Model,
    ModelSizes,
    Target,
    Workload,
    cpu_target,
    gpu_target,
)
from .hardware import Hardware
from .hostfile import Host
from .steps import STEPS, flag_value


def _plan(deployment: DeploymentType, target: Target, notes: list[str], sizes: ModelSizes,
          workload: Workload) -> DeploymentPlan:
    steps = {number: spec.planner(target, sizes, workload) for number, spec in STEPS.items()}
    return DeploymentPlan(deployment, target.world, steps, notes)


def plan_gpu(deployment: DeploymentType, sizes: ModelSizes, hardware: Hardware, hosts: list[Host] | None,
             workload: Workload = Workload()) -> DeploymentPlan:
    """Settings for single_gpu, single_node and multi_node (nodes assumed alike to this one)."""
    return _plan(deployment, *gpu_target(deployment, hardware, hosts), sizes, workload)


def plan_cpu(sizes: ModelSizes, hardware: Hardware, quick: CpuQuickRun = CpuQuickRun(),
             workload: Workload = Workload()) -> DeploymentPlan:
    return _plan(DeploymentType.CPU, *cpu_target(hardware, quick), sizes, workload)


def plan_deployment(
    deployment: DeploymentType, sizes: ModelSizes, hardware: Hardware, hosts: list[Host] | None = None,
    workload: Workload = Workload(),
) -> DeploymentPlan:
    if deployment is DeploymentType.CPU:
        return plan_cpu(sizes, hardware, workload=workload)
    return plan_gpu(deployment, sizes, hardware, hosts, workload)


def apply_zero_overrides(plan: DeploymentPlan, stages: Mapping[Model, int | None]) -> None:
    """Set each model's ZeRO stage (None: keep the planned one) in the plan field each step names for it."""
    for number, spec in STEPS.items():
        overrides = {name: stages[model] for model, name in spec.zero_stage_fields.items() if stages[model] is not None}
        # ZeRO-0 offloads nothing: an offload planned for another stage goes with it
        overrides |= {name.replace("zero_stage", "offload"): False for name, stage in overrides.items() if stage == 0}
        if overrides:
            plan.steps[number] = replace(plan.steps[number], **overrides)


def release_sample_caps(plan: DeploymentPlan, user_flags: Mapping[int, Sequence[str]]) -> None:
    """A step the user gives --max_steps (and no --max_train_samples) loses the plan's --max_train_samples: the
    plan caps the data at its own steps' worth (one epoch of the quick run), which would end the step there
    whatever --max_steps asks."""
    for number, tokens in user_flags.items():
        step = plan.steps.get(number)
        if step is None or getattr(step, "max_train_samples", None) is None:
            continue
        if flag_value(tokens, "--max_steps") is not None and flag_value(tokens, "--max_train_samples") is None:
            plan.steps[number] = replace(step, max_train_samples=None)
