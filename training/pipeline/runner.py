"""Run the chosen steps in order, each one's output feeding the next, and summarise them.

Layout under the output dir: `step1/`, `step2/`, `step3/`, `dpo/` (the steps' run folders),
`logs/stepN.log`, and `summary.json` (the run's status from before its first step, the table printed at the end).

A step whose run folder holds a finished run (its `summary.json`) of the flags this run gives it is skipped, so
the same command run again after a failure goes on where it stopped; with `--resume`, a step resumes from its
latest checkpoint where its folder holds one, and starts from the beginning where it holds none.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn

from transformers import PreTrainedTokenizerBase

from training.core.args import flag_values, same_result_flags
from training.core.model_loading import EMBEDDED_MODEL_NAME, load_tokenizer
from training.placement.machine import check_gpus_per_node
from training.placement.spec import AUTO
from training.reliability.checkpointing import CheckpointManager
from training.reliability.layouts import check_same_vocabulary, scored_layout_warning, tuned_layout_warning
from training.reliability.run_lock import RunLock
from training.reliability.run_records import (
    args_of_model,
    changed_flags,
    read_run_args,
    read_summary,
    run_id_of,
    trained_prompt_format,
)
from training.reliability.signals import (
    EXIT_INTERRUPTED,
    OUTPUT_UNREAD,
    GracefulInterrupt,
    resume_command,
    stopped_by,
    take_received_signal,
)
from training.reliability.validation import check_folder_path, check_output_dir
from training.rewards import load_reward_fn
from utils.atomic import atomic_write_text
from utils.data.args import SOURCE_FLAGS, flags_another_step_reads
from utils.data.formatting import resolve_prompt_format
from utils.data.sources import looks_local, parse_source_spec, source_fingerprint
from utils.data.unsupervised import text_source_fingerprint
from utils.errors import EXIT_BROKEN_PIPE, UserError
from utils.output_pipes import unread_outputs

from .config import DPO, PipelineConfig
from .deployment import DPO_SAID, DPO_STEP, DeploymentPlan, DeploymentType, Model, ModelSizes, detect_deployment
from .failures import exception_cause
from .hardware import Hardware, detect_hardware, model_size
from .hostfile import Host, check_host_or_address, read_hostfile
from .launch import (
    IMPI,
    PDSH,
    REPO_ROOT,
    Launcher,
    StepStopped,
    check_launcher_args,
    check_launcher_installed,
    check_not_under_a_launcher,
    check_same_slots,
    drop_stray_launcher_name,
    env_for_launcher_program,
    env_for_other_nodes,
    format_command,
    is_this_machine,
    launcher_env,
    other_nodes_env_warnings,
    run_in_process,
    run_subprocess,
    visible_gpus,
)
from .planning import apply_zero_overrides, follow_user_max_steps, host_memory_warnings, plan_deployment
from .steps import (STEPS, ModelInput, StepEntry, accepted_options, drop_flag, flag_value, group_flags,
                    route_extra_flags, step_args_flags)
from .summary import StepResult, settings_table, summary_table


# what a step must have for --actor-zero-stage / --reward-zero-stage to set a stage
UNTAKEN_ZERO_STAGE = {
    Model.ACTOR: "trains or runs the actor",
    Model.REWARD: "has a reward model or critic (step 3 has none under a critic-free algorithm with --reward_fn)",
}


Inputs = dict[int, list[tuple[ModelInput, str]]]
# `_recorded_flags`: a step's flag values, and those free to differ
RecordedFlags = tuple[dict[str, Any], frozenset[str]]
TRAINED_FROM_FILE = "trained_from.json"  # train.py's record, in a step's run folder, of the inputs it trained from
DATA_VERSIONS_KEY = "data files"  # in it, beside the model flags: `_data_versions`
RESUME_FLAG = "--resume"
OTHER_NODES_ENV_FILE = "deepspeed_env"  # in the logs folder: what the launcher exports on other nodes
PROMPT_FORMAT = "prompt_format"  # the flag (in each step's recorded flags) that lays conversations out
RUNNING, COMPLETED, FAILED, STOPPED = "running", "completed", "failed", "stopped"  # summary.json's status
STOPPED_WHILE_PLANNING = "stopped while planning, before any step started; to go on, run the same train.py command"


def _input_value(config: PipelineConfig, step: int, source: ModelInput) -> str | None:
    """The model a step starts from; an earlier step's output that this run does not make is checked now
    (None: an input a reward function replaces, left out)."""
    if source.from_step is None:
        return config.base_model(source.model)
    producer = STEPS[source.from_step]
    if producer.number in config.steps:
        return str(config.run_dir(producer.number))
    path = config.step_outputs.get(producer.number) or str(config.run_dir(producer.number))
    if not producer.output.saved_in(path):
        named = config.step_outputs.get(producer.number) is not None
        if source.reward_fn_replaces and config.reward_fn is not None and not named:
            return None
        raise UserError(
            f"step {step} needs the step-{producer.number} {producer.output.what}, and {path} holds none; "
            f"run step {producer.number} first (--step {producer.number} {step}), or point "
            f"--{producer.name}-output at {producer.output.points_at}"
        )
    return path


def _inputs(config: PipelineConfig) -> Inputs:
    """Each step's model flags with their values."""
    values = {step: [(source, _input_value(config, step, source)) for source in STEPS[step].inputs]
              for step in config.steps}
    return {step: [(source, value) for source, value in pairs if value is not None] for step, pairs in values.items()}


def step_argv(config: PipelineConfig, step: int, plan: DeploymentPlan, routed: Mapping[int, list[str]],
              inputs: Inputs) -> list[str]:
    """Model and run-folder flags, then the plan's flags, then the user's (argparse keeps the last value)."""
    base = [token for source, value in inputs[step] for token in (source.flag, value)]
    base += ["--output_dir", str(config.run_dir(step)), *config.step_flags(step)]
    return base + plan.steps[step].argv() + routed.get(step, []) + config.step_args.get(step, [])


def _model_sizes(config: PipelineConfig, inputs: Inputs) -> ModelSizes:
    """Each model's size from --actor-model/--reward-model, or, where the step training it is not run,
    from the earlier output a step of this run starts from. A model no step of the run uses is not read (`--step 2
    --actor-model X` does not need X): it takes the other's size, for planners whose plans go unused."""
    sources = {model: config.base_model(model) for model in Model}
    for pairs in inputs.values():
        for source, value in pairs:
            if source.from_step is not None and source.from_step not in config.steps:
                sources[source.model] = value
    used = {source.model for step in config.steps for source in STEPS[step].inputs}
    sizes = {model: model_size(path, config.trust_remote_code) for model, path in sources.items() if model in used}
    return ModelSizes(actor=sizes.get(Model.ACTOR) or sizes[Model.REWARD],
                      reward=sizes.get(Model.REWARD) or sizes[Model.ACTOR])


def _launcher(config: PipelineConfig, deployment: DeploymentType, hardware: Hardware,
              hosts: list[Host] | None) -> Launcher | None:
    if deployment is DeploymentType.CPU:
        return None
    check_launcher_installed()
    if deployment is DeploymentType.MULTI_NODE:
        launcher = Launcher(deployment, hostfile=config.hostfile, master_port=config.master_port,
                            master_addr=config.master_addr, nodes=len(hosts),
                            on_this_machine=is_this_machine(hosts[0].name), hosts=tuple(host.name for host in hosts),
                            backend=config.launcher, backend_args=config.launcher_args, slots=hosts[0].slots)
        check_launcher_args(launcher)
        return launcher
    gpus = 1 if deployment is DeploymentType.SINGLE_GPU else max(1, hardware.num_gpus)
    return Launcher(deployment, num_gpus=gpus, master_port=config.master_port)


def _hosts(config: PipelineConfig, deployment: DeploymentType) -> list[Host] | None:
    if deployment is not DeploymentType.MULTI_NODE:
        return None
    if not config.hostfile:
        raise UserError("--deployment-type multi_node needs --hostfile FILE (one node a line: 'worker-1 slots=8')")
    hosts = read_hostfile(config.hostfile)
    check_same_slots(config.launcher, config.hostfile, [host.slots for host in hosts])
    return hosts


