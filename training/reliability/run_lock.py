"""One run per output folder: an OS-level lock that dies with the process that holds it.

`filelock.FileLock` on Linux/macOS is an `flock` on `<output_dir>/.run.lock`; the kernel drops it
when the holder exits for any reason (SIGKILL and power loss included), so a crashed run never
blocks the next one. Who holds it (pid, host, start time) is kept in a separate file, because
older filelock versions truncate the lock file on every attempt to take it. Rank 0 takes the lock
for the whole job and tells the other ranks whether it got it. Having taken it, rank 0 removes the staging
folders and files (`utils.atomic`) a killed run left in the folder. train.py holds one on its --output-dir, and
each step it runs one on its own run folder below it (another file), so the two never meet.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import filelock

from utils.atomic import atomic_write_text, remove_temporaries
from utils.dist import is_main_process, refuse_on_every_rank

LOCK_FILE = ".run.lock"
OWNER_FILE = ".run.lock.json"
# how long a run waits on a held lock before it is refused: a dry run's look (`RunLock.holder_now`) holds it an instant
TAKER_WAIT_S = 1.0
logger = logging.getLogger(__name__)


class RunLock:
    """Hold `<output_dir>/.run.lock` while a run writes there (context manager; every rank enters it)."""

    def __init__(self, output_dir: str | os.PathLike, flag: str = "--output_dir"):
        self.output_dir = Path(output_dir)
        self.flag = flag  # the folder's flag, which the refusal says to change
        self._lock: filelock.BaseFileLock | None = None

    @property
    def owner_path(self) -> Path:
        return self.output_dir / OWNER_FILE

    def _holder(self) -> str:
        try:
            owner = json.loads(self.owner_path.read_text())
            return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "pid unknown"

    def holder_now(self) -> str | None:
        """The description of the run holding the lock now, else None; takes it for no longer than a look, and
        creates nothing (a dry run's look at the folder). Taking it is the only look that sees an flock wherever one
        is held: fcntl's F_GETLK does not see one on Linux, a shared lock would refuse a taker as much, and
        /proc/locks lists neither another pid namespace's nor another host's on a shared file system. A run taking
        the lock meanwhile waits that instant out (`TAKER_WAIT_S`)."""
        lock_path = self.output_dir / LOCK_FILE
        if not lock_path.is_file():
            return None
        lock = filelock.FileLock(str(lock_path), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            return self._holder()
        except OSError:  # a lock file this process may not open: nothing to tell from it
            return None
        lock.release()
        return None

    def _take_before(self, deadline: float) -> filelock.BaseFileLock | None:
        """The lock, taken before `deadline` (time.monotonic), else None: another run holds it. The folder is made
        again where the run that held it removed it meanwhile with its lock files (`remove_files_if_alone`: a run
        refused while planning leaves no folder it created), as filelock does not remake a folder removed during a
        wait. Two runs never both hold it: filelock (3.21 on) retakes a lock file unlinked while it waited to lock it."""
        while True:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(str(self.output_dir / LOCK_FILE), timeout=max(0.0, deadline - time.monotonic()))
            try:
                lock.acquire()
                return lock
            except filelock.Timeout:
                return None
            except FileNotFoundError:  # the folder removed between making it and locking in it
                if time.monotonic() >= deadline:
                    raise

    def _try_acquire(self) -> str | None:
        """Take the lock; None on success, else the holder's description."""
        lock = self._take_before(time.monotonic() + TAKER_WAIT_S)
        if lock is None:
            return self._holder()
        if isinstance(lock, filelock.SoftFileLock):
            warnings.warn(f"{self.output_dir} does not support OS file locks; a crashed run's lock must be "
                          f"removed by hand ({self.output_dir / LOCK_FILE})", stacklevel=3)
        self._lock = lock
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": list(sys.orig_argv)}
        atomic_write_text(self.owner_path, json.dumps(owner, indent=2) + "\n")
        # the holder is the folder's only writer: a staging folder here is a dead run's unfinished save (a final
        # model is the size of the model), which nothing else would ever remove
        for leftover in remove_temporaries(self.output_dir):
            logger.info("removed %s, left by a run that stopped while saving", leftover)
        return None

    def acquire(self) -> "RunLock":
        holder = self._try_acquire() if is_main_process() else None
        refuse_on_every_rank(None if holder is None else f"output dir {self.output_dir} is in use by another run "
                             f"({holder}); wait for it to finish or choose another {self.flag}")
        return self

    def remove_files_if_alone(self) -> bool:
        """While held, where the folder holds nothing but this lock's files (a run that ended before writing
        anything): remove them, the lock file last, so the folder is as empty as before, and release the lock; whether
        it did. Removed while held, the lock file is no other run's: one starting after makes its own, and its owner
        file is its own (a release after this one unlinks nothing)."""
        try:
            others = [path for path in self.output_dir.iterdir() if path.name not in (LOCK_FILE, OWNER_FILE)]
        except OSError:  # the folder gone or unreadable meanwhile: nothing to tidy
            return False
        if self._lock is None or others:
            return False
        self.owner_path.unlink(missing_ok=True)
        (self.output_dir / LOCK_FILE).unlink(missing_ok=True)
        self._lock.release()
        self._lock = None
        return True

    def release(self) -> None:
        if self._lock is not None:
            self.owner_path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
