"""A deployment's plan: each registered step's planner run for the deployment's target and the models."""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from training.placement.planner import zero_stages_tried
from training.placement.spec import AUTO

from .deployment import (
    CpuQuickRun,
    DeploymentPlan,
    DeploymentType,
    HostModel,
    HostNeed,
    Model,
    ModelSizes,
    StageFlagSet,
    Target,
    Workload,
    cpu_target,
    gpu_target,
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
    the plan's, train.py's --actor-zero-stage/--reward-zero-stage or the user's step flags over them (--stepN-args
    "--offload true"); the warning names those that raised the need (`_flags_that_moved_it`). None where no rank runs
    here, as this machine's available memory is not theirs: planned where no GPU is (a login node), or on
    multi_node with a hostfile that does not list this machine."""
    needs = {step: _host_need(plan, step, flags) for step, flags in runs_with.items() if step in plan.host_models}
    warnings = host_memory_short_now(hardware, needs)
    if warnings and _ranks_run_here(plan.deployment, hardware, hosts):
        return warnings
    return []


def _host_need(plan: DeploymentPlan, step: int, runs_with: Mapping[str, Any]) -> HostNeed:
    """`step`'s host need with the flags it runs with and as planned, and the flags that moved it
    (`_flags_that_moved_it`). Where the step picks some of its flags as it starts (`_flags_it_may_run_with`), the
    most it may need."""
    given = {**plan.steps[step].flags, **runs_with}
    as_planned = _flags_as_planned(plan, step)
    models = plan.host_models[step]

    def need(flags: Mapping[str, Any]) -> float:
        return sum(model.host_bytes(flags, plan.world_size, plan.nodes) for model in models)

    needs = [(flags, need(flags)) for flags in _flags_it_may_run_with(plan, step, given)]
    as_run, run_bytes = max(needs, key=lambda flags_and_bytes: flags_and_bytes[1])

    def as_the_user_set(names: list[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_flag_that_set_it(plan, step, name, as_run, given) for name in names))

    raised, lowered = _flags_that_moved_it(need, as_run, as_planned, [model.flag_names for model in models])
    at_most = len({need_bytes for _, need_bytes in needs}) > 1
    return HostNeed(run_bytes, need(as_planned), as_the_user_set(raised), as_the_user_set(lowered), at_most)


def _flags_that_moved_it(need: Callable[[Mapping[str, Any]], float], as_run: Mapping[str, Any],
                         as_planned: Mapping[str, Any],
                         models_flags: Iterable[Iterable[str]]) -> tuple[list[str], list[str]]:
    """The memory flags (`models_flags`: each model's) that raised a step's `need` with the flags it runs with
    (`as_run`), and those that lowered it. A flag moved it where putting it alone back to the plan's value moves it
    (down: it raised it). Of one model's flags that move nothing so, each moved it where putting them back together
    moves it and putting back the others without it does not move it as much: --lora_dim 0 beside
    --only_optimize_lora false, which turn the plan's LoRA off only together. A flag that moves nothing is not named:
    one read as the plan's value ("true" for True), --lora_dim 8 where no --only_optimize_lora makes it count, or
    --actor_zero_stage 3 where --actor_offload false leaves the actor on the GPUs."""
    run_bytes = need(as_run)

    def moved_back(names: Collection[str]) -> float:
        return run_bytes - need({**as_run, **{name: as_planned.get(name) for name in names}})

    moved: dict[str, float] = {}
    for flags in models_flags:
        alone = {name: moved_back([name]) for name in flags}
        moved.update({name: bytes_moved for name, bytes_moved in alone.items() if bytes_moved})
        together = [name for name, bytes_moved in alone.items() if not bytes_moved]
        all_moved = moved_back(together)
        moved.update({name: all_moved for name in together
                      if all_moved and moved_back([other for other in together if other != name]) != all_moved})
    return ([name for name, bytes_moved in moved.items() if bytes_moved > 0],
            [name for name, bytes_moved in moved.items() if bytes_moved < 0])


def _flags_it_may_run_with(plan: DeploymentPlan, step: int, given: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The flag values `step` may run with, `given` those of its command line over the plan's: those alone, or under
    step 3's --placement auto, which picks the trained models' ZeRO stages as the step starts (an offloaded one's
    may go to ZeRO-3, whose offload holds the weights too), each pick of stages it may make."""
    if given.get("placement") != AUTO:
        return [given]
    trained = [model for model in plan.host_models[step] if isinstance(model, HostModel) and model.trained]
    stage_flags = [f"{model.prefix}zero_stage" for model in trained]
    picks = [zero_stages_tried(choice.offload, choice.zero_stage, plan.world_size)
             for choice in (model.choice(given) for model in trained)]
    return [{**given, **dict(zip(stage_flags, stages))} for stages in product(*picks)]


def _flags_as_planned(plan: DeploymentPlan, step: int) -> dict[str, Any]:
    """`step`'s flags as the planner set them, before train.py's ZeRO stage flags."""
    return {**plan.steps[step].flags,
            **{name: stage_flag.planned for name, stage_flag in plan.stage_flags_set.get(step, {}).items()}}


def _flag_that_set_it(plan: DeploymentPlan, step: int, name: str, as_run: Mapping[str, Any],
                      given: Mapping[str, Any]) -> str:
    """The flag, as the user gave it, that set `step`'s memory flag `name` to its value `as_run`: the step flag itself
    (--offload), train.py's stage flag that set it (--actor-zero-stage) where no step flag did, or --placement auto
    where it picks another value than the command line `given` (a ZeRO stage)."""
    if not runs_as_planned(given.get(name), as_run.get(name)):
        return f"--placement {AUTO}"
    stage_flag = plan.stage_flags_set.get(step, {}).get(name)
    if stage_flag is None or not runs_as_planned(plan.steps[step].flags.get(name), as_run.get(name)):
        return f"--{name}"
    return stage_flag.given


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
    plan sets that field (step 3's plan leaves --critic_zero_stage out of a run without critic and reward model),
    recording the planned values they replace (`DeploymentPlan.stage_flags_set`). Returns the models given a stage
    that no step of `steps` takes."""
    taken = set()
    for number, spec in STEPS.items():
        if number not in plan.steps:
            continue
        planned = plan.steps[number].flags
        set_by = {name: model for model, name in spec.zero_stage_fields.items()
                  if stages[model] is not None and name in planned}
        if number in steps:
            taken |= set(set_by.values())
        overrides = {name: stages[model] for name, model in set_by.items()}
        # ZeRO-0 offloads nothing: an offload planned for another stage goes with it
        offloads = {name.replace("zero_stage", "offload"): name for name, stage in overrides.items() if stage == 0}
        overrides |= dict.fromkeys(offloads, False)
        set_by |= {offload: set_by[stage_flag] for offload, stage_flag in offloads.items()}
        if replaced := {name: StageFlagSet(f"--{set_by[name].value}-zero-stage", planned.get(name))
                        for name, value in overrides.items() if not runs_as_planned(planned.get(name), value)}:
            plan.stage_flags_set[number] = replaced
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