def _check_slots_of_this_machine(config: PipelineConfig, hosts: list[Host] | None, hardware: Hardware) -> None:
    """Refuse a hostfile line that names this machine with more slots than its GPUs: DeepSpeed's launcher would start
    a rank on each of GPUs 0 to slots - 1 here, and those past its last fail on an invalid device once started.
    Checked where this machine's GPU count is known: it has a GPU, and no CUDA_VISIBLE_DEVICES hides some from the
    count (the launcher gives a hostfile's ranks their GPUs by index whatever it says)."""
    if hosts is None or hardware.num_gpus == 0 or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    for host in hosts:
        if host.slots > hardware.num_gpus and is_this_machine(host.name):
            raise UserError(f"{config.hostfile}: '{host.name} slots={host.slots}' names this machine, which has "
                            f"{hardware.num_gpus} GPU{'s' if hardware.num_gpus > 1 else ''}; DeepSpeed's launcher "
                            f"would start {host.slots} ranks here, on GPUs 0 to {host.slots - 1}, those past its last "
                            f"failing as they start; give it slots={hardware.num_gpus} at most")


def _check_output(config: PipelineConfig, step: int) -> None:
    run_dir = config.run_dir(step)
    if not STEPS[step].output.saved_in(run_dir):
        raise UserError(f"step {step} ended without saving its model in {run_dir}; see {config.log_path(step)}")


def _placement_plans(config: PipelineConfig, prepared: PreparedRun, step3: StepEntry, hardware: Hardware) -> str:
    """Step 3's ranked placements for its planned command line (`--placement auto`)."""
    from training.placement.auto import auto_placement_report

    sizes = _model_sizes(config, _inputs(config))
    return auto_placement_report(step3.build_parser(), prepared.argvs[3], sizes.actor, sizes.reward,
                                 prepared.plan.world_size, hardware.cpu_cores,
                                 run_world=prepared.plan.deployment is not DeploymentType.CPU,
                                 gpus=prepared.plan.deployment is DeploymentType.MULTI_NODE or hardware.num_gpus > 0)


def _recorded_flags(parsed: Any) -> RecordedFlags:
    """{flag: value} of a step's parsed command line as the step records them in its args.json (a settings parser's
    flags once the settings have resolved their defaults, `flag_values`; a plain argparse parser's namespace), and
    the flags among them that do not change what the step computes."""
    if isinstance(parsed, argparse.Namespace):  # no field marks: only the launch flags every step has are free
        return vars(parsed), frozenset({"resume", "local_rank"})
    return flag_values(parsed), same_result_flags(parsed)


def _finished_summary(config: PipelineConfig, step: int, flags: RecordedFlags) -> dict | None:
    """The summary of the finished run in `step`'s folder, which this run skips (None: none there, the step runs).
    A finished run whose recorded flags differ from this run's `flags` is refused, not reused."""
    run_dir = config.run_dir(step)
    summary, recorded = read_summary(run_dir), read_run_args(run_dir)
    if summary is None or recorded is None or not STEPS[step].output.saved_in(run_dir):
        return None
    changed = changed_flags(recorded, flags[0], flags[1] | flags_another_step_reads(step))
    if changed:
        changes = ", ".join(f"--{name} {json.dumps(then)} -> {json.dumps(now)}"
                            for name, (then, now) in changed.items())
        raise UserError(
            f"step {step} finished in {run_dir} with other settings than this run gives it ({changes}); run with the "
            f"same settings, or choose another --output-dir (or delete {run_dir} to run step {step} again)"
        )
    return summary


def _finished_steps(config: PipelineConfig, argvs: Mapping[int, list[str]], flags: Mapping[int, RecordedFlags],
                    inputs: Inputs) -> dict[int, dict]:
    """The summaries of the steps this run skips: finished in their folders, with the flags it gives them, from
    models it does not make anew (a step that starts from the model of a step that runs, runs too)."""
    finished: dict[int, dict] = {}
    for step in config.steps:
        if _remade(config, step, finished):
            continue
        summary = _finished_summary(config, step, flags[step])
        if summary is not None:
            _check_trained_from_current_inputs(config, step, inputs[step], argvs[step])
            finished[step] = summary
    return finished


def _input_versions(inputs: list[tuple[ModelInput, str]]) -> dict[str, str | None]:
    """{model flag: the `run_id` of the run that made the input} for the inputs an earlier step makes (None: none
    recorded there). A run made again has another."""
    versions: dict[str, str | None] = {}
    for source, value in inputs:
        if source.from_step is None:
            continue
        versions[source.flag] = run_id_of(value)
    return versions


def _data_versions(argv: list[str]) -> dict[str, list]:
    """{local data source: the paths, sizes and content hashes of the files the data layer reads of it} (as its
    cache tells a changed file): rewritten under the same path, a finished step trained on other data. A source that
    cannot be read now is left to its step to name."""
    versions = {}
    for flag, source, _ in _local_data_paths(argv):
        try:  # a missing or unreadable source raises too
            fingerprint = text_source_fingerprint(source) if flag == UNSUPERVISED_FLAG \
                else source_fingerprint(parse_source_spec(source))
        except UserError:
            continue
        versions[source] = fingerprint["files"]
    return versions


def _record_input_versions(config: PipelineConfig, step: int, inputs: list[tuple[ModelInput, str]],
                           argv: list[str]) -> None:
    """Written before the step starts, so that its checkpoints, should it stop, say what they were trained from."""
    config.run_dir(step).mkdir(parents=True, exist_ok=True)
    versions = {**_input_versions(inputs), DATA_VERSIONS_KEY: _data_versions(argv)}
    atomic_write_text(config.run_dir(step) / TRAINED_FROM_FILE, json.dumps(versions, indent=2) + "\n")


def _check_trained_from_current_inputs(config: PipelineConfig, step: int, inputs: list[tuple[ModelInput, str]],
                                       argv: list[str], what: str = "finished") -> None:
    """Refuse to reuse a finished step, or to resume a stopped one's checkpoints (`what`), whose input model was
    made again since (an earlier invocation ran only that input's step), or whose local data files changed: it was
    trained from the old ones. Not checked for a step train.py did not run."""
    try:
        recorded = json.loads((config.run_dir(step) / TRAINED_FROM_FILE).read_text())
    except (OSError, ValueError):
        return
    current = _input_versions(inputs)
    for source, value in inputs:
        if source.flag in recorded and recorded[source.flag] != current.get(source.flag):
            raise UserError(
                f"step {step} {what} in {config.run_dir(step)} from an earlier run of its input {value} "
                f"({source.flag}), which was trained again since; delete {config.run_dir(step)} to run step {step} "
                f"from the new one, or choose another --output-dir"
            )
    data = _data_versions(argv)
    for source, files in recorded.get(DATA_VERSIONS_KEY, {}).items():
        if source in data and _files_changed(files, data[source]):
            raise UserError(
                f"step {step} {what} in {config.run_dir(step)} on data that changed since: {source} (its files' "
                f"sizes or contents differ); delete {config.run_dir(step)} to train step {step} on it again, or choose "
                f"another --output-dir"
            )


def _files_changed(recorded: list, current: list) -> bool:
    """Whether a data source's files (`file_fingerprint`: path, size, content hash) differ from those a step recorded.
    A record written before the content hashes holds each file's mtime in ns (an int) where the hash is now: it is
    compared as it was written, by path, size and mtime, so a run folder of that time is not refused for its format."""
    if recorded and all(isinstance(entry[2], int) for entry in recorded):
        current = [[path, size, os.stat(path).st_mtime_ns] for path, size, _ in current]
    return recorded != current


def _remade(config: PipelineConfig, step: int, finished: Mapping[int, dict]) -> bool:
    """Whether `step` starts from the model of a step that runs in this invocation."""
    return any(source.from_step in config.steps and source.from_step not in finished for source in STEPS[step].inputs)


