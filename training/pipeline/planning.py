"""A deployment's plan: each registered step's planner run for the deployment's target and the models."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Collection, Mapping, Sequence

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
    host_bytes_as_run,
    host_memory_short_now,
)
from .hardware import Hardware
from .hostfile import Host, is_this_machine
from .launch import no_gpu_visible
from .steps import STEPS, flag_value
from .summary import runs_as_planned


def _plan(deployment: DeploymentType, target: Target, notes: list[str], sizes: ModelSizes,
          workload: Workload, steps: Collection[int] | None) -> DeploymentPlan:
    """The plan of `steps` (None: every registered step). A step the run leaves out is not planned: a model that
    fits none of its memory choices (step 3's four models, where step 1 trains one) refuses no run without it."""
    plans = {number: spec.planner(target, sizes, workload) for number, spec in STEPS.items()
             if steps is None or number in steps}
    return DeploymentPlan(deployment, target.world, plans, notes, dict(target.host_models), target.nodes)


def plan_gpu(deployment: DeploymentType, sizes: ModelSizes, hardware: Hardware, hosts: list[Host] | None,
             workload: Workload = Workload(), steps: Collection[int] | None = None) -> DeploymentPlan:
    """Settings for single_gpu, single_node and multi_node (nodes assumed alike to this one), sized from the memory
    installed (`host_memory_warnings` compares their offload with the memory available now)."""
    target, notes = gpu_target(deployment, hardware, hosts)
    notes = [*notes, *_hidden_gpus_note(hardware), _host_memory_note(deployment, hardware)]
    return _plan(deployment, target, notes, sizes, workload, steps)


def _hidden_gpus_note(hardware: Hardware) -> list[str]:
    """Why no GPU is found here, where CUDA_VISIBLE_DEVICES hides them all: a GPU machine so hidden was planned as a
    login node is, unsaid (a dry run plans on; single_gpu and single_node runs are refused before any step)."""
    no_gpu_seen = no_gpu_visible()
    if hardware.num_gpus or no_gpu_seen is None:
        return []
    return [(f"{no_gpu_seen}, so none is counted here; where it has some, unset the variable, or list the GPUs to run "
             "on (nvidia-smi -L gives their indices), for a plan of them")]


def host_memory_warnings(plan: DeploymentPlan, hardware: Hardware, hosts: list[Host] | None,
                         runs_with: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Warnings for the steps that run (`runs_with`: each one's flag values as its command line gives them) whose
    offload the memory available on this machine now does not hold, counted with the memory flags each runs with:
    the plan's (--actor-zero-stage included, which sets the plan's stage), or the user's step flags over them
    (--stepN-args "--offload true"), which the warning names. None where no rank runs here, as this machine's
    available memory is not theirs: planned where no GPU is (a login node), or on multi_node with a hostfile that
    does not list this machine."""
    running = {step: flags for step, flags in runs_with.items() if step in plan.host_models}
    needs = {step: host_bytes_as_run(plan.host_models[step], {**plan.steps[step].flags, **flags}, plan.nodes)
             for step, flags in running.items()}
    user_set = {step: _memory_flags_the_user_set(plan, step, flags) for step, flags in running.items()}
    warnings = host_memory_short_now(hardware, needs, user_set)
    if warnings and _ranks_run_here(plan.deployment, hardware, hosts):
        return warnings
    return []


def _memory_flags_the_user_set(plan: DeploymentPlan, step: int, runs_with: Mapping[str, Any]) -> list[str]:
    """The flags of `step`'s models' memory choices (`HostModel.flag_names`) that it runs with otherwise than
    planned."""
    planned = plan.steps[step].flags
    return [name for model in plan.host_models[step] for name in model.flag_names
            if name in runs_with and not runs_as_planned(planned.get(name), runs_with[name])]


def _ranks_run_here(deployment: DeploymentType, hardware: Hardware, hosts: list[Host] | None) -> bool:
    """Whether the GPU steps' ranks run on this machine; on multi_node, where a hostfile line is this machine (asked
    last: a name may be looked up)."""
    return hardware.num_gpus > 0 and (deployment is not DeploymentType.MULTI_NODE
                                      or any(is_this_machine(host.name) for host in hosts or ()))


def _host_memory_note(deployment: DeploymentType, hardware: Hardware) -> str:
    """The host memory the offload choices were sized for, as counted here (on multi_node, for every node); planned
    where no GPU is, the accelerators' memory too (`gpu_target`)."""
    accelerators = " and as each GPU's (no GPU here)" if hardware.num_gpus == 0 else ""
    nodes = ", each node assumed alike" if deployment is DeploymentType.MULTI_NODE else ""
    return f"host memory counted for offload{accelerators}: {hardware.cpu_memory_said} on this machine{nodes}"


def plan_cpu(sizes: ModelSizes, hardware: Hardware, quick: CpuQuickRun = CpuQuickRun(),
             workload: Workload = Workload(), steps: Collection[int] | None = None) -> DeploymentPlan:
    return _plan(DeploymentType.CPU, *cpu_target(hardware, quick), sizes, workload, steps)


def plan_deployment(
    deployment: DeploymentType, sizes: ModelSizes, hardware: Hardware, hosts: list[Host] | None = None,
    workload: Workload = Workload(), steps: Collection[int] | None = None,
) -> DeploymentPlan:
    if deployment is DeploymentType.CPU:
        return plan_cpu(sizes, hardware, workload=workload, steps=steps)
    return plan_gpu(deployment, sizes, hardware, hosts, workload, steps)


def apply_zero_overrides(plan: DeploymentPlan, stages: Mapping[Model, int | None],
                         steps: Collection[int]) -> set[Model]:
    """Set each model's ZeRO stage (None: keep the planned one) in the plan field each step names for it, where the
    plan sets that field (step 3's plan leaves --critic_zero_stage out of a run without critic and reward model).
    Returns the models given a stage that no step of `steps` takes."""
    taken = set()
    for number, spec in STEPS.items():
        if number not in plan.steps:
            continue
        planned = plan.steps[number].flags
        overrides = {name: stages[model] for model, name in spec.zero_stage_fields.items()
                     if stages[model] is not None and name in planned}
        if number in steps:
            taken |= {model for model, name in spec.zero_stage_fields.items() if name in overrides}
        # ZeRO-0 offloads nothing: an offload planned for another stage goes with it
        overrides |= {name.replace("zero_stage", "offload"): False for name, stage in overrides.items() if stage == 0}
        if overrides:
            plan.steps[number] = replace(plan.steps[number], **overrides)
    return {model for model, stage in stages.items() if stage is not None} - taken


def follow_user_max_steps(plan: DeploymentPlan, user_flags: Mapping[int, Sequence[str]]) -> None:
    """Fit a step's plan to the --max_steps the user gives it. The plan's --max_train_samples cap (its own steps'
    worth: one epoch of the quick run) goes, unless the user gives one too, or the step would end there whatever
    --max_steps asks. A shorter run than planned keeps the plan's share of warm-up, unless the user gives
    --num_warmup_steps: the tiny model's 500-step plan warms up for 50 steps, which a --max_steps 3 run never left
    (and is shorter than the run: a --max_steps 1 run's one step warmed up is at rate 0; the step refuses it).
    A longer one keeps the planned warm-up: --max_steps is then a cap, and the data (an epoch) may end the step
    well before it, so a warm-up scaled up to it could last the whole run."""
    for number, tokens in user_flags.items():
        step = plan.steps.get(number)
        user_steps = flag_value(tokens, "--max_steps")
        if step is None or user_steps is None:
            continue
        changes = {}
        if getattr(step, "max_train_samples", None) is not None and flag_value(tokens, "--max_train_samples") is None:
            changes["max_train_samples"] = None
        warmup, planned_steps = getattr(step, "num_warmup_steps", None), getattr(step, "max_steps", None)
        shorter = user_steps.isdigit() and planned_steps and int(user_steps) < planned_steps  # a bad value: the step says
        if warmup and shorter and flag_value(tokens, "--num_warmup_steps") is None:
            steps = int(user_steps)
            changes["num_warmup_steps"] = min(max(1, steps * warmup // planned_steps), max(steps - 1, 0))
        if changes:
            plan.steps[number] = replace(step, **changes)
