"""What the bench scripts share: running a step in a child process (its own peak memory), the device's
name, the printed table and the JSON report."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from training.pipeline.failures import signal_cause

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_child(script: Path, module: str, argv: list[str], result_file: Path) -> dict:
    """Run a step's `main` in a fresh process (`script --child ...`, see `child_main`); returns its summary and
    that process's peak RSS."""
    command = [sys.executable, str(script.resolve()), "--child", module, str(result_file), *argv]
    print("$", shlex.join(command[2:]), flush=True)
    status = subprocess.run(command, check=False, cwd=REPO_ROOT).returncode
    if status:
        raise SystemExit(f"{module} {child_failure(status)}; no report written")
    return json.loads(result_file.read_text())


def child_failure(status: int) -> str:
    """How a child that ended with `status` (nonzero) failed: its own exit, whose error it printed, or a signal (a
    negative status), which prints nothing, said as train.py says it of a step (SIGKILL: likely the OOM killer)."""
    if status > 0:
        return f"exited with status {status} (its error is above)"
    return f"was {signal_cause(-status)}"


def child_main(child: list[str]) -> None:
    """`--child MODULE RESULT_FILE ARGS...`: run MODULE.main(ARGS) and write its summary and peak memory (GB, 10^9
    bytes, as step 3's `memory/peak_rss_gb`)."""
    from step3_rlhf.run_loop import peak_rss_gb  # first: an import after the step cannot raise the peak it reports

    module, result_file, argv = child[0], child[1], child[2:]
    summary = importlib.import_module(module).main(argv)
    Path(result_file).write_text(json.dumps({"summary": summary, "peak_memory_gb": peak_rss_gb()}, default=str))


def device_name(device=None) -> str:
    """The GPU's name (`device` a CUDA device), or the CPU's model name, whether it has native bf16, and the
    threads used."""
    import torch

    from utils.cpu import cpu_has_native_bf16, cpu_model_name

    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{cpu_model_name()} CPU ({bf16}), {torch.get_num_threads()} threads"


def print_table(rows: list[dict], columns: tuple[str, ...]) -> None:
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns))


def git_output(*args: str) -> str | None:
    """`git ARGS` run in this checkout, its output stripped; None where git or the repository is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict:
    """The commit of the code measured and whether the checkout differed from it (changed, deleted or new files;
    not those git ignores): a figure from a tree with uncommitted changes, a new module it imports too, cannot be
    reproduced from its commit alone. bench/results is left out: the benchmarks themselves rewrite its files, so a
    second benchmark run would otherwise always report changes. None for both outside a git checkout."""
    commit = git_output("rev-parse", "HEAD")
    changes = git_output("status", "--porcelain", "--", ".", ":(exclude)bench/results") if commit else None
    return {"git_commit": commit, "git_uncommitted_changes": bool(changes) if changes is not None else None}


def provenance(device: str | None = None) -> dict:
    """Where, with what and how a result was measured: the device (default: this CPU), the threads, the torch,
    transformers and deepspeed versions, the code's commit (`code_version`) and the command line."""
    import torch

    return {
        "device": device or device_name(),
        "cpu_threads": torch.get_num_threads(),
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "deepspeed")},
        **code_version(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def write_report(benchmark: str, args: argparse.Namespace, rows: list[dict], started: float, device: str | None = None,
                 **extra) -> dict:
    """The JSON every bench writes: device (default: this CPU), versions, the commit, the command, the settings,
    `results` and the wall time."""
    report = {
        "benchmark": benchmark,
        **provenance(device),
        **extra,
        "settings": {key: value for key, value in vars(args).items() if key != "child"},
        "results": rows,
        "wall_time_s": round(time.time() - started, 1),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return report