def _check_no_stale_checkpoints(config: PipelineConfig, finished: Mapping[int, dict], inputs: Inputs,
                                argvs: Mapping[int, list[str]]) -> None:
    """Refuse, before anything runs, a step whose folder holds checkpoints of a run from a model this run makes
    anew, or that an earlier invocation made anew: resumed, it would go on from weights trained on the old one
    (and without --resume it would refuse)."""
    for step in config.steps:
        run_dir = config.run_dir(step)
        if step in finished or not CheckpointManager(run_dir).latest():
            continue
        if _remade(config, step, finished):
            raise UserError(
                f"{run_dir} holds checkpoints of step {step} trained from a model this run makes again; delete "
                f"{run_dir} (or its checkpoints) to run step {step} from the new one, or choose another --output-dir"
            )
        _check_trained_from_current_inputs(config, step, inputs[step], argvs[step], "stopped with checkpoints")


def _resume_from_checkpoints_only(config: PipelineConfig, step: int, argv: list[str]) -> list[str]:
    """`argv` without --resume when `step`'s folder holds no checkpoint (the step never started, or stopped before
    its first save): --resume then starts it from the beginning rather than failing it."""
    if CheckpointManager(config.run_dir(step)).latest() is not None:
        return argv
    return drop_flag(argv, RESUME_FLAG)


def _check_resumed_world_size(config: PipelineConfig, plan: DeploymentPlan, argvs: Mapping[int, list[str]]) -> None:
    """Refuse, before anything starts, to resume a step from a checkpoint written by another number of processes
    (a node or GPUs more or fewer since the crash): ZeRO shards the optimizer state by rank and each rank goes on
    from its own data position, so the step would refuse it, but only once launched on every node."""
    for step, argv in argvs.items():
        info = CheckpointManager(config.run_dir(step)).latest()
        if flag_value(argv, RESUME_FLAG) is None or info is None:
            continue
        saved_by = info.world_size or plan.world_size
        if saved_by != plan.world_size:
            raise UserError(
                f"step {step} would resume from {info.path}, written by {saved_by} processes, but this "
                f"{plan.deployment.value} run has {plan.world_size}; resume on {saved_by} GPUs (the hostfile, "
                f"--deployment-type and CUDA_VISIBLE_DEVICES of that run), or delete {info.path.parent} to start "
                f"step {step} over on {plan.world_size}"
            )


@dataclass
class PreparedRun:
    """Everything decided before the first step starts."""

    plan: DeploymentPlan
    launcher: Launcher | None  # None: in this process
    argvs: dict[int, list[str]]
    commands: dict[int, list[str]]  # of the steps that run
    finished: dict[int, dict]  # the summaries of the steps skipped, finished in their folders
    inputs: Inputs  # each step's model flags and their values
    runs_with: dict[int, dict[str, Any]]  # each step's flag values as its command line gives them
    hosts: list[Host] | None = None  # multi_node: the hostfile's lines
    reward_warning: str | None = None  # `_reward_model_checked`'s, said with the plan
    # each model's tokenizer (or why it does not load) as the planning checks read it, read once
    tokenizers: dict[str, PreTrainedTokenizerBase | UserError] = field(default_factory=dict)


def _parsed_step_commands(config: PipelineConfig, user_flags: Mapping[int, list[str]], argvs: Mapping[int, list[str]],
                          entry: Callable[[int], StepEntry]) -> dict[int, Any]:
    """Every step's command line, parsed by its CLI before the first step starts: a misspelt or ill-typed flag in
    --stepN-args fails now, not when its step is reached hours later; every step's problem at once."""
    parsed, problems = {}, {}
    for step, argv in argvs.items():
        try:
            parsed[step] = _parse_step_command(config, step, user_flags[step], argv, entry)
        except UserError as error:
            problems[step] = str(error)
    _refuse_step_problems(problems)
    return parsed


def _parse_step_command(config: PipelineConfig, step: int, user_flags: list[str], argv: list[str],
                        entry: Callable[[int], StepEntry]) -> Any:
    """`argv` parsed by `step`'s CLI. --output_dir is train.py's to give (a step's run folder under --output-dir), not
    one of the `user_flags`; so are the step's model flags and step 3's --algorithm."""
    given = {group[0].split("=", 1)[0] for group in group_flags(user_flags)}
    if "--output_dir" in given:
        raise UserError(f"--output_dir was passed to step {step}: train.py puts each step's run folder under "
                        f"--output-dir (step {step} in {config.run_dir(step)}); use --output-dir")
    for source in STEPS[step].inputs:
        if source.flag in given:
            raise UserError(
                f"{source.flag} was passed to step {step}: train.py gives each step its model, and plans the "
                f"memory for it; use --{source.model.value}-model"
                + (f" (or --{STEPS[source.from_step].name}-output)" if source.from_step is not None else ""))
    if step == 3 and "--algorithm" in given:
        raise UserError("--algorithm was passed to step 3: train.py plans step 3 for its own --algorithm "
                        "(a critic or none, samples per prompt); give it to train.py")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return entry(step).build_parser().parse_args(argv)
    except UserError as error:  # a refusal of the settings' own, as they are made (`__post_init__`)
        raise UserError(f"step {step}: {error}") from None
    except SystemExit as exit_:
        message = errors.getvalue().strip().splitlines()[-1:] or [f"exit status {exit_.code}"]
        raise UserError(f"step {step}'s flags do not parse ({message[0]}); check the flags train.py passes it "
                        f"(given to every step that takes them, or in --{STEPS[step].name}-args)") from None


def _check_step_flags(config: PipelineConfig, parsed: Mapping[int, Any], world_size: int,
                      on_this_device: bool, refused: Mapping[int, str]) -> None:
    """Each step's own flag checks (its settings' `check_flags`, which the step runs when it starts), for the steps
    in `parsed`, on `world_size` ranks: a value a step refuses fails now, not after the steps before it trained; and,
    `on_this_device` (the ranks run on devices like this process's), the precisions they cannot compute in
    (`check_device`). train.py gives a flag to every step that takes it, so one meant for one step may reach another
    that refuses it. `refused`: the problems planning found before (step 3's reward model), refused with these."""
    problems = {}
    for step, settings in parsed.items():
        if isinstance(settings, argparse.Namespace):  # a plain argparse CLI: no settings, no checks
            continue
        try:
            settings.check_flags(world_size)
            if on_this_device:
                settings.check_device()
        except UserError as error:
            problems[step] = f"step {step}: {error}"
    # a step took what another refuses
    routed_to_others = config.extra_args and problems and len(problems) < len(parsed)
    hint = ("; train.py gives a flag to every step that takes it: to give one to some steps only, pass it in "
            f"{step_args_flags()}") if routed_to_others else ""
    for step, problem in refused.items():
        problems[step] = f"{problems[step]}; {problem}" if step in problems else problem
    _refuse_step_problems(problems, hint)


def _refuse_step_problems(problems: Mapping[int, str], hint: str = "") -> None:
    """One `UserError` naming every step's problem (each message names its step), then `hint`."""
    if not problems:
        return
    listed = "; ".join(problems[step] for step in sorted(problems))
    if len(problems) > 1:
        listed = f"{len(problems)} steps can't run as given, before any step runs: {listed}"
    raise UserError(listed + hint)


