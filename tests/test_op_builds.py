"""A build of a compiled op that waits on a lock an interrupted build left is said, with the way out
(`utils/op_builds.py`)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

from conftest import REPO_ROOT

from utils.op_builds import build_locks, watching_build_locks

LOGGER = "utils.op_builds"


def stale_lock(root, op: str = "fused_adam"):
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    return lock


def ours(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == LOGGER]


def test_a_wait_past_the_threshold_names_the_lock_and_the_way_out(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = stale_lock(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER), watching_build_locks(after_s=0.05):
        deadline = time.monotonic() + 30  # the warning's first look imports torch's extension module
        while not ours(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
    (record,) = ours(caplog)
    assert str(lock) in record.message and "delete its folder" in record.message


def test_no_word_without_a_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with watching_build_locks(after_s=0.05):
            time.sleep(0.3)
        time.sleep(2)  # a look that began inside has ended
    assert not ours(caplog)


def test_no_word_before_the_threshold(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale_lock(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with watching_build_locks(after_s=1):
            pass
        time.sleep(1.5)
    assert not ours(caplog)


def test_locks_are_found_with_and_without_torch_extensions_dir_layouts(tmp_path):
    plain, nested = stale_lock(tmp_path, "fused_adam"), stale_lock(tmp_path / "py312_cu130", "cpu_adam")
    assert build_locks(tmp_path) == sorted([plain, nested])


def test_a_process_whose_communication_op_build_is_locked_says_so(tmp_path):
    """The hang users meet: DeepSpeed's CPU communication op compiles at the first `init_distributed`, and a lock
    that a stopped build left makes torch wait without end and without a word. Here the process says which lock."""
    stale_lock(tmp_path, "deepspeed_shm_comm")
    code = ("import logging; logging.basicConfig(level=logging.WARNING); import utils.op_builds as builds; "
            "builds.STALE_LOCK_WARNING_S = 1.0; from utils.dist import init_distributed; init_distributed()")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    env = {key: value for key, value in env.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any("for an op build's lock" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.kill()
    process.wait()
    reader.join(timeout=10)
    warned = [line for line in lines if "for an op build's lock" in line]
    assert warned and "deepspeed_shm_comm/lock" in warned[0], "".join(lines)[-3000:]
