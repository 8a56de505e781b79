"""Run bookkeeping shared by the three steps: the run's arguments, metrics as JSONL and TensorBoard.

Only rank 0 writes; other ranks get a logger whose calls do nothing, so call sites need no checks.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from .dist import is_main_process

METRICS_FILE = "metrics.jsonl"
ARGS_FILE = "args.json"
SUMMARY_FILE = "summary.json"


def setup_logging(level: int = logging.INFO) -> None:
    """Plain one-line log records on every rank; ranks > 0 only report warnings."""
    logging.basicConfig(
        level=level if is_main_process() else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def save_run_args(run_dir: str | os.PathLike, args: Any) -> None:
    """Record the command-line arguments of a run (argparse namespace or dataclass) as JSON."""
    if not is_main_process():
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    values = vars(args) if hasattr(args, "__dict__") else dict(args)
    (Path(run_dir) / ARGS_FILE).write_text(json.dumps(values, indent=2, default=str) + "\n")


def read_run_args(run_dir: str | os.PathLike) -> dict | None:
    """The arguments `save_run_args` recorded in `run_dir`; None when it holds none or they do not parse."""
    try:
        values = json.loads((Path(run_dir) / ARGS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def save_summary(run_dir: str | os.PathLike, summary: Mapping[str, Any]) -> None:
    """Write a step's result summary (what its `main` returns) as `summary.json` in the run folder."""
    if not is_main_process():
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(dict(summary), indent=2, default=str) + "\n")


class MetricsLogger:
    """Append `{"step": n, "time": t, **metrics}` lines to `metrics.jsonl` and mirror them to TensorBoard."""

    def __init__(self, run_dir: str | os.PathLike, enable_tensorboard: bool = True, prefix: str = "") -> None:
        self.enabled = is_main_process()
        self.prefix = prefix
        self.path = Path(run_dir) / METRICS_FILE
        self._writer = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        clean = {f"{self.prefix}{k}": (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "time": time.time(), **clean}, allow_nan=True) + "\n")
        if self._writer is not None:
            for key, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
