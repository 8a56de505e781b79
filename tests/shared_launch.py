"""A launch whose output several tests read, started once per test run. A module-scoped fixture alone would start
it once in each pytest-xdist worker that runs one of its tests; here the first worker to ask starts it and the
others wait for it and read its saved result."""
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def launched_once(request: pytest.FixtureRequest, name: str,
                  launch: Callable[[Path], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """`launch(folder)`'s result, `folder` a new directory: run by this test run's first caller of `name`, read back
    by the others. A launch that raised (a timeout) is run again by the next caller, in a folder of its own."""
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if hasattr(request.config, "workerinput"):
        # the run's folder, which holds each worker's own. Asked of this process's config, not of
        # PYTEST_XDIST_WORKER, which a pytest started from a worker's test inherits: its record would land in the
        # folder that holds every run's and be read back by later runs.
        root = root.parent
    record = root / f"{name}.json"
    with FileLock(f"{record}.lock"):
        if not record.is_file():
            result = launch(Path(tempfile.mkdtemp(prefix=name, dir=root)))
            record.write_text(json.dumps({"args": [str(arg) for arg in result.args], "returncode": result.returncode,
                                          "stdout": result.stdout, "stderr": result.stderr}))
    return subprocess.CompletedProcess(**json.loads(record.read_text()))
