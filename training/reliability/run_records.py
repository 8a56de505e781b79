"""The run folder's records: the arguments a step ran with (`args.json`) and its result (`summary.json`).

Only rank 0 writes, each record atomically (a kill mid-write leaves the old file or none, never half of one).
`args.json` is what a later step reads to check its inputs (see `training.reliability.validation`), so it is
written after every check has passed. `summary.json` is written last, after the model: it marks a finished run.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping

from training.core.args import RESOLVED_SUFFIX
from utils.atomic import atomic_write_text
from utils.data.args import with_resolved_sources
from utils.dist import is_main_process

ARGS_FILE = "args.json"
SUMMARY_FILE = "summary.json"
RUN_ID_KEY = "run_id"


def _as_json(values: Mapping[str, Any]) -> str:
    return json.dumps(dict(values), indent=2, default=str) + "\n"


def as_recorded(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as a record reads them back (paths as strings, tuples as lists), so they compare equal."""
    return json.loads(_as_json(values))


def _write_record(run_dir: str | os.PathLike, name: str, values: Mapping[str, Any]) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / name, _as_json(values))


def read_record(run_dir: str | os.PathLike, name: str) -> dict | None:
    """The JSON object in `run_dir`/`name`; None where it is missing, unreadable or not an object."""
    try:
        values = json.loads((Path(run_dir) / name).read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def save_run_args(run_dir: str | os.PathLike, args: Any) -> None:
    """Record the command-line arguments of a run (argparse namespace or dataclass) as JSON.

    An earlier run's `summary.json` goes first: from now on the folder holds this run, unfinished.
    """
    if not is_main_process():
        return
    (Path(run_dir) / SUMMARY_FILE).unlink(missing_ok=True)
    _write_record(run_dir, ARGS_FILE, vars(args) if hasattr(args, "__dict__") else dict(args))


def read_run_args(run_dir: str | os.PathLike) -> dict | None:
    """The arguments `save_run_args` recorded in `run_dir`; None when it holds none or they do not parse."""
    return read_record(run_dir, ARGS_FILE)


def run_dir_of(model: str | os.PathLike) -> Path | None:
    """The run folder that holds `model`'s args.json: `model` itself, or its parent when `model` is the
    model folder a step saved inside its run folder (`<run>/model`, step 3's `<run>/actor`)."""
    model = Path(model).expanduser()
    if (model / ARGS_FILE).is_file():
        return model
    if (model / "config.json").is_file() and (model.parent / ARGS_FILE).is_file():
        return model.parent
    return None


def args_of_model(model: str | os.PathLike) -> dict:
    """The arguments of the run that trained `model` (a run folder or the model folder inside one); empty for a
    model no run of this project trained."""
    run_dir = run_dir_of(model)
    return (read_run_args(run_dir) if run_dir is not None else None) or {}


def trained_prompt_format(model: str | os.PathLike) -> str:
    """The --prompt_format of the run that trained `model` (its args.json); auto for a model no run of this project
    trained (its chat template, else plain)."""
    return args_of_model(model).get("prompt_format", "auto")


def with_resolved_flags(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """`recorded` flags keyed as `current` keys the flags it records resolved ("dtype (resolved)": see
    `training.core.args.resume_fixed_flags`). A record written before those keys existed holds the flag as given:
    its resolved value, unless it was "auto", which resolved to what is no longer known (then left out)."""
    flags = dict(recorded)
    for key in current:
        flag = key.removesuffix(RESOLVED_SUFFIX)
        if flag != key and key not in flags and flag in flags:
            given = flags.pop(flag)
            if given != "auto":
                flags[key] = given
    return flags


def changed_flags(recorded: Mapping[str, Any], current: Mapping[str, Any],
                  ignored: frozenset[str] = frozenset()) -> dict[str, tuple[Any, Any]]:
    """{flag: (recorded value, current value)} for each flag whose value in `current` ({flag: value}, as a
    step parses its command line) differs from the one `recorded` in an args.json; the `ignored` ones aside (those
    that do not change what a run computes: `training.core.args.same_result_flags`)."""
    recorded, current = with_resolved_sources(recorded), as_recorded(current)
    return {name: (recorded.get(name), current.get(name)) for name in sorted(recorded.keys() | current.keys())
            if name not in ignored and recorded.get(name) != current.get(name)}


def save_summary(run_dir: str | os.PathLike, summary: Mapping[str, Any]) -> dict[str, Any]:
    """Write a step's result summary as `summary.json` in the run folder, with a `run_id` of its own (a run made
    again has another, whatever its figures: train.py tells a retrained input by it); returns what it wrote,
    which the step's `main` returns."""
    recorded = {**summary, RUN_ID_KEY: uuid.uuid4().hex}
    if is_main_process():
        _write_record(run_dir, SUMMARY_FILE, recorded)
    return recorded


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """The summary `save_summary` wrote in `run_dir` (a finished run); None when it holds none or it does not parse."""
    return read_record(run_dir, SUMMARY_FILE)


def run_id_of(model: str | os.PathLike) -> str | None:
    """The `run_id` of the finished run that made `model` (a run folder or the model folder inside one); None for a
    model no finished run of this project made."""
    run_dir = run_dir_of(model)
    return (read_summary(run_dir) or {}).get(RUN_ID_KEY) if run_dir is not None else None
