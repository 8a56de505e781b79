"""Step 3's `--placement`: the layout of its models on the ranks, checked before anything loads."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from training.placement.machine import check_gpus_per_node
from training.placement.planner import PlanChoice
from training.placement.settings import PlacementSettings
from training.placement.spec import (
    AUTO,
    OFFLOAD,
    Placement,
    build_placement,
    parse_placement_ratio,
    zero3_on_part_of_the_ranks,
)
from training.placement.workload import offloaded_models
from utils.atomic import atomic_write_text
from utils.dist import broadcast_from_main, get_world_size, is_main_process
from utils.errors import UserError

if TYPE_CHECKING:  # step3_rlhf.settings calls `check_placement_flags` from `Step3Settings.check_flags`
    from step3_rlhf.settings import Step3Settings

logger = logging.getLogger(__name__)

AUTO_PLAN_FILE = "placement_auto.json"  # in the run folder: what --placement auto chose when the run started


def record_auto_plan(output_dir: str | Path, plan: PlanChoice) -> None:
    """Keep the plan in the run folder (main process; once the start checks passed), for a resume to take."""
    if is_main_process():
        atomic_write_text(Path(output_dir) / AUTO_PLAN_FILE, json.dumps(asdict(plan), indent=2) + "\n")


def placement_roles(args: Step3Settings) -> list[str]:
    """The models the run holds: actor and reference always, the critic and reward model when it has them."""
    from training.placement.workload import step3_model_paths

    paths = step3_model_paths(args)
    return ["actor", *(["critic"] if paths["critic"] else []), "reference", *(["reward"] if paths["reward"] else [])]


def check_placement_args(args: Step3Settings, placement: Placement) -> None:
    """What a placement other than colocate does not run yet, refused with the flag to change."""
    partial = zero3_on_part_of_the_ranks(placement, args.actor.zero_stage, args.critic.zero_stage,
                                         offloaded_models(args))
    if partial is not None:
        cause, role = partial
        on = f"with the {role} on {len(placement.ranks[role])} of {placement.world_size} ranks"
        if cause == OFFLOAD:
            raise UserError(f"--offload_{role}_model {on}: offloading makes it ZeRO-3, which partitions a model over "
                            f"every rank; give the {role} every rank (--placement_ratio {role}=1) or drop the offload")
        built = "" if role == cause else f" (the {role} is built at the {cause}'s ZeRO stage)"
        raise UserError(f"--{cause}_zero_stage 3 {on}{built}: ZeRO-3 partitions a model over every rank, so each "
                        f"rank must hold it; use --{cause}_zero_stage 0-2 or give the {role} every rank")
    refused = {"--inference_tp_size > 1": args.hybrid.inference_tp_size > 1}
    for flag, given in refused.items():
        if given:
            raise UserError(f"{flag} is not supported with --placement {args.placement.placement} yet "
                            f"({placement.describe()}); drop it or use --placement colocate")


def check_placement_flags(args: Step3Settings, world_size: int) -> None:
    """What the --placement flags alone refuse on `world_size` ranks (`Step3Settings.check_flags`, before anything
    loads): a --placement_ratio under auto, and a named placement that cannot be laid out or that the other flags do
    not run with. Under auto the plan needs the machine's profile; the run checks it as it plans."""
    if args.placement.placement == AUTO:
        _refuse_ratio_with_auto(args.placement)
        return
    placement = named_placement(args, world_size)
    if placement is not None and not placement.is_colocated:
        check_placement_args(args, placement)


def named_placement(args: Step3Settings, world_size: int) -> Placement | None:
    """The layout --placement (not auto) and --placement_ratio name on `world_size` ranks (None: the default,
    co-located)."""
    settings = args.placement
    if settings.placement == "colocate" and settings.placement_ratio is None:
        return None
    ratio = parse_placement_ratio(settings.placement_ratio) if settings.placement_ratio else None
    return build_placement(settings.placement, world_size, placement_roles(args), ratio)


