"""SIGTERM/SIGINT: finish the step, save, print the resume command; a second Ctrl-C aborts."""
import contextlib
import io
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TESTS_DIR
from crash_resume import step_env
from supervised_data import write_arithmetic_jsonl
from test_step3_rlhf import make_step3_inputs, step3_argv
from tiny_models import make_tiny_model_dir

from training.reliability.signals import (
    EXIT_INTERRUPTED,
    OUTPUT_UNREAD,
    GracefulInterrupt,
    OutputReaderWatch,
    resume_command,
    take_received_signal,
)
from utils.errors import EXIT_BROKEN_PIPE, run_cli

LOOP = """
import sys, time
from dataclasses import dataclass
import torch, deepspeed
from utils.dist import init_distributed
from training.core.args import RunArguments, ScheduleSettings, SettingsParser
from training.reliability.checkpointing import CheckpointSettings
from training.reliability.signals import GracefulInterrupt

@dataclass
class LoopCLI:
    run: RunArguments
    schedule: ScheduleSettings
    checkpoints: CheckpointSettings

settings = SettingsParser(LoopCLI).parse_args()
args = settings.checkpoints
init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                                  config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}})
manager = args.manager(settings.run.output_dir)
state = manager.restore({"model": engine}, resume=args.resume) or {}
print("start", engine.global_steps, state.get("note"), flush=True)
with GracefulInterrupt() as stop:
    while engine.global_steps < settings.schedule.max_steps:
        loss = engine(torch.randn(1, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        print("step", engine.global_steps, flush=True)
        time.sleep(0.05)
        if stop.should_stop():
            path = manager.save(engine.global_steps, {"model": engine}, {"note": "interrupted"})
            stop.exit_for_resume(engine.global_steps, path)
print("done", engine.global_steps, flush=True)
"""


