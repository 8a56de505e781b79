"""This process's stdout and stderr where they are pipes: whether the program reading one has gone (a write would
raise BrokenPipeError), and sending what is written there to /dev/null from then on."""
from __future__ import annotations

import contextlib
import os
import select
import stat
from collections.abc import Sequence

OUTPUT_FDS = (1, 2)  # stdout and stderr, which a launched rank shares with its launcher and train.py's pipe


def pipes_among(fds: Sequence[int]) -> list[int]:
    """Those of `fds` that are open pipes."""
    pipes = []
    for fd in fds:
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.append(fd)
    return pipes


def without_reader(fd: int) -> bool:
    """Whether `fd`, a pipe's write end, has no reader (POLLERR)."""
    poller = select.poll()
    poller.register(fd, 0)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def unread_outputs() -> list[int]:
    """Those of stdout and stderr that are pipes whose reader has gone."""
    return [fd for fd in pipes_among(OUTPUT_FDS) if without_reader(fd)]


def write_to_devnull(fd: int) -> None:
    """`fd` writes to /dev/null from now on: its reader has left, and a write there would raise BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
