"""Step 1 killed mid-run (SIGKILL), cut off in the middle of a save, or stopped by Ctrl-C ends, after
`--resume`, with exactly the weights of an uninterrupted run (CPU, fixed seed, GPT-2 with dropout on,
so the RNG state, data position, optimizer and LR schedule must all come back). Step 3, with the EMA and the
pretraining mixture, killed in a rollout, between updates or mid-save, resumes to the same models and metrics, on
one rank and on two with a ZeRO-3 actor."""
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
from shared_launch import built_once
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
def inputs(request):
    """One set for the test run's workers (`built_once`): a test resumes a copy of `reference` with its flags."""
    return built_once(request, "crash_resume_inputs", write_inputs)


def write_inputs(folder: Path) -> dict:
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
def reference(distributed, inputs, request):
    """The uninterrupted run's final model folder, trained once for the test run's workers (`built_once`): tests
    read it or copy it."""
    def train(folder: Path) -> Path:
        summary = step1_main(step1_args(inputs, folder / "run"))
        assert summary["optimizer_steps"] == TOTAL_STEPS
        return folder / "run" / "model"

    return built_once(request, "crash_resume_reference", train)


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


# step 3: a crash at each point of a PPO step, with the EMA and the pretraining mixture -----------------------------

STEP3 = REPO_ROOT / "step3_rlhf" / "main.py"
STEP3_FLAGS = ["--max_steps", "6", "--save_interval", "2", "--actor_learning_rate", "1e-3", "--enable_ema",
               "--ema_beta", "0.5", "--enable_hybrid_engine", "--unsupervised_dataset_name", "{text}",
               "--unsup_coef", "1.0", "--seed", "5", "--eval_interval", "2"]
# Step 3 killing itself (SIGKILL) in PPO step N (argument 2): in its rollout (argument 1), after its first update
# (the actor, the EMA and both streams moved on in memory), or in the held-out evaluation after it (before its
# checkpoint). Every rank of a launched run kills itself there.
KILL_IN_STEP3 = """
import os, signal, sys
from step3_rlhf import run_loop
from step3_rlhf.ppo_trainer import PPOTrainer
from step3_rlhf.main import main

method = {"rollout": "generate_experience", "training": "train_rlhf", "evaluation": "evaluate_prompts"}[sys.argv[1]]
kill_step = int(sys.argv[2])
original, calls = getattr(PPOTrainer, method), []
step_of = run_loop.PPORun._ppo_step

def ppo_step(run):
    calls.append(run.step + 1)
    return step_of(run)

def killed_in_kill_step(self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    if calls[-1:] == [kill_step]:
        os.kill(os.getpid(), signal.SIGKILL)
    return result

run_loop.PPORun._ppo_step = ppo_step
setattr(PPOTrainer, method, killed_in_kill_step)
main(sys.argv[3:])
"""


@pytest.fixture(scope="module")
def step3_inputs(request):
    """One set for the test run's workers (`built_once`), as `step3_reference` is."""
    from test_step3_rlhf import write_step3_inputs

    return built_once(request, "crash_resume_step3_inputs", write_step3_inputs)


def step3_args(inputs, output_dir) -> list[str]:
    from test_step3_rlhf import step3_argv

    return step3_argv(inputs, output_dir, *[flag.format(text=inputs["text"]) for flag in STEP3_FLAGS])


@pytest.fixture(scope="module")
def step3_reference(step3_inputs, request) -> Path:
    """The uninterrupted step-3 run's folder, run once for the test run's workers (`built_once`): tests read it."""
    def run_reference(folder: Path) -> Path:
        run_step(STEP3, step3_args(step3_inputs, folder / "run"), folder / "reference.log")
        return folder / "run"

    return built_once(request, "crash_resume_step3_reference", run_reference)


def logged_values(run: Path) -> list[dict]:
    """Every metrics line but its wall-clock readings (times, rates, memory)."""
    timed = ("time", "memory/")
    return [{key: value for key, value in record.items() if not key.startswith(timed) and "per_s" not in key}
            for record in read_metrics(run)]


