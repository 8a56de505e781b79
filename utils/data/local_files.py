"""Local data: which files a path holds, their records, and where each record was read (for the bad-row report).

A folder is read recursively (into linked folders too), its .json/.jsonl/.parquet files in name order. Files and
folders inside it whose names start with "." or "_" are left out, as `datasets` leaves them out: a notebook's
`.ipynb_checkpoints/` copies of older files, Spark's `_SUCCESS` and `_temporary/`. A folder written by `datasets`'
`save_to_disk` is loaded as the dataset it holds (a `DatasetDict`'s splits one after the other in name order, less
its evaluation splits, as a hub dataset's are: `eval_splits`); a folder holding one is refused naming it. A folder's
files of its evaluation splits are left out too, by the split word of their folders or names (`file_split`:
`default/test/0000.parquet`, `data/test-00000-of-00001.parquet`, `hh-rlhf-test.jsonl`); files naming no split beside
files naming one are refused, a folder whose files name none read whole. Each file goes by its own path: where
`datasets` takes one layout (split folders, or the sharded `data/` files) and leaves the other files unread, those are
read here by their splits too (a `train.jsonl` beside a `test/` folder is trained on). The files `datasets` writes
beside rows (dataset_info.json, dataset_infos.json, state.json, dataset_dict.json) are no rows and are left out.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from utils.errors import UserError

from .eval_splits import SPLIT_KEYWORDS, TRAIN_SPLIT, TRAINING, SplitChoice, name_words
from .jsonio import FileRecords, read_json_file
from .samples import SkippedRows

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
TEXT_SUFFIX = ".txt"  # plain text: the pretraining mixture's documents
# Data files a folder may hold that are not read: compressed or other tables, refused rather than left out unseen.
UNREAD_DATA_SUFFIXES = (".csv", ".tsv", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".arrow", ".feather")
_SAVED_DATASET_MARKS = (("state.json", "dataset_info.json"), ("dataset_dict.json",))  # what `save_to_disk` writes
# What `datasets` writes beside a dataset's rows, not rows: a hub copy's dataset_infos.json, save_to_disk's files.
_DATASET_METADATA_NAMES = ("dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json")


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder `datasets.Dataset.save_to_disk` (or a `DatasetDict`'s) wrote."""
    return path.is_dir() and any(all((path / name).is_file() for name in marks) for marks in _SAVED_DATASET_MARKS)


def _is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _visible_files(folder: Path) -> list[Path]:
    """The files under `folder`, in name order, hidden names left out. Linked folders are followed (a folder assembled
    from links to shard folders: rglob left their files out, silently), each real folder once (a link back up is no
    loop; the first of two links to one folder in name order reads it)."""
    files, seen = [], set()
    for root, folders, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            folders.clear()
            continue
        seen.add(real)
        folders[:] = sorted(name for name in folders if not _is_hidden(name))
        files += [Path(root) / name for name in names if not _is_hidden(name) and (Path(root) / name).is_file()]
    return sorted(files)


def local_files(path: Path) -> list[Path]:
    """The files a local source reads (a saved dataset's: all of them)."""
    if not path.exists():
        relative = "" if path.is_absolute() else f" (under the current directory {Path.cwd()})"
        raise UserError(f"data path {path} does not exist{relative}")
    if is_saved_dataset(path):
        return _visible_files(path)
    if path.is_dir():
        files = _visible_files(path)
        _refuse_saved_datasets_inside(path, files)
        _refuse_unread_data_files(path, files)
        files = [file for file in files if _holds_rows(file)]
        if not files:
            raise UserError(f"data folder {path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if is_saved_dataset(path.parent):
        raise UserError(f"{path} is a file of a dataset saved by datasets' save_to_disk, read only as the dataset: "
                        f"pass its folder {path.parent} instead")
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"unsupported data file {path}: use {', '.join(LOCAL_SUFFIXES)} (or a folder of them)")
    return [path]


def _holds_rows(file: Path) -> bool:
    """Whether a folder's `file` is one of its data files: a .json/.jsonl/.parquet file, not the metadata `datasets`
    writes beside rows."""
    return file.suffix in LOCAL_SUFFIXES and file.name not in _DATASET_METADATA_NAMES


def local_text_files(path: Path) -> list[Path]:
    """The plain-text files of a local source of text (the pretraining mixture's): a .txt file, or the .txt files of a
    folder that holds no .json/.jsonl/.parquet file (other data files, or a saved dataset inside it, refused as
    `local_files` refuses them); [] for a source of records."""
    if not path.is_dir():
        return [path] if path.suffix == TEXT_SUFFIX else []
    if is_saved_dataset(path):
        return []
    files = _visible_files(path)
    texts = [file for file in files if file.suffix == TEXT_SUFFIX]
    if not texts or any(_holds_rows(file) for file in files):
        return []
    _refuse_saved_datasets_inside(path, files)
    _refuse_unread_data_files(path, files)
    return texts


