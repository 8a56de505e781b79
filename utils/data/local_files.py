"""Local data: which files a path holds, their records, and where each record was read (for the bad-row report).

A folder is read recursively, its .json/.jsonl/.parquet files in name order.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from utils.errors import UserError

from .jsonio import FileRecords, read_json_file
from .samples import SkippedRows

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


def local_files(path: Path) -> list[Path]:
    """The files a local source reads."""
    if not path.exists():
        raise UserError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(file for file in path.rglob("*") if file.suffix in LOCAL_SUFFIXES and file.is_file())
        if not files:
            raise UserError(f"data folder {path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"unsupported data file {path}: use {', '.join(LOCAL_SUFFIXES)} (or a folder of them)")
    return [path]


def _read_parquet(file: Path, name: str) -> FileRecords:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except pyarrow.ArrowException as error:
        raise UserError(f"{file} is not a readable parquet file ({error}); write it again, or move it out of the "
                        "data") from error
    return FileRecords.numbered(name, "row", table.to_pylist())


def read_local_files(path: Path, skipped: SkippedRows) -> list[FileRecords]:
    """The records of each file of `path` (a file or folder); bad lines of JSON-lines files are counted in `skipped`."""
    files = local_files(path)
    root = path if path.is_dir() else path.parent
    return [_read_parquet(file, str(file.relative_to(root))) if file.suffix == ".parquet"
            else read_json_file(file, str(file.relative_to(root)), skipped) for file in files]


class RecordOrigins:
    """Where each record of a local source was read ("part-001.jsonl line 124"), by the record's index."""

    def __init__(self, names: Sequence[str], file_of: np.ndarray, positions: np.ndarray):
        self.names, self.file_of, self.positions = list(names), file_of, positions

    @classmethod
    def of(cls, files: Sequence[FileRecords]) -> RecordOrigins:
        """The origins of the records of `files`, concatenated in order."""
        file_of = np.repeat(np.arange(len(files)), [len(file.records) for file in files])
        positions = np.array([position for file in files for position in file.positions], dtype=np.int64)
        return cls([f"{file.name} {file.unit}" for file in files], file_of, positions)

    def take(self, indices: Sequence[int]) -> RecordOrigins:
        """The origins of the records at `indices`, in that order."""
        return RecordOrigins(self.names, self.file_of[list(indices)], self.positions[list(indices)])

    def __call__(self, index: int) -> str:
        return f"{self.names[self.file_of[index]]} {self.positions[index]}"
