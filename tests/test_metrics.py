import json
import logging
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from training.loops.call_times import CALL_TIMES_FILE
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


def tensorboard_points(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Each tag's (step, value) points as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def jsonl_points(run_dir) -> dict[str, list[tuple[int, float]]]:
    points = {}
    for row in read_metrics(run_dir):
        for tag, value in row.items():
            if tag not in ("step", "time"):
                points.setdefault(tag, []).append((row["step"], value))
    return points


# (what the crashed run logged, the checkpoint it left: step and lines, or None, what the next run logs)
TRAIN, EVAL = "reward/score_mean", "eval/score_mean"
CRASHED_RUNS = {
    "resumed mid-run": ([(step, TRAIN) for step in range(1, 6)], (3, 3), [(step, TRAIN) for step in (4, 5, 6)]),
    "restarted": ([(step, TRAIN) for step in range(1, 6)], None, [(1, TRAIN), (2, TRAIN)]),
    "resumed after the last evaluation": ([(1, TRAIN), (2, TRAIN), (2, EVAL)], (2, 2), [(2, EVAL)]),
}


@pytest.mark.parametrize("case", CRASHED_RUNS)
def test_tensorboard_shows_what_metrics_jsonl_keeps_after_a_resume_or_a_restart(tmp_path, case):
    """The event files were appended to: after a resume from the checkpoint of step 3, TensorBoard read steps 4 and
    5 twice (the crashed run's and the resumed run's); after a restart without a checkpoint, the earlier run's steps
    beside the new ones; and a last evaluation logged after the checkpoint of its step, which the resumed run logs
    again, twice. TensorBoard now reads each tag's points as metrics.jsonl holds them: the crashed run's up to the
    checkpoint, then the new run's."""
    crashed, checkpoint, logged_next = CRASHED_RUNS[case]
    first = MetricsLogger(tmp_path)
    first.rewind(None)
    for step, tag in crashed:
        first.log(step, {tag: float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened in, and read in that order
    second = MetricsLogger(tmp_path)
    second.rewind(*checkpoint) if checkpoint else second.rewind(None)
    for step, tag in logged_next:
        second.log(step, {tag: 100.0 + step})
    second.close()
    kept = crashed[:checkpoint[1]] if checkpoint else []
    expected = {}
    for step, tag, value in [(step, tag, float(step)) for step, tag in kept] + \
            [(step, tag, 100.0 + step) for step, tag in logged_next]:
        expected.setdefault(tag, []).append((step, value))
    assert jsonl_points(tmp_path) == expected
    assert tensorboard_points(tmp_path) == expected


def test_a_resume_finding_fewer_lines_than_its_checkpoint_recorded_says_so(tmp_path, caplog):
    """The lines a checkpoint counted can be lost where the machine went down before they reached the disk: the
    resumed run kept what was there without a word."""
    earlier = MetricsLogger(tmp_path, enable_tensorboard=False)
    for step in range(1, 4):
        earlier.log(step, {"loss": float(step)})
    lines = earlier.path.read_text().splitlines(keepends=True)
    earlier.path.write_text("".join(lines[:2]))
    resumed = MetricsLogger(tmp_path, enable_tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="training.loops.metrics"):
        resumed.rewind(3, 3)
    assert resumed.lines_written == 2
    assert "metrics.jsonl holds 2 lines up to step 3 where the checkpoint recorded 3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.loops.metrics"):
        MetricsLogger(tmp_path, enable_tensorboard=False).rewind(3, 2)
    assert not caplog.text


def ppo_run(run_dir, checkpoints, call_timer=None):
    """A step-3 loop around stand-ins: no models, a checkpoint manager of the test's."""
    from step3_rlhf.run_loop import PPORun

    args = SimpleNamespace(run=SimpleNamespace(output_dir=str(run_dir)), checkpoints=SimpleNamespace(resume=True))
    stream = SimpleNamespace(load_state_dict=lambda state: None, state_dict=dict)
    trainer = SimpleNamespace(load_state_dict=lambda state, rank_state: None, state_dict=dict, rank_state=dict)
    return PPORun(args, SimpleNamespace(actor=None, critic=None), trainer, stream, None, None, total_steps=6,
                  checkpoints=checkpoints, metrics=MetricsLogger(run_dir, enable_tensorboard=False),
                  call_timer=call_timer)


def write_call_times(run_dir, steps) -> None:
    (run_dir / CALL_TIMES_FILE).write_text("".join(json.dumps({"step": step, "ranks": []}) + "\n" for step in steps))


def test_a_resumed_step_3_cuts_call_times_back_to_its_checkpoint_also_without_profile_calls(tmp_path):
    """call_times.jsonl was cut back only where the resumed run had --profile_calls: resumed without it, the run
    folder kept the crashed run's lines past the checkpoint, which the placement cost model's fit then read."""
    write_call_times(tmp_path, range(1, 6))
    state = {"step": 3, "ppo_step": 3, "prompts": {}, "unsupervised": None, "trainer": {}, "evaluations": [],
             "last_stats": {}, "metrics_lines": 0}
    checkpoints = SimpleNamespace(restore=lambda engines, resume: state, reading_loaded_state=nullcontext)
    ppo_run(tmp_path, checkpoints).restore()
    assert [json.loads(line)["step"] for line in (tmp_path / CALL_TIMES_FILE).read_text().splitlines()] == [1, 2, 3]


def test_a_step_3_checkpoint_is_saved_after_the_logs_it_counts_are_on_disk(tmp_path, fsynced_paths):
    """The checkpoint is fsynced but metrics.jsonl and call_times.jsonl were not: after a power loss the checkpoint
    could outlive the lines it counts."""
    saved_after = []
    checkpoints = SimpleNamespace(save=lambda *args: saved_after.append(list(fsynced_paths)))
    run = ppo_run(tmp_path, checkpoints)
    run.metrics.log(1, {"loss": 1.0})
    write_call_times(tmp_path, [1])
    run.save_checkpoint()
    assert saved_after == [[str(tmp_path / "metrics.jsonl"), str(tmp_path / CALL_TIMES_FILE)]]
