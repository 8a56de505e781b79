"""bench/pipeline.py: train.py's run turned into the bench JSON (device, models, each step's settings, seconds and
quality, the PPO step's median phases) beside a reference run's. The pipeline itself is stubbed: what it writes
(each step's args.json, step 3's metrics.jsonl) and returns (its summary) stand in for a run."""
import json
import resource
import shlex
from pathlib import Path

import pytest

from bench import pipeline
from training.pipeline.steps import STEPS
from training.reliability.checkpointing import MARKER_FILE
from utils.errors import UserError


def _fake_run(step_figures: dict[str, dict], seconds: float):
    """A stand-in for `train.py`'s run: writes each step's args.json (and step 3's PPO metrics) into the run folder
    its flags name and returns a summary as run_pipeline does."""

    def run(train_argv: list[str]) -> dict:
        out = Path(train_argv[train_argv.index("--output-dir") + 1])
        supervised = {"dtype": "bf16", "zero_stage": 0, "per_device_train_batch_size": 8}
        args = {"1": supervised, "2": supervised, "4": supervised,
                "3": {"dtype": "bf16", "actor_zero_stage": 0, "per_device_generation_batch_size": 4,
                      "per_device_training_batch_size": 4}}
        for step in step_figures:
            (out / STEPS[int(step)].name).mkdir(parents=True)
            (out / STEPS[int(step)].name / "args.json").write_text(json.dumps(args[step]))
        ppo = [{"time/step_s": s, "time/generation_s": s / 2, "time/scoring_s": 0.1, "time/training_s": 0.2}
               for s in (5.0, 1.0, 3.0)]
        if "3" in step_figures:
            (out / "step3" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"eval": 1}, *ppo]))
        steps = {step: {"title": f"step {step}", "seconds": seconds, "summary": {"step": step, **figures}}
                 for step, figures in step_figures.items()}
        return {"deployment": "cpu", "total_seconds": 3 * seconds, "steps": steps}

    return run


FIGURES = {"1": {"eval_perplexity_before": 5.49, "eval_perplexity_after": 5.29, "model_dir": "x"},
           "2": {"eval_accuracy_before": 0.47, "eval_accuracy_after": 0.88},
           "3": {"reward_first": 0.94, "reward_last": 1.43, "kl_exact_last": 0.51, "ppo_steps": 36}}


def test_a_run_is_reported_step_by_step_beside_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(pipeline, "run", _fake_run(FIGURES, 60.0))
    reference = pipeline.main(["--output", str(tmp_path / "cpu.json")])
    assert reference["device"] and reference["model"] == reference["reward_model"] == "smollm2-135m"
    assert reference["dtype"] == ["bf16"] and reference["batch_size"] == {"1": 8, "2": 8, "3": 4}
    step3 = reference["steps"]["3"]
    assert step3["settings"]["actor_zero_stage"] == 0
    assert step3["figures"]["median_step_s"] == 3.0 and step3["figures"]["median_generation_s"] == 1.5
    assert "model_dir" not in reference["steps"]["1"]["figures"], "paths are not figures"
    assert str(tmp_path / "runs") in reference["train_command"], "a fresh run folder of its own"

    faster = {**FIGURES, "2": {"eval_accuracy_before": 0.5, "eval_accuracy_after": 0.7}}
    monkeypatch.setattr(pipeline, "run", _fake_run(faster, 20.0))
    passed = ["--output-dir", str(tmp_path / "gpu_run"), "--step1-args", "--max_steps 1 --max_train_samples 8"]
    report = pipeline.main(["--output", str(tmp_path / "gpu.json"), "--reference", str(tmp_path / "cpu.json"),
                            "--", *passed])
    assert shlex.split(report["train_command"])[-len(passed):] == passed  # pastes back as the command it ran
    rows = {(row["step"], row["figure"]): (row["value"], row["reference"]) for row in report["results"]}
    assert rows[("2", "eval_accuracy_after")] == (0.7, 0.88)
    assert rows[("1", "seconds")] == (20.0, 60.0)
    assert rows[("3", "median_step_s")] == (3.0, 3.0)
    assert report["reference"]["device"] == reference["device"]
    assert json.loads((tmp_path / "gpu.json").read_text())["results"] == report["results"]


