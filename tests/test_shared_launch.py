"""`shared_launch.launched_once`: one launch per test run, whose result every caller reads."""
import subprocess
from types import SimpleNamespace

import pytest
from shared_launch import launched_once


def test_a_launch_runs_once_per_run_and_one_that_raised_runs_again(tmp_path, monkeypatch):
    """Callers in pytest-xdist workers (PYTEST_XDIST_WORKER) share the run's folder, above each worker's own."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    worker_temp = tmp_path / "gw1"
    worker_temp.mkdir()
    tmp_path_factory = SimpleNamespace(getbasetemp=lambda: worker_temp)
    folders = []

    def launch(folder):
        folders.append(folder)
        if len(folders) == 1:
            raise subprocess.TimeoutExpired("worker", 1)
        return subprocess.CompletedProcess(["worker", folder], 3, stdout="out", stderr="err")

    with pytest.raises(subprocess.TimeoutExpired):
        launched_once(tmp_path_factory, "shared", launch)
    first, again = (launched_once(tmp_path_factory, "shared", launch) for _ in range(2))
    assert len(folders) == 2 and folders[0] != folders[1] and all(folder.is_dir() for folder in folders)
    assert folders[1].parent == tmp_path
    for result in (first, again):
        assert (result.args, result.returncode, result.stdout, result.stderr) == \
            (["worker", str(folders[1])], 3, "out", "err")
