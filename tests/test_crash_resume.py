"""Step 1 killed mid-run (SIGKILL), cut off in the middle of a save, or stopped by Ctrl-C ends, after
`--resume`, with exactly the weights of an uninterrupted run (CPU, fixed seed, GPT-2 with dropout on,
so the RNG state, data position, optimizer and LR schedule must all come back)."""
import json
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from crash_resume import (
    assert_same_weights,
    kill_after_checkpoint,
    latest_checkpoint_step,
    launch_step,
    run_step,
    step_env,
    wait_for_stalled_save,
)
from supervised_data import write_arithmetic_jsonl
from tiny_models import make_tiny_model_dir

from step1_sft.main import main as step1_main
from training.loops.metrics import read_metrics
from training.reliability.checkpointing import MARKER_FILE
from training.reliability.signals import EXIT_INTERRUPTED
from utils.atomic import is_temporary

pytestmark = pytest.mark.slow

STEP1 = REPO_ROOT / "step1_sft" / "main.py"
TOTAL_STEPS = 12  # 2 epochs of 6 micro-batches: a resume at step 4 must also cross the epoch boundary


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    return {
        "model": make_tiny_model_dir(folder / "tiny-gpt2", "gpt2"),
        "data": write_arithmetic_jsonl(folder / "pairs.jsonl", 24),
        "cache": str(folder / "cache"),
    }


def step1_args(inputs, output_dir) -> list[str]:
    return [
        "--model_name_or_path", inputs["model"], "--data_path", inputs["data"], "--data_split", "1,1,0",
        "--data_output_path", inputs["cache"], "--output_dir", str(output_dir), "--seed", "7",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--num_train_epochs", "2",
        "--learning_rate", "3e-3", "--dtype", "fp32", "--max_seq_len", "64", "--save_interval", "2",
        "--keep_last_checkpoints", "3", "--log_interval", "1",
    ]


@pytest.fixture(scope="module")
def reference(distributed, inputs, tmp_path_factory):
    """The uninterrupted run's final model folder."""
    output_dir = tmp_path_factory.mktemp("reference") / "run"
    summary = step1_main(step1_args(inputs, output_dir))
    assert summary["optimizer_steps"] == TOTAL_STEPS
    return output_dir / "model"


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_weights(reference, inputs, tmp_path):
    args = step1_args(inputs, tmp_path / "run")
    run = launch_step(STEP1, args, tmp_path / "killed.log")
    killed_at = kill_after_checkpoint(run, min_step=4)
    assert killed_at < TOTAL_STEPS and not (tmp_path / "run" / "model").exists()

    output = run_step(STEP1, [*args, "--resume"], tmp_path / "resumed.log")
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}" in output
    assert_same_weights(reference, tmp_path / "run" / "model")
    logged = [record["step"] for record in read_metrics(tmp_path / "run") if "train/loss" in record]
    assert logged == sorted(set(logged)) and logged[-1] == TOTAL_STEPS  # each step once, in order


