"""Stop cleanly on SIGTERM/SIGINT: finish the optimizer step, save a checkpoint, say how to resume.

The first signal only sets a flag. The training loop asks `should_stop()` after every optimizer
step (all ranks, at the same point: the answer is agreed across ranks, since a launcher or a
scheduler may signal the ranks at slightly different moments), saves a checkpoint and calls
`exit_for_resume`, which prints the command to continue and exits with `EXIT_INTERRUPTED`.
A second SIGINT (Ctrl-C again) aborts at once; the last complete checkpoint stays valid. Past the last step
(`finishing`: the final model's export), a signal only says that the run finishes that first, then ends as a
finished run: stopping there would lose what the export writes, and with `--save_interval 0` the whole run.

train.py runs steps one after another: a stop request during a step also ends train.py before the next step
(`take_received_signal`), in this process or, through the launcher, in the step's processes.

Output whose reader has gone (train.py, which reads the ranks' output, killed) is a stop request too, sent as a
SIGTERM and noted as `OUTPUT_UNREAD`: the rank writes to /dev/null from then on (its next write to the pipe would
raise BrokenPipeError, ending it before its save), saves at the next step and exits with `EXIT_INTERRUPTED`
(`OutputReaderWatch`). train.py, where no step is under way, ends with the shell's status for it instead.

Only a second SIGINT aborts, not a SIGTERM after a SIGINT: Ctrl-C under the `deepspeed` launcher
reaches each rank twice (SIGINT from the terminal, then SIGTERM from the launcher). That launcher
kills its ranks 30 s after forwarding the signal, so a checkpoint that takes longer to write is
lost there, and the run resumes from the previous one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import shlex
import signal
import sys
import threading
from types import FrameType
from typing import IO, Callable, Iterator, NoReturn, Sequence

from utils.dist import any_rank, get_world_size, print_rank0
from utils.output_pipes import OUTPUT_FDS, pipes_among, without_reader, write_to_devnull

EXIT_INTERRUPTED = 3
"""Exit status of a run stopped on request after saving its checkpoint (0: finished, 2: user error)."""

OUTPUT_UNREAD = signal.SIGPIPE
"""The stop request noted where this process's output has no reader any more (the program it was piped into
ended): the output watch sends this process a SIGTERM, which the handler in place takes as this, not as a SIGTERM
someone sent."""

_received: signal.Signals | None = None  # the first stop request this process took since `take_received_signal`
_unread_output_signalled = False  # the output watch sent this process the SIGTERM no handler has taken yet


def record_signal(signum: int) -> signal.Signals:
    """Note a stop request for whoever runs several steps in this process (train.py stops before the next), and
    return it: `OUTPUT_UNREAD` for the SIGTERM the output watch sent, else the signal."""
    global _received, _unread_output_signalled
    request = signal.Signals(signum)
    if request == signal.SIGTERM and _unread_output_signalled:
        request, _unread_output_signalled = OUTPUT_UNREAD, False
    if _received is None:
        _received = request
    return request


def stop_cause(request: signal.Signals, program: str = "this process") -> str:
    """What made `request`, as a message says it: 'received SIGTERM', or `program`'s output without a reader."""
    if request == OUTPUT_UNREAD:
        return f"{program}'s output has no reader any more (the program it was piped into ended)"
    return f"received {request.name}"


def stopped_by(request: signal.Signals | None, program: str = "this process") -> str:
    """How `program` stopped, after 'stopped': 'on SIGTERM', 'as its output has no reader ...'; None: 'on request'."""
    if request is None:
        return "on request"
    if request == OUTPUT_UNREAD:
        return f"as {stop_cause(request, program)}"
    return f"on {request.name}"