def _saved_datasets_inside(folder: Path, files: Sequence[Path]) -> list[Path]:
    """The folders below `folder` that `save_to_disk` wrote, each the outermost (a `DatasetDict`'s, not its splits')."""
    saved = set()
    for file in files:
        below = reversed(file.relative_to(folder).parents[:-1])  # the file's folders below `folder`, outermost first
        outermost = next((folder / part for part in below if is_saved_dataset(folder / part)), None)
        if outermost is not None:
            saved.add(outermost)
    return sorted(saved)


def _refuse_saved_datasets_inside(folder: Path, files: Sequence[Path]) -> None:
    """Refuse a folder that holds a dataset saved by `save_to_disk` (given by its parent): its .arrow files are read
    only as the dataset that folder is, and were refused as data files to decompress or convert."""
    saved = _saved_datasets_inside(folder, files)
    if saved:
        each = ", each as its own --data_path entry," if len(saved) > 1 else ""
        raise UserError(f"data folder {folder} holds {'datasets' if len(saved) > 1 else 'a dataset'} saved by "
                        f"datasets' save_to_disk, read only from the folder it was saved to: pass "
                        f"{' and '.join(map(str, saved))}{each} instead")


def _listed(folder: Path, files: Sequence[Path]) -> str:
    """The first three of `files`, by their paths inside `folder`, and how many more."""
    names = [str(file.relative_to(folder)) for file in files[:3]]
    return ", ".join(names) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _refuse_unread_data_files(folder: Path, files: Sequence[Path]) -> None:
    """Refuse a folder holding data files of a format not read (a .jsonl.gz, a .csv beside .jsonl files): their rows
    would be left out unseen, or the folder said to hold no data files."""
    unread = [file for file in files if file.suffix in UNREAD_DATA_SUFFIXES]
    if unread:
        raise UserError(f"data folder {folder} holds {_listed(folder, unread)}, which would not be read: only "
                        f"{', '.join(LOCAL_SUFFIXES)} files are (decompress them, or convert them to .jsonl or "
                        ".parquet), or move them out of the folder")


def _read_parquet(file: Path, name: str) -> FileRecords:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except pyarrow.ArrowException as error:
        raise UserError(f"{file} is not a readable parquet file ({error}); write it again, or move it out of the "
                        "data") from error
    return FileRecords.numbered(name, "row", table.to_pylist())


def split_name(dataset: str, split: str) -> str:
    """How the bad-row report names a split of a dataset (saved, or on the hub)."""
    return f"{dataset}[{split}]"


def _read_saved_dataset(path: Path, choice: SplitChoice) -> list[FileRecords]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return [FileRecords.numbered(split_name(path.name, split), "row", loaded[split].to_list())
                for split in choice.of(str(path), sorted(loaded))]
    choice.refuse_named(str(path))
    return [FileRecords.numbered(path.name, "row", loaded.to_list())]


# The split each split word names (`eval_splits.SPLIT_KEYWORDS`): "training" and "train" name train's.
_SPLIT_OF_WORD = {word: split for split, words in SPLIT_KEYWORDS.items() for word in words}
# A file of `datasets`' sharded layout, named by its split whatever the split's name (SPLIT_PATTERN_SHARDED):
# data/train_prefs-00000-of-00001.parquet.
_SHARDED_FILE = re.compile(r"data/(?P<split>[^/]+?)-\d{5}-of-\d{5}[^/]*")
# A split name `datasets` accepts (its split name check); it refuses a sharded file naming another (data/my-split-...).
_VALID_SPLIT_NAME = re.compile(r"\w+(?:\.\w+)*")


def file_split(file: Path, folder: Path) -> str | None:
    """The split a file of `folder` has by its path inside it, as `datasets` finds a data folder's splits: in its
    sharded layout (`data/SPLIT-00000-of-00001.parquet`) the name before the shard's number; else the split of the
    first split word (`eval_splits.name_words`, `SPLIT_KEYWORDS`) of its folders below `folder`, outermost first, then
    of its name (`default/test/0000.jsonl`, `hh-rlhf-test.jsonl` and `rm_static_test.jsonl` are test's, `dev.jsonl`
    validation's); None where none names one."""
    relative = file.relative_to(folder)
    sharded = _SHARDED_FILE.fullmatch(relative.as_posix())
    if sharded is not None:
        return _sharded_split(sharded["split"], folder, relative)
    for part in (*relative.parent.parts, relative.stem):
        split = next((_SPLIT_OF_WORD[word] for word in name_words(part) if word in _SPLIT_OF_WORD), None)
        if split is not None:
            return split
    return None