def _check_run_shape(config: PipelineConfig, deployment: DeploymentType) -> None:
    """Refuse train.py flags this run would drop unseen: --hostfile off multi_node, an --NAME-output of a step that
    runs (its output is made anew) or that no step of the run takes, an --algorithm that the steps run contradict."""
    launcher = None if config.launcher == PDSH else config.launcher
    for flag, given in (("--hostfile", config.hostfile), ("--master-addr", config.master_addr),
                        ("--launcher", launcher), ("--launcher-args", config.launcher_args)):
        if given is not None and deployment is not DeploymentType.MULTI_NODE:
            raise UserError(f"{flag} is for --deployment-type multi_node; this run is {deployment.value}: drop "
                            f"{flag}, or pass --deployment-type multi_node")
    if config.master_port is not None and deployment is DeploymentType.CPU:
        raise UserError("--master-port is the launcher's, and the cpu deployment runs the steps in this process "
                        "without one; drop it, or pass another --deployment-type")
    if config.master_addr is not None:
        check_host_or_address(config.master_addr, "--master-addr")
    if config.master_port is not None and not 1 <= config.master_port <= 65535:
        raise UserError(f"--master-port {config.master_port} is not a port; give one from 1 to 65535 (or none: "
                        "a free one on one node, 29500 on several)")
    for step, output in config.step_outputs.items():
        if output is not None and step in config.steps:
            raise UserError(f"--{STEPS[step].name}-output names step {step}'s model for a run without step {step}, "
                            f"but this run runs it (into {config.run_dir(step)}); drop one of the two")
    _check_outputs_taken(config)
    if config.algorithm == DPO and {2, 3} & set(config.steps):
        raise UserError(f"--algorithm dpo runs step 1 then {DPO_SAID}, not steps 2 or 3; drop --step, or give "
                        f"--step 1 {DPO_STEP} (or --step {DPO_STEP})")
    if config.algorithm not in ("ppo", DPO) and DPO_STEP in config.steps:
        raise UserError(f"--algorithm {config.algorithm} is step 3's RL algorithm, but this run runs {DPO_SAID} "
                        f"in its place; drop step {DPO_STEP}, or give --algorithm dpo")


def _check_outputs_taken(config: PipelineConfig) -> None:
    """Refuse an --NAME-output that no step of the run takes (--step2-output with --algorithm dpo, whose steps 1 and
    4 have no reward model): it would be dropped unseen."""
    for step, output in config.step_outputs.items():
        readers = [number for number, spec in STEPS.items() if any(source.from_step == step for source in spec.inputs)]
        if output is not None and not set(readers) & set(config.steps):
            raise UserError(f"--{STEPS[step].name}-output is for step {' or '.join(map(str, readers))}, which this "
                            f"run (steps {', '.join(map(str, config.steps))}) does not include; drop it, or add that "
                            f"step to --step")


def _check_hardware_file_layout(step3: Any, hosts: list[Host] | None) -> None:
    """Step 3's --placement auto with a --hardware_file plans the hostfile's ranks in the file's nodes: refused where
    its GPUs per node are not the hostfile's slots (`check_gpus_per_node`)."""
    placement = getattr(step3, "placement", None)
    if hosts is None or placement is None or placement.placement != AUTO or not placement.hardware_file:
        return
    check_gpus_per_node(placement.hardware_file, [host.slots for host in hosts], "the hostfile gives its nodes {sizes} "
                        "slots", "a hostfile of {per_node} slots a node")


UNSUPERVISED_FLAG = "--unsupervised_dataset_name"
DATA_PATH_FLAGS = (*(f"--{flag}" for flag in SOURCE_FLAGS), UNSUPERVISED_FLAG)


def _local_data_paths(argv: list[str]) -> list[tuple[str, str, Path]]:
    """(flag, source, path) of each local data source `argv` names (a hub dataset, a task or `embedded` is none)."""
    found = []
    for group in group_flags(argv):
        name, _, inline = group[0].partition("=")
        if name in DATA_PATH_FLAGS:
            for source in ([inline] if inline else group[1:]):
                path = parse_source_spec(source).path
                if looks_local(path):
                    found.append((name, source, Path(path).expanduser()))
    return found


def _check_step_inputs(config: PipelineConfig, argvs: Mapping[int, list[str]]) -> None:
    """What fails only when its step starts, hours in, checked now for the steps that run (`argvs`): the
    --reward_fn, and local data paths."""
    if config.reward_fn is not None:
        load_reward_fn(config.reward_fn)
    for step, argv in argvs.items():
        for name, source, path in _local_data_paths(argv):
            if not path.exists():
                raise UserError(f"step {step}'s {name} {source}: {path} does not exist")


def _check_step_args_of_steps_run(config: PipelineConfig) -> None:
    """Refuse --stepN-args for a step this run does not include: they would be dropped unseen (--step2-args meant
    for DPO, which is --dpo-args)."""
    for step, args in config.step_args.items():
        if args and step not in config.steps:
            running = ", ".join(f"{s} (--{STEPS[s].name}-args)" for s in config.steps)
            raise UserError(f"--{STEPS[step].name}-args is given, but step {step} ({STEPS[step].title}) is not part of "
                            f"this run, whose steps are {running}; give the flags to one of those")


def route_user_flags(config: PipelineConfig, entry: Callable[[int], StepEntry]) -> dict[int, list[str]]:
    """The flags given to train.py that it does not read itself, each given to the run's steps that accept it; one
    that no step accepts (a typo, a renamed flag) is a `UserError` (`route_extra_flags`). Reads no file."""
    return route_extra_flags(
        config.extra_args, config.steps, {s: accepted_options(entry(s).build_parser()) for s in config.steps},
        read_by_train_py=frozenset({"--reward_fn"}),
    ) if config.extra_args else {}


def prepare_run(config: PipelineConfig, entry: Callable[[int], StepEntry], hardware: Hardware) -> PreparedRun:
    """Validate the inputs (hostfile, prerequisites, flags), plan the deployment, build each step's command."""
    _check_step_args_of_steps_run(config)
    deployment = config.deployment_type or detect_deployment(hardware, config.hostfile is not None)
    _check_run_shape(config, deployment)
    hosts = _hosts(config, deployment)
    _check_slots_of_this_machine(config, hosts, hardware)
    inputs = _inputs(config)
    routed = route_user_flags(config, entry)
    reward_model = any(source.model is Model.REWARD for source, _ in inputs.get(3, []))
    plan = plan_deployment(deployment, _model_sizes(config, inputs), hardware, hosts, config.workload(reward_model),
                           steps=config.steps)
    if untaken := apply_zero_overrides(plan, config.zero_stages(), config.steps):
        raise UserError("; ".join(
            f"--{model.value}-zero-stage {config.zero_stages()[model]}: no step of this run (steps "
            f"{', '.join(map(str, config.steps))}) {UNTAKEN_ZERO_STAGE[model]}: drop it" for model in sorted(untaken)))
    user_flags = {step: [*routed.get(step, []), *config.step_args.get(step, [])] for step in config.steps}
    follow_user_max_steps(plan, user_flags)
    launcher = _launcher(config, deployment, hardware, hosts)
    argvs = {step: _resume_from_checkpoints_only(config, step, step_argv(config, step, plan, routed, inputs))
             for step in config.steps}
    parsed = _parsed_step_commands(config, user_flags, argvs, entry)
    flags = {step: _recorded_flags(settings) for step, settings in parsed.items()}
    finished = _finished_steps(config, argvs, flags, inputs)
    # a finished step is skipped, its flags unused: not checked (a check added since would refuse what it finished with)
    # the cpu deployment runs the steps in this process, and a GPU one launched here on this machine's devices (its
    # CPU where it has no GPU); only planned where no GPU is (a dry run on a login node), or run on other nodes, the
    # steps run on devices this process does not see
    on_this_device = (deployment is DeploymentType.CPU or hardware.num_gpus > 0
                      or not (config.dry_run or deployment is DeploymentType.MULTI_NODE))
    runs_with = {step: values for step, (values, _) in flags.items()}
    tokenizers: dict[str, PreTrainedTokenizerBase | UserError] = {}
    reward_warning, refused = _reward_model_checked(config, inputs, runs_with, finished, tokenizers)
    _check_step_flags(config, {step: settings for step, settings in parsed.items() if step not in finished},
                      plan.world_size, on_this_device, refused)
    _check_step_inputs(config, {step: argv for step, argv in argvs.items() if step not in finished})
    _check_no_stale_checkpoints(config, finished, inputs, argvs)
    _check_resumed_world_size(config, plan, {step: argv for step, argv in argvs.items() if step not in finished})
    if 3 in parsed and 3 not in finished:
        _check_hardware_file_layout(parsed[3], hosts)
    commands = {
        step: launcher.command_now(STEPS[step].script(), argvs[step], check_gpus=not config.dry_run) if launcher
        else ["python", "-m", STEPS[step].module, *argvs[step]]
        for step in config.steps if step not in finished
    }
    return PreparedRun(plan, launcher, argvs, commands, finished, inputs, runs_with, hosts, reward_warning,
                       tokenizers)


