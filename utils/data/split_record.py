"""How many records each source held when a step cut it into shards, so that a later step can tell it changed.

The seeded permutation that cuts a source into the steps' shards (`splits.phase_shard`) is drawn over its record
count: a source that gained or lost a record between two steps (a malformed line fixed, a row added) is permuted
anew, and the later step's shard overlaps the rows the earlier one trained on. A step records the counts of its
`--data_path` sources in its run folder (`SPLIT_RECORD_FILE`, beside its args.json) and `shard_match` compares
them with a later step's. Counting a source reads it whole, so a count is remembered beside the tokenised-data
cache, keyed as that cache keys a source (its fingerprint, the data code): a source is read again to count it only
once it changed.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from utils.atomic import atomic_write_text
from utils.dist import is_main_process

from .cache import code_version, stable_hash
from .sources import load_source, parse_source_spec, source_fingerprint, source_identity

SPLIT_RECORD_FILE = "data_split.json"


def _count_file(path: str, data_output_path: str | os.PathLike) -> Path:
    key = stable_hash({"code": code_version(), "source": source_fingerprint(parse_source_spec(path))})[:20]
    return Path(data_output_path).expanduser() / f"records_{key}.json"


def remember_record_count(path: str, data_output_path: str | os.PathLike, count: int) -> None:
    """Note that the source `path` (a `--data_path` entry) holds `count` records, as `load_source` gives them."""
    file = _count_file(path, data_output_path)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(file, json.dumps({"source": path, "records": count}) + "\n")
    except OSError:  # only a saving: the count is read again next time
        pass


def record_count(path: str, data_output_path: str | os.PathLike, recount: bool = False) -> int:
    """How many records the source `path` holds: as remembered, or read (`recount`: read in any case)."""
    if not recount:
        try:
            return int(json.loads(_count_file(path, data_output_path).read_text())["records"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    count = len(load_source(parse_source_spec(path)))
    remember_record_count(path, data_output_path, count)
    return count


def write_split_record(run_dir: str | os.PathLike, data_paths: Sequence[str],
                       data_output_path: str | os.PathLike) -> None:
    """Record in `run_dir` how many records each source of `data_paths` held when the run cut it (rank 0 writes)."""
    if not is_main_process():
        return
    sources = [{"source": path, "records": record_count(path, data_output_path)} for path in data_paths]
    atomic_write_text(Path(run_dir) / SPLIT_RECORD_FILE, json.dumps({"sources": sources}, indent=2) + "\n")


def read_split_record(run_dir: str | os.PathLike) -> dict[str, int] | None:
    """{source identity: records} as `write_split_record` recorded them in `run_dir`; None where it recorded none (a
    run from before the record) or the record does not parse."""
    try:
        sources = json.loads((Path(run_dir) / SPLIT_RECORD_FILE).read_text())["sources"]
        return {source_identity(entry["source"]): int(entry["records"]) for entry in sources}
    except (OSError, ValueError, KeyError, TypeError):
        return None
