"""One run per output folder: a second run is refused with a clear message; a killed holder frees the folder."""
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
from conftest import REPO_ROOT

from training.reliability.run_lock import LOCK_FILE, OWNER_FILE, RunLock
from utils.errors import UserError

HOLDER = """
import sys, time
from training.reliability.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()  # keep a reference: a collected lock is released
print("locked", flush=True)
time.sleep(120)
"""


def start_holder(output_dir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_run_is_refused_until_the_holder_is_killed(tmp_path):
    output_dir = tmp_path / "run"
    holder = start_holder(output_dir)
    try:
        with pytest.raises(UserError) as refused:
            RunLock(output_dir).acquire()
        message = str(refused.value)
        assert f"output dir {output_dir} is in use by another run (pid {holder.pid} on " in message
        assert "started 20" in message and "wait for it to finish or choose another --output_dir" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    # the kernel dropped the dead holder's lock: the next run gets the folder and records itself
    with RunLock(output_dir):
        assert f'"pid": {os.getpid()}' in (output_dir / OWNER_FILE).read_text()
    assert not (output_dir / OWNER_FILE).exists()


def test_lock_is_exclusive_within_one_process_and_reusable_after_release(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(UserError, match=f"pid {os.getpid()} on "):
        RunLock(tmp_path).acquire()
    first.release()
    with RunLock(tmp_path):
        pass


def test_the_lock_holder_removes_what_a_dead_run_left_staged_and_a_refused_run_removes_nothing(tmp_path):
    """A run killed inside its final save left a hidden staging folder the size of the model in the run folder,
    and no later run (nor a resume) ever removed it."""
    holder = RunLock(tmp_path).acquire()
    staged = [tmp_path / ".model.tmp-2de98602", tmp_path / ".actor.tmp-old-1a2b3c4d"]
    for folder in staged:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / ".metrics.jsonl.tmp-0a0a0a0a").write_text("{}")
    (tmp_path / "model").mkdir()
    with pytest.raises(UserError, match="in use by another run"):
        RunLock(tmp_path).acquire()
    assert all(folder.is_dir() for folder in staged)  # the live holder's saves in progress stay
    holder.release()
    with RunLock(tmp_path):
        assert sorted(path.name for path in tmp_path.iterdir()) == [".run.lock", OWNER_FILE, "model"]


def test_a_look_at_the_lock_names_a_live_holder_alone_and_creates_nothing(tmp_path):
    """A dry run of train.py takes no lock, but says where another run holds its folder now."""
    output_dir = tmp_path / "run"
    assert RunLock(output_dir).holder_now() is None and not output_dir.exists()
    holder = start_holder(output_dir)
    try:
        assert RunLock(output_dir).holder_now().startswith(f"pid {holder.pid} on ")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert RunLock(output_dir).holder_now() is None  # its owner file stays, but the kernel dropped its lock
    assert (output_dir / OWNER_FILE).exists()
    with pytest.raises(UserError, match="choose another --output-dir$"), RunLock(output_dir):
        RunLock(output_dir, flag="--output-dir").acquire()


def test_a_run_taking_the_lock_while_a_dry_run_looks_at_it_is_not_refused(tmp_path):
    """A dry run looks at the lock by taking it for an instant (`holder_now`: a look that takes nothing cannot see an
    flock on Linux); a run taking the lock at that instant was refused, 'in use by another run (pid unknown)'. The
    look is held here for 0.2 s by another descriptor, as a look on a loaded machine might be."""
    RunLock(tmp_path).acquire().release()  # the lock file a look finds
    look = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    fcntl.flock(look, fcntl.LOCK_EX | fcntl.LOCK_NB)
    looked = threading.Timer(0.2, os.close, [look])  # closing it drops the flock
    looked.start()
    try:
        with RunLock(tmp_path):
            assert f'"pid": {os.getpid()}' in (tmp_path / OWNER_FILE).read_text()
    finally:
        looked.join()



class HolderTidiesUpWhileWaitedOn(logging.Handler):
    """Run A's end as a run refused while planning (runner's tidy-up: its lock files, then the folders it made, then
    the lock) at the moment filelock logs that run B's attempt found the lock held and B waits."""

    def __init__(self, holder: RunLock, made_by_holder):
        super().__init__(logging.DEBUG)
        self.holder, self.made_by_holder = holder, made_by_holder
        self.tidied_up = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.tidied_up or "not acquired" not in record.getMessage():
            return
        self.tidied_up = True
        assert self.holder.remove_files_if_alone()
        for folder in (self.holder.output_dir, *self.holder.output_dir.parents):
            folder.rmdir()
            if folder == self.made_by_holder:
                break
        self.holder.release()


def test_a_run_that_removed_its_lock_files_leaves_the_next_holders_alone_when_it_releases(tmp_path):
    """A run that removed its lock files (`remove_files_if_alone`) then released its lock, which unlinked the owner
    file again: a run that had taken the folder in between lost its owner file, and a third run was told the lock's
    holder is 'pid unknown'."""
    output_dir = tmp_path / "out"
    first = RunLock(output_dir).acquire()
    assert first.remove_files_if_alone()
    with RunLock(output_dir):
        first.release()
        assert (output_dir / OWNER_FILE).is_file()
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            RunLock(output_dir).acquire()


def test_a_run_waiting_for_the_lock_takes_it_where_the_holder_removes_the_folder_it_made(tmp_path):
    """Run B waits for the lock while run A, refused while planning, removes its lock files and the folders it made:
    B makes the folder again and takes the lock, where it died on FileNotFoundError naming .run.lock; a third run is
    then refused, B's lock being the one at the path."""
    made_by_a = tmp_path / "new"
    output_dir = made_by_a / "out"
    tidy_up = HolderTidiesUpWhileWaitedOn(RunLock(output_dir).acquire(), made_by_a)
    filelock_logger = logging.getLogger("filelock")
    level = filelock_logger.level
    filelock_logger.addHandler(tidy_up)
    filelock_logger.setLevel(logging.DEBUG)
    try:
        with RunLock(output_dir):
            assert tidy_up.tidied_up, "run A was not waited on"
            assert (output_dir / LOCK_FILE).is_file() and (output_dir / OWNER_FILE).is_file()
            with pytest.raises(UserError, match="is in use by another run"):
                RunLock(output_dir).acquire()
    finally:
        filelock_logger.removeHandler(tidy_up)
        filelock_logger.setLevel(level)