def _run_step(config: PipelineConfig, prepared: PreparedRun, step: int,
              entry: Callable[[int], StepEntry]) -> StepResult:
    spec = STEPS[step]
    print(f"\n=== step {step}: {spec.title} -> {config.run_dir(step)} (log: {config.log_path(step)}) ===", flush=True)
    started = time.perf_counter()
    label = f"step {step} ({spec.title})"
    _record_input_versions(config, step, prepared.inputs[step], prepared.argvs[step])
    try:
        if prepared.launcher is None:
            summary = run_in_process(entry(step).main, prepared.argvs[step], config.log_path(step), label)
        else:
            command = prepared.launcher.command_now(STEPS[step].script(), prepared.argvs[step])
            print(f"launch: {format_command(command)}", flush=True)  # its master port is settled now
            run_subprocess(command, config.log_path(step), label, env=_launch_env(config, prepared.launcher),
                           stop_ranks=prepared.launcher.ranks_stop_command(STEPS[step].script(), prepared.argvs[step]),
                           nodes=prepared.launcher.output_prefixes, stop_status=prepared.launcher.stop_status)
            summary = read_summary(config.run_dir(step)) or {}
    except UserError as error:
        raise _with_resume_hint(config, step, error) from error
    _check_output(config, step)
    return StepResult(step, spec.title, time.perf_counter() - started, summary)


def _launch_env(config: PipelineConfig, launcher: Launcher) -> dict[str, str]:
    """The launcher's environment, with what --launcher's program does not give the ranks (`Launcher.ranks_env`);
    through pdsh with the env file that carries what the ranks on other nodes need, in the run's logs folder
    (`env_for_other_nodes`); through srun or mpirun with one of the user's checked env file lines alone
    (`env_for_launcher_program`)."""
    env = {**launcher_env(REPO_ROOT), **launcher.ranks_env()}
    env_file = config.output_dir / "logs" / OTHER_NODES_ENV_FILE
    if launcher.through_pdsh:
        return env_for_other_nodes(env, env_file)
    if launcher.through_nodes_launcher:
        return env_for_launcher_program(env, env_file)
    return env


def _say_variables_left_out(prepared: PreparedRun) -> None:
    """Warn, before any step starts and in a dry run alike, of the variables the ranks on other nodes need that
    `_launch_env`'s env file leaves out (`other_nodes_env_warnings`): where a step of the run launches there, not
    where every step is finished and nothing launches."""
    launcher = prepared.launcher
    if prepared.commands and launcher is not None and launcher.through_pdsh:
        for warning in other_nodes_env_warnings(launcher_env(REPO_ROOT)):
            print(f"warning: {warning}", file=sys.stderr, flush=True)


