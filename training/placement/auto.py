"""`--placement auto` before a run: the machine to plan for, step 3's workload from its flags, the ranked plans."""
from __future__ import annotations

import argparse

from training.pipeline.hardware import ModelSize
from utils.errors import UserError

from .calibration import cache_path, calibrate, load_calibration, load_or_calibrate
from .machine import MachineSpec, load_machine_file
from .planner import format_plans, search
from .spec import ranks_text
from .workload import step3_model_paths, step3_workload

TOP_PLANS = 10


def planning_machine(hardware_file: str | None, recalibrate: bool, dtype: str, world_size: int,
                     cores: int, gpus: bool = False) -> tuple[MachineSpec, str]:
    """The machine and a line saying where its constants come from: the hardware file (its own world size), else
    this machine as `world_size` ranks: a saved calibration, a fresh one with --calibrate, or, with neither, a
    quick profile of about ten seconds (not saved). `gpus`: the ranks planned for are GPUs, which a calibration,
    of this machine's CPU, does not describe: a hardware file is required."""
    if hardware_file:
        machine = load_machine_file(hardware_file, dtype)
        return machine, f"machine constants: {machine.name} from the hardware file {hardware_file} ({dtype})"
    if gpus:
        from .machine import preset_names

        raise UserError(
            "--placement auto plans GPU ranks here, and without --hardware_file it would take this machine's "
            "calibration, which measures its CPU (its cores' rates, its RAM as each rank's memory); pass "
            f"--hardware_file with a preset ({', '.join(preset_names())}) or a YAML of your GPUs, or name a placement")
    threads = max(1, cores // world_size)
    path = cache_path(dtype, threads, world_size)
    saved = None if recalibrate else load_calibration(path)
    if saved is not None:
        return saved, f"machine constants: the saved calibration {path}{_others_load(saved, cores)}"
    if recalibrate:
        machine = load_or_calibrate(dtype, threads, world_size, recalibrate=True)
        return machine, f"machine constants: measured now (--calibrate), saved to {path}{_others_load(machine, cores)}"
    machine = calibrate(dtype, threads, world_size, quick=True)
    return machine, ("machine constants: a quick profile of this machine's CPU (no saved calibration; pass "
                     "--calibrate for a full one, saved for later runs, or --hardware_file for GPUs)"
                     f"{_others_load(machine, cores)}")


BUSY_CORES = 0.5  # other processes' load from which a calibration's figures are said to be slowed by it


def _others_load(machine: MachineSpec, cores: int) -> str:
    """What else ran while `machine` was calibrated: its rates, and so every time predicted, are slower by it."""
    busy = machine.others_busy_cores
    if busy is None:
        return ""
    if busy < BUSY_CORES:
        return f"; other processes kept {busy:.1f} of {cores} cores busy while it measured"
    return (f"; measured while other processes kept {busy:.1f} of {cores} cores busy, so its times (and the "
            "predicted steps) are slower than this machine's when it is idle: calibrate again then (--calibrate)")


def auto_placement_report(parser: argparse.ArgumentParser, argv: list[str], actor: ModelSize, scorer: ModelSize,
                          world_size: int, cores: int, run_world: bool = True, gpus: bool = False) -> str:
    """Parse step 3's command line, and rank the plans for its workload. `actor`/`scorer`: the sizes of the
    step-1 and step-2 models (the critic starts from the scorer, or from the actor without a reward model).
    `run_world`: `world_size` is the ranks the run will have (a GPU deployment), which step 3 plans for whatever the
    hardware file's node count; else (the cpu deployment) a hardware file plans for its own nodes x GPUs: a cluster
    planned before it is rented. `gpus`: the run's ranks are GPUs (`planning_machine`)."""
    args = parser.parse_args(argv)
    paths = step3_model_paths(args)
    critic = None if paths["critic"] is None else (scorer if paths["reward"] else actor)
    reward = scorer if paths["reward"] else None
    settings = args.placement
    dtype = args.run.dtype if settings.hardware_file and args.run.dtype != "auto" else None
    dtype = dtype or ("bf16" if settings.hardware_file else args.run.dtype_name)
    machine, source = planning_machine(settings.hardware_file, settings.calibrate, dtype, world_size, cores, gpus)
    file_world = settings.hardware_file is not None and not run_world
    world = machine.world_size if file_world else world_size
    workload = step3_workload(args, actor, critic, reward, dtype)
    plans = search(workload, machine, world)
    ranks = "the hardware file's nodes x GPUs" if file_world else "the run's"
    lines = [f"\nstep 3 --placement auto on {ranks_text(world)} ({ranks}); {source}", format_plans(plans, TOP_PLANS)]
    if plans:
        lines.append("the top plan's step-3 flags: " + " ".join(plans[0].flags))
    else:
        lines.append("no plan fits; give step 3 more ranks, LoRA, or smaller batches")
    return "\n".join(lines)
