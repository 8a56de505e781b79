"""On-disk cache of tokenised data, keyed by a hash of everything that changes it.

One process per node (local rank 0) builds under a file lock while the other ranks wait at a
barrier, then every rank loads the file. Writes go to a temporary file renamed into place, so a
crash never leaves a half-written cache behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from training.dist import barrier, get_local_rank
from training.errors import UserError

CACHE_VERSION = 1


def stable_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict:
    """Name plus hashes of the vocabulary, special tokens and chat template."""
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "class": type(tokenizer).__name__,
        "vocab": stable_hash(sorted(tokenizer.get_vocab().items())),
        "special": {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "chat_template": stable_hash(getattr(tokenizer, "chat_template", None)),
    }


def cache_file(data_output_path: str | os.PathLike, prefix: str, key_inputs: dict) -> Path:
    key = stable_hash({"version": CACHE_VERSION, **key_inputs})[:20]
    return Path(data_output_path).expanduser() / f"{prefix}_{key}.pt"


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_or_load(path: Path, build: Callable[[], dict], rebuild: bool = False) -> tuple[dict, bool]:
    """Load `path`, building it first (on local rank 0, under a lock) when missing or `rebuild`.

    Returns `(obj, built)` where `built` says whether this process built it.
    """
    built = False
    if get_local_rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(path) + ".lock"):
                if rebuild or not path.is_file():
                    atomic_torch_save(build(), path)
                    built = True
        finally:
            barrier()
    else:
        barrier()
    if not path.is_file():
        raise UserError(f"the data cache {path} was not built; see the error reported by local rank 0")
    return torch.load(path, weights_only=True), built