def _refuse_ratio_with_auto(settings: PlacementSettings) -> None:
    if settings.placement_ratio is not None:
        raise UserError(f"--placement_ratio {settings.placement_ratio!r} with --placement auto: the planner chooses "
                        "every model's share itself; drop --placement_ratio or name a placement")


def resolve_placement(args: Step3Settings) -> tuple[Placement | None, PlanChoice | None]:
    """The placement of the run's models (None: co-located, the default path), and under `auto` the plan it took:
    the planner's fastest plan that fits (decided on rank 0, for every rank) with its ZeRO stages, inference TP and
    micro-batch; with --resume, the plan recorded when the run started (`record_auto_plan`), not a new one, which
    could differ by the profile's timing noise and then refuse the resume for flags the user never gave."""
    settings = args.placement
    world = get_world_size()
    auto = None
    if settings.placement == AUTO:
        _refuse_ratio_with_auto(settings)
        roles = placement_roles(args)
        auto = broadcast_from_main(_auto_plan(args, world, roles) if is_main_process() else None)
        if isinstance(auto, str):
            raise UserError(auto)
        args.actor.zero_stage, args.critic.zero_stage = auto.actor_zero_stage, auto.critic_zero_stage
        args.hybrid.inference_tp_size, args.loop.per_device_training_batch_size = auto.inference_tp, auto.micro_batch
        args.placement.enable_stage_fusion = auto.stage_fusion
        placement = build_placement(auto.base, world, roles, auto.shares)
        logger.info("--placement auto: %s (%s), actor ZeRO-%d, critic ZeRO-%d, inference TP %d, micro-batch %d, "
                    "stage fusion %s", auto.base, placement.describe(), auto.actor_zero_stage, auto.critic_zero_stage,
                    auto.inference_tp, auto.micro_batch, "on" if auto.stage_fusion else "off")
    else:
        placement = named_placement(args, world)
    if placement is None or placement.is_colocated:
        return None, auto
    check_placement_args(args, placement)
    return placement, auto


def _auto_plan(args: Step3Settings, world: int, roles: list[str]) -> PlanChoice | str:
    """Rank 0's plan: the one recorded at the run's start when resuming, else the planner's; or the planner's error
    message (so every rank raises it)."""
    recorded = Path(args.run.output_dir) / AUTO_PLAN_FILE
    if args.checkpoints.resume and recorded.is_file():
        logger.info("--placement auto: resuming with the plan chosen at the run's start (%s)", recorded)
        return PlanChoice(**json.loads(recorded.read_text()))
    from deepspeed.accelerator import get_accelerator

    from training.pipeline.hardware import model_size
    from training.placement.auto import planning_machine
    from training.placement.planner import choose_placement
    from training.placement.workload import step3_model_paths, step3_workload
    from utils.cpu import cpu_cores

    try:
        paths = step3_model_paths(args)
        sizes = {role: model_size(path, args.run.trust_remote_code) if path else None
                 for role, path in paths.items()}
        on_gpus = get_accelerator().device_name() != "cpu"
        if on_gpus and args.placement.hardware_file:
            _check_launched_nodes(args.placement.hardware_file, world)
        machine, source = planning_machine(args.placement.hardware_file, args.placement.calibrate,
                                           args.run.dtype_name, world, cpu_cores(), on_gpus)
        logger.info("--placement auto: %s", source)
        workload = step3_workload(args, sizes["actor"], sizes["critic"], sizes["reward"])
        plan = choose_placement(workload, machine, world, roles)
    except UserError as error:
        return str(error)
    return plan.choice()


def _check_launched_nodes(hardware_file: str, world: int) -> None:
    """Ranks on several nodes, started by a launcher (train.py checks the hostfile's slots before it starts step 3):
    the ranks the launcher runs on a node must be the hardware file's GPUs per node (`check_gpus_per_node`)."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")  # torchrun's, DeepSpeed launcher's
    if per_node is not None and world > int(per_node):
        check_gpus_per_node(hardware_file, [int(per_node)], "the launcher runs {sizes} ranks a node",
                            "launch {per_node} ranks a node")