def _visible_devices_launched_through(prepared: PreparedRun, backend: str) -> str | None:
    """This machine's CUDA_VISIBLE_DEVICES where a step of the run launches ranks on a hostfile's nodes through
    `backend`, the state both warnings below read (None where it is unset or no step launches so)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if prepared.commands and visible is not None and prepared.hosts and prepared.launcher.backend == backend:
        return visible
    return None


def _say_visible_devices_not_followed(prepared: PreparedRun) -> None:
    """Warn, where a multi_node step will launch ranks on this machine, that its CUDA_VISIBLE_DEVICES is not followed:
    DeepSpeed's launcher gives a hostfile's ranks GPUs 0 to slots - 1 of each node whatever it says (selecting others
    takes its --include, which train.py does not pass), so a run restricted to GPUs 2 and 3 ran on 0 and 1, unsaid.
    Said only where one of those GPUs is not among those it lists (not for `0,1` beside `localhost slots=2`, as a
    scheduler sets it), or it names GPUs otherwise than by index; and only through pdsh: srun and mpirun leave the
    variable to the ranks, each taking the GPU of its local rank among those it lists."""
    visible = _visible_devices_launched_through(prepared, PDSH)
    if visible is None:
        return
    listed = {int(index) for index in visible_gpus()}
    here = next((host for host in prepared.hosts
                 if not set(range(host.slots)) <= listed and is_this_machine(host.name)), None)
    if here is None:
        return
    print(f"warning: multi_node: CUDA_VISIBLE_DEVICES={visible} is not followed for the ranks on this machine: "
          "DeepSpeed's launcher gives a hostfile's ranks GPUs 0 to slots - 1 of each node (here GPUs "
          f"{','.join(map(str, range(here.slots)))}, for '{here.name} slots={here.slots}'), and train.py has no "
          "--include to choose others; to run on those GPUs alone, use --deployment-type single_node here, which "
          "follows it", file=sys.stderr, flush=True)


def _say_visible_devices_sent_to_every_node(prepared: PreparedRun) -> None:
    """Warn, where a multi_node step launches through `--launcher impi` on other nodes, that this machine's
    CUDA_VISIBLE_DEVICES reaches their ranks too: Intel MPI's (or MPICH's) Hydra mpirun passes its environment to
    every rank, so a list set here for this machine (by a scheduler, or by hand) restricts every node's ranks to the
    same GPU indices."""
    visible = _visible_devices_launched_through(prepared, IMPI)
    if visible is None:
        return
    other = next((host.name for host in prepared.hosts if not is_this_machine(host.name)), None)
    if other is None:
        return
    print(f"warning: multi_node --launcher {prepared.launcher.backend}: CUDA_VISIBLE_DEVICES={visible} is this "
          "machine's, and mpirun passes this environment to the ranks on every node: those on "
          f"{other} see only its GPUs {visible} too (each rank takes the one of its local rank among them); to have "
          "each node's ranks on its own GPUs 0 to slots - 1, unset it here", file=sys.stderr, flush=True)


def _say_layouts_unlike_step_1(config: PipelineConfig, prepared: PreparedRun) -> None:
    """Warn, before any step starts and in a dry run alike, of a step that runs from step 1's model (step 3, DPO) and
    lays conversations out otherwise than step 1 tunes it (`tuned_layout_warning`): the step warned of it only as it
    started, after the steps before it had run for hours. Step 1's --prompt_format is the one it runs with in this
    run, else the one its run recorded; the tokenizer is read only where the two differ."""
    for step in prepared.commands:
        for source, model in prepared.inputs[step]:
            tuned = _step_1_prompt_format(prepared, model) if source.from_step == 1 else None
            given = prepared.runs_with[step].get(PROMPT_FORMAT)
            if tuned is None or given is None or tuned == given:
                continue
            if warning := _layout_unlike_step_1(config, prepared, step, model, (given, tuned)):
                print(f"warning: {warning}", file=sys.stderr, flush=True)


def _layout_unlike_step_1(config: PipelineConfig, prepared: PreparedRun, step: int, model: str,
                          formats: tuple[str, str]) -> str | None:
    """`tuned_layout_warning` for `step`, given step 1's `model` under the first of `formats` where step 1 tunes it
    under the second, naming the flag as train.py takes it (`_checked_with_tokenizers`: or that it was not checked).
    A format the tokenizer cannot render is refused as the `_StepRefuses` of the step whose format it is."""
    given, tuned = formats

    def checked(tokenizer: PreTrainedTokenizerBase) -> str | None:
        _refused_as(1, resolve_prompt_format, tuned, tokenizer)
        _refused_as(step, resolve_prompt_format, given, tokenizer)
        return tuned_layout_warning(tokenizer, given, tuned, model, f"step {step}", to_be_tuned=1 in prepared.commands,
                                    passing=f'--{STEPS[step].name}-args "--prompt_format {tuned}"')
    return _checked_with_tokenizers(
        config, prepared.tokenizers, (_tokenizer_model(config, prepared.runs_with, 1, model),), checked,
        f"step {step}'s --prompt_format {given} was not checked against step 1's ({tuned}) for a layout unlike the one "
        "its model is tuned on")


class _StepRefuses(UserError):
    """A refusal of `step`'s found while planning, refused with the steps' flag problems."""

    def __init__(self, step: int, error: UserError):
        super().__init__(f"step {step}: {error}")
        self.step = step


def _reward_model_checked(config: PipelineConfig, inputs: Inputs, runs_with: Mapping[int, Mapping[str, Any]],
                          finished: Mapping[int, dict], tokenizers: dict[str, PreTrainedTokenizerBase | UserError]
                          ) -> tuple[str | None, dict[int, str]]:
    """Step 3's reward model against its actor, before any step starts and in a dry run alike (step 3 checks it only
    as it starts, after steps 1 and 2 ran): the warning of `_reward_layout_warning`, and the refusals it finds (step
    3's of a reward model whose vocabulary is not the actor's, a step's of a format its tokenizer cannot render),
    refused with the steps' other problems."""
    if 3 not in runs_with or 3 in finished:
        return None, {}
    try:
        return _reward_layout_warning(config, inputs, runs_with, finished, tokenizers), {}
    except _StepRefuses as refusal:
        return None, {refusal.step: str(refusal)}


def _reward_layout_warning(config: PipelineConfig, inputs: Inputs, runs_with: Mapping[int, Mapping[str, Any]],
                           finished: Mapping[int, dict], tokenizers: dict[str, PreTrainedTokenizerBase | UserError]
                           ) -> str | None:
    """The warning where step 3 gives its reward model the actor's tokens laid out otherwise than step 2 trains it on
    (`scored_layout_warning`): another chat template (a reward model of another family) or --prompt_format. Step 2's
    --prompt_format is the one it runs with in this run, else the one its run recorded; the tokenizers are read only
    where the two models or the two formats differ, and their vocabularies compared there (step 3's `_StepRefuses`,
    as step 3 refuses: the tokenizers are those steps 1 and 2 save, each what `load_tokenizer` makes of its base
    model, a pad token added alike), and each format checked against the tokenizer that renders it (a `_StepRefuses`
    of the step whose format it is: step 2's, step 3's)."""
    models = {source.from_step: model for source, model in inputs[3]}
    if 2 not in models:  # scored by --reward_fn alone
        return None
    given = runs_with[3].get(PROMPT_FORMAT)
    trained = runs_with[2].get(PROMPT_FORMAT) if 2 in runs_with else trained_prompt_format(models[2])
    actor, reward = (_tokenizer_model(config, runs_with, step, models[step]) for step in (1, 2))
    if actor == reward and given == trained:
        return None

    def checked(actor_tokenizer, reward_tokenizer) -> str | None:
        _refused_as(3, check_same_vocabulary, actor_tokenizer, reward_tokenizer, reward)
        if given is None or trained is None:
            return None
        _refused_as(2, resolve_prompt_format, trained, reward_tokenizer)
        _refused_as(3, resolve_prompt_format, given, actor_tokenizer)
        return scored_layout_warning(actor_tokenizer, given, reward_tokenizer, trained, models[2],
                                     to_be_trained=2 in runs_with and 2 not in finished)
    return _checked_with_tokenizers(
        config, tokenizers, (actor, reward), checked,
        f"step 3's reward model was not checked for a vocabulary unlike the actor's, nor step 3's --prompt_format "
        f"{given} against step 2's ({trained}) for a layout unlike the one the reward model is trained on")


def _refused_as(step: int, check: Callable[..., object], *args: Any) -> None:
    """`check(*args)`, its `UserError` raised as `step`'s refusal."""
    try:
        check(*args)
    except UserError as error:
        raise _StepRefuses(step, error) from None


def _tokenizer_model(config: PipelineConfig, runs_with: Mapping[int, Any], step: int, output: str) -> str:
    """The model whose tokenizer lays out the conversations of `step`'s `output`: the base model it starts from where
    this run runs `step` (its output may not be saved yet) or skips it finished, else the output."""
    return config.base_model(STEPS[step].inputs[0].model) if step in runs_with else output


def _checked_with_tokenizers(config: PipelineConfig, tokenizers: dict[str, PreTrainedTokenizerBase | UserError],
                             models: tuple[str, ...], check: Callable[..., str | None], unchecked: str) -> str | None:
    """`check`'s warning, given the tokenizers of `models` (`_planned_tokenizer`). Where one does not load (a hub
    model offline whose tokenizer no cache holds), `unchecked`, saying why: the plan went on without the check
    before, and the step that loads the tokenizer says so itself."""
    try:
        loaded = [_planned_tokenizer(config, tokenizers, model) for model in models]
    except UserError as error:
        return f"{unchecked}, as the tokenizer does not load: {error}"
    return check(*loaded)


def _planned_tokenizer(config: PipelineConfig, tokenizers: dict[str, PreTrainedTokenizerBase | UserError],
                       model: str) -> PreTrainedTokenizerBase:
    """`model`'s tokenizer, read once per planning into `tokenizers` (the layout checks of steps 1 and 2 both read
    the actor's); one that does not load is refused alike each time, not read again."""
    if model not in tokenizers:
        try:
            tokenizers[model] = load_tokenizer(model, config.trust_remote_code)
        except UserError as error:
            tokenizers[model] = error
    if isinstance(read := tokenizers[model], UserError):
        raise read
    return read


def _step_1_prompt_format(prepared: PreparedRun, model: str) -> str | None:
    """The --prompt_format step 1 tunes `model` under: this run's, where it runs step 1 (or skips it finished), else
    the one recorded by the run that made `model` (None: no run of this project)."""
    flags = prepared.runs_with[1] if 1 in prepared.runs_with else args_of_model(model)
    return flags.get(PROMPT_FORMAT)


def _say_model_flags_unused(config: PipelineConfig, inputs: Inputs) -> None:
    """Warn of an --actor-model or --reward-model given (not the embedded default) that no step of the run starts
    from, saying what the run uses instead: DPO and a step 3 scored by --reward_fn alone have no reward model, and a
    step 3 whose steps 1 and 2 are not run takes their outputs. A warning, not a refusal: the same command with
    another --step (or --algorithm) stays valid."""
    for model in Model:
        given = config.base_model(model)
        starts_from_it = any(source.model is model and source.from_step is None
                             for step in config.steps for source in STEPS[step].inputs)
        if given != EMBEDDED_MODEL_NAME and not starts_from_it:
            print(f"warning: --{model.value}-model {given} is not used: {_used_instead(config, inputs, model)}",
                  file=sys.stderr, flush=True)


def _used_instead(config: PipelineConfig, inputs: Inputs, model: Model) -> str:
    """What the run uses in place of the `model` flag no step starts from (an earlier step's output, or nothing), and
    what to do."""
    taken = [f"step {step} takes the step-{source.from_step} {STEPS[source.from_step].output.what} in {value}, not "
             f"one trained from it (add {source.from_step} to --step for that)"
             for step, pairs in inputs.items() for source, value in pairs if source.model is model]
    if taken:
        return "; ".join(taken) + f"; or drop --{model.value}-model"
    why = ""
    if model is Model.REWARD and config.algorithm == DPO:
        why = ": DPO trains the step-1 model against a frozen copy of itself, with no reward model"
    elif model is Model.REWARD and 3 in config.steps:
        why = f": step 3 scores its answers with --reward_fn {config.reward_fn} alone"
    steps = ", ".join(map(str, config.steps))
    return f"no step of this run (steps {steps}) uses the {model.value} model{why}; drop --{model.value}-model"


def _with_resume_hint(config: PipelineConfig, step: int, error: UserError) -> UserError:
    """A failed step's error, saying how to go on: from the checkpoint it left (a crash hours in, a node lost), where
    it left one (a rerun without --resume would refuse its folder), else by the same command, which skips the finished
    steps."""
    latest = CheckpointManager(config.run_dir(step)).latest()
    if latest is None:
        return UserError(f"{error}; once the cause is fixed, the same train.py command runs step {step} again "
                         f"(finished steps are skipped)")
    return UserError(f"{error}; step {step} left a checkpoint of its step {latest.step} ({latest.path}): once the "
                     f"cause is fixed, {_resuming_command(config)} goes on from it")


def _resuming_command(config: PipelineConfig) -> str:
    """The command that goes on from a step's checkpoint: this one, with --resume where it has none."""
    return "the same train.py command" + ("" if RESUME_FLAG in config.extra_args else f" with {RESUME_FLAG}")


def _stopped_mid_step(config: PipelineConfig, step: int) -> str:
    """What train.py says of a step a stop request ended before it finished: the checkpoint a rerun goes on from,
    or, stopped before its first, that the step starts over."""
    latest = CheckpointManager(config.run_dir(step)).latest()
    if latest is None:
        return (f"step {step} stopped before its first checkpoint; to go on, run the same train.py command (step "
                f"{step} starts over)")
    return (f"step {step} stopped before it finished, with a checkpoint of its step {latest.step} ({latest.path}); to "
            f"go on, run {_resuming_command(config)}")


def _step_result(config: PipelineConfig, prepared: PreparedRun, step: int,
                 entry: Callable[[int], StepEntry]) -> StepResult:
    if step in prepared.finished:
        return _skipped_result(step, prepared.finished[step])
    return _run_step(config, prepared, step, entry)


def _skipped_result(step: int, summary: dict) -> StepResult:
    """A step finished by an earlier run, which this one skips: that run's summary."""
    return StepResult(step, STEPS[step].title, 0.0, summary, skipped=True)


def _planned(config: PipelineConfig, prepared: PreparedRun, step: int) -> str:
    if step in prepared.finished:
        return f"finished in {config.run_dir(step)}, skipped"
    return format_command(prepared.commands[step])


def _stopped_message(what: str, received: signal.Signals | None) -> str:
    """What train.py says as a stop request ends it: how it stopped, then `what` (which step, how to go on)."""
    return f"train.py stopped {stopped_by(received, 'train.py')}: {what}"


def _stop(what: str, received: signal.Signals | None) -> NoReturn:
    """End train.py as a step ends on a stop request: the message (on stderr where the request is the output's
    reader gone: stdout goes nowhere), then `EXIT_INTERRUPTED`."""
    print(f"\n{_stopped_message(what, received)}", flush=True,
          file=sys.stderr if received == OUTPUT_UNREAD else sys.stdout)
    raise SystemExit(EXIT_INTERRUPTED)


def _stop_between_steps(what: str, received: signal.Signals) -> NoReturn:
    """End train.py, where no step is under way, on a stop request: as `_stop` does, but quietly with the shell's
    SIGPIPE status where `_said_between_steps` says nothing (the output's reader gone: no step was cut)."""
    if _said_between_steps(what, received) is None:
        raise SystemExit(EXIT_BROKEN_PIPE)
    _stop(what, received)


def _stop_if_requested(what: str) -> None:
    """End train.py here, where no step is under way, on a stop request taken since the last look
    (`_stop_between_steps`)."""
    received = take_received_signal()
    if received is not None:
        _stop_between_steps(what, received)


def _said_between_steps(what: str, received: signal.Signals) -> str | None:
    """What train.py says as a stop request ends it between steps (`_stop_between_steps`): nothing where it is the
    output's reader gone, as train.py then ends quietly."""
    return None if received == OUTPUT_UNREAD else _stopped_message(what, received)


def _stopped_record(step: int | None, received: signal.Signals | None, message: str | None) -> dict:
    """What `summary.json` says of a run a stop request ended: the step a rerun goes on with (the one stopped, or the
    next one that runs; None: none is left), the signal (SIGPIPE: train.py's output left without a reader; None: a
    step's own, not train.py's), what train.py said (None: it ended quietly), and the command that goes on (this one
    with --resume, which a step with no checkpoint ignores)."""
    return {"step": step, "signal": received.name if received is not None else None, "message": message,
            "resume": resume_command()}


def _end_if_output_unread() -> None:
    """train.py past its last step or its dry run's plan: its output's reader gone meanwhile ends it with the
    shell's SIGPIPE status (what it printed was cut off); a signal there is nothing to stop."""
    if take_received_signal() == OUTPUT_UNREAD:
        raise SystemExit(EXIT_BROKEN_PIPE)


def run_pipeline(
    config: PipelineConfig,
    entries: Mapping[int, StepEntry] | None = None,
    hardware: Hardware | None = None,
) -> dict:
    """Plan, print and (unless a dry run) run the steps; returns what `summary.json` holds, or for a dry
    run the commands. `entries` replaces steps' entry points and `hardware` the detected machine (tests)."""

    def entry(step: int) -> StepEntry:
        return (entries or {}).get(step) or STEPS[step].entry()

    check_not_under_a_launcher()
    drop_stray_launcher_name()
    folder = check_folder_path(config.output_dir, "--output-dir")
    take_received_signal()  # a stop request before this run is not one for it
    stops = GracefulInterrupt(on_receipt="train.py ends before its next step (a step under way stops at its next "
                                         "checkpoint)", program="train.py", quiet_if_unread=True)
    with _output_dir_lock(folder, config.dry_run), stops:
        report = _planned_and_run(config, entry, hardware or detect_hardware())
        _end_if_output_unread()
    return report


@contextlib.contextmanager
def _output_dir_lock(folder: Path, dry_run: bool) -> Iterator[None]:
    """The lock train.py holds on its --output-dir (`folder`, checked) from before it plans to its end: a second
    train.py there is refused at once, before it plans from step folders the first one writes, or writes its
    summary.json over the first's. Each step's own lock is on its run folder below (`RunLock`). A dry run writes
    nothing and takes none. A run that ends having written nothing there (refused while planning) leaves no lock
    file, nor the folders it created for it."""
    if dry_run:
        yield
        return
    created = _topmost_missing(folder)
    with RunLock(check_output_dir(folder, "--output-dir"), flag="--output-dir") as lock:
        try:
            yield
        finally:
            if lock.remove_files_if_alone() and created is not None:
                _remove_empty_folders(folder, created)


def _topmost_missing(folder: Path) -> Path | None:
    """The outermost of `folder` and its parents that does not exist yet (None: `folder` exists)."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    return missing[-1] if missing else None


def _remove_empty_folders(folder: Path, topmost: Path) -> None:
    """Remove `folder` and its parents up to `topmost` (one of them), each only while empty: a folder another process
    wrote into meanwhile stays."""
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == topmost:
            return


def _say_output_dir_in_use(config: PipelineConfig) -> None:
    """Warn, in a dry run (which takes no lock), where another run holds --output-dir now: the same command without
    --dry-run would be refused."""
    holder = RunLock(config.output_dir).holder_now()
    if holder is not None:
        print(f"warning: --output-dir {config.output_dir} is in use by another run ({holder}); run now, without "
              "--dry-run, train.py would be refused until that run ends", file=sys.stderr, flush=True)


def _planned_and_run(config: PipelineConfig, entry: Callable[[int], StepEntry], hardware: Hardware) -> dict:
    """`run_pipeline` under its stop-request handler: a stop request while planning or between steps ends train.py
    at the next of those points, saying how to go on."""
    prepared = prepare_run(config, entry, hardware)
    deployment = prepared.plan.deployment.value
    print(settings_table(prepared.plan, config.steps, prepared.runs_with), flush=True)
    how = "in this process, as" if prepared.launcher is None else "with"
    print(f"\n{'would run' if config.dry_run else 'runs'} {how}:")
    if prepared.launcher is not None and prepared.launcher.settles_port_at_launch:
        print("  (master ports free now; each step takes one free when it starts, printed at its launch)")
    for step in config.steps:
        print(f"  step {step}: {_planned(config, prepared, step)}", flush=True)
    _say_variables_left_out(prepared)
    _say_visible_devices_not_followed(prepared)
    _say_visible_devices_sent_to_every_node(prepared)
    _say_model_flags_unused(config, prepared.inputs)
    _say_layouts_unlike_step_1(config, prepared)
    if prepared.reward_warning is not None:
        print(f"warning: {prepared.reward_warning}", file=sys.stderr, flush=True)
    if config.dry_run:
        _say_output_dir_in_use(config)
    running = {step: prepared.runs_with[step] for step in prepared.commands}
    for warning in host_memory_warnings(prepared.plan, hardware, prepared.hosts, running):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if not config.dry_run:
        return _run_steps(config, prepared, entry)
    _stop_if_requested(STOPPED_WHILE_PLANNING)
    if 3 in config.steps and config.passed_flag("--placement") == AUTO:
        print(_placement_plans(config, prepared, entry(3), hardware), flush=True)
    return {"deployment": deployment, "commands": prepared.commands}


@dataclass
class RunRecord:
    """train.py's `summary.json` as the run goes: `running` from before its first step (replacing an earlier run's
    record), then what ended it, written once (`end`)."""

    config: PipelineConfig
    prepared: PreparedRun
    results: list[StepResult] = field(default_factory=list)  # the steps gone through so far, in order
    started: float = field(default_factory=time.perf_counter)
    ended: bool = False

    def mark_running(self) -> None:
        """Write the running mark; where it cannot be written (a full disk), the run does not start: a `UserError`."""
        try:
            _write_report(self.config, _running_record(self.prepared, self.steps_recorded()))
        except OSError as unwritten:
            raise UserError(f"{_not_recorded(self.config, 'that this run started', unwritten)}, so it ran no step; "
                            f"{FREE_SUMMARY}, or choose another --output-dir") from unwritten

    def end(self, failed: dict | None = None, stopped: dict | None = None) -> dict:
        """Write the record of the run's end (completed, or `failed` or `stopped` as `_report` says) and return it."""
        report = _report(self.prepared.plan.deployment.value, self.steps_recorded(),
                         time.perf_counter() - self.started, failed=failed, stopped=stopped)
        _write_report(self.config, report)
        self.ended = True
        return report

    def end_or_warn(self, failed: dict | None = None, stopped: dict | None = None) -> None:
        """`end` where train.py ends on something else (a stop, an error): a record that cannot be written (a full
        disk) is warned of (`_say_end_unrecorded`), so that what ended the run still ends train.py as it would."""
        try:
            self.end(failed=failed, stopped=stopped)
        except OSError as unwritten:
            _say_end_unrecorded(self.config, unwritten)
            self.ended = True  # tried: not to be recorded again as train.py's crash

    def steps_recorded(self) -> list[StepResult]:
        """The steps gone through so far, then the later ones an earlier run finished (which this one skips)."""
        gone_through = {result.step for result in self.results}
        return [*self.results, *(_skipped_result(step, summary) for step, summary in self.prepared.finished.items()
                                 if step not in gone_through)]

    def step_to_go_on_with(self) -> int | None:
        """The first step of the run that has not finished (None: none is left)."""
        gone_through = {result.step for result in self.results}
        return next((step for step in self.prepared.commands if step not in gone_through), None)

    def end_as_raised(self, error: BaseException) -> None:
        """Record what `error`, raised past the running mark and not recorded yet, ended the run as (`_ending`);
        where summary.json cannot be written, warn of it, so that `error` is still what ends train.py."""
        self.end_or_warn(**self._ending(error))

    def _ending(self, error: BaseException) -> dict[str, dict]:
        """`end`'s `stopped` or `failed` for `error`: a second Ctrl-C (`KeyboardInterrupt`), or a print that met
        train.py's output left without a reader before the output watch did (the `BrokenPipeError` `run_cli` ends
        quietly on with the SIGPIPE status), as a stop; a step's failure (`UserError`) or train.py's own as failed."""
        step = self.step_to_go_on_with()
        if isinstance(error, KeyboardInterrupt):
            return {"stopped": _stopped_record(step, signal.SIGINT, str(error) or None)}
        if isinstance(error, BrokenPipeError) and unread_outputs():
            return {"stopped": _stopped_record(step, OUTPUT_UNREAD, None)}
        if isinstance(error, UserError):
            return {"failed": {"step": step, "error": str(error)}}
        return {"failed": {"step": step, "error": f"train.py crashed: {exception_cause(error)}; the traceback is on "
                                                  "its stderr"}}