@pytest.mark.parametrize("point, step, resumed_at", [("rollout", 6, 4), ("training", 6, 4), ("checkpoint", 6, 4),
                                                      ("evaluation", 4, 2)])
def test_step3_killed_anywhere_in_a_ppo_step_resumes_to_the_uninterrupted_run(step3_reference, step3_inputs,
                                                                              tmp_path, point, step, resumed_at):
    """Killed in a rollout, between updates, while writing a checkpoint or in the held-out evaluation before it, the
    resumed run draws the same prompts, pretraining text and samples: the same models (actor, critic, EMA) and the
    same metrics, each step and each evaluation once."""
    run = tmp_path / "run"
    args = step3_args(step3_inputs, run)
    if point == "checkpoint":
        killed = launch_step(STEP3, args, tmp_path / "killed.log", stall_save_at=step)
        wait_for_stalled_save(killed)
        killed.process.send_signal(signal.SIGKILL)
    else:
        with open(tmp_path / "killed.log", "w") as log:
            killed = subprocess.run([sys.executable, "-c", KILL_IN_STEP3, point, str(step), *args], check=False, stdout=log,
                                    stderr=subprocess.STDOUT, env=step_env(), cwd=REPO_ROOT, timeout=400)
        assert killed.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert latest_checkpoint_step(run) == resumed_at and not (run / "actor").exists()

    output = run_step(STEP3, [*args, "--resume"], tmp_path / "resumed.log")
    assert f"resuming step 3 after PPO step {resumed_at}" in output
    for folder in ("actor", "critic", "actor_ema"):
        assert_same_weights(step3_reference / folder, run / folder)
    assert logged_values(run) == logged_values(step3_reference)


def exit_status(process: subprocess.Popen, timeout: float = 600) -> int:
    """`process`'s exit status; killed past `timeout` seconds (its status then says so)."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.mark.parametrize("hybrid_engine", [False, True], ids=["hf", "hybrid_engine"])
def test_step3_on_two_ranks_with_a_zero3_actor_killed_mid_training_resumes_to_the_uninterrupted_run(
        step3_inputs, tmp_path, hybrid_engine):
    """2 gloo ranks, the actor and its EMA partitioned by ZeRO-3 (odd-sized partitions padded), both ranks killed
    after PPO step 4's first update: the resumed run ends with the uninterrupted run's models and metrics."""
    from utils.dist import free_port

    kill_script = tmp_path / "kill_in_step3.py"
    kill_script.write_text(KILL_IN_STEP3)

    def launched(script: list[str], name: str, *extra: str) -> subprocess.Popen:
        args = step3_args(step3_inputs, tmp_path / name)
        args[args.index("--max_steps") + 1] = "4"
        args += ["--actor_zero_stage", "3", "--per_device_generation_batch_size", "2",
                 "--per_device_training_batch_size", "1", *extra]
        if not hybrid_engine:
            args.remove("--enable_hybrid_engine")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), *script, *args]
        with open(tmp_path / f"{name}{len(extra)}.log", "w") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**step_env(), "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT)

    # the uninterrupted run beside the killed one: their ranks' start-ups (imports, engines) overlap
    reference, killed = launched([str(STEP3)], "reference"), launched([str(kill_script), "training", "4"], "run")
    assert exit_status(reference) == 0, (tmp_path / "reference0.log").read_text()[-3000:]
    assert exit_status(killed) != 0 and "Signal 9 (SIGKILL)" in (tmp_path / "run0.log").read_text()
    assert latest_checkpoint_step(tmp_path / "run") == 2
    assert exit_status(launched([str(STEP3)], "run", "--resume")) == 0, (tmp_path / "run1.log").read_text()[-3000:]
    for folder in ("actor", "critic", "actor_ema"):
        assert_same_weights(tmp_path / "reference" / folder, tmp_path / "run" / folder)
    assert logged_values(tmp_path / "run") == logged_values(tmp_path / "reference")
