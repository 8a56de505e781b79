"""Step 3's placement cost model and planner: roofline terms by hand, memory by hand, the schedule, the search,
hardware files, calibration caching and train.py's --placement auto dry run."""
import json
from dataclasses import replace

import pytest
from test_train_pipeline import TWO_CORES, FakeSteps, common

import training.placement.calibration as calibration
from training.pipeline.cli import parse_config
from training.pipeline.hardware import GIB, ModelSize
from training.pipeline.runner import run_pipeline
from training.placement.cost_model import estimate_step, forward_call, generation_calls, rank_memory_gib, training_calls
from training.placement.machine import MachineSpec, load_machine_file, preset_names
from training.placement.planner import check_fits, choose_placement, format_plans, search
from training.placement.spec import build_placement
from training.placement.workload import Step3Workload
from utils.errors import UserError

MACHINE = MachineSpec(name="round", nodes=1, devices_per_node=8, memory_gib=80, matmul_flops=1e12,
                      memory_bandwidth=1e11, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9,
                      collective_latency_s=1e-5, call_overhead_s=1e-3, decode_step_overhead_s=1e-4,
                      baseline_memory_gib=1.0, usable_memory_fraction=1.0)
BILLION = ModelSize(parameters=10**9, hidden_size=1000, num_layers=10, vocab_size=1000)
SMALL = ModelSize(parameters=10**8, hidden_size=500, num_layers=5, vocab_size=1000)
WORKLOAD = Step3Workload(actor=BILLION, critic=BILLION, reward=BILLION, prompts_per_rank=4, samples_per_prompt=1,
                         prompt_len=100, answer_len=100, train_micro_batch=2, dtype="bf16", hybrid_engine=False)


def test_one_forward_is_its_flops_over_the_matmul_rate_plus_the_call_overhead():
    call = forward_call(WORKLOAD, "reference", build_placement("colocate", 1), MACHINE)
    # 2 * 1e9 params * 4 rows * 200 tokens + 4 * 4 rows * 200^2 * 1000 hidden * 10 layers
    assert call.flops == pytest.approx(1.6e12 + 6.4e9)
    assert call.bytes == 2e9  # bf16 weights streamed once: 0.02 s, under the 1.6064 s of math
    assert call.seconds == pytest.approx(1.6064 + 1e-3)


def test_one_decode_step_streams_the_weights_and_the_kv_cache():
    prefill, decode = generation_calls(WORKLOAD, build_placement("colocate", 1), MACHINE)
    # weights 2e9 B + KV 4 rows * 150 mean context * 2 (K, V) * 1000 * 10 layers * 2 B = 2.024e9 B at 1e11 B/s
    assert decode.bytes == pytest.approx(2.024e9)
    assert decode.flops == pytest.approx(8e9 + 4 * 4 * 150 * 1000 * 10)  # 8.024 ms of math: memory-bound
    assert decode.seconds == pytest.approx(0.02024 + 10 * 1e-4)  # + one decode overhead per layer
    assert decode.count == 100 and prefill.count == 1


def test_one_train_call_is_three_forwards():
    train, reduce, optimizer = training_calls(WORKLOAD, "actor", build_placement("colocate", 1), MACHINE)
    assert train.flops == pytest.approx(3 * (2e9 * 2 * 200 + 4 * 2 * 200**2 * 1000 * 10))
    assert train.seconds == pytest.approx(2.4096 + 2 * 1e-3)
    assert train.count == 2 and optimizer.count == 2  # 4 rows / micro-batch 2, one chunk, one epoch
    assert reduce.seconds == 0.0  # nothing to reduce on one rank


def test_zero3_divides_the_trained_models_states_by_the_group_on_four_ranks():
    placement = build_placement("colocate", 4, ("actor", "reference"))
    lone = replace(WORKLOAD, critic=None, reward=None)
    zero0 = rank_memory_gib(replace(lone, actor_zero_stage=0), placement, MACHINE, 0)
    zero3 = rank_memory_gib(replace(lone, actor_zero_stage=3), placement, MACHINE, 0)
    # actor: 2 B weights + 2 B grads + 12 B fp32 master and Adam moments per parameter; reference: 2 B weights
    # (sharded with the actor under ZeRO-3); the largest transient is the actor's training micro-batch:
    # 34 * 2 rows * 200 * 1000 * 10 B activations + 2 * 200 * 1000 * 4 B logits + 4 * 2 * 200 * 1000 * 2 B
    transient = 1.36e8 + 1.6e6 + 3.2e6
    assert zero0 == pytest.approx(1.0 + (16e9 + 2e9 + transient) / GIB)
    assert zero3 == pytest.approx(1.0 + (16e9 / 4 + 2e9 / 4 + transient) / GIB)