FREE_SUMMARY = "free space there, or make it writable"  # what to do where summary.json could not be written


def _not_recorded(config: PipelineConfig, what: str, unwritten: OSError) -> str:
    """That train.py could not record `what` in summary.json, and the OSError that stopped it."""
    return f"train.py could not record {what} in {config.output_dir / 'summary.json'} ({unwritten})"


def _say_end_unrecorded(config: PipelineConfig, unwritten: OSError) -> None:
    """Warn that the record of the run's end could not be written (a full disk): summary.json still says `running`."""
    print(f"warning: {_not_recorded(config, 'how this run ended', unwritten)}: it still says the run is running; "
          f"{FREE_SUMMARY}, before the next run", file=sys.stderr, flush=True)


def _running_record(prepared: PreparedRun, finished: list[StepResult]) -> dict:
    """What `summary.json` says while the run goes: when it started, the command, the host and pid of train.py, the
    steps it runs, and the `finished` ones it skips."""
    return {"status": RUNNING, "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv), "host": socket.gethostname(), "pid": os.getpid(),
            "deployment": prepared.plan.deployment.value, "steps_to_run": list(prepared.commands),
            "steps": _steps_record(finished)}


def _run_steps(config: PipelineConfig, prepared: PreparedRun, entry: Callable[[int], StepEntry]) -> dict:
    """Run the planned steps, `summary.json` saying the run is running until it says how it ended, however it ends
    (`RunRecord.end_as_raised`)."""
    record = RunRecord(config, prepared)
    record.mark_running()
    try:
        return _steps_run(config, prepared, entry, record)
    except BaseException as error:
        if not record.ended:
            record.end_as_raised(error)
        raise


