"""The run folder's records: the arguments a step ran with (`args.json`) and its result (`summary.json`).

Only rank 0 writes. `args.json` is what a later step reads to check its inputs (see
`training.reliability.validation`), so it is written after every check has passed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from utils.dist import is_main_process

ARGS_FILE = "args.json"
SUMMARY_FILE = "summary.json"


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