def test_interleaved_scoring_takes_the_longer_half():
    workload = replace(WORKLOAD, reward=SMALL)
    colocated = build_placement("colocate", 2)
    interleaved = build_placement("interleave", 2)
    seconds = {role: forward_call(workload, role, interleaved, MACHINE).seconds
               for role in ("actor", "critic", "reference", "reward")}
    # both ranks score their own chunk with the actor and critic; rank 0 both chunks' reference, rank 1 reward's
    first_half = seconds["actor"] + seconds["critic"] + 2 * seconds["reference"]
    second_half = seconds["actor"] + seconds["critic"] + 2 * seconds["reward"]
    assert estimate_step(workload, interleaved, MACHINE).scoring_s == pytest.approx(max(first_half, second_half))
    assert estimate_step(workload, colocated, MACHINE).scoring_s == pytest.approx(sum(seconds.values()))


def test_disaggregated_scoring_follows_the_whole_generation_and_only_it_syncs():
    placement = build_placement("disaggregate", 4)  # ranks 0-1 score and train, 2-3 generate two chunks each
    estimate = estimate_step(WORKLOAD, placement, MACHINE)
    per_pass = sum(call.seconds * call.count for call in generation_calls(WORKLOAD, placement, MACHINE)) / 2
    per_chunk = sum(forward_call(WORKLOAD, role, placement, MACHINE).seconds
                    for role in ("actor", "reference", "reward", "critic"))
    # the runtime scores after every chunk is generated (no stage fusion): rank 0 scores chunks 0 and 1
    assert estimate.generation_s == pytest.approx(2 * per_pass)
    assert estimate.scoring_s == pytest.approx(2 * per_chunk)
    assert estimate.sync_s > 0 and estimate.exchange_s > 0
    for name in ("colocate", "interleave"):
        assert estimate_step(WORKLOAD, build_placement(name, 4), MACHINE).sync_s == 0.0


def test_planner_keeps_only_plans_that_fit_fastest_first():
    tight = replace(MACHINE, memory_gib=12.0)  # 4 x 1B models: ZeRO-0 states alone take 36 GB per rank
    plans = search(WORKLOAD, tight, 4)
    assert plans and all(plan.estimate.peak_memory_gib <= 12.0 for plan in plans)
    assert all((plan.actor_zero_stage, plan.critic_zero_stage) != (0, 0) for plan in plans)
    times = [plan.estimate.step_s for plan in plans]
    assert times == sorted(times)
    best = choose_placement(WORKLOAD, tight, 4)
    assert best.estimate.step_s == times[0]
    assert best.flags[:2] == ["--placement", best.base] and "--per_device_training_batch_size" in best.flags
    table = format_plans(plans, top=3)
    assert "placement" in table and best.placement.name in table and "peak GiB" in table


def test_check_fits_names_the_rank_the_models_and_the_gib():
    tiny = replace(MACHINE, memory_gib=8.0)
    with pytest.raises(UserError, match=r"cannot fit: rank 0 holds the actor, critic, reference, reward and needs "
                                        r"[\d.]+ GiB, but round has 8.0 GiB"):
        check_fits(WORKLOAD, build_placement("colocate", 4), tiny)
    check_fits(replace(WORKLOAD, actor_zero_stage=3, critic_zero_stage=3), build_placement("colocate", 4), MACHINE)
    with pytest.raises(UserError, match="cannot fit: rank 0"):  # nothing fits: the co-located ZeRO-3 plan's error
        choose_placement(WORKLOAD, replace(MACHINE, memory_gib=1.0), 4)


def _write(tmp_path, text, name="machine.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = ("nodes: 2\ngpus_per_node: 4\nmemory_gib: 40\npeak_flops: {bf16: 2.0e12}\nmemory_bandwidth: 1.0e12\n"
        "intra_node_bandwidth: 1.0e11\ninter_node_bandwidth: 1.0e10\n")


