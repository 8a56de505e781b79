"""User-facing errors: one clear line that says what went wrong and what to do.

Anything a user can cause (a bad path, an unknown dataset, no network for a hub name, malformed
input) is raised as `UserError`; `run_cli` turns it into a single `error: ...` line and exit code 2
instead of a deep traceback.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from utils.output_pipes import unread_outputs, write_to_devnull

T = TypeVar("T")

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # a shell's status for a process that SIGPIPE ended: the reader of its output left


class UserError(Exception):
    """An error the user can fix; its message must say how."""


class UserErrors(UserError):
    """Several `UserError`s reported at once (`refuse_all`), numbered in one message."""

    def __init__(self, messages: list[str]):
        self.messages = messages
        super().__init__(f"{len(messages)} problems: " + "; ".join(f"({n}) {m}" for n, m in enumerate(messages, 1)))


def refuse_all(*checks: Callable[[], object]) -> None:
    """Run every one of `checks` (independent checks that raise a `UserError`) and raise every refusal at once: one
    `UserError` as it was, several as one `UserErrors`, so a command line with several mistakes is told of them all."""
    messages = []
    for check in checks:
        try:
            check()
        except UserErrors as errors:
            messages.extend(errors.messages)
        except UserError as error:
            messages.append(str(error))
    refuse_messages(messages)


def refuse_messages(messages: Sequence[str]) -> None:
    """Raise every one of `messages` (refusals) at once: one as a `UserError`, several as one `UserErrors`, none not
    at all."""
    if len(messages) == 1:
        raise UserError(messages[0])
    if messages:
        raise UserErrors(list(messages))


def refuse_wrong(*cases: tuple[object, str]) -> None:
    """Raise at once (`refuse_messages`) the message of every `(wrong, message)` case whose `wrong` is true: the
    independent range checks of a few flags, each said where it fails."""
    refuse_messages([message for wrong, message in cases if wrong])


def run_cli(main: Callable[..., T]) -> Callable[..., T]:
    """Decorate a console entry point so a `UserError` ends the process with one clear line, and its output left
    without a reader (train.py, which reads a rank's output, killed before the rank's stop handler is in place; `|
    head`) ends it quietly with the shell's SIGPIPE status, not in a BrokenPipeError traceback and status 1: saying a
    `UserError` on a stderr without a reader too."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            try:
                return main(*args, **kwargs)
            except UserError as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                sys.exit(EXIT_USER_ERROR)
        except BrokenPipeError:
            unread = unread_outputs()
            if not unread:
                raise
            for fd in unread:  # Python's flush of them at exit would raise again
                write_to_devnull(fd)
            sys.exit(EXIT_BROKEN_PIPE)

    return wrapper