def test_sigterm_saves_a_checkpoint_and_the_resume_command_continues(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    output_dir = tmp_path / "run"
    command = [sys.executable, str(script), "--output_dir", str(output_dir), "--max_steps", "100000"]
    env = step_env()  # without this process's own MASTER_PORT, which a test may have taken
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    for line in run.stdout:
        if line.strip() == "step 3":
            run.send_signal(signal.SIGTERM)
            break
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == EXIT_INTERRUPTED, stderr[-2000:]
    steps = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step ")]
    stopped_at = steps[-1] if steps else 3
    assert stopped_at <= 4  # the step under way when the signal came is finished, no more
    assert "received SIGTERM: stopping after this step" in stderr
    expected = shlex.join(command + ["--resume"])
    assert f"stopped on SIGTERM after step {stopped_at}; checkpoint saved to {output_dir / 'checkpoints' / f'step{stopped_at}'}" in stdout
    assert f"to continue: {expected}" in stdout
    assert (output_dir / "checkpoints" / "latest").read_text() == f"step{stopped_at}"

    resumed = subprocess.run(shlex.split(expected.replace("100000", str(stopped_at + 2))), capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"start {stopped_at} interrupted" in resumed.stdout
    assert f"done {stopped_at + 2}" in resumed.stdout


def test_first_signal_requests_a_stop_and_a_second_sigint_aborts():
    before = signal.getsignal(signal.SIGTERM)
    with GracefulInterrupt() as stop:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.should_stop() and stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM (launcher forwarding) changes nothing
        with pytest.raises(KeyboardInterrupt, match="second interrupt"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_watch_that_cannot_start_leaves_the_handlers_and_streams_as_they_were(monkeypatch):
    """A thread that cannot start (none left) raised out of GracefulInterrupt's entry with its signal handlers
    installed and, in the watch, sys.stdout guarded and the wake-up pipe open: none was ever put back."""
    import training.reliability.signals as signals

    def no_thread_left(self):
        raise RuntimeError("can't start new thread")

    read_end, write_end = os.pipe()
    stdout, before = sys.stdout, signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(threading.Thread, "start", no_thread_left)
    try:
        with open(write_end, "w", closefd=False) as piped:
            monkeypatch.setattr(sys, "stdout", piped)
            open_fds = len(os.listdir("/proc/self/fd"))
            with pytest.raises(RuntimeError, match="can't start new thread"):
                OutputReaderWatch(lambda: None, fds=(write_end,)).__enter__()
            assert sys.stdout is piped and len(os.listdir("/proc/self/fd")) == open_fds
    finally:
        os.close(read_end)
        os.close(write_end)
        monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(signals.OutputReaderWatch, "__enter__", no_thread_left)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        GracefulInterrupt().__enter__()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_with_stderr_closed_still_requests_the_stop(monkeypatch):
    """train.py, which reads the ranks' output, killed: the handler's message meets a closed pipe."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed_stderr = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stderr", closed_stderr)
    try:
        with GracefulInterrupt() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and stop.received == signal.SIGTERM
    finally:
        with contextlib.suppress(OSError):  # its unwritten message meets the closed pipe again
            closed_stderr.close()


def test_a_signal_in_the_middle_of_a_write_to_stderr_still_requests_the_stop(monkeypatch):
    """The handler runs between two bytecodes of whatever the rank was doing, a progress bar's write to stderr
    included: a print there re-entered stderr's buffer, whose RuntimeError ('reentrant call') left the handler
    before the stop request was noted, and ended the rank without its checkpoint."""
    read_end, write_end = os.pipe()
    handlers: list[GracefulInterrupt] = []

    class SignalledMidWrite(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            if handlers and not handlers[0].requested:
                handlers[0]._handle(signal.SIGTERM, None)  # as if the signal came while this write ran
            return os.write(write_end, bytes(data))

        def fileno(self) -> int:
            return write_end

    stderr = io.TextIOWrapper(io.BufferedWriter(SignalledMidWrite()), write_through=True)
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        with GracefulInterrupt() as stop:
            handlers.append(stop)
            print("step 3 of 10", file=sys.stderr, flush=True)
            assert stop.requested and stop.received == signal.SIGTERM
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as written:
        assert "received SIGTERM: stopping after this step" in written.read()
    take_received_signal()


@pytest.mark.parametrize("quiet", [False, True])
def test_only_the_output_watchs_own_sigterm_is_taken_as_the_output_unread(capfd, quiet):
    """The SIGTERM the output watch sends this process was said and noted as a SIGTERM someone sent ('received
    SIGTERM'), which train.py took for one. It is noted as `OUTPUT_UNREAD` and said as such (not at all by train.py's
    handler, `quiet_if_unread`); a SIGTERM that comes later is one."""
    with GracefulInterrupt(program="train.py", quiet_if_unread=quiet) as stop:
        GracefulInterrupt._output_reader_gone()  # what the watch calls once the reader has gone
        assert stop.received == OUTPUT_UNREAD
    assert take_received_signal() == OUTPUT_UNREAD
    said = capfd.readouterr().err
    unread = "train.py's output has no reader any more (the program it was piped into ended): stopping after this step"
    assert (unread in said, "SIGTERM" in said) == (not quiet, False)
    with GracefulInterrupt() as later:
        os.kill(os.getpid(), signal.SIGTERM)
        assert later.received == signal.SIGTERM
    assert take_received_signal() == signal.SIGTERM


def test_a_stop_request_an_enclosing_handler_took_stops_the_inner_one():
    """train.py's handler takes a stop request while a step it runs in this process starts up: the step's own
    handler, entered later, stops at its first step, rather than the step running to its end."""
    with GracefulInterrupt(on_receipt="ending before the next step") as pipeline:
        os.kill(os.getpid(), signal.SIGTERM)
        with GracefulInterrupt() as step:
            assert step.received == signal.SIGTERM
    assert pipeline.received == signal.SIGTERM
    with GracefulInterrupt() as later:
        assert not later.requested
    take_received_signal()


RANK_WRITING_AS_IT_TRAINS = """
import sys, time
from training.reliability.signals import GracefulInterrupt
with GracefulInterrupt() as stop:
    print("ready", flush=True)
    waited_until = time.monotonic() + 30
    while not stop.requested and time.monotonic() < waited_until:
        print("step", file=sys.stderr, flush=True)  # a progress bar
        time.sleep(0.02)
    print("saving", flush=True)
    open(sys.argv[1], "w").write(stop.received.name if stop.requested else "no stop request")
    stop.exit_for_resume(1, "checkpoints/step1")
"""


LATE_REDIRECT = """
import time
import training.reliability.signals as signals
redirect = signals.write_to_devnull
def late_redirect(fd):
    time.sleep(0.5)  # the watch's thread, woken, waits its turn while the rank writes on
    redirect(fd)
signals.write_to_devnull = late_redirect
"""


@pytest.mark.parametrize("redirect", ["watched", "late"])
def test_a_rank_whose_output_reader_has_gone_takes_it_as_a_stop_request_and_saves(tmp_path, redirect):
    """train.py killed (SIGKILL, the OOM killer) left the launcher's ranks writing to the pipe it had read: their next
    print raised BrokenPipeError and ended them with status 1 before their checkpoint (or, past it, in
    `exit_for_resume`'s message, with 1 or 120 rather than 3). Now they take it as a stop request: save, exit 3. Also
    where a write meets the pipe before the watch's thread has redirected it: that write raised BrokenPipeError."""
    saved = tmp_path / "saved"
    read_end, write_end = os.pipe()
    rank_code = (LATE_REDIRECT if redirect == "late" else "") + RANK_WRITING_AS_IT_TRAINS
    rank = subprocess.Popen([sys.executable, "-c", rank_code, str(saved)], stdout=write_end,
                            stderr=write_end, env=step_env())
    os.close(write_end)
    with os.fdopen(read_end) as output:
        while output.readline().strip() not in ("ready", ""):
            pass
    assert rank.wait(timeout=60) == EXIT_INTERRUPTED
    assert saved.read_text() == OUTPUT_UNREAD.name  # the watch's own SIGTERM is not taken as one someone sent


STEP_WAITING_FOR_A_STOP = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda signum, frame: open(sys.argv[1], "w").write("SIGTERM"))
print("ready", flush=True)
waited_until = time.monotonic() + 10
while not os.path.exists(sys.argv[1]) and time.monotonic() < waited_until:
    time.sleep(0.05)
sys.exit(3 if os.path.exists(sys.argv[1]) else 0)
"""

TRAIN_PY_LAUNCHING_A_STEP = """
import sys
from pathlib import Path
from training.pipeline.launch import StepStopped, run_subprocess
from training.reliability.signals import GracefulInterrupt
with GracefulInterrupt():
    try:
        run_subprocess([sys.executable, "-c", sys.argv[1], sys.argv[2]], Path(sys.argv[3]), "step 1")
        open(sys.argv[4], "w").write("ran to its end")
    except StepStopped:
        open(sys.argv[4], "w").write("stopped")
"""


@pytest.mark.parametrize("step, redirect", [("waiting", "watched"), ("writing", "late")])
def test_train_py_whose_output_reader_has_gone_stops_the_step_under_way(tmp_path, step, redirect):
    """train.py's own output left without a reader (`train.py | tee`, tee killed) was taken as a stop request by its
    handler alone: the launched step ran on to its end, unsaid (or, had a write of its output come first, failed on
    the pipe). It is now a stop request passed on to the step's processes, as a SIGTERM to train.py is. A copy of the
    step's output meeting the pipe before the watch redirected it ended train.py in a BrokenPipeError (status 1)."""
    got, outcome = tmp_path / "step_got", tmp_path / "outcome"
    read_end, write_end = os.pipe()
    train_py = (LATE_REDIRECT if redirect == "late" else "") + TRAIN_PY_LAUNCHING_A_STEP
    step_code = RANK_WRITING_AS_IT_TRAINS if step == "writing" else STEP_WAITING_FOR_A_STOP
    parent = subprocess.Popen([sys.executable, "-c", train_py, step_code, str(got),
                               str(tmp_path / "step1.log"), str(outcome)], stdout=write_end, stderr=write_end,
                              env=step_env())
    os.close(write_end)
    with os.fdopen(read_end) as output:
        while output.readline().strip() not in ("ready", ""):
            pass
    assert parent.wait(timeout=60) == 0
    assert (got.read_text(), outcome.read_text()) == ("SIGTERM", "stopped")


TRAIN_PY_RUNNING_A_STEP_IN_PROCESS = """
import sys
from pathlib import Path
from training.pipeline.launch import StepStopped, run_in_process
from training.reliability.signals import GracefulInterrupt

def step_main(argv):
    exec(sys.argv[2], {"__name__": "step"})  # the step, which saves to sys.argv[1]

with GracefulInterrupt(on_receipt="train.py ends before its next step", program="train.py", quiet_if_unread=True):
    try:
        run_in_process(step_main, [], Path(sys.argv[3]), "step 1")
        open(sys.argv[4], "w").write("ran to its end")
    except StepStopped:
        open(sys.argv[4], "w").write("stopped")
"""


def test_a_step_train_py_runs_in_process_saves_when_the_console_goes(tmp_path):
    """The cpu deployment's step, run in train.py's process, its output teed to the console (`train.py | tee`, tee
    killed): a write of the step's meeting the pipe before a watch had redirected it raised BrokenPipeError through
    the tee, and train.py ended on it, the step unsaved, rather than stopping it and exiting 3."""
    saved, outcome, log = tmp_path / "saved", tmp_path / "outcome", tmp_path / "step1.log"
    read_end, write_end = os.pipe()
    parent = subprocess.Popen([sys.executable, "-c", LATE_REDIRECT + TRAIN_PY_RUNNING_A_STEP_IN_PROCESS, str(saved),
                               RANK_WRITING_AS_IT_TRAINS, str(log), str(outcome)], stdout=write_end,
                              stderr=write_end, env=step_env())
    os.close(write_end)
    with os.fdopen(read_end) as output:
        while output.readline().strip() not in ("ready", ""):
            pass
    assert parent.wait(timeout=60) == 0
    assert (saved.read_text(), outcome.read_text()) == (OUTPUT_UNREAD.name, "stopped")
    # the tee's log still gets what the console missed, naming the cause as train.py's handler passed it on
    unread = "train.py's output has no reader any more (the program it was piped into ended)"
    assert f"stopped as {unread} after step 1" in log.read_text()


def test_a_write_meeting_a_watched_pipe_without_its_reader_is_taken_as_its_leaving(monkeypatch):
    read_end, write_end = os.pipe()
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    gone = []
    with OutputReaderWatch(lambda: gone.append(True), fds=[write_end]):
        os.close(read_end)
        for _ in range(100):
            print("step", flush=True)
    assert gone == [True]  # once, by the guard or the thread, which the block's end has joined
    assert sys.stdout is stdout
    assert os.path.samestat(os.fstat(write_end), os.stat(os.devnull))
    stdout.close()


def test_a_log_handler_made_before_the_watch_writes_where_prints_go_once_the_reader_has_gone(monkeypatch, capsys):
    """A log handler keeps the stream it was made with (`setup_logging`'s, DeepSpeed's, made before the step's
    watch): its record meeting the pipe before the watch's thread redirected it printed a '--- Logging error ---'
    BrokenPipeError traceback, each record until then, rather than being taken as the reader's leaving."""
    from training.reliability import signals

    redirect = signals.write_to_devnull
    monkeypatch.setattr(signals, "write_to_devnull", lambda fd: (time.sleep(0.3), redirect(fd)))  # the thread, late
    read_end, write_end = os.pipe()
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    handler = logging.StreamHandler(stdout)
    logger = logging.getLogger("test_signals.made_before_the_watch")
    logger.addHandler(handler)
    gone = []
    try:
        with OutputReaderWatch(lambda: gone.append(True), fds=[write_end]):
            os.close(read_end)
            for _ in range(20):
                logger.warning("step")
        assert handler.stream is stdout  # put back with the streams
    finally:
        logger.removeHandler(handler)
    assert gone == [True]
    assert "Logging error" not in capsys.readouterr().err
    stdout.close()


def test_a_guarded_stream_kept_past_the_watch_takes_nothing_for_it(monkeypatch):
    """A guard something kept (a log handler made inside the block) took a write meeting the pipe without its reader
    after the block as the watch would: `on_gone` called, a SIGTERM to the process with no handler left to take it."""
    read_end, write_end = os.pipe()
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    gone = []
    with OutputReaderWatch(lambda: gone.append(True), fds=[write_end]):
        kept = sys.stdout
    os.close(read_end)
    with pytest.raises(BrokenPipeError):
        print("after the block", file=kept, flush=True)
    assert gone == []
    os.close(write_end)
    with contextlib.suppress(OSError):  # its unwritten line meets the closed file descriptor
        stdout.close()


RANK_STARTING_UP = """
import time
from utils.errors import run_cli

@run_cli
def main():  # a step before its stop handler is in place (loading its model), printing as it goes
    print("ready", flush=True)
    waited_until = time.monotonic() + 30
    while time.monotonic() < waited_until:
        print("loading", flush=True)
        time.sleep(0.02)

main()
"""


def test_a_rank_whose_output_reader_goes_before_its_stop_handler_ends_quietly(tmp_path):
    """train.py killed while a rank started up (no GracefulInterrupt yet to watch the pipe) ended the rank's next
    print in a BrokenPipeError traceback and status 1: run_cli now ends it quietly with the shell's SIGPIPE status."""
    errors = tmp_path / "stderr"
    read_end, write_end = os.pipe()
    with errors.open("w") as stderr:
        rank = subprocess.Popen([sys.executable, "-c", RANK_STARTING_UP], stdout=write_end, stderr=stderr,
                                env=step_env())
    os.close(write_end)
    with os.fdopen(read_end) as output:
        output.readline()
    assert rank.wait(timeout=60) == EXIT_BROKEN_PIPE
    assert errors.read_text() == ""


RANK_REFUSING = """
from utils.errors import UserError, run_cli

@run_cli
def main():
    raise UserError("the data file has no 'chosen' column")

main()
"""


def test_a_user_error_said_on_a_stderr_without_its_reader_ends_quietly(tmp_path):
    """Printing a UserError's 'error: ...' line on a stderr whose reader had gone raised BrokenPipeError inside the
    `except UserError` block, out of reach of its sibling `except BrokenPipeError`: a traceback and status 1. It
    ends quietly with the shell's SIGPIPE status, as any other output without its reader does."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        rank = subprocess.run([sys.executable, "-c", RANK_REFUSING], stdout=subprocess.DEVNULL, stderr=write_end,
                              env=step_env(), timeout=60, check=False)
    finally:
        os.close(write_end)
    assert rank.returncode == EXIT_BROKEN_PIPE


def test_run_cli_raises_a_broken_pipe_of_another_cause():
    """Only stdout or stderr left without its reader ends the process quietly; a pipe or socket of its own raises."""
    @run_cli
    def main():
        raise BrokenPipeError("a socket of its own")

    with pytest.raises(BrokenPipeError, match="of its own"):
        main()


def test_a_broken_pipe_of_another_cause_is_raised(monkeypatch):
    """Only a watched pipe left without its reader is taken as the output's reader gone."""
    read_end, write_end = os.pipe()

    class BrokenOtherwise(io.StringIO):
        def fileno(self) -> int:
            return write_end

        def write(self, text: str) -> int:
            raise BrokenPipeError("a pipe inside the stream, not the output's")

    monkeypatch.setattr(sys, "stdout", BrokenOtherwise())
    gone = []
    try:
        with OutputReaderWatch(lambda: gone.append(True), fds=[write_end]), \
                pytest.raises(BrokenPipeError, match="not the output's"):
            print("step")
    finally:
        os.close(read_end)
        os.close(write_end)
    assert gone == []


def test_the_output_watch_does_nothing_where_the_output_is_a_file_or_a_terminal(tmp_path, monkeypatch):
    terminal, terminal_end = os.openpty()
    with open(tmp_path / "out", "w") as file:
        monkeypatch.setattr(sys, "stdout", file)
        with OutputReaderWatch(lambda: None, fds=[file.fileno(), terminal_end]):
            assert sys.stdout is file
            assert "output-reader-watch" not in [thread.name for thread in threading.enumerate()]
    os.close(terminal)
    os.close(terminal_end)


def _cpu_ticks(thread: threading.Thread) -> int:
    """The CPU time `thread` has spent, in clock ticks (user and system: /proc's stat fields 14 and 15)."""
    stat_fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(stat_fields[11]) + int(stat_fields[12])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads a thread's CPU time from /proc")
def test_the_output_watch_waits_without_spending_time():
    read_end, write_end = os.pipe()
    with OutputReaderWatch(lambda: None, fds=[write_end]):
        watch = next(thread for thread in threading.enumerate() if thread.name == "output-reader-watch")
        time.sleep(0.5)
        ticks = _cpu_ticks(watch)
    os.close(read_end)
    os.close(write_end)
    assert ticks <= 1  # the thread blocks in poll, it does not spin (spinning: about 50 ticks of 10 ms)


def test_the_output_watch_ends_with_its_block():
    read_end, write_end = os.pipe()
    with OutputReaderWatch(lambda: None, fds=[write_end]):
        assert "output-reader-watch" in [thread.name for thread in threading.enumerate()]
    assert "output-reader-watch" not in [thread.name for thread in threading.enumerate()]
    os.close(read_end)
    os.close(write_end)


def test_exit_for_resume_prints_the_command_and_exits_with_the_documented_code(capsys):
    stop = GracefulInterrupt()
    stop.received = signal.SIGINT
    with pytest.raises(SystemExit) as exited:
        stop.exit_for_resume(7, "/runs/a/checkpoints/step7", argv=["python", "train.py", "--output_dir", "/runs/a"])
    assert exited.value.code == EXIT_INTERRUPTED
    out = capsys.readouterr().out
    assert "stopped on SIGINT after step 7; checkpoint saved to /runs/a/checkpoints/step7" in out
    assert "to continue: python train.py --output_dir /runs/a --resume" in out


def test_resume_command_drops_the_launcher_rank_and_adds_resume_once():
    assert resume_command(["step1_sft/main.py", "--local_rank=1", "--lr", "1e-3"]) == "step1_sft/main.py --lr 1e-3 --resume"
    assert resume_command(["main.py", "--local_rank", "0", "--resume", "--data", "a b"]) == "main.py --resume --data 'a b'"


STEP_THAT_SIGNALS_TRAIN_PY = """
import os, signal, sys, time
seen = []
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda number, frame: seen.append(signal.Signals(number).name))
for count in (1, 2):
    os.kill(os.getppid(), signal.SIGINT)  # `kill -INT` to train.py alone
    waited_until = time.monotonic() + 5
    while len(seen) < count and time.monotonic() < waited_until:
        time.sleep(0.01)
print("the step's processes got", seen, flush=True)
sys.exit(3)
"""


def test_a_sigint_to_train_py_alone_reaches_the_launched_step_as_a_stop_request_and_a_second_as_an_abort(tmp_path):
    """`kill -INT` to train.py (not to its process group, as a terminal's Ctrl-C) was not passed on to the launched
    step: train.py waited for the step to run to its end. The first is passed on as a SIGTERM, a stop request that
    the SIGINT a Ctrl-C gives the ranks as well does not turn into an abort; a second as a SIGINT, an abort."""
    from training.pipeline.launch import StepStopped, run_subprocess
    from training.reliability.signals import take_received_signal

    log = tmp_path / "step1.log"
    take_received_signal()  # one an earlier test took in this process
    with pytest.raises(StepStopped):
        run_subprocess([sys.executable, "-c", STEP_THAT_SIGNALS_TRAIN_PY], log, "step 1")
    assert take_received_signal() == signal.SIGINT
    assert "the step's processes got ['SIGTERM', 'SIGINT']" in log.read_text()


def test_a_stop_request_arriving_as_the_launcher_starts_is_passed_on_to_it(tmp_path, monkeypatch):
    """The stop-request handler was installed only once the launcher had started: a SIGTERM in between reached the
    handler before it (train.py's default: death, the launcher left running unwatched; here a test's handler), and the
    step ran to its end as if none had come. A stop request taken while the launcher starts now reaches it."""
    from training.pipeline import launch
    from training.reliability.signals import handling_signals, take_received_signal

    started = launch.subprocess.Popen

    def signalled_as_it_starts(*args, **kwargs):
        process = started(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return process

    monkeypatch.setattr(launch.subprocess, "Popen", signalled_as_it_starts)
    unseen = []
    take_received_signal()
    with handling_signals((signal.SIGTERM,), lambda signum, frame: unseen.append(signum)), \
            pytest.raises(launch.StepStopped):
        launch.run_subprocess([sys.executable, "-c", "import time; time.sleep(10)"], tmp_path / "step1.log", "step 1")
    assert take_received_signal() == signal.SIGTERM
    assert unseen == []

SIGNALLED_AT_SUMMARY = """
import json, os, signal, sys
import training.reliability.run_records as records

write = records._write_record

def signalled_write(run_dir, name, values):
    if name == records.SUMMARY_FILE:
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's stop arrives just as the run ends
    write(run_dir, name, values)

records._write_record = signalled_write
step, argv = sys.argv[1], json.loads(sys.argv[2])
if step == "step1":
    from step1_sft.main import main
else:
    from step3_rlhf.main import main
main(argv)
"""


@pytest.mark.slow
@pytest.mark.parametrize("step", ["step1", "step3"])
def test_a_signal_while_the_summary_is_written_lets_the_run_end_finished(tmp_path, tmp_path_factory, step):
    """Past the final export the run promises to finish, but the summary (which marks the run finished) was written
    after the signal guard (and the run lock) had been left: the default handler killed the run there, its models
    written and no summary.json, so train.py took the step for unfinished."""
    output_dir = tmp_path / "run"
    if step == "step1":
        argv = ["--model_name_or_path", make_tiny_model_dir(tmp_path / "model", "llama"),
                "--data_path", write_arithmetic_jsonl(tmp_path / "d.jsonl", 16), "--data_split", "1,1,0",
                "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(output_dir),
                "--per_device_train_batch_size", "4", "--dtype", "fp32", "--max_seq_len", "64", "--max_steps", "1"]
    else:
        argv = step3_argv(make_step3_inputs(tmp_path_factory), output_dir, "--max_steps", "1")
    env = {**step_env(), "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{step_env()['PYTHONPATH']}"}
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AT_SUMMARY, step, json.dumps(argv)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "received SIGTERM: finishing the final model" in done.stderr
    assert (output_dir / "summary.json").is_file()


def test_the_signal_handling_loads_without_the_checkpointings_libraries():
    """A launcher's parent process and each rank's stop handling import light modules of packages whose other modules
    need transformers and DeepSpeed (seconds of every such start-up); the packages' __init__ files import none of
    their modules, so importing one loads only what it needs."""
    light = ("training.reliability.signals", "training.reliability.run_lock", "training.loops.metrics",
             "training.algorithms")
    script = f"import sys, {', '.join(light)}; print(sorted({{'transformers', 'deepspeed'}} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=step_env(),
                            cwd=TESTS_DIR.parent, timeout=120, check=False)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["[]"], loaded.stdout
