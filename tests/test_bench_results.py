"""Every committed benchmark result says where, with what and how it was measured: a figure without its device,
library versions and command cannot be checked or reproduced."""
import json
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


def _commands(report: dict) -> list:
    """The command that wrote the file, or each command of a GPU session's calls."""
    if "command" in report:
        return [report["command"]]
    return [call.get("command") for call in report.get("calls", [])] or [None]


def test_there_are_results_to_check():
    assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=[path.name for path in RESULTS])
def test_a_result_names_its_device_versions_and_command(path):
    report = json.loads(path.read_text())
    assert report.get("device"), "no device"
    versions = report.get("versions", {})
    assert all(versions.get(name) for name in ("torch", "transformers", "deepspeed")), f"versions missing: {versions}"
    assert all(isinstance(command, str) and command.strip() for command in _commands(report)), "no command"