def test_a_save_cut_off_part_way_is_skipped_and_the_previous_checkpoint_resumed(reference, inputs, tmp_path):
    args = step1_args(inputs, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    run = launch_step(STEP1, args, tmp_path / "stalled.log", stall_save_at=4)
    wait_for_stalled_save(run)
    run.process.send_signal(signal.SIGKILL)
    assert run.wait(timeout=60) == -signal.SIGKILL

    staged = [path for path in checkpoints.iterdir() if is_temporary(path)]
    assert [path.name.split(".tmp-")[0] for path in staged] == [".step4"]
    assert (staged[0] / "model").is_dir() and not (staged[0] / MARKER_FILE).exists()  # cut off mid-save
    assert not (checkpoints / "step4").exists()
    assert latest_checkpoint_step(tmp_path / "run") == 2

    step1_main([*args, "--resume"])
    assert_same_weights(reference, tmp_path / "run" / "model")
    assert not any(is_temporary(path) for path in checkpoints.iterdir())  # the next save swept it up


def evaluated_steps(run_dir: Path) -> list[int]:
    return [record["step"] for record in read_metrics(run_dir) if any(key.startswith("eval/") for key in record)]


@pytest.mark.parametrize("checkpoint", [6, 12])  # the end of the first epoch; of the run (a finished run resumed)
def test_a_resume_from_the_checkpoint_that_ended_an_epoch_logs_each_evaluation_once(reference, inputs, tmp_path,
                                                                                     checkpoint):
    """An epoch's last step is saved before its closing evaluation is logged at the same step: the resumed run
    cuts the metrics back to what the checkpoint held, logs that evaluation once, and counts the epoch."""
    run = tmp_path / "run"
    if checkpoint == 12:
        shutil.copytree(reference.parent, run)
    else:
        step1_main([*step1_args(inputs, run), "--keep_last_checkpoints", "6"])
        for later in (run / "checkpoints").glob("step*"):
            if int(later.name[4:]) > checkpoint:
                shutil.rmtree(later)
        (run / "checkpoints" / "latest").write_text(f"step{checkpoint}")
        shutil.rmtree(run / "model")
    summary = step1_main([*step1_args(inputs, run), "--resume"])
    assert evaluated_steps(run) == evaluated_steps(reference.parent) == [0, 6, 12]
    expected = json.loads((reference.parent / "summary.json").read_text())
    assert (summary["optimizer_steps"], summary["epochs_completed"]) == (TOTAL_STEPS, expected["epochs_completed"]) \
        == (TOTAL_STEPS, 2)
    assert_same_weights(reference, run / "model")


def test_ctrl_c_saves_says_how_to_resume_and_the_resumed_run_matches(reference, inputs, tmp_path):
    args = step1_args(inputs, tmp_path / "run")
    run = launch_step(STEP1, args, tmp_path / "interrupted.log")
    kill_after_checkpoint(run, min_step=2, sig=signal.SIGINT)
    assert run.wait(timeout=120) == EXIT_INTERRUPTED, run.output()[-3000:]

    output = run.output()
    stopped = latest_checkpoint_step(tmp_path / "run")
    assert "received SIGINT: stopping after this step and saving a checkpoint" in output
    assert (f"stopped on SIGINT after step {stopped}; checkpoint saved to "
            f"{tmp_path / 'run' / 'checkpoints' / f'step{stopped}'}") in output
    resume = shlex.join([sys.executable, str(STEP1), *args, "--resume"])
    assert f"to continue: {resume}" in output
    assert not (tmp_path / "run" / "model").exists()

    step1_main(shlex.split(resume)[2:])
    assert_same_weights(reference, tmp_path / "run" / "model")


SIGTERM_IN_EXPORT = """
import os, signal, sys
import training.loops.supervised_step as supervised_step
from step1_sft.main import main

export = supervised_step.save_hf_model

def export_signalled(*args, **kwargs):  # the scheduler's SIGTERM lands as the final model is written
    os.kill(os.getpid(), signal.SIGTERM)
    return export(*args, **kwargs)

supervised_step.save_hf_model = export_signalled
main(sys.argv[1:])
"""


def test_a_sigterm_during_the_final_export_lets_the_run_finish_it(inputs, tmp_path):
    """Past its last step a run has no step to stop after: a SIGTERM then lets it write its final model and
    summary and end as finished (it used to kill the run mid-export: without --save_interval, nothing was left)."""
    run = tmp_path / "run"
    argv = step1_args(inputs, run)
    at = argv.index("--save_interval")
    del argv[at:at + 2]  # no resume checkpoint to fall back on
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_EXPORT, *argv], capture_output=True, text=True,
                          env=step_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "received SIGTERM: finishing the final model's save, then ending" in done.stderr
    assert (run / "model" / "config.json").is_file() and (run / "summary.json").is_file()
    assert not (run / "checkpoints").exists()
