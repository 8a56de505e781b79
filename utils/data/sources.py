"""Data sources: parse a `--data_path` entry, fingerprint it cheaply, and load its raw records.

A source is `embedded`, a generated task (`task:arithmetic?difficulty=3`, see tasks.py), a local
json/jsonl/parquet file or folder (see local_files.py), or a Hugging Face hub name (loaded with
`datasets.load_dataset`, its splits concatenated in name order, less its evaluation splits, `test` and `validation`,
where it has any other: the pipeline makes its own phase and eval splits, and trains on none of the dataset's
held-out rows). Append `[SPLIT]` to a hub name, a saved `DatasetDict`, a folder of per-split files or a .json object of
lists to read that one split alone (an evaluation split too), e.g. `Dahoas/rm-static[test]`. Append `:FORMAT` to
state the row format instead of detecting it from the columns, e.g. `pairs.jsonl:hh_rlhf`; each file of a folder
is detected on its own, and a folder whose files differ is refused. A local row's dict column `metadata` is kept
with its samples.

A local source is fingerprinted by its files' paths, sizes and content hashes; a hub dataset by its name
only, so pass --rebuild_data_cache after the hub copy changes.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.errors import UserError

from . import embedded, tasks
from .eval_splits import TRAIN_SPLIT, TRAINING, SplitChoice
from .jsonio import FileRecords
from .local_files import (
    LOCAL_SUFFIXES,
    TEXT_SUFFIX,
    UNREAD_DATA_SUFFIXES,
    RecordOrigins,
    local_files,
    read_local_files,
    split_name,
)
from .readers import FORMATS, PARSERS, Parser, detect_format, with_row_metadata
from .samples import SkippedRows, SkipRow, comparable_text, comparable_turns

_DETECT_SAMPLE = 20


@dataclass(frozen=True)
class SourceSpec:
    path: str
    format: str | None = None  # None: detect from the columns
    split: str | None = None  # None: the splits `eval_splits.SplitChoice` picks

    def __str__(self) -> str:
        named = f"{self.path}[{self.split}]" if self.split is not None else self.path
        return f"{named}:{self.format}" if self.format else named

    @property
    def is_embedded(self) -> bool:
        return self.path == embedded.EMBEDDED_SOURCE

    @property
    def is_task(self) -> bool:
        return tasks.is_task_spec(self.path)


def parse_source_spec(text: str) -> SourceSpec:
    """`PATH`, `PATH[SPLIT]`, either with `:FORMAT` after it (FORMAT one of `readers.FORMATS`), or a task with all
    its options written out."""
    if tasks.is_task_spec(text):
        return SourceSpec(tasks.canonical_task_spec(text))
    path, _, suffix = text.rpartition(":")
    if path and suffix in FORMATS:
        return _with_split(path, suffix)
    if path and suffix and not os.path.exists(text) and "/" not in suffix and "\\" not in suffix:
        _refuse_split_after_format(text, path, suffix)
        raise UserError(f"unknown data format '{suffix}' in '{text}'; use one of {', '.join(FORMATS)}")
    return _with_split(text, None)


def _refuse_split_after_format(text: str, path: str, suffix: str) -> None:
    """Refuse `PATH:FORMAT[SPLIT]` (a known FORMAT) naming the order `[SPLIT]` and `:FORMAT` go in."""
    named = _NAMED_SPLIT.fullmatch(suffix)
    if named is not None and named["path"] in FORMATS:
        raise UserError(f"data source '{text}' names its split after its format: write [SPLIT] before :FORMAT, "
                        f"'{path}[{named['split']}]:{named['path']}'")


def _with_split(text: str, data_format: str | None) -> SourceSpec:
    """`text` read as `PATH[SPLIT]` where it ends so (and names no existing file)."""
    named = _NAMED_SPLIT.fullmatch(text)
    if named is None or os.path.exists(text):
        return SourceSpec(text, data_format)
    return SourceSpec(named["path"], data_format, named["split"])


_NAMED_SPLIT = re.compile(r"(?P<path>.+)\[(?P<split>[^\[\]]+)\]")


def looks_local(path: str) -> bool:
    """A path that exists, or that is written like a file path rather than a hub name `owner/name`: it begins with
    ".", "/" or "~", or ends in a data file's extension (one read, .txt, or one refused as a .csv is: a missing
    `data/train.csv` taken for a hub name failed on the hub, or offline, rather than saying the file is missing)."""
    return os.path.exists(path) or path.startswith((".", "/", "~")) or \
        Path(path).suffix in (*LOCAL_SUFFIXES, *UNREAD_DATA_SUFFIXES, TEXT_SUFFIX)


def _resolved_path(spec: SourceSpec) -> str:
    if spec.is_embedded or spec.is_task or not looks_local(spec.path):
        return spec.path
    return str(Path(spec.path).expanduser().resolve())


def source_identity(text: str) -> str:
    """What a `--data_path` entry reads, whatever its stated format: a local path resolved, else the name; a named
    split with it, but for train: `X[train]` reads the rows `X` does where train is X's one training split (hh-rlhf's
    and rm-static's train and test), and where X has others its record count differs, which the shard checks refuse,
    the two reading rows in common."""
    spec = parse_source_spec(text)
    return str(SourceSpec(_resolved_path(spec), split=None if spec.split == TRAIN_SPLIT else spec.split))


def resolved_source(text: str) -> str:
    """A `--data_path` entry with a local path made absolute (a stated format and split kept); any other entry as
    given."""
    spec = parse_source_spec(text)
    resolved = _resolved_path(spec)
    return text if resolved == spec.path else str(dataclasses.replace(spec, path=resolved))


_HASH_CHUNK = 1 << 20
_SETTLED_NS = 1_000_000_000  # a file's times are coarser than this nowhere the data lives


def _hashed_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def _memoized_hash(path: str, size: int, mtime_ns: int, inode: int, ctime_ns: int) -> str:
    """The stat fields only key the memo: any write, and any mtime restored after one, changes the ctime."""
    return _hashed_file(path)


def _content_hash(path: str, stat: os.stat_result) -> str:
    """SHA-256 of the file, read once per process and version of it; a file changed within the last second is read
    each time (a second write that soon may leave its times as they were)."""
    if time.time_ns() - stat.st_ctime_ns < _SETTLED_NS:
        return _hashed_file(path)
    return _memoized_hash(path, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)


def file_fingerprint(files: Sequence[Path]) -> list:
    """Each file's resolved path, size and content hash (the same on every rank that reads the same bytes).

    Not its mtime: a same-size edit within the file system's time resolution, or by a tool that restores the mtime,
    kept it, and the data cache served the old rows (a flipped preference label). Hashing runs at about 1 GB/s."""
    fingerprints = []
    for file in files:
        path, stat = str(file.resolve()), file.stat()
        fingerprints.append([path, stat.st_size, _content_hash(path, stat)])
    return fingerprints


def source_fingerprint(spec: SourceSpec) -> dict:
    """What identifies the source's content, without reading it (part of the cache key)."""
    if spec.is_embedded:  # its sample and pair rules are code: `cache.code_version` covers them
        return {"source": str(spec), "files": file_fingerprint([embedded.embedded_data_file()])}
    if spec.is_task:  # generated by code (`cache.code_version`) from the options the name spells out
        return {"source": str(spec)}
    if looks_local(spec.path):
        return {"source": str(spec), "files": file_fingerprint(local_files(Path(spec.path).expanduser()))}
    return {"source": str(spec), "hub": True}