@pytest.mark.parametrize("record", ["step1/summary.json", "dpo/summary.json", f"step1/checkpoints/step3/{MARKER_FILE}"])
def test_a_folder_that_holds_a_run_is_refused(tmp_path, record):
    """train.py would skip its finished steps, or go on from a stopped one's checkpoint: nothing (or only the rest)
    would be timed. DPO's run folder is `dpo/`, which the check once missed: a DPO run's step was then reported with
    the seconds of its skip."""
    (tmp_path / "old" / record).parent.mkdir(parents=True)
    (tmp_path / "old" / record).write_text(json.dumps({"step": 3, "engines": ["model"]}))
    with pytest.raises(UserError, match="already holds a run"):
        pipeline.fresh_run_argv(["--algorithm", "dpo", "--step", "4", "--output-dir", str(tmp_path / "old")])


@pytest.mark.parametrize("record", [{"status": "running", "steps": {}},
                                    {"status": "stopped", "steps": {}, "stopped": {"step": 1, "signal": "SIGTERM"}}])
def test_a_folder_whose_run_ended_before_any_step_finished_is_timed(tmp_path, record):
    """train.py writes its summary.json (`running`) before step 1, so a run killed, or stopped while it planned,
    leaves one where no step finished or saved: train.py would run every step anew, and the folder was refused as
    one it would resume."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps(record))
    argv = ["--output-dir", str(tmp_path / "old")]
    assert pipeline.fresh_run_argv(argv) == argv


def test_a_dpo_run_reports_its_held_out_pair_accuracy_and_margin(tmp_path, monkeypatch):
    """Under `--algorithm dpo` the DPO step (4) was reported with its seconds alone, none of its quality figures."""
    monkeypatch.setattr(pipeline, "REPO_ROOT", tmp_path)
    dpo = {"eval_accuracy_before": 0.0, "eval_accuracy_after": 0.64, "eval_margin_before": 0.0,
           "eval_margin_after": 0.023, "final_train_loss": 0.68, "optimizer_steps": 39}
    monkeypatch.setattr(pipeline, "run", _fake_run({"1": FIGURES["1"], "4": {**dpo, "dpo_beta": 0.1}}, 30.0))
    report = pipeline.main(["--output", str(tmp_path / "dpo.json"), "--", "--algorithm", "dpo"])
    assert report["steps"]["4"]["figures"] == dpo
    assert report["batch_size"] == {"1": 8, "4": 8}
    assert {row["figure"] for row in report["results"] if row["step"] == "4"} == {"seconds", *dpo}


def test_the_dpo_bench_writes_nothing_when_no_source_is_left(tmp_path, monkeypatch):
    """Without the shared hh-rlhf file it skipped that source, then wrote a report of no rows over the committed
    bench/results/dpo_cpu.json (its default --output)."""
    import sys

    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))  # bench/dpo.py imports its neighbours as a script
    monkeypatch.delitem(sys.modules, "dpo", raising=False)
    import dpo

    monkeypatch.setattr(dpo, "HH_PAIRS", tmp_path / "missing" / "pairs.jsonl")
    output = tmp_path / "dpo.json"
    with pytest.raises(SystemExit, match="no source left to compare on; nothing written"):
        dpo.main(["--sources", "hh_rlhf_harmless", "--output", str(output)])
    assert not output.exists()


def test_the_algorithms_bench_reuses_a_step1_model_only_of_the_same_settings(monkeypatch):
    """Its step-1 model lived in one folder, reused whatever --sft_steps, --sft_learning_rate or the task asked."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import algorithms

    folder = lambda *argv: algorithms.step1_folder(algorithms.parse_args(list(argv)))
    assert folder() == folder() != folder("--sft_steps", "7") != folder("--sft_learning_rate", "1e-3")
    assert folder() != folder("--difficulty", "3") and folder() != folder("--seed", "5")


def _committed_report(name: str) -> dict:
    return json.loads((pipeline.REPO_ROOT / "bench" / "results" / name).read_text())


def _fresh_report(bench, argv: list[str], tmp_path: Path, monkeypatch) -> dict:
    """The report a rerun of `bench` (its module) with `argv` writes, without rows: its command and settings."""
    import sys
    import time

    from bench.common import write_report

    command = [f"bench/{bench.__name__}.py", *argv, "--output", str(tmp_path / "fresh.json")]
    monkeypatch.setattr(sys, "argv", command)
    return write_report(bench.__name__, bench.parse_args(command[1:]), [], time.time())


def _setting(settings: dict, name: str, old_name: str):
    """A report's setting under the flag's name, or under its old spelling: the committed results were written before
    the benches took the steps' flag names (581cfe4, 1192991); a rerun writes the new one."""
    return settings[name] if name in settings else settings[old_name]


