"""Training metrics of a run: JSONL lines (`metrics.jsonl`) mirrored to TensorBoard.

Only rank 0 writes; other ranks get a logger whose calls do nothing, so call sites need no checks. A run
`rewind`s the file when it knows where it starts: a fresh run into a folder that holds an earlier run's file
starts it empty, and a resumed run cuts it back to the lines it held when the checkpoint was taken (their count is
part of the checkpoint: `lines_written`), so what followed is logged once, again. Cutting by count, not only by
step, also drops what a run logs at the checkpoint's own step after saving it (an epoch's or the run's last
evaluation), which the resumed run logs again.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Mapping

from utils.atomic import atomic_write_text
from utils.dist import is_main_process

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Append `{"step": n, "time": t, **metrics}` lines to `metrics.jsonl` and mirror them to TensorBoard."""

    def __init__(self, run_dir: str | os.PathLike, enable_tensorboard: bool = True) -> None:
        self.enabled = is_main_process()
        self.path = Path(run_dir) / METRICS_FILE
        self._writer = None
        self.lines_written = 0  # the file's complete lines since `rewind` (rank 0), what a checkpoint records
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def rewind(self, step: int | None, lines: int | None = None) -> None:
        """Keep only the lines of steps up to `step` (a resumed run's checkpoint), and of those the first `lines`
        (the checkpoint's `lines_written`, where it has one), or none (step None: a fresh run)."""
        if self.enabled:
            self.lines_written = rewind_jsonl(self.path, step, lines)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "time": time.time(), **clean}, allow_nan=True) + "\n")
        self.lines_written += 1
        if self._writer is not None:
            for key, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _complete_lines(path: Path) -> list[tuple[str, dict]]:
    """Each line of a per-step JSONL file with its record, without a line cut short (a run killed while
    appending it)."""
    complete = []
    for line in path.read_text().splitlines():
        try:
            complete.append((line, json.loads(line)))
        except ValueError:
            if line.strip():
                logger.warning("%s: dropped a line cut short (the run was stopped while writing it)", path)
    return complete


def rewind_jsonl(path: Path, step: int | None, lines: int | None = None) -> int:
    """Keep the lines of a per-step JSONL file (each with a "step") up to `step`, at most the first `lines` of them,
    or none (step None); rewritten atomically, so a run stopped meanwhile keeps the old file whole. Returns how
    many lines it kept."""
    if not path.is_file():
        return 0
    kept = [] if step is None else [line for line, record in _complete_lines(path) if record["step"] <= step]
    kept = kept[:lines]
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return len(kept)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    return [record for _, record in _complete_lines(path)] if path.is_file() else []