def _sharded_split(split: str, folder: Path, relative: Path) -> str:
    """The split a file of `datasets`' sharded layout names, refused where `datasets` refuses it as no split name."""
    if _VALID_SPLIT_NAME.fullmatch(split) is None:
        name = relative.as_posix()
        valid = "_".join(re.findall(r"\w+", split)) or "split"
        renamed = name.replace(f"data/{split}-", f"data/{valid}-", 1)
        raise UserError(f"data folder {folder} holds {name}, of datasets' sharded layout (data/SPLIT-00000-of-00001), "
                        f"whose split '{split}' is no split name (datasets refuses it: letters, digits and _, parts "
                        f"joined by .): rename the split's files ({renamed})")
    return split


def _files_of_splits(folder: Path, files: Sequence[Path], choice: SplitChoice) -> list[Path]:
    """The files of the splits `choice` picks among the files' splits (`file_split`), as of a hub dataset's; a folder
    whose files name no split is one split, train, read whole (as `datasets` reads it)."""
    splits = {file: file_split(file, folder) for file in files}
    _refuse_files_naming_no_split(folder, splits)
    splits = {file: TRAIN_SPLIT if split is None else split for file, split in splits.items()}
    chosen = set(choice.of(str(folder), sorted(set(splits.values()))))
    return [file for file in files if splits[file] in chosen]


def _refuse_files_naming_no_split(folder: Path, splits: Mapping[Path, str | None]) -> None:
    """Refuse a folder whose files name splits (`file_split`) beside files naming none: `datasets` leaves those out,
    unread, and reading them as training rows would guess (a `heldout.jsonl` beside `train.jsonl` is not)."""
    unnamed = [file for file, split in splits.items() if split is None]
    if unnamed and len(unnamed) < len(splits):
        named = [file for file, split in splits.items() if split is not None]
        raise UserError(f"data folder {folder} holds files naming a split ({_listed(folder, named)}) beside files "
                        f"naming none ({_listed(folder, unnamed)}), whose split is not known (datasets leaves them "
                        "unread): put their split in their names or folders (train.jsonl, test/part0.jsonl), or move "
                        "them out of the folder")


def read_local_files(path: Path, skipped: SkippedRows, choice: SplitChoice = TRAINING) -> list[FileRecords]:
    """The records of each file of `path` (a file or folder) of the splits `choice` picks (a folder's files by their
    names' splits, `file_split`); bad lines of JSON-lines files are counted in `skipped`. A split is named only of a
    saved `DatasetDict`, a folder's files or a .json file's object of lists."""
    if is_saved_dataset(path):
        return _read_saved_dataset(path, choice)
    files = local_files(path)
    if path.is_dir():
        files, choice = _files_of_splits(path, files, choice), SplitChoice(evaluating=choice.evaluating)
    elif path.suffix != ".json":
        choice.refuse_named(str(path))
    root = path if path.is_dir() else path.parent
    return [_read_parquet(file, str(file.relative_to(root))) if file.suffix == ".parquet"
            else read_json_file(file, str(file.relative_to(root)), skipped, choice) for file in files]


class RecordOrigins:
    """Where each record of a source was read ("part-001.jsonl line 124", a hub dataset's "name[train] row 7"), by
    the record's index."""

    def __init__(self, names: Sequence[str], file_of: np.ndarray, positions: np.ndarray):
        self.names, self.file_of, self.positions = list(names), file_of, positions

    @classmethod
    def of(cls, files: Sequence[FileRecords]) -> RecordOrigins:
        """The origins of the records of `files`, concatenated in order."""
        file_of = np.repeat(np.arange(len(files)), [len(file.records) for file in files])
        positions = np.array([position for file in files for position in file.positions], dtype=np.int64)
        return cls([f"{file.name} {file.unit}" for file in files], file_of, positions)

    @classmethod
    def numbered(cls, names: Sequence[str], counts: Sequence[int]) -> RecordOrigins:
        """The origins of parts of `counts` records each, concatenated in order, each part's numbered from 1."""
        counts = np.asarray(counts, dtype=np.int64)
        file_of = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(counts.sum(), dtype=np.int64) - (np.cumsum(counts) - counts)[file_of] + 1
        return cls(names, file_of, positions)

    def take(self, indices: Sequence[int]) -> RecordOrigins:
        """The origins of the records at `indices`, in that order."""
        return RecordOrigins(self.names, self.file_of[list(indices)], self.positions[list(indices)])

    def __call__(self, index: int) -> str:
        return f"{self.names[self.file_of[index]]} {self.positions[index]}"
