"""Crash-and-resume harness for any step entry point that saves through `CheckpointManager`.

A test launches the step's `main.py` in a subprocess (`launch_step`), waits until a complete
checkpoint of at least some step exists (`wait_for_checkpoint`), kills or signals it
(`kill_after_checkpoint`), then resumes with `--resume` (in a subprocess with `run_step`, or
in-process by calling the step's `main`) and compares the final weights with an uninterrupted
run (`assert_same_weights`). `stall_save_at=N` freezes the process in the middle of writing
checkpoint N (engine files written, completion marker not yet), so a test can kill a save
part-way (`wait_for_stalled_save`). Step 3 uses the same pattern with `--actor_...` flags:

    run = launch_step(STEP3, argv, tmp_path / "step3.log")
    kill_after_checkpoint(run, min_step=2)
    run_step(STEP3, [*argv, "--resume"], tmp_path / "resumed.log")
    assert_same_weights(reference / "actor", output_dir_of(argv) / "actor")
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from conftest import REPO_ROOT, TESTS_DIR
from safetensors.torch import load_file

from training.reliability.checkpointing import CheckpointManager

STEP_RUNNER = TESTS_DIR / "scripts" / "run_step.py"
POLL_S = 0.02
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def step_env() -> dict[str, str]:
    """The environment a step subprocess needs: the repository importable, CPU DeepSpeed, no hub, and
    none of the launcher variables this test process set for its own world (the step makes its own)."""
    inherited = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return {
        **inherited,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def step_command(script: str | Path, argv: Sequence[str], stall_save_at: int | None = None,
                 stall_file: Path | None = None) -> list[str]:
    if stall_save_at is None:
        return [sys.executable, str(script), *argv]
    return [sys.executable, str(STEP_RUNNER), "--stall_save_at", str(stall_save_at), "--stall_file", str(stall_file),
            str(script), "--", *argv]


@dataclass
class StepProcess:
    """A step running in a subprocess; stdout and stderr go to `log` (a pipe could fill and block it)."""

    process: subprocess.Popen
    command: list[str]
    output_dir: Path
    log: Path
    stall_file: Path | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"{self.command} did not end within {timeout} s; log:\n{self.output()[-3000:]}")


def output_dir_of(argv: Sequence[str]) -> Path:
    """The value of `--output_dir` in a step's arguments."""
    words = list(argv)
    for index, word in enumerate(words):
        if word == "--output_dir":
            return Path(words[index + 1])
        if word.startswith("--output_dir="):
            return Path(word.split("=", 1)[1])
    raise ValueError(f"no --output_dir in {words}")


def launch_step(script: str | Path, argv: Sequence[str], log: str | Path,
                stall_save_at: int | None = None) -> StepProcess:
    """Start `python <script> <argv>` in the repository root, its output going to `log`."""
    log = Path(log)
    stall_file = log.with_suffix(".stalled") if stall_save_at is not None else None
    command = step_command(script, argv, stall_save_at, stall_file)
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=step_env(), cwd=REPO_ROOT)
    return StepProcess(process, command, output_dir_of(argv), log, stall_file)


def latest_checkpoint_step(output_dir: str | Path) -> int | None:
    """The step of the checkpoint a resume would load now (None: no complete checkpoint)."""
    latest = CheckpointManager(output_dir).latest()
    return None if latest is None else latest.step


def _wait_for(run: StepProcess, ready: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if run.process.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.process.returncode}) before {what}; log:\n{run.output()[-3000:]}")
        if time.monotonic() > deadline:
            run.process.kill()
            run.process.wait()
            raise AssertionError(f"no {what} within {timeout} s; log:\n{run.output()[-3000:]}")
        time.sleep(POLL_S)


def wait_for_checkpoint(run: StepProcess, min_step: int, timeout: float = 300) -> int:
    """Block until a complete checkpoint of step >= `min_step` exists; return its step."""
    found: list[int] = []

    def ready() -> bool:
        step = latest_checkpoint_step(run.output_dir)
        found[:] = [step] if step is not None else []
        return step is not None and step >= min_step

    _wait_for(run, ready, f"checkpoint of step >= {min_step}", timeout)
    return found[0]


def wait_for_stalled_save(run: StepProcess, timeout: float = 300) -> None:
    """Block until a run launched with `stall_save_at` is frozen in the middle of that save."""
    assert run.stall_file is not None, "launch the step with stall_save_at=N"
    _wait_for(run, run.stall_file.exists, "stalled checkpoint save", timeout)


def kill_after_checkpoint(run: StepProcess, min_step: int, sig: signal.Signals = signal.SIGKILL,
                          timeout: float = 300) -> int:
    """Send `sig` once a checkpoint of step >= `min_step` is complete; return that step.

    With SIGKILL it also waits for the process and checks that it really died mid-run (a run
    that had already finished would make the resume test meaningless).
    """
    step = wait_for_checkpoint(run, min_step, timeout)
    run.process.send_signal(sig)
    if sig == signal.SIGKILL:
        code = run.wait(timeout=60)
        assert code == -signal.SIGKILL, f"the run ended by itself (exit {code}) before the kill; log:\n{run.output()[-3000:]}"
    return step


def run_step(script: str | Path, argv: Sequence[str], log: str | Path, timeout: float = 400) -> str:
    """Run a step to completion in a subprocess; returns its output (asserts exit 0)."""
    return finished_output(launch_step(script, argv, log), timeout)


def finished_output(run: StepProcess, timeout: float = 400) -> str:
    """The output of a launched step once it has ended (asserts exit 0). A test that starts its uninterrupted
    reference run with `launch_step` beside the run it interrupts collects it here: the two start-ups overlap."""
    code = run.wait(timeout)
    assert code == 0, f"{run.command} exited {code}; log:\n{run.output()[-3000:]}"
    return run.output()


def folder_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a saved model folder."""
    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no safetensors files in {folder}"
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update({f"{file.name}:{key}": value for key, value in load_file(file).items()})
    return weights


def assert_same_weights(expected_folder: str | Path, actual_folder: str | Path) -> None:
    """The two saved models hold bit-identical tensors."""
    expected, actual = folder_weights(expected_folder), folder_weights(actual_folder)
    assert sorted(expected) == sorted(actual)
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"
