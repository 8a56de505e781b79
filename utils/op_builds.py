"""Saying so when the build of a compiled op (DeepSpeed's FusedAdam, DeepSpeedCPUAdam, its CPU communication op)
waits on a lock that an interrupted build left.

torch compiles such an op at first use in a folder of its own under TORCH_EXTENSIONS_DIR, holding a `lock` file there
while it builds; any other process that needs the op waits for that file to go, without a word and without end. A
build stopped half-way (Ctrl-C, a killed job) leaves the file behind, and from then on every run stops silently at
that point: DeepSpeed users know it as a run that hangs at "Loading extension module". `watching_build_locks` tells
the user, once the wait has gone on, which lock it is and how to clear it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_LOCK_WARNING_S = 60.0  # an op's build takes seconds on CPU and one to two minutes with nvcc


def extension_build_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its per-user cache folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    """The build locks under `root`: ROOT/OP/lock (TORCH_EXTENSIONS_DIR set) or ROOT/pyXY_DEVICE/OP/lock."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def _since(lock: Path) -> str | None:
    """When `lock` was made, or None when it is gone already (its build ended)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(lock.stat().st_mtime))
    except FileNotFoundError:
        return None


@contextmanager
def watching_build_locks(after_s: float | None = None) -> Iterator[None]:
    """Inside: something that may compile an op. If it is still inside after `after_s` (default
    `STALE_LOCK_WARNING_S`) and a build lock exists, a warning names each lock, its age and the way out."""
    wait_s = STALE_LOCK_WARNING_S if after_s is None else after_s

    def warn() -> None:
        locks = [f"{lock} (since {since})" for lock in build_locks(extension_build_root())
                 if (since := _since(lock)) is not None]
        if locks:
            logger.warning("still waiting after %.0f s for an op build's lock: %s. If no other process is building "
                           "that op now, a build stopped half-way left the lock: delete its folder (the op is built "
                           "again) and start again.", wait_s, ", ".join(locks))

    timer = threading.Timer(wait_s, warn)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
