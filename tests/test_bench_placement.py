"""bench/placement.py's settings: what it refuses before any rank starts."""
import json
import sys

import pytest

from bench import placement


def test_one_step_is_refused_the_warm_up_would_be_the_measured_step(monkeypatch, tmp_path, capsys):
    """With --steps 1 the median step time was the first step's, warm-up included, set beside a prediction of a
    steady step."""
    monkeypatch.setattr(sys, "argv", ["placement.py", "--steps", "1", "--actor", str(tmp_path / "no_actor"),
                                      "--critic", str(tmp_path / "no_critic")])
    with pytest.raises(SystemExit) as stopped:
        placement.main()
    assert stopped.value.code == 2
    assert "--steps must be at least 2" in capsys.readouterr().err


def test_the_published_bench_names_its_device_and_versions_as_every_bench_does(tmp_path, monkeypatch):
    """placement_published.json recorded torch's and deepspeed's versions at its top level and no device or
    transformers version, unlike every other bench's report."""
    from bench import placement_published

    monkeypatch.setattr(placement_published, "predict_published", lambda presets: [])
    placement_published.main(["--output", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device"] and report["cpu_threads"] >= 1
    assert set(report["versions"]) == {"torch", "transformers", "deepspeed"} and all(report["versions"].values())
