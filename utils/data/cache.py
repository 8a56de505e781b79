"""On-disk cache of tokenised data, keyed by a hash of everything that changes it.

One process per node (local rank 0) loads or builds under a file lock while the other ranks wait at a
barrier, then they load the file. Writes go to a temporary file, fsynced and renamed into place, so a
crash never leaves a half-written cache behind; a file damaged otherwise (a disk that filled, a copy
cut short) is built again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from utils.atomic import atomic_torch_save
from utils.dist import barrier, get_local_rank
from utils.errors import UserError

DATA_CODE_DIR = Path(__file__).resolve().parent
logger = logging.getLogger("utils.data")
_UNREADABLE = (OSError, EOFError, RuntimeError, pickle.UnpicklingError)  # what torch.load raises on a damaged file
PROBE_TEXT = "Probe: Hello, World! 12 + 30 = 42.\n\tTabs, accents (é, ü) and 漢字."
PROBE_CONVERSATION = (
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 12 + 30?"},
)


def stable_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


ROW_LIBRARIES = ("datasets", "pyarrow", "transformers", "tokenizers")  # their versions join the cache key


def source_version(folder: Path = DATA_CODE_DIR) -> str:
    """Hash of the names and contents of the Python files in `folder` (by default this data package)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode("utf-8") + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def code_version() -> dict:
    """The version of the code that turns rows into cached items, derived rather than hand-bumped.

    It hashes the source of the whole data package, not a list of the modules that tokenise and
    format: a list goes stale when a helper moves or a module is added, and a forgotten constant
    bump silently reuses data built by older code, whereas a needless rebuild after an unrelated edit
    costs only the build time. The versions of the libraries that read the rows (datasets, and pyarrow, which reads
    a parquet file for both: a column's type, its nulls) and encode the text (transformers, tokenizers) join it.
    """
    return {"data_code": source_version(), **{library: version(library) for library in ROW_LIBRARIES}}


def _probe_encodings(tokenizer) -> dict:
    """How the tokenizer encodes a fixed text with its special tokens (BOS/EOS insertion, post-processor)
    and, when it has a chat template, a fixed conversation rendered with it."""
    probes = {"text": tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"]}
    if getattr(tokenizer, "chat_template", None):
        try:
            rendered = tokenizer.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False, add_generation_prompt=True)
            probes["chat"] = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        except Exception as err:  # jinja templates raise their own errors; the failure is part of the behaviour
            probes["chat"] = f"error: {type(err).__name__}: {err}"
    return probes


def _backend_hash(tokenizer) -> str | None:
    """A hash of a fast tokenizer's definition (its tokenizer.json: normalizer, pre-tokenizer, merges, ...); None for
    a slow one. The vocabulary and the probes miss a change there that the probe text does not show (a tokenizer.json
    updated in place with another normalizer or merges), and the cache served the old tokens. Not its truncation and
    padding: each call sets them, so they tell what was last encoded (another rank would look for another file)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    definition = json.loads(backend.to_str())
    return stable_hash({key: value for key, value in definition.items() if key not in ("truncation", "padding")})


def tokenizer_fingerprint(tokenizer) -> dict:
    """Name, hashes of the vocabulary, the fast tokenizer's definition, special tokens and chat template, and the
    probe encodings."""
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "class": type(tokenizer).__name__,
        "vocab": stable_hash(sorted(tokenizer.get_vocab().items())),
        "backend": _backend_hash(tokenizer),
        "special": {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "chat_template": stable_hash(getattr(tokenizer, "chat_template", None)),
        "probes": _probe_encodings(tokenizer),
    }


def cache_file(data_output_path: str | os.PathLike, prefix: str, key_inputs: dict) -> Path:
    key = stable_hash({"code": code_version(), **key_inputs})[:20]
    return Path(data_output_path).expanduser() / f"{prefix}_{key}.pt"


def _make_cache_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        raise UserError(f"--data_output_path {folder}: a file stands where the data cache's folder goes; choose "
                        "another --data_output_path") from err


def _load_or_warn(path: Path) -> dict | None:
    """The cache file's contents; None, with a warning naming it, for a damaged one (a disk that filled, a copy
    cut short): it is built again."""
    try:
        return torch.load(path, weights_only=True)
    except _UNREADABLE as err:
        logger.warning("the data cache file %s is damaged (%s: %s); building it again", path, type(err).__name__, err)
        return None


def build_or_load(path: Path, build: Callable[[], dict], rebuild: bool = False) -> tuple[dict, bool]:
    """Load `path`, building it first (on local rank 0, under a lock) when missing, damaged or `rebuild`.

    Returns `(obj, built)` where `built` says whether this process built it. A file to be built again (damaged, or
    `rebuild`) is removed before the build, so a build that fails leaves no file for the other ranks to load.
    """
    if get_local_rank() != 0:
        barrier()
        if not path.is_file():
            raise UserError(f"the data cache {path} was not built; see the error reported by local rank 0")
        try:
            return torch.load(path, weights_only=True), False
        except _UNREADABLE as err:
            raise UserError(f"the data cache {path} cannot be read ({type(err).__name__}: {err}); rerun with "
                            "--rebuild_data_cache") from err
    try:
        _make_cache_folder(path.parent)
        with FileLock(str(path) + ".lock"):
            state = None if rebuild or not path.is_file() else _load_or_warn(path)
            if state is not None:
                return state, False
            # a damaged or replaced file goes first: should the build fail, the other ranks find no file and say so
            # ("see local rank 0"), rather than load the file it was to replace or call a damaged one theirs to rebuild
            path.unlink(missing_ok=True)
            state = build()
            atomic_torch_save(state, path)
            return state, True
    finally:
        barrier()
