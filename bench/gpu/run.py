"""Everything GPU-specific in one command, on a fresh GPU machine (see the README's "On a GPU").

    python3 -m bench.gpu.run --output $OUT                          # every stage
    python3 -m bench.gpu.run --output $OUT --stages tests           # one stage (its prerequisites run first)
    python3 -m bench.gpu.run --output /tmp/x --dry_run              # print the commands; runs nothing

Each stage's commands append their output to a log in the output folder and write their JSONs there; a failing
command ends its stage (a later command marked `always` still runs, even past the budget, for `ALWAYS_GRACE_S`),
is recorded, and the next stage runs. No other command starts after `--budget_s`, and each is stopped at it, so the
call ends with the output packed into
`gpu_run.tar.gz` beside `status.json` (what the device tool brings back: at most 8 files). `status.json` lists
every stage of this call: ok, failed or skipped (and why), with each command's exit status and seconds.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from bench.gpu.pack import pack
from bench.gpu.stages import Command, Context, GpuRunSettings, Stage, select

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMED_OUT = 124
ALWAYS_GRACE_S = 15  # how long a command marked `always` may run past the budget (copying a cut run's reports takes
# about a second; `plan.TIMEOUT_MARGIN_S` leaves room for it and the packing)


@dataclass
class CommandResult:
    command: str
    returncode: int
    seconds: float


@dataclass
class StageResult:
    stage: str
    status: str  # ok, failed or skipped
    reason: str | None = None
    seconds: float = 0.0
    commands: list[CommandResult] = field(default_factory=list)


def run_command(command: Command, ctx: Context, timeout_s: float) -> CommandResult:
    """Run one command in the repository root, its output appended to its log; stopped (whole process group)
    after `timeout_s`."""
    started = time.monotonic()
    with (ctx.out / command.log).open("a") as log:
        log.write(f"\n$ {command.shell()}\n")
        log.flush()
        process = subprocess.Popen(command.argv, cwd=ctx.repo, env=ctx.env(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.write(f"\n[stopped after {timeout_s:.0f} s: the run's budget]\n")
            returncode = TIMED_OUT
    return CommandResult(command.shell(), returncode, round(time.monotonic() - started, 1))


def run_stage(stage: Stage, ctx: Context, deadline: float) -> StageResult:
    started = time.monotonic()
    built = stage.commands(ctx)
    if isinstance(built, str):
        return StageResult(stage.name, "skipped", built)
    result = StageResult(stage.name, "ok")
    for command in built:
        if result.status == "failed" and not command.always:
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not command.always:
            if result.status == "ok":
                result.status, result.reason = "failed", "out of time (--budget_s)"
            continue  # a later `always` command still collects what the cut one left
        outcome = run_command(command, ctx, remaining if remaining > 0 else ALWAYS_GRACE_S)
        result.commands.append(outcome)
        if outcome.returncode != 0 and result.status == "ok":
            result.status = "failed"
            result.reason = f"exit {outcome.returncode}: {command.argv[1:3]} (see {command.log})"
    result.seconds = round(time.monotonic() - started, 1)
    return result


def run_stages(stages: list[Stage], ctx: Context) -> list[StageResult]:
    """Every stage in order, each after the last whatever its outcome, until the budget is spent."""
    deadline = time.monotonic() + ctx.settings.budget_s
    ctx.state.mkdir(parents=True, exist_ok=True)
    results = []
    for stage in stages:
        if time.monotonic() >= deadline:
            results.append(StageResult(stage.name, "skipped", "out of time (--budget_s)"))
            continue
        print(f"== {stage.name}: {stage.measures}", flush=True)
        results.append(run_stage(stage, ctx, deadline))
        print(f"   {results[-1].status} {results[-1].reason or ''}", flush=True)
    return results


def dry_run(stages: list[Stage], ctx: Context) -> None:
    """Print each stage's commands as they would be built now, or why it would not run."""
    for stage in stages:
        print(f"== {stage.name}: {stage.measures}")
        built = stage.commands(ctx)
        if isinstance(built, str):
            print(f"   skip: {built}")
        elif not built:
            print("   nothing to do")
        for command in [] if isinstance(built, str) else built:
            print(f"   {command.shell()}")


def write_status(results: list[StageResult], ctx: Context) -> dict:
    """This call's `status.json`, also appended to the state folder's history of calls on this machine."""
    status = {"stages": [asdict(result) for result in results], "settings": asdict(ctx.settings),
              "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    (ctx.out / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    ctx.state.mkdir(parents=True, exist_ok=True)
    with (ctx.state / "history.jsonl").open("a") as history:
        history.write(json.dumps(status) + "\n")
    return status


def main(argv: list[str] | None = None) -> list[StageResult]:
    (settings,) = HfArgumentParser(GpuRunSettings).parse_args_into_dataclasses(argv)
    ctx = Context(settings, REPO_ROOT, sys.executable)
    try:
        stages = select(settings.stages, settings.skip)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    if settings.dry_run:
        dry_run(stages, ctx)
        return []
    ctx.out.mkdir(parents=True, exist_ok=True)
    results = run_stages(stages, ctx)
    write_status(results, ctx)
    archive = pack(ctx.out)
    print(f"\n{'stage':<12} {'status':<8} {'seconds':>8}  reason")
    for result in results:
        print(f"{result.stage:<12} {result.status:<8} {result.seconds:>8.1f}  {result.reason or ''}")
    print(f"packed into {archive} ({archive.stat().st_size / 2**20:.1f} MiB) beside status.json")
    return results


if __name__ == "__main__":
    main()
