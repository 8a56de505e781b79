"""How many records each source held when a step cut it into shards, so that a later step can tell it changed.

The seeded permutation that cuts a source into the steps' shards (`splits.phase_shard`) is drawn over its record
count: a source that gained or lost a record between two steps (a malformed line fixed, a row added, a hub copy
updated) is permuted anew, and the later step's shard overlaps the rows the earlier one trained on. The build that
cuts a step's shards keeps the count it cut each source from (step 1's `--sft_only_data_path` sources too: their
held-out part is drawn over their count alike) with its tokenised data (the cached
state's `RECORDS_KEY`: a cache hit gives the count its items were cut from, and no source is read to count it); the
step writes those counts in its run folder (`SPLIT_RECORD_FILE`, beside its args.json), and a later step started
from that run compares them with the counts its own build cut (`shard_match.check_same_record_counts`). The record
also says which shard the step trained on (its phase), so that a later run of the same step started from it holds out
no record that run trained on (`shard_match.check_same_shards`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from utils.atomic import atomic_write_text
from utils.dist import is_main_process

SPLIT_RECORD_FILE = "data_split.json"
RECORDS_KEY = "records"  # in a step's cached data state: [[source entry, records it was cut from], ...]


def write_split_record(run_dir: str | os.PathLike, records: Sequence[tuple[str, int]], phase: int) -> None:
    """Record in `run_dir` the shard `phase` the step trained on and the records each source was cut from,
    `(--data_path entry, count)` as the step's build cut them (rank 0 writes)."""
    if not is_main_process():
        return
    sources = [{"source": path, "records": int(count)} for path, count in records]
    atomic_write_text(Path(run_dir) / SPLIT_RECORD_FILE,
                      json.dumps({"phase": phase, "sources": sources}, indent=2) + "\n")


def read_split_record(run_dir: str | os.PathLike) -> list[tuple[str, int]] | None:
    """`(--data_path entry, records)` as `write_split_record` recorded them in `run_dir`, each entry as that run named
    it; None where it recorded none (a run from before the record) or the record does not parse."""
    try:
        sources = json.loads((Path(run_dir) / SPLIT_RECORD_FILE).read_text())["sources"]
        return [(str(entry["source"]), int(entry["records"])) for entry in sources]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_split_phase(run_dir: str | os.PathLike) -> int | None:
    """The shard (1, 2 or 3) the step that wrote `run_dir`'s record trained on; None where the record does not say
    (a run from before the phase was recorded, or none)."""
    try:
        phase = json.loads((Path(run_dir) / SPLIT_RECORD_FILE).read_text())["phase"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return phase if phase in (1, 2, 3) else None