def hub_error(name: str, err: Exception, what: str = "dataset") -> UserError:
    return UserError(
        f"could not load {what} '{name}' from the Hugging Face hub ({type(err).__name__}: {err}). "
        "Without network access, download it elsewhere and pass a local json/jsonl/parquet file or folder "
        "(e.g. --data_path /path/to/pairs.jsonl:hh_rlhf), or use --data_path embedded"
    )


def load_hub_dataset(name: str, config_name: str | None = None, split: str | None = None,
                     choice: SplitChoice = TRAINING) -> tuple[Any, RecordOrigins]:
    """The dataset's `split` (None: the splits `choice` picks, one after the other in name order) as one
    `datasets.Dataset`, and where each of its rows was read ("name[train] row 7", for the bad-row report)."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name, split=split)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        raise hub_error(name, err) from err
    if isinstance(loaded, datasets.DatasetDict):
        parts = {split_name(name, key): loaded[key] for key in choice.of(name, sorted(loaded))}
        dataset = datasets.concatenate_datasets(list(parts.values()))
    else:
        choice.refuse_named(name)
        parts, dataset = {name if split is None else split_name(name, split): loaded}, loaded
    return dataset, RecordOrigins.numbered([f"{part} row" for part in parts], [len(rows) for rows in parts.values()])


@dataclass
class LoadedSource:
    """A source's raw records (a list, or a `datasets.Dataset` for hub names) and how to parse them."""

    spec: SourceSpec
    records: Any
    format: str
    parse: Parser
    load_skips: SkippedRows = field(default_factory=SkippedRows)
    add_rejections: Callable | None = None  # builds preference pairs for sources that have none
    origins: RecordOrigins | None = None  # a local or hub source's: where each record was read

    def __len__(self) -> int:
        return len(self.records)

    def where(self, index: int) -> str | None:
        """Where the record at `index` was read, for the bad-row report (None: an embedded or generated source's)."""
        return self.origins(index) if self.origins is not None else None

    def take(self, indices: Sequence[int]) -> list:
        if isinstance(self.records, list):
            return [self.records[i] for i in indices]
        return self.records.select(list(indices)).to_list()


def _column_values(records: Any) -> dict[str, Any]:
    """The columns of the first records, each with its first non-null value there (None: null in all of them): the
    values' types tell formats apart whose column names are alike (a `prompt` string or message list)."""
    if isinstance(records, list):
        columns, first = {}, records[:_DETECT_SAMPLE]
    else:
        columns, first = dict.fromkeys(records.column_names), records.select(range(min(len(records), _DETECT_SAMPLE)))
    for record in first:
        if isinstance(record, dict):
            for key, value in record.items():
                if columns.get(key) is None:
                    columns[key] = value
    return columns


