import json

from training.loops.metrics import MetricsLogger, read_metrics
from training.reliability.run_records import save_run_args


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"train/loss": 2.5, "train/lr": 1e-3})
    logger.log(2, {"train/loss": float("nan")})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] == 2.5
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_run_args_are_recorded(tmp_path):
    import argparse

    save_run_args(tmp_path, argparse.Namespace(zero_stage=3, data_path=["embedded"]))
    assert json.loads((tmp_path / "args.json").read_text()) == {"zero_stage": 3, "data_path": ["embedded"]}


def test_a_fresh_run_starts_the_file_empty_and_a_resumed_one_drops_what_follows_its_checkpoint(tmp_path):
    earlier = MetricsLogger(tmp_path, enable_tensorboard=False)
    for step in range(5):
        earlier.log(step, {"loss": float(step)})
    resumed = MetricsLogger(tmp_path, enable_tensorboard=False)
    resumed.rewind(2)  # checkpoint after step 2: steps 3 and 4 will be logged again
    resumed.log(3, {"loss": 30.0})
    assert [(row["step"], row["loss"]) for row in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    fresh = MetricsLogger(tmp_path, enable_tensorboard=False)
    fresh.rewind(None)
    fresh.log(0, {"loss": 7.0})
    assert [(row["step"], row["loss"]) for row in read_metrics(tmp_path)] == [(0, 7.0)]


def test_a_line_cut_short_by_a_kill_is_dropped_on_resume_and_when_read(tmp_path):
    """A run killed while appending a line leaves it partial: the resumed run's rewind drops it (it used to
    crash every later resume) and the readers skip it."""
    killed = MetricsLogger(tmp_path, enable_tensorboard=False)
    for step in range(3):
        killed.log(step, {"loss": float(step)})
    with killed.path.open("a") as handle:
        handle.write('{"step": 3, "time": 17000.1, "lo')
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2]
    resumed = MetricsLogger(tmp_path, enable_tensorboard=False)
    resumed.rewind(2)
    resumed.log(3, {"loss": 30.0})
    assert [(row["step"], row["loss"]) for row in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