def take_received_signal() -> signal.Signals | None:
    """The first stop request since the last call (SIGINT/SIGTERM), which this call forgets."""
    global _received
    received, _received = _received, None
    return received


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command that started this process, with `--resume` added (and the launcher's `--local_rank` removed)."""
    words = list(sys.orig_argv if argv is None else argv)
    kept: list[str] = []
    skip_value = False
    for word in words:
        if skip_value:
            skip_value = False
            continue
        if word == "--local_rank":
            skip_value = True
            continue
        if word.startswith("--local_rank="):
            continue
        kept.append(word)
    if "--resume" not in kept:
        kept.append("--resume")
    return shlex.join(kept)


def _launched_by_launcher() -> bool:
    return get_world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ


@contextlib.contextmanager
def handling_signals(signals: Sequence[signal.Signals],
                     handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """`handler` for `signals` inside the block, the previous handlers after it; in the main thread only, where
    Python runs signal handlers (elsewhere the block runs with the handlers as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signals}
    try:
        yield
    finally:
        for signum, earlier in previous.items():
            signal.signal(signum, earlier)


def say_from_handler(text: str) -> None:
    """Write `text` to stderr from a signal handler: to its file descriptor, not through `sys.stderr`, as the
    handler may run in the middle of a write there (a progress bar's), where a buffered write raises 'reentrant
    call' out of the handler; a closed stderr (train.py, which reads the ranks' output, killed) is passed over, as
    the stop request noted before it is what matters."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), text.encode())


class OutputReaderWatch:
    """Watches this process's stdout and stderr where they are pipes, from a thread: once no process reads one any
    more, that file descriptor writes to /dev/null from then on (a write to the pipe would raise BrokenPipeError)
    and `on_gone` is called, once.

    A write can meet the pipe in the moment between its reader leaving and the thread's redirect (the thread waits
    for the interpreter lock while the main thread prints): `sys.stdout` and `sys.stderr`, where they write to a
    watched pipe, are guarded inside the block (`_ReaderGoneGuard`), so that such a write is taken as the thread
    takes the reader's leaving, not raised into whatever printed (a progress bar, a log line)."""

    def __init__(self, on_gone: Callable[[], None], fds: Sequence[int] = OUTPUT_FDS) -> None:
        self._on_gone = on_gone
        self._pipes = pipes_among(fds)
        self._watching = False
        self._gone_said = False
        self._lock = threading.Lock()
        self._guards: dict[str, _ReaderGoneGuard] = {}
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="output-reader-watch", daemon=True)

    def __enter__(self) -> None:
        self._watching = True
        if self._pipes:
            self._guard_std_streams()
            try:
                self._thread.start()
            except BaseException:  # no thread left to start: the streams and the wake-up pipe go back as they were
                self.__exit__()
                raise

    def __exit__(self, *exc_info) -> None:
        os.write(self._wake_write, b"x")
        if self._thread.is_alive():
            self._thread.join()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._unguard_std_streams()
        self._watching = False

    def reader_gone(self, fd: int) -> bool:
        """Whether `fd`, one of the pipes watched, has no reader any more: if so it writes to /dev/null from now on
        (it may already, redirected by this watch or another one in this process) and `on_gone` has been called.
        False past the block: a guard something kept beyond it takes nothing for it."""
        if not self._watching or fd not in self._pipes:
            return False
        with self._lock:
            if _writes_to_devnull(fd):
                return True
            if not without_reader(fd):
                return False
            write_to_devnull(fd)
            first, self._gone_said = not self._gone_said, True
        if first:
            self._on_gone()
        return True

    def _guard_std_streams(self) -> None:
        """Guard `sys.stdout` and `sys.stderr` where they write to a watched pipe, and the log handlers made before
        the block that write to them (a handler keeps the stream it was given: its write meeting the pipe without a
        reader printed a '--- Logging error ---' traceback)."""
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if _fileno(stream) in self._pipes:
                self._guards[name] = _ReaderGoneGuard(stream, self)
                setattr(sys, name, self._guards[name])
                _redirect_log_handlers(stream, self._guards[name])

    def _unguard_std_streams(self) -> None:
        """Put back the streams guarded, and the log handlers' streams, where the guard is still in place (not
        replaced since)."""
        for name, guard in self._guards.items():
            if getattr(sys, name) is guard:
                setattr(sys, name, guard.stream)
            _redirect_log_handlers(guard, guard.stream)
        self._guards.clear()

    def _watch(self) -> None:
        poller = select.poll()
        for fd in self._pipes:
            poller.register(fd, 0)  # a pipe's write end reports POLLERR, always polled for, once it has no reader
        poller.register(self._wake_read, select.POLLIN)
        unread = len(self._pipes)
        while unread:
            for fd, _ in poller.poll():
                if fd == self._wake_read:
                    return
                poller.unregister(fd)
                self.reader_gone(fd)
                unread -= 1


class _ReaderGoneGuard:
    """`stream` (`sys.stdout` or `sys.stderr`, writing to a pipe an `OutputReaderWatch` watches), whose write or
    flush that raises BrokenPipeError because that pipe's reader has gone is taken by the watch as its thread would
    take it (the text goes nowhere, as it would a moment later); a BrokenPipeError of another cause is raised."""

    def __init__(self, stream: IO[str], watch: OutputReaderWatch) -> None:
        self.stream = stream
        self._fd = stream.fileno()
        self._watch = watch

    def reader_gone(self) -> bool:
        return self._watch.reader_gone(self._fd)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            if not self.reader_gone():
                raise
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            if not self.reader_gone():
                raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def output_reader_gone(stream: IO[str]) -> bool:
    """Whether `stream` (`sys.stdout` or `sys.stderr`) writes to a pipe an `OutputReaderWatch` watches, whose reader
    has gone: for a BrokenPipeError met writing to its `buffer`, past the guard (taken as the watch takes it)."""
    return isinstance(stream, _ReaderGoneGuard) and stream.reader_gone()


def _redirect_log_handlers(stream: IO[str], to: IO[str]) -> None:
    """Point the log handlers, of every logger, that write to `stream` (DeepSpeed's logger has one of its own) at
    `to`, which writes to the same file descriptor: not by `setStream`, whose flush of `stream` would raise where the
    pipe's reader has already gone."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for handler in (handler for logger in loggers for handler in logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            with handler.lock:
                handler.stream = to


def _fileno(stream: IO[str] | None) -> int | None:
    """`stream`'s file descriptor, None where it has none (pytest's captured streams, a closed one)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _writes_to_devnull(fd: int) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(os.devnull))
    except OSError:
        return False


