"""Atomic writes: build under a temporary name beside the target, then rename into place.

A reader (or a resumed run) therefore sees either the old complete folder/file or the new complete
one, never a half-written one. Temporary names start with "." and contain ".tmp-", so readers can
tell them apart from finished work and a later writer can sweep up what a crash left behind.

`atomic_directory` is for one writer (rank 0 of a model save). `shared_atomic_directory` is for a
folder that every rank writes into (a DeepSpeed checkpoint): the ranks agree on one temporary
name, and rank 0 renames it once all of them are done. It needs a filesystem shared by all ranks.
"""
from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from utils.dist import barrier, broadcast_from_main, is_main_process, refuse_on_every_rank

TMP_MARK = ".tmp-"


def temporary_path(final_path: str | os.PathLike, token: str) -> Path:
    """The hidden sibling a write to `final_path` is staged in."""
    final = Path(final_path)
    return final.parent / f".{final.name}{TMP_MARK}{token}"


def is_temporary(path: str | os.PathLike) -> bool:
    name = Path(path).name
    return name.startswith(".") and TMP_MARK in name


def remove_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the staging folders/files an interrupted write left in `folder`; returns what was removed."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for entry in folder.iterdir():
            if is_temporary(entry):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a folder's entries to disk (a rename is durable only once its folder is)."""
    flags = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) if Path(path).is_dir() else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file under `root`, then the folders (so files written by other ranks are durable too)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file so that it is either absent/old or complete: tmp file, fsync, `os.replace`."""
    path = Path(path)
    tmp = temporary_path(path, uuid.uuid4().hex[:8])
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """`torch.save` through a temporary file (load it back with `torch.load(..., weights_only=True)`)."""
    path = Path(path)
    tmp = temporary_path(path, uuid.uuid4().hex[:8])
    try:
        torch.save(obj, tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def replace_directory(source: Path, final: Path) -> None:
    """Rename the finished folder `source` to `final`, moving an existing `final` aside first.

    POSIX cannot swap two folders atomically, so an old `final` is renamed to a hidden `.old`
    name, the new one renamed in, and only then the old one deleted.
    """
    old = None
    if final.exists():
        old = temporary_path(final, f"old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(source, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `final_path`; on success it replaces `final_path`, on error it is removed.

    Single writer: call it on one rank only (see `shared_atomic_directory` for all ranks).
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(final, uuid.uuid4().hex[:8])
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_directory(tmp, final)


@contextmanager
def shared_atomic_directory(final_path: str | os.PathLike) -> Iterator[Path]:
    """Like `atomic_directory`, but every rank calls it and may write into the yielded folder.

    Rank 0 draws a random token and broadcasts it, so all ranks stage into the same folder; a
    barrier after the body makes rank 0 rename only once every rank has finished writing. If a rank
    fails inside the body the others cannot be told (they may be blocked in a collective): the
    staging folder is then left for `remove_temporaries` and `final_path` is untouched.
    """
    final = Path(final_path)
    tmp = temporary_path(final, broadcast_from_main(uuid.uuid4().hex[:8]))
    if is_main_process():
        tmp.mkdir(parents=True)
    barrier()
    try:
        refuse_on_every_rank(None if tmp.is_dir() else
                             f"{final.parent} is not visible to every rank; checkpoints need a folder on a filesystem "
                             "shared by all nodes: choose such an --output_dir")
        yield tmp
    except BaseException:
        if is_main_process():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if is_main_process():
        fsync_tree(tmp)
        replace_directory(tmp, final)
    barrier()
