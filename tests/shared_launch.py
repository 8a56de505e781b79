"""A launch or a build whose output several tests read, made once per test run. A module-scoped fixture alone would
make it once in each pytest-xdist worker that runs one of its tests; here the first process to ask makes it and the
others wait for it and read its saved result."""
import pickle
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

from utils.atomic import atomic_write_bytes

Built = TypeVar("Built")


def built_once(request: pytest.FixtureRequest, name: str, build: Callable[[Path], Built]) -> Built:
    """`build(folder)`'s result (picklable), `folder` a new directory: built by this test run's first caller of `name`,
    read back (a copy) by the others. A build that raised is run again by the next caller, in a folder of its own.
    Its users share `folder`: they read it, and write only what its builder writes safely beside another (a locked
    data cache), their own runs going to their own `tmp_path`."""
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if hasattr(request.config, "workerinput"):
        # the run's folder, which holds each worker's own. Asked of this process's config, not of
        # PYTEST_XDIST_WORKER, which a pytest started from a worker's test inherits: its record would land in the
        # folder that holds every run's and be read back by later runs.
        root = root.parent
    record = root / f"{name}.pickle"
    with FileLock(f"{record}.lock"):
        if not record.is_file():
            atomic_write_bytes(record, pickle.dumps(build(Path(tempfile.mkdtemp(prefix=name, dir=root)))))
    return pickle.loads(record.read_bytes())


def launched_once(request: pytest.FixtureRequest, name: str,
                  launch: Callable[[Path], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """`built_once` for a launch: `launch(folder)`'s finished process."""
    return built_once(request, name, launch)