def test_hardware_files_and_their_errors(tmp_path):
    machine = load_machine_file(_write(tmp_path, GOOD + "matmul_efficiency: 0.5\n"))
    assert (machine.world_size, machine.matmul_flops, machine.memory_gib) == (8, 1e12, 40)
    assert machine.link_bandwidth((0, 3)) > machine.link_bandwidth((3, 4))  # one node vs across two
    with pytest.raises(UserError, match="no such file, nor a preset; the presets are a100-80gb, h100-80gb"):
        load_machine_file(str(tmp_path / "missing.yaml"))
    with pytest.raises(UserError, match="unknown key.*flops_peak"):
        load_machine_file(_write(tmp_path, GOOD + "flops_peak: 1\n"))
    with pytest.raises(UserError, match="lacks memory_gib"):
        load_machine_file(_write(tmp_path, GOOD.replace("memory_gib: 40\n", "")))
    with pytest.raises(UserError, match="memory_bandwidth must be a positive number, got -1"):
        load_machine_file(_write(tmp_path, GOOD.replace("1.0e12", "-1")))
    with pytest.raises(UserError, match="not fp32"):
        load_machine_file(_write(tmp_path, GOOD), dtype="fp32")
    assert load_machine_file(_write(tmp_path, json.dumps({"nodes": 1, "gpus_per_node": 1, "memory_gib": 1,
                                                          "peak_flops": 1e12, "memory_bandwidth": 1,
                                                          "intra_node_bandwidth": 1, "inter_node_bandwidth": 1}),
                                    "m.json")).devices_per_node == 1


def test_preset_files_load_by_name():
    assert preset_names() == ["a100-80gb", "h100-80gb"]
    a100, h100 = load_machine_file("a100-80gb"), load_machine_file("h100-80gb")
    assert a100.world_size == h100.world_size == 8 and a100.memory_gib == 80
    assert h100.matmul_flops > a100.matmul_flops and a100.intra_node_bandwidth > a100.inter_node_bandwidth


def test_calibration_is_saved_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(calibration, "calibrate", lambda dtype, threads, world, quick=False: measured.append(1)
                        or replace(MACHINE, name=f"measured {len(measured)}"))
    first = calibration.load_or_calibrate("bf16", 2, 1)
    again = calibration.load_or_calibrate("bf16", 2, 1)
    assert first == again and len(measured) == 1
    path = calibration.cache_path("bf16", 2, 1)
    assert path.parent == tmp_path / "rlhf-pipeline" / "calibration" and path.name.endswith("-bf16-t2-w1.json")
    assert {"cpu_model", "torch", "date", "machine"} <= set(json.loads(path.read_text()))
    assert calibration.load_or_calibrate("bf16", 2, 1, recalibrate=True).name == "measured 2"


def _dry_run(tmp_path, fakes, extra):
    entries = {step: entry for step, entry in fakes.entries().items() if step != 3}  # step 3's real CLI parses
    config = parse_config(common(tmp_path, fakes.model_dir) + ["--placement", "auto", "--dry-run", *extra])
    return run_pipeline(config, entries=entries, hardware=TWO_CORES)


def test_dry_run_with_placement_auto_prints_the_ranked_plans(tmp_path, tiny_model_dir, capsys, monkeypatch):
    fakes = FakeSteps(tiny_model_dir("llama"))
    _dry_run(tmp_path, fakes, ["--hardware_file", "a100-80gb"])
    out = capsys.readouterr().out
    assert "step 3 --placement auto on 8 rank(s); machine constants: a100-80gb from the hardware file" in out
    assert "placements, fastest first" in out and "the top plan's step-3 flags: --placement" in out

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a saved calibration of this machine is used
    calibration.save_calibration(replace(MACHINE, devices_per_node=1), calibration.cache_path("bf16", 2, 1))
    _dry_run(tmp_path, fakes, [])
    out = capsys.readouterr().out
    assert "on 1 rank(s); machine constants: the saved calibration" in out and "1 │ colocate" in out


def test_published_setups_get_finite_predictions():
    from bench.placement_published import predict_published, published_setups

    presets = {name: load_machine_file(name) for name in preset_names()}
    setups = published_setups()
    assert len(setups) >= 7 and {setup.machine for setup in setups} <= set(presets)
    (row,) = predict_published(presets, setups[:1])  # 7B x4 on 8 A100s: both plans fit
    assert row["gpus"] == 8 and row["published"] > 1 and isinstance(row["agrees"], bool)
    assert 0 < row["predicted"] < float("inf")
