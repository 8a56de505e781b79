"""Data sources: parse a `--data_path` entry, fingerprint it cheaply, and load its raw records.

A source is `embedded`, a local json/jsonl/parquet file or folder, or a Hugging Face hub name
(loaded with `datasets.load_dataset`, all splits concatenated in name order: the pipeline makes
its own phase and eval splits). Append `:FORMAT` to state the row format instead of detecting it
from the columns, e.g. `pairs.jsonl:hh_rlhf`.

A local source is fingerprinted by its files' paths, sizes and mtimes; a hub dataset by its name
only, so pass --rebuild_data_cache after the hub copy changes.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from utils.errors import UserError

from . import embedded
from .jsonio import read_json_file
from .readers import FORMATS, PARSERS, Parser, detect_format

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_DETECT_SAMPLE = 20


@dataclass(frozen=True)
class SourceSpec:
    path: str
    format: str | None = None  # None: detect from the columns

    def __str__(self) -> str:
        return f"{self.path}:{self.format}" if self.format else self.path

    @property
    def is_embedded(self) -> bool:
        return self.path == embedded.EMBEDDED_SOURCE


def parse_source_spec(text: str) -> SourceSpec:
    """`PATH` or `PATH:FORMAT` (FORMAT one of `readers.FORMATS`)."""
    path, _, suffix = text.rpartition(":")
    if path and suffix in FORMATS:
        return SourceSpec(path, suffix)
    if path and suffix and not os.path.exists(text) and "/" not in suffix and "\\" not in suffix:
        raise UserError(f"unknown data format '{suffix}' in '{text}'; use one of {', '.join(FORMATS)}")
    return SourceSpec(text)


def _local_files(path: Path) -> list[Path]:
    if not path.exists():
        raise UserError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"data folder {path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"unsupported data file {path}: use {', '.join(LOCAL_SUFFIXES)} (or a folder of them)")
    return [path]


def looks_local(path: str) -> bool:
    """A path that exists, or that is written like a file path rather than a hub name `owner/name`."""
    return os.path.exists(path) or path.startswith((".", "/", "~")) or Path(path).suffix in LOCAL_SUFFIXES + (".txt",)


def source_identity(text: str) -> str:
    """What a `--data_path` entry reads, whatever its stated format: a local path resolved, else the name."""
    spec = parse_source_spec(text)
    if spec.is_embedded or not looks_local(spec.path):
        return spec.path
    return str(Path(spec.path).expanduser().resolve())


def file_fingerprint(files: Sequence[Path]) -> list:
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def source_fingerprint(spec: SourceSpec) -> dict:
    """What identifies the source's content, without reading it (part of the cache key)."""
    if spec.is_embedded:  # its sample and pair rules are code: `cache.code_version` covers them
        return {"source": str(spec), "files": file_fingerprint([embedded.embedded_data_file()])}
    if looks_local(spec.path):
        return {"source": str(spec), "files": file_fingerprint(_local_files(Path(spec.path).expanduser()))}
    return {"source": str(spec), "hub": True}


def hub_error(name: str, err: Exception, what: str = "dataset") -> UserError:
    return UserError(
        f"could not load {what} '{name}' from the Hugging Face hub ({type(err).__name__}: {err}). "
        "Without network access, download it elsewhere and pass a local json/jsonl/parquet file or folder "
        "(e.g. --data_path /path/to/pairs.jsonl:hh_rlhf), or use --data_path embedded"
    )


def load_hub_dataset(name: str, config_name: str | None = None, split: str | None = None):
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name, split=split)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        raise hub_error(name, err) from err
    if isinstance(loaded, datasets.DatasetDict):
        return datasets.concatenate_datasets([loaded[key] for key in sorted(loaded)])
    return loaded


def read_local_records(path: Path, skipped: Counter) -> list:
    records: list = []
    for file in _local_files(path):
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            records.extend(pq.read_table(file).to_pylist())
        else:
            records.extend(read_json_file(file, skipped))
    return records


@dataclass
class LoadedSource:
    """A source's raw records (a list, or a `datasets.Dataset` for hub names) and how to parse them."""

    spec: SourceSpec
    records: Any
    format: str
    parse: Parser
    load_skips: Counter = field(default_factory=Counter)
    add_rejections: Callable | None = None  # builds preference pairs for sources that have none

    def __len__(self) -> int:
        return len(self.records)

    def take(self, indices: Sequence[int]) -> list:
        if isinstance(self.records, list):
            return [self.records[i] for i in indices]
        return self.records.select(list(indices)).to_list()


def _columns(records: Any) -> list[str]:
    if not isinstance(records, list):
        return list(records.column_names)
    return [key for record in records[:_DETECT_SAMPLE] if isinstance(record, dict) for key in record]


def load_source(spec: SourceSpec) -> LoadedSource:
    if spec.is_embedded:
        return LoadedSource(
            spec, embedded.load_embedded_conversations(), "sharegpt", embedded.parse_embedded,
            add_rejections=embedded.add_embedded_rejections,
        )
    skipped: Counter = Counter()
    if looks_local(spec.path):
        records = read_local_records(Path(spec.path).expanduser(), skipped)
    else:
        records = load_hub_dataset(spec.path)
    if len(records) == 0:
        raise UserError(f"data source '{spec}' holds no records" + (f" (skipped: {dict(skipped)})" if skipped else ""))
    data_format = spec.format or detect_format(_columns(records))
    if data_format is None:
        raise UserError(
            f"cannot tell the row format of data source '{spec}' from its columns {sorted(set(_columns(records)))}; "
            f"state it as PATH:FORMAT with FORMAT one of {', '.join(FORMATS)}"
        )
    return LoadedSource(spec, records, data_format, PARSERS[data_format], skipped)
