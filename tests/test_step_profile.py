"""The calibration's profiled step: call times read back per kind, the factors and overhead it fits, the cost model
applying them, and a real profiled step 3 on one rank."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_placement_planner import MACHINE, WORKLOAD

import training.placement.calibration as calibration
from training.loops.call_times import CALL_TIMES_FILE
from training.placement.cost_model import estimate_step
from training.placement.spec import build_placement
from training.placement.step_profile import (
    ProfileShape,
    call_time_factors,
    launch_env,
    measured_calls,
    measured_step_overhead_s,
    profile_corrections,
    run_step3,
)
from utils.dist import free_port
from utils.errors import UserError


def _record(step_s: float, *ranks: dict[str, float]) -> str:
    return json.dumps({"step": 1, "step_s": step_s,
                       "ranks": [{"calls": {name: {"s": s, "n": 1} for name, s in calls.items()}, "peak_rss_gb": 1.0}
                                 for calls in ranks]})


def test_call_times_are_read_per_rank_as_the_cost_model_names_them_and_fitted_per_kind(tmp_path):
    """The first step is dropped (first-call costs); the decoder's sampling loop counts as decode steps and
    DeepSpeed's engine step as the optimizer step; a kind's factor is its measured seconds over its predicted ones,
    summed over roles and ranks; the exchange is no call kind; the overhead is the step beyond its busiest rank."""
    rank0 = {"actor/decode step": 1.0, "actor/generate": 0.5, "actor/forward": 0.3, "critic/forward": 0.1,
             "actor/optimizer step": 0.2, "actor/engine step": 0.2, "exchange/experience": 0.4}
    rank1 = {"actor/decode step": 1.5, "actor/forward": 0.2, "critic/forward": 0.2, "actor/optimizer step": 0.4}
    lines = [_record(100.0, {"actor/forward": 50.0}, {"actor/forward": 50.0}),
             _record(3.5, rank0, rank1), _record(3.3, rank0, rank1), _record(4.1, rank0, rank1)]
    (tmp_path / CALL_TIMES_FILE).write_text("\n".join(lines) + "\n")
    measured = measured_calls(tmp_path)
    assert measured[0] == pytest.approx({"actor/decode step": 1.5, "actor/forward": 0.3, "critic/forward": 0.1,
                                         "actor/optimizer step": 0.4, "exchange/all": 0.4})
    assert measured[1] == pytest.approx({"actor/decode step": 1.5, "actor/forward": 0.2, "critic/forward": 0.2,
                                         "actor/optimizer step": 0.4})
    assert measured_step_overhead_s(tmp_path) == pytest.approx(3.5 - 2.7)  # rank 0: 2.7 s of calls
    predicted = [{"actor/decode step": 1.0, "actor/forward": 0.2, "critic/forward": 0.2, "actor/optimizer step": 0.4,
                  "exchange/all": 1.0}] * 2
    assert call_time_factors(measured, predicted) == pytest.approx({"decode step": 1.5, "forward": 0.8 / 0.8,
                                                                    "optimizer step": 1.0})


def test_calibrated_factors_lengthen_each_kind_of_call_and_the_overhead_the_step():
    placement = build_placement("colocate", 1)
    base = estimate_step(WORKLOAD, placement, MACHINE)
    corrected = replace(MACHINE, call_time_factors={"forward": 2.0, "decode step": 3.0, "backward": 1.5},
                        step_overhead_s=0.25)
    estimate = estimate_step(WORKLOAD, placement, corrected)
    factor = {"forward": 2.0, "decode step": 3.0, "backward": 1.5}
    for before, after in zip(base.calls, estimate.calls, strict=True):
        assert after.seconds == pytest.approx(before.seconds * factor.get(before.kind, 1.0)), before.kind

    def seconds(kind: str, of) -> float:
        return sum(call.total_s for call in of.calls if call.kind == kind)

    added = sum((factor[kind] - 1) * seconds(kind, base) for kind in factor)
    assert estimate.step_s == pytest.approx(base.step_s + added + 0.25)  # co-located: every call in turn
    assert estimate.other_s == 0.25 and base.other_s == 0.0
    assert estimate.per_rank_memory_gib == base.per_rank_memory_gib


def test_a_calibration_keeps_its_factors_when_saved_and_loaded(tmp_path):
    machine = replace(MACHINE, call_time_factors={"forward": 1.25, "backward": 1.5}, step_overhead_s=0.1)
    calibration.save_calibration(machine, tmp_path / "machine.json")
    assert calibration.load_calibration(tmp_path / "machine.json") == machine


def test_a_launch_from_inside_a_launched_rank_starts_its_own_world(monkeypatch):
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500"), ("TORCHELASTIC_RUN_ID", "x"),
                        ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    env = launch_env(3)
    assert env["OMP_NUM_THREADS"] == "3" and env["HF_HUB_OFFLINE"] == "1"
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)


def test_a_failed_step3_launch_reports_the_workers_error_line(tmp_path):
    with pytest.raises(UserError) as raised:
        run_step3(["--actor_model_name_or_path", str(tmp_path / "no-such-model"), "--critic_model_name_or_path",
                   str(tmp_path / "no-such-model"), "--output_dir", str(tmp_path / "o"), "--data_path", "embedded"],
                  1, 1, tmp_path / "step3.log")
    message = str(raised.value)
    assert "\nerror: " in message and "no-such-model" in message and "ChildFailedError" not in message
    assert message.endswith(f"its whole log: {tmp_path / 'step3.log'}")


TINY_PROFILE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True}


def test_a_failed_profiled_step_names_a_log_that_outlives_the_calibration(tmp_path, monkeypatch):
    """The log was written inside the profile's temporary folder, deleted before the user could read it.
    (`run_step3`'s own failure message is the test above's.)"""
    import training.placement.step_profile as step_profile

    def failing_step3(argv, world_size, threads, log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("error: the profiled step failed\n")
        raise UserError(f"step 3 failed\nits whole log: {log}")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(step_profile, "write_profile_models", lambda root, model: (root / "actor", root / "reward"))
    monkeypatch.setattr(step_profile, "run_step3", failing_step3)
    with pytest.raises(UserError) as raised:
        profile_corrections(MACHINE, "fp32", 1, 1)
    log = Path(str(raised.value).rpartition("its whole log: ")[2])
    assert log.is_relative_to(calibration.cache_dir()) and "the profiled step failed" in log.read_text()


def cache_holding_the_converted_embedded_model(folder: Path) -> Path:
    """An XDG cache folder whose project cache links to this machine's converted embedded model (converting it
    there first if it is not yet): a test that moves the cache keeps its files apart without dequantising the GGUF
    again, which took more of the profiled step's test than the step itself."""
    from training.core.embedded_model import embedded_model_path

    models = Path(embedded_model_path()).parent
    (folder / "rlhf_pipeline").mkdir(parents=True)
    (folder / "rlhf_pipeline" / models.name).symlink_to(models, target_is_directory=True)
    return folder


