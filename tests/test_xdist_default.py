"""The default test run on pytest-xdist workers (tests/conftest.py's `pytest_cmdline_main`), and the ways to a serial
one."""
import os
import subprocess
import sys

import pytest
from conftest import TESTS_DIR, default_xdist_workers

# four tests, each writing the worker it ran on (PYTEST_XDIST_WORKER; "serial" without one)
TESTS = """
import os
import pytest

@pytest.mark.parametrize("index", range(4))
def test_on(index):
    with open(os.environ["RAN_ON"], "a") as ran_on:
        ran_on.write(os.environ.get("PYTEST_XDIST_WORKER", "serial") + "\\n")
"""


def run_pytest(folder, *args: str, typed: str = "") -> tuple[str, list[str]]:
    """pytest on `folder`'s tests with this suite's conftest as a plugin (the folder lies outside tests/), `typed`
    its standard input (a debugger's commands); returns its output and the worker each test ran on."""
    (folder / "test_on.py").write_text(TESTS)
    (folder / "pytest.ini").write_text("[pytest]\n")
    ran_on = folder / "ran_on.txt"
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "RAN_ON": str(ran_on)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own worker, where it runs on one
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", *args,
                             str(folder)], cwd=folder, env=env, input=typed, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, ran_on.read_text().split()


@pytest.mark.skipif(default_xdist_workers() == 0, reason="this process may use fewer than 2 CPUs")
def test_a_run_without_n_runs_on_two_workers(tmp_path):
    output, workers = run_pytest(tmp_path)
    assert "created: 2/2 workers" in output
    assert len(workers) == 4 and set(workers) <= {"gw0", "gw1"}, workers


def test_a_run_given_its_worker_count_keeps_it(tmp_path):
    output, workers = run_pytest(tmp_path, "-n", "3")
    assert "created: 3/3 workers" in output
    assert len(workers) == 4 and set(workers) <= {"gw0", "gw1", "gw2"}, workers


@pytest.mark.parametrize("serial", [("-n", "0"), ("-p", "no:xdist")], ids=" ".join)
def test_a_run_told_so_runs_serially(tmp_path, serial):
    output, workers = run_pytest(tmp_path, *serial)
    assert "workers" not in output and workers == ["serial"] * 4


@pytest.mark.parametrize("terminal", [("-s",), ("--capture=no",), ("--trace",)], ids=" ".join)
def test_a_run_that_needs_the_terminal_runs_serially(tmp_path, terminal):
    """On a worker a test's print would not be shown and `--trace` would not stop (as `--pdb` would not)."""
    output, workers = run_pytest(tmp_path, *terminal, typed="continue\n" * 4)
    assert "workers" not in output and workers == ["serial"] * 4
    if "--trace" in terminal:
        assert output.count("(Pdb)") >= 4


@pytest.mark.parametrize("cpus, workers", [({0}, 0), ({0, 1}, 2), (set(range(64)), 2)])
def test_the_default_worker_count_is_two_at_most_and_none_on_one_cpu(monkeypatch, cpus, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus, raising=False)
    assert default_xdist_workers() == workers