def test_the_algorithms_bench_names_the_step3_flags_it_passes_on_as_step3_does(tmp_path, monkeypatch):
    """Its --time_budget_minutes and --training_batch_size were step 3's --max_train_minutes and
    --per_device_training_batch_size under names of its own; the old spellings, in the committed results' commands,
    still read the same, and a rerun's report (its settings under the new names) reads as its command."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import algorithms

    argv = ["--max_train_minutes", "3", "--per_device_training_batch_size", "8"]
    flags = algorithms.step3_flags(algorithms.parse_args(argv), "grpo", Path("actor"), Path("out"))
    assert flags[flags.index("--max_train_minutes") + 1] == "3.0"
    assert flags[flags.index("--per_device_training_batch_size") + 1] == "8"
    reports = [_committed_report("algorithms_cpu.json"), _committed_report("algorithms_cpu_grpo_20min.json"),
               _fresh_report(algorithms, argv, tmp_path, monkeypatch)]
    for report in reports:
        ran = algorithms.parse_args(shlex.split(report["command"])[2:])
        settings = report["settings"]
        assert ran.max_train_minutes == _setting(settings, "max_train_minutes", "time_budget_minutes")
        assert ran.per_device_training_batch_size == _setting(settings, "per_device_training_batch_size",
                                                              "training_batch_size")


def test_a_benchs_child_reports_its_peak_memory_in_gb_as_step3_does(tmp_path, monkeypatch):
    """It wrote the peak RSS in KiB over 2^20, GiB, as `peak_memory_gb`: 7% below the GB (10^9 bytes) of step 3's
    `memory/peak_rss_gb` and the placement bench's figures."""
    from bench.common import child_main

    (tmp_path / "stand_in_step.py").write_text("def main(argv):\n    return {'argv': argv}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    child_main(["stand_in_step", str(tmp_path / "result.json"), "--flag"])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["summary"] == {"argv": ["--flag"]}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert result["peak_memory_gb"] == pytest.approx(peak_kib * 1024 / 1e9, rel=1e-3)


def test_the_dpo_bench_names_the_flags_it_passes_on_as_the_steps_do(tmp_path, monkeypatch):
    """Its --steps and --eval_pairs were the runs' --max_steps and --max_eval_samples under names of its own; the old
    spellings, in the committed result's command, still read the same, and a rerun's report (its settings under the
    new names) reads as its command."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import dpo

    flags = dpo.run_flags(dpo.parse_args(["--max_steps", "20", "--max_eval_samples", "32"]), "embedded", Path("out"))
    assert flags[flags.index("--max_steps") + 1] == "20" and flags[flags.index("--max_train_samples") + 1] == "160"
    assert flags[flags.index("--max_eval_samples") + 1] == "32"
    fresh = _fresh_report(dpo, ["--max_steps", "20", "--max_eval_samples", "32"], tmp_path, monkeypatch)
    for report in (_committed_report("dpo_cpu.json"), fresh):
        ran = dpo.parse_args(shlex.split(report["command"])[2:])
        settings = report["settings"]
        assert ran.max_steps == _setting(settings, "max_steps", "steps")
        assert ran.max_eval_samples == _setting(settings, "max_eval_samples", "eval_pairs")


@pytest.mark.parametrize("steps,warmup", [(1, 0), (2, 1), (30, 3), (60, 6)])
def test_the_dpo_benchs_runs_take_their_flags_at_any_length(monkeypatch, tmp_path, steps, warmup):
    """At --max_steps 1 it gave each run one warm-up step, as long as the run, which the steps refuse: the first
    child exited with that error and the bench with a CalledProcessError traceback."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import dpo

    from step2_reward import main as reward_model
    from step2_reward.dpo import main as dpo_step

    args = dpo.parse_args(["--max_steps", str(steps), "--work_dir", str(tmp_path)])
    for method, step in (("dpo", dpo_step), ("reward_model", reward_model)):
        flags = dpo.run_flags(args, "embedded", tmp_path / method) + dpo.method_flags(args, method)
        assert step.parse_args(flags).schedule.num_warmup_steps == warmup


@pytest.mark.parametrize("steps,warmup", [(1, 0), (2, 1), (16, 2)])
def test_the_algorithms_benchs_step1_warms_up_for_fewer_steps_than_it_runs(monkeypatch, steps, warmup):
    """At --sft_steps 2 (or 1) its two warm-up steps lasted the whole step-1 run, which step 1 refuses."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import algorithms

    flags = algorithms.step1_flags(algorithms.parse_args(["--sft_steps", str(steps)]))
    assert flags[flags.index("--num_warmup_steps") + 1] == str(warmup)


def test_a_failed_child_stops_the_bench_with_a_message_not_a_traceback(tmp_path, monkeypatch):
    """A step that exited with an error (its own message printed) ended the bench in a CalledProcessError
    traceback."""
    from bench.common import run_child

    (tmp_path / "failing_step.py").write_text("def main(argv):\n    raise SystemExit('error: a refused flag')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = Path(pipeline.__file__).parent / "dpo.py"
    with pytest.raises(SystemExit, match=r"^failing_step exited with status 1 \(its error is above\); no report"):
        run_child(script, "failing_step", [], tmp_path / "result.json")


@pytest.mark.parametrize("bench,flag", [("dpo", "--max_steps"), ("algorithms", "--sft_steps")])
def test_a_bench_refuses_a_step_count_below_one(monkeypatch, capsys, bench, flag):
    """At 0 steps the bench started its first child with a warm-up of -1 steps, which that child refused beside the
    step count itself."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    module = importlib.import_module(bench)
    with pytest.raises(UserError, match=f"^{flag} 0: .* at least one optimizer step; pass 1 or more$"):
        module.parse_args([flag, "0"])
    with pytest.raises(SystemExit) as stopped:
        module.main([flag, "-3"])
    assert stopped.value.code == 2 and capsys.readouterr().err.startswith(f"error: {flag} -3: ")


def test_a_child_killed_by_a_signal_is_said_to_be_killed_not_to_have_printed_an_error(tmp_path, monkeypatch):
    """A child the OOM killer ended (status -9) prints nothing, yet the bench said 'exited with status -9 (its error
    is above)'."""
    import signal

    from bench.common import child_failure, run_child

    (tmp_path / "killed_step.py").write_text("import os, signal\n\n\ndef main(argv):\n"
                                             "    os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = Path(pipeline.__file__).parent / "dpo.py"
    with pytest.raises(SystemExit, match=r"^killed_step was killed \(signal 9, SIGKILL\), likely out of host memory \("
                                         r"the OS's out-of-memory killer; `dmesg` says\): run with fewer models"):
        run_child(script, "killed_step", [], tmp_path / "result.json")
    # the words train.py says of a step's rank (failures.signal_cause), the one mapping of signals to words
    assert child_failure(-signal.SIGTERM) == "was killed (signal 15, SIGTERM)"
    unnamed = signal.SIGRTMIN + 2
    assert child_failure(-unnamed) == f"was killed (signal {unnamed}, unknown)"


@pytest.mark.parametrize("rows", [0, 2, 6])
def test_the_algorithms_bench_refuses_rows_per_step_an_algorithm_cannot_take_whole(monkeypatch, rows):
    """GRPO and RLOO answer each prompt 4 times: --rows_per_step 2 gave their runs --per_device_generation_batch_size
    0, which step 3 refused (a flag the user never passed), and 6 gave them 4 rows a step beside PPO's 6."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import algorithms

    with pytest.raises(UserError, match=f"^--rows_per_step {rows}: .*grpo 4, rloo 4.* multiple of 4; pass e.g. 4$"):
        algorithms.parse_args(["--rows_per_step", str(rows)])
    assert algorithms.parse_args(["--rows_per_step", "3", "--algorithms", "ppo", "remax"]).rows_per_step == 3


def test_the_algorithms_benchs_step_time_skips_a_metrics_line_cut_short(tmp_path, monkeypatch):
    """seconds_per_step parsed metrics.jsonl itself, so a line cut short (a run stopped while appending it) raised
    a JSONDecodeError where every other reader of the file (read_metrics) drops it."""
    monkeypatch.syspath_prepend(str(Path(pipeline.__file__).parent))
    import algorithms

    steps = [{"step": step, **{phase: float(step) for phase in algorithms.PHASES}} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps) + '{"step": 4, "ti')
    assert algorithms.seconds_per_step(tmp_path) == 6.0


def test_the_pipeline_benchs_ppo_step_time_skips_a_metrics_line_cut_short(tmp_path):
    """ppo_step_seconds parsed metrics.jsonl itself, as bench/algorithms.py did before 839c688: a line cut short
    raised a JSONDecodeError where read_metrics, every other reader of the file, drops it."""
    steps = [{"step": step, **{phase: float(step) for phase in pipeline.PPO_PHASES}} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps) + '{"step": 4, "ti')
    assert pipeline.ppo_step_seconds(tmp_path) == {"median_step_s": 2.0, "median_generation_s": 2.0,
                                                   "median_scoring_s": 2.0, "median_training_s": 2.0}