def test_a_profiled_step3_on_one_rank_measures_every_call_kind(tmp_path, monkeypatch):
    """A real (tiny) step 3 with every call timed: each kind of call the cost model has gets a positive factor."""
    # where the step's log and data are kept
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_holding_the_converted_embedded_model(tmp_path / "cache")))
    machine = replace(MACHINE, devices_per_node=1)
    fitted = profile_corrections(machine, "fp32", 1, 1, TINY_PROFILE_MODEL, ProfileShape(batch=2, prompt_len=32,
                                                                                         answer_len=8, steps=2))
    factors = fitted["call_time_factors"]
    assert {"enter generate mode", "prefill", "decode step", "forward", "train forward", "backward",
            "optimizer step"} <= set(factors), factors
    assert all(factor > 0 for factor in factors.values()) and fitted["step_overhead_s"] >= 0


def test_a_calibration_started_by_a_launched_rank_makes_a_world_of_its_own():
    """`--placement auto --calibrate` calibrates on rank 0 of a launched run; its calibration ranks inherited the
    launcher's variables, TORCHELASTIC_USE_AGENT_STORE among them, with which their rendezvous waited forever for
    the launcher's store instead of starting one."""
    script = ("from training.placement.calibration import measure_ranks; "
              "print(sorted(measure_ranks('fp32', 1, 2, quick=True)))")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONPATH": str(REPO_ROOT)}
    # the timeout guards against the hang alone: the calibration took 71-103 s on a loaded 2-core machine
    finished = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=300)
    assert finished.returncode == 0 and "matmul_flops" in finished.stdout, finished.stderr[-3000:]


def test_a_calibration_rank_ends_without_the_interpreters_finalization(tmp_path):
    """A calibration rank aborted now and then after its work ('terminate called without an active exception',
    SIGABRT): the profiler keeps its gloo group, and the group's threads, alive past destroy_process_group, and a
    gloo thread freeing the last collective's tensor while the interpreter finalizes cannot take the GIL and is
    ended inside gloo. Each rank now leaves once its result is handed over: its exit handlers never run."""
    finished = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "scripts" / "calibration_teardown_worker.py"),
                               str(tmp_path)], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0 and "collectives" in finished.stdout, finished.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
