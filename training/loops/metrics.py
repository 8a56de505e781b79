"""Training metrics of a run: JSONL lines (`metrics.jsonl`) mirrored to TensorBoard.

Only rank 0 writes; other ranks get a logger whose calls do nothing, so call sites need no checks. A run
`rewind`s the file when it knows where it starts: a fresh run into a folder that holds an earlier run's file
starts it empty, and a resumed run cuts it back to the lines it held when the checkpoint was taken (their count is
part of the checkpoint: `lines_written`), so what followed is logged once, again. Cutting by count, not only by
step, also drops what a run logs at the checkpoint's own step after saving it (an epoch's or the run's last
evaluation), which the resumed run logs again.

TensorBoard (`tensorboard/`) is made to show what the file keeps: a fresh run removes the earlier run's event files,
and a resumed run opens its writer with `purge_step` at the checkpoint's step, which hides every earlier event from
that step on, then writes again that step's kept lines (those logged before the save).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Mapping

from utils.atomic import atomic_write_text, fsync_path
from utils.dist import is_main_process

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
EVENT_FILES = "events.out.tfevents.*"


class MetricsLogger:
    """Append `{"step": n, "time": t, **metrics}` lines to `metrics.jsonl` and mirror them to TensorBoard."""

    def __init__(self, run_dir: str | os.PathLike, enable_tensorboard: bool = True) -> None:
        self.enabled = is_main_process()
        self.path = Path(run_dir) / METRICS_FILE
        self.tensorboard_dir = Path(run_dir) / TENSORBOARD_DIR if enable_tensorboard else None
        self._writer = None  # opened by `rewind` (or the first `log` of a logger never rewound)
        self.lines_written = 0  # the file's complete lines since `rewind` (rank 0), what a checkpoint records
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def rewind(self, step: int | None, lines: int | None = None) -> None:
        """Keep only the lines of steps up to `step` (a resumed run's checkpoint), and of those the first `lines`
        (the checkpoint's `lines_written`, where it has one), or none (step None: a fresh run); TensorBoard's
        events likewise."""
        if not self.enabled:
            return
        kept = rewind_jsonl(self.path, step, lines)
        self.lines_written = len(kept)
        if self.tensorboard_dir is not None:
            self._rewind_tensorboard(step, [record for record in kept if record["step"] == step])

    def _rewind_tensorboard(self, step: int | None, at_step: list[dict]) -> None:
        """A writer whose events, read after the earlier ones, leave what the kept lines hold: a fresh run's
        (step None) in a folder without the earlier event files; a resumed run's purging every earlier event from
        `step` on, with `at_step`, the kept lines of `step`, written again."""
        self.close()
        if step is None:
            for events in self.tensorboard_dir.glob(EVENT_FILES):
                events.unlink()
        self._open_writer(purge_step=step)
        for record in at_step:
            self._mirror(record)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **clean}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, allow_nan=True) + "\n")
        self.lines_written += 1
        if self.tensorboard_dir is not None and self._writer is None:
            self._open_writer(purge_step=None)
        self._mirror(record)

    def _open_writer(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)

    def _mirror(self, record: Mapping[str, float]) -> None:
        """One line's finite numbers to TensorBoard, at its step and time."""
        if self._writer is None:
            return
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, float) and math.isfinite(value):
                self._writer.add_scalar(key, value, record["step"], walltime=record["time"])
        self._writer.flush()

    def sync(self) -> None:
        """Put the file's lines on disk (fsync) before a checkpoint records how many it holds: the checkpoint is
        fsynced, and after a power loss it would otherwise outlive its last lines."""
        if self.enabled:
            sync_jsonl(self.path)

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


def rewind_jsonl(path: Path, step: int | None, lines: int | None = None) -> list[dict]:
    """Keep the lines of a per-step JSONL file (each with a "step") up to `step`, at most the first `lines` of them,
    or none (step None); rewritten atomically, so a run stopped meanwhile keeps the old file whole. Returns the
    records it kept; warns where it holds fewer than the `lines` a checkpoint recorded."""
    complete = _complete_lines(path) if path.is_file() and step is not None else []
    kept = [(line, record) for line, record in complete if record["step"] <= step][:lines]
    if lines is not None and len(kept) < lines:
        logger.warning("%s holds %d lines up to step %d where the checkpoint recorded %d (lost when the machine "
                       "went down before they reached the disk?): the metrics of those steps are missing from it",
                       path, len(kept), step, lines)
    if path.is_file():
        atomic_write_text(path, "".join(f"{line}\n" for line, _ in kept))
    return [record for _, record in kept]


def sync_jsonl(path: Path) -> None:
    """fsync a per-step JSONL file, where there is one."""
    if path.is_file():
        fsync_path(path)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    return [record for _, record in _complete_lines(path)] if path.is_file() else []
