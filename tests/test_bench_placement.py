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


def _stand_in_measure(args, placement: str) -> dict:
    return {"measured_step_s": 2.0 if placement == "colocate" else 3.0, "measured_peak_gb": 1.0}


def _stand_in_predictions(args) -> tuple[dict, list[str], str]:
    predicted = {placement: {"predicted_step_s": 2.5, "predicted_peak_gb": 1.1} for placement in placement.PLACEMENTS}
    return predicted, list(placement.PLACEMENTS), "this cpu"


def test_the_report_holds_each_placements_row_once_and_is_returned(monkeypatch, tmp_path, capsys):
    """The rows went into the report twice, as `results` and again as `measured`; and `main` returned nothing where
    every other bench returns its report."""
    monkeypatch.setattr(placement, "measure", _stand_in_measure)
    monkeypatch.setattr(placement, "predictions", _stand_in_predictions)
    output = tmp_path / "placement.json"
    report = placement.main(["--actor", str(tmp_path), "--critic", str(tmp_path), "--output", str(output)])
    assert report == json.loads(output.read_text())
    assert [row["placement"] for row in report["results"]] == list(placement.PLACEMENTS)
    assert "measured" not in report and report["measured_fastest"] == "colocate"
    assert capsys.readouterr().out.count("\ncolocate | ") == 1


def test_a_missing_model_folder_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        placement.main(["--actor", str(tmp_path / "no_actor"), "--critic", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'no_actor'} is missing: run `python train.py`")


def test_the_published_bench_names_its_device_and_versions_as_every_bench_does(tmp_path, monkeypatch):
    """placement_published.json recorded torch's and deepspeed's versions at its top level and no device or
    transformers version, unlike every other bench's report."""
    from bench import placement_published

    monkeypatch.setattr(placement_published, "predict_published", lambda presets: [])
    placement_published.main(["--output", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device"] and report["cpu_threads"] >= 1
    assert set(report["versions"]) == {"torch", "transformers", "deepspeed"} and all(report["versions"].values())