def _steps_run(config: PipelineConfig, prepared: PreparedRun, entry: Callable[[int], StepEntry],
               record: RunRecord) -> dict:
    """Each step in turn, a stop request before one of them or during one ending train.py there; returns the
    completed run's record."""
    for step in config.steps:
        _stop_if_requested_before_step(record)
        try:
            record.results.append(_step_result(config, prepared, step, entry))
        except StepStopped:
            received, what = take_received_signal(), _stopped_mid_step(config, step)
            record.end_or_warn(stopped=_stopped_record(step, received, _stopped_message(what, received)))
            _stop(what, received)
    report = record.end()
    print("\n" + summary_table(record.results, report["total_seconds"]), flush=True)
    return report


def _stop_if_requested_before_step(record: RunRecord) -> None:
    """End train.py, recording it, on a stop request taken while it planned or since the last step."""
    received = take_received_signal()
    if received is None:
        return
    what = STOPPED_WHILE_PLANNING
    if record.results:
        what = (f"step {record.results[-1].step} finished and the next did not start; to go on, run the same train.py "
                f"command (finished steps are skipped)")
    record.end_or_warn(stopped=_stopped_record(record.step_to_go_on_with(), received,
                                               _said_between_steps(what, received)))
    _stop_between_steps(what, received)


def _report(deployment: str, results: list[StepResult], total: float, failed: dict | None = None,
            stopped: dict | None = None) -> dict:
    """What `summary.json` holds at the run's end: its status, the steps that finished (or were skipped), and the one
    that failed, or the stop request that ended the run (`_stopped_record`), if one did."""
    status = FAILED if failed is not None else STOPPED if stopped is not None else COMPLETED
    report = {"status": status, "deployment": deployment, "total_seconds": total, "steps": _steps_record(results)}
    ending = {name: value for name, value in (("failed", failed), ("stopped", stopped)) if value is not None}
    return {**report, **ending}


def _steps_record(results: list[StepResult]) -> dict:
    """Each step's title, seconds, whether this run skipped it (finished by an earlier one), and its summary."""
    return {str(r.step): {"title": r.title, "seconds": r.seconds, "skipped": r.skipped, "summary": dict(r.summary)}
            for r in results}


def _write_report(config: PipelineConfig, report: dict) -> None:
    config.output_dir.mkdir(parents=True, exist_ok=True)  # the running mark comes before any step makes it
    atomic_write_text(config.output_dir / "summary.json", json.dumps(report, indent=2, default=str) + "\n")