class GracefulInterrupt:
    """Context manager that turns SIGINT/SIGTERM, and this process's output left without a reader, into a stop
    request at the next step boundary. `program` names this process in what it says of its output (train.py's);
    `quiet_if_unread`: say nothing on taking that one (train.py, which then ends as SIGPIPE would end it, or says so
    as it stops a step)."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
                 on_receipt: str = "stopping after this step and saving a checkpoint", program: str = "this process",
                 quiet_if_unread: bool = False):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._handling = contextlib.ExitStack()
        self._on_receipt = on_receipt
        self._program = program
        self._quiet_if_unread = quiet_if_unread

    def __enter__(self) -> "GracefulInterrupt":
        """Handle the signals from here on; a stop request that an enclosing one took (train.py's, while a step it
        runs in this process started up) is this one's too, and so is the name of the program whose output it is."""
        enclosing = getattr(signal.getsignal(self.signals[0]), "__self__", None)
        if isinstance(enclosing, GracefulInterrupt):
            self.received = enclosing.received
            self._program = enclosing._program
        with self._handling:  # closed only where the watch does not start: the handlers go back as they were
            self._handling.enter_context(handling_signals(self.signals, self._handle))
            if threading.current_thread() is threading.main_thread() and signal.SIGTERM in self.signals:  # handled
                self._handling.enter_context(OutputReaderWatch(self._output_reader_gone))
            self._handling = self._handling.pop_all()
        return self

    def __exit__(self, *exc_info) -> None:
        self._handling.close()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        request = record_signal(signum)
        if self.received is not None and request == signal.SIGINT:
            raise KeyboardInterrupt("second interrupt: aborting without a checkpoint")
        if self.received is None:
            self.received = request
            if not (request == OUTPUT_UNREAD and self._quiet_if_unread):
                say_from_handler(f"\n{stop_cause(request, self._program)}: {self._on_receipt} (press Ctrl-C again to "
                                 f"abort at once)\n")

    @staticmethod
    def _output_reader_gone() -> None:
        """No process reads this one's output any more (train.py killed, or the program train.py's output was piped
        into): a SIGTERM to this process, which whatever handler is in place takes as the stop request
        `OUTPUT_UNREAD` (train.py's passes it on to a step it launched as a SIGTERM)."""
        global _unread_output_signalled
        _unread_output_signalled = True
        os.kill(os.getpid(), signal.SIGTERM)

    def finishing(self, task: str) -> None:
        """The run is past its last step and now does `task` ("the final model's save"): a signal from here on
        lets it finish that and end as a finished run."""
        self._on_receipt = f"finishing {task}, then ending (the run is past its last step)"

    @property
    def requested(self) -> bool:
        """Whether this rank received a signal (local; the loop should use `should_stop`)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Whether any rank received a signal. Collective: every rank calls it after each optimizer step."""
        return any_rank(self.requested)

    def exit_for_resume(self, step: int, checkpoint: os.PathLike | str, argv: Sequence[str] | None = None) -> NoReturn:
        """Print where the checkpoint is and how to continue, then exit with `EXIT_INTERRUPTED` (every rank)."""
        reason = "on a signal on another rank" if self.received is None else stopped_by(self.received, self._program)
        command = resume_command(argv)
        if _launched_by_launcher():
            hint = f"run the same launcher command with --resume added (this rank ran: {command})"
        else:
            hint = command
        print_rank0(f"stopped {reason} after step {step}; checkpoint saved to {checkpoint}\n"
                    f"to continue: {hint}")
        sys.stdout.flush()
        raise SystemExit(EXIT_INTERRUPTED)
