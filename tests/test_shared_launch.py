"""`shared_launch.built_once` and `launched_once`: one build or launch per test run, whose result every caller
reads."""
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from shared_launch import built_once, launched_once


def fixture_request(basetemp, worker: str | None) -> SimpleNamespace:
    """A stand-in for a test's `request` in a pytest process whose basetemp is `basetemp`: a pytest-xdist worker's
    (its config's workerinput naming `worker`), or a serial run's (None)."""
    config = SimpleNamespace() if worker is None else SimpleNamespace(workerinput={"workerid": worker})
    tmp_path_factory = SimpleNamespace(getbasetemp=lambda: basetemp)
    return SimpleNamespace(config=config, getfixturevalue={"tmp_path_factory": tmp_path_factory}.__getitem__)


def test_a_launch_runs_once_per_run_and_one_that_raised_runs_again(tmp_path):
    """Callers in pytest-xdist workers share the run's folder, above each worker's own."""
    worker_temp = tmp_path / "gw1"
    worker_temp.mkdir()
    request = fixture_request(worker_temp, "gw1")
    folders = []

    def launch(folder):
        folders.append(folder)
        if len(folders) == 1:
            raise subprocess.TimeoutExpired("worker", 1)
        return subprocess.CompletedProcess(["worker", folder], 3, stdout="out", stderr="err")

    with pytest.raises(subprocess.TimeoutExpired):
        launched_once(request, "shared", launch)
    first, again = (launched_once(request, "shared", launch) for _ in range(2))
    assert len(folders) == 2 and folders[0] != folders[1] and all(folder.is_dir() for folder in folders)
    assert folders[1].parent == tmp_path
    for result in (first, again):
        assert (result.args, result.returncode, result.stdout, result.stderr) == (["worker", folders[1]], 3, "out", "err")


def test_a_serial_run_started_from_a_workers_test_keeps_its_launch_in_its_own_folder(tmp_path, monkeypatch):
    """A pytest started by a test on a worker inherits PYTEST_XDIST_WORKER; as a serial run it keeps its record in
    its own basetemp, not in the folder above, which holds every run's and outlives them: a later run read an
    earlier one's result from there."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    results = []
    for run in ("first", "second"):
        basetemp = tmp_path / f"pytest-{run}"
        basetemp.mkdir()
        results.append(launched_once(fixture_request(basetemp, None), "shared",
                                     lambda folder, run=run: subprocess.CompletedProcess([run], 0, "", "")))
    assert [result.args for result in results] == [["first"], ["second"]]
    assert not list(tmp_path.glob("*.pickle"))


def test_a_build_is_made_once_and_each_caller_gets_its_result_as_built(tmp_path):
    """A module-scoped fixture's in-process build (a training run's folder and summary): one build for the run's
    workers, and for a worker that asks again, each caller getting the build's objects, not their text."""
    builds = []

    def build(folder: Path) -> tuple[Path, dict]:
        builds.append(folder)
        return folder / "run", {"steps": (1, 2), "loss": 0.1 + 0.2}

    results = []
    for worker in ("gw0", "gw1", "gw0"):
        worker_temp = tmp_path / worker
        worker_temp.mkdir(exist_ok=True)
        results.append(built_once(fixture_request(worker_temp, worker), "trained", build))
    assert len(builds) == 1 and builds[0].parent == tmp_path
    assert results == [(builds[0] / "run", {"steps": (1, 2), "loss": 0.1 + 0.2})] * 3