def load_source(spec: SourceSpec, evaluating: bool = False) -> LoadedSource:
    """The source's records, without duplicates (`without_duplicates`): of its named split, else of the splits a step
    trains on, or, `evaluating` (an evaluation tool), of its evaluation splits where it has any (`SplitChoice`)."""
    return without_duplicates(_read_source(spec, SplitChoice(spec.split, evaluating)))


def without_duplicates(source: LoadedSource) -> LoadedSource:
    """`source` keeping the first of each set of records whose rows parse to the same samples, the others counted
    as skipped "duplicate" (records that differ only in an id, or in whitespace and Unicode compatibility forms, are
    the same text: `samples.comparable_text`, as the held-out check compares): the seeded shards and held-out parts
    are cut by record, so a copy would put the same text in training and in evaluation, or in two steps."""
    keep, seen, skips = [], set(), source.load_skips.copy()
    for index, record in enumerate(source.records):
        key = _content_key(source, record)
        if key not in seen:
            keep.append(index)
        else:
            skips.skip("duplicate", source.where(index))
        if key is not None:
            seen.add(key)
    if len(keep) == len(source):
        return source
    records = source.take(keep) if isinstance(source.records, list) else source.records.select(keep)
    origins = source.origins.take(keep) if source.origins is not None else None
    return dataclasses.replace(source, records=records, load_skips=skips, origins=origins)


def _content_key(source: LoadedSource, record: Any) -> str | None:
    """What a record's rows parse to, as comparable text (`samples.comparable_text`); None for a row the parser skips (its reason is counted later), and
    for a row whose replies do not read: such rows were skipped whole before step 3 kept their prompts, so counting
    them as copies now would re-cut the shards of data an earlier run was split from."""
    try:
        samples = source.parse(record, 0)
    except SkipRow:
        return None
    if any(sample.reply_error for sample in samples):
        return None
    return json.dumps([(comparable_turns(s.turns), _comparable_reply(s.chosen), _comparable_reply(s.rejected),
                        s.metadata) for s in samples], default=str, sort_keys=True)


def _comparable_reply(reply: str | None) -> str | None:
    return None if reply is None else comparable_text(reply)


def _read_source(spec: SourceSpec, choice: SplitChoice) -> LoadedSource:
    if spec.is_embedded or spec.is_task:
        choice.refuse_named(str(spec))
    if spec.is_embedded:
        return LoadedSource(
            spec, embedded.load_embedded_conversations(), "sharegpt", embedded.parse_embedded,
            add_rejections=embedded.add_embedded_rejections,
        )
    if spec.is_task:
        return LoadedSource(spec, tasks.load_task_problems(spec.path), "task", tasks.parse_task_problem)
    skipped = SkippedRows()
    local = looks_local(spec.path)
    if local:
        files = read_local_files(Path(spec.path).expanduser(), skipped, choice)
        records = [record for file in files for record in file.records]
        origins, data_format = RecordOrigins.of(files), spec.format or _detect_local_format(spec, files)
    else:
        records, origins = load_hub_dataset(spec.path, choice=choice)
        data_format = spec.format or detect_format(_column_values(records))
    if len(records) == 0:
        said = f" (skipped: {skipped.report()})" if skipped else ""
        raise UserError(f"data source '{spec}' holds no records{said}")
    if data_format is None:
        raise _unknown_format(spec, records, origins)
    parse = with_row_metadata(PARSERS[data_format]) if local else PARSERS[data_format]
    return LoadedSource(spec, records, data_format, parse, skipped, origins=origins)


def _unknown_format(spec: SourceSpec, records: Any, origins: RecordOrigins) -> UserError:
    """The error for a source whose row format is not detected: the columns its first records hold, or, where they
    hold none (a JSON array of prompt strings), what its first record is."""
    columns = sorted(_column_values(records))
    if not columns:
        first = records[0]
        return UserError(
            f"data source '{spec}' holds no columns to read rows from: its first records are not JSON objects with "
            f"columns (at {origins(0)}: {type(first).__name__} {json.dumps(first, default=str)[:60]}); write each "
            f"record as an object, e.g. {{\"prompt\": \"...\", \"chosen\": \"...\"}}, in one of the formats "
            f"{', '.join(FORMATS)}")
    return UserError(
        f"cannot tell the row format of data source '{spec}' from its columns {columns}; state it as PATH:FORMAT with "
        f"FORMAT one of {', '.join(FORMATS)}, or write its rows in one of them (README's Data passage lists their "
        "columns)")


def _detect_local_format(spec: SourceSpec, files: Sequence[FileRecords]) -> str | None:
    """The format of the files' rows, each file detected on its own: files of different formats are refused (the
    other files' rows would all be skipped)."""
    formats = {file.name: detect_format(_column_values(file.records)) for file in files if file.records}
    if len(set(formats.values())) > 1:
        found = ", ".join(f"{name} ({data_format or 'unknown'})" for name, data_format in formats.items())
        raise UserError(f"data folder '{spec}' holds files of different row formats: {found}; pass each format's "
                        "files as their own --data_path entries (their rows are blended)")
    return next(iter(formats.values()), None)
