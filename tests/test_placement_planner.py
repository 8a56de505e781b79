"""Step 3's placement cost model and planner: roofline terms by hand, memory by hand, the schedule, the search,
hardware files, calibration caching and train.py's --placement auto dry run."""
import json
import os
import sys
import time
from dataclasses import asdict, replace

import pytest
from test_train_pipeline import TWO_CORES, FakeSteps, common

import training.placement.auto as auto
import training.placement.calibration as calibration
from training.pipeline.cli import parse_config
from training.pipeline.hardware import GIB, ModelSize
from training.pipeline.runner import run_pipeline
from training.loops.call_times import CallTimer
from training.placement.cost_model import estimate_step, forward_call, generation_calls, rank_memory_gib, training_calls
from training.placement.machine import MachineSpec, load_machine_file, preset_names
from training.placement.planner import check_fits, choose_placement, format_plans, search
from training.placement.spec import build_placement
from training.placement.workload import Step3Workload
from utils.errors import UserError

MACHINE = MachineSpec(name="round", nodes=1, devices_per_node=8, memory_gib=80, matmul_flops=1e12,
                      memory_bandwidth=1e11, copy_bandwidth=5e10, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9,
                      collective_latency_s=1e-5, call_overhead_s=1e-3, decode_step_overhead_s=1e-4,
                      baseline_memory_gib=1.0, backward_flops=5e11, attention_flops=1e11,
                      attention_backward_flops=5e10, forward_elementwise_s=1e-10, sampling_s_per_logit=1e-9,
                      backward_elementwise_s=2e-10, optimizer_s_per_param=1e-9, reduce_efficiency=0.5,
                      usable_memory_fraction=1.0)
BILLION = ModelSize(parameters=10**9, hidden_size=1000, num_layers=10, vocab_size=1000)
SMALL = ModelSize(parameters=10**8, hidden_size=500, num_layers=5, vocab_size=1000)
WORKLOAD = Step3Workload(actor=BILLION, critic=BILLION, reward=BILLION, prompts_per_rank=4, samples_per_prompt=1,
                         prompt_len=100, answer_len=100, train_micro_batch=2, dtype="bf16", hybrid_engine=False)


def test_one_forward_is_its_flops_over_the_matmul_rate_plus_its_elementwise_work_and_the_call_overhead():
    call = forward_call(WORKLOAD, "reference", build_placement("colocate", 1), MACHINE)
    # 2 * 1e9 params * 4 rows * 200 tokens + 4 * 4 rows * 200^2 * 1000 hidden * 10 layers
    assert call.flops == pytest.approx(1.6e12 + 6.4e9)
    assert call.bytes == 2e9  # bf16 weights streamed once: 0.02 s, under the 1.6 s of dense math
    # attention's 6.4e9 FLOPs at 1e11 FLOP/s; + 1e-10 s per token per hidden unit per layer: 800 * 1000 * 10; the
    # vocabulary head runs on the 101 positions that predict answer tokens, not the 99 before them
    head_skipped = 2 * 1000 * 1000 * 4 * 99 / 1e12
    assert call.seconds == pytest.approx(1.6 - head_skipped + 0.064 + 8e-4 + 1e-3)


def test_elementwise_work_grows_with_tokens_hidden_and_layers():
    placement = build_placement("colocate", 1)
    base = forward_call(WORKLOAD, "reference", placement, replace(MACHINE, forward_elementwise_s=0.0)).seconds
    longer = replace(WORKLOAD, prompt_len=300)  # 400 tokens a row instead of 200
    base_longer = forward_call(longer, "reference", placement, replace(MACHINE, forward_elementwise_s=0.0)).seconds
    extra = forward_call(WORKLOAD, "reference", placement, MACHINE).seconds - base
    extra_longer = forward_call(longer, "reference", placement, MACHINE).seconds - base_longer
    assert extra == pytest.approx(8e-4) and extra_longer == pytest.approx(2 * extra)


def test_one_decode_step_streams_the_weights_and_the_kv_cache():
    prefill, decode = generation_calls(WORKLOAD, build_placement("colocate", 1), MACHINE)
    # weights 2e9 B + KV 4 rows * 150 mean context * 2 (K, V) * 1000 * 10 layers * 2 B = 2.024e9 B at 1e11 B/s
    assert decode.bytes == pytest.approx(2.024e9)
    assert decode.flops == pytest.approx(8e9 + 4 * 4 * 150 * 1000 * 10)  # 8.024 ms of math: memory-bound
    # + one decode overhead per layer, + drawing each row's token over the 1000-entry vocabulary at 1e-9 s a logit
    assert decode.seconds == pytest.approx(0.02024 + 10 * 1e-4 + 4 * 1000 * 1e-9)
    assert decode.count == 100 and prefill.count == 1


def test_one_train_micro_batch_is_a_forward_and_a_backward_at_the_backward_rate():
    forward, backward, optimizer = training_calls(WORKLOAD, "actor", build_placement("colocate", 1), MACHINE)
    dense, attention = 2e9 * 2 * 200, 4 * 2 * 200**2 * 1000 * 10
    assert forward.flops == pytest.approx(dense + attention)
    assert backward.flops == pytest.approx(2 * (dense + attention))
    # 400 tokens * 1000 hidden * 10 layers of elementwise work: 1e-10 s forward, 2e-10 s backward per unit
    head_skipped = 2 * 1000 * 1000 * 2 * 99  # the vocabulary head on the answer's 101 positions only
    assert forward.seconds == pytest.approx((dense - head_skipped) / 1e12 + attention / 1e11 + 4e-4 + 1e-3)
    # plus the 1e9 bf16 gradients written (2 B), read (2 B) and added into fp32 buffers (4 + 4 B) at 5e10 B/s
    accumulate = 1e9 * (2 + 2 + 4 + 4) / 5e10
    assert backward.seconds == pytest.approx(2 * (dense - head_skipped) / 5e11 + 2 * attention / 5e10 + 8e-4 + 1e-3
                                             + accumulate)
    assert forward.count == backward.count == 2 and optimizer.count == 2  # 4 rows / micro-batch 2, one chunk


def test_attention_runs_at_its_own_rate_and_grows_with_the_square_of_the_sequence():
    placement = build_placement("colocate", 1)

    def attention_s(prompt_len: int) -> float:
        workload = replace(WORKLOAD, prompt_len=prompt_len)
        slow = forward_call(workload, "reference", placement, replace(MACHINE, attention_flops=5e10)).seconds
        return slow - forward_call(workload, "reference", placement, MACHINE).seconds  # half the rate: twice the time

    assert attention_s(100) == pytest.approx(4 * 4 * 200**2 * 1000 * 10 / 1e11)
    assert attention_s(300) == pytest.approx(4 * attention_s(100))  # 400 tokens a row instead of 200


def test_a_value_model_makes_no_vocabulary_logits():
    placement = build_placement("colocate", 1)
    actor, critic = (training_calls(WORKLOAD, role, placement, MACHINE)[0] for role in ("actor", "critic"))
    # same size, but the critic's forward skips the 2 * 1000 vocab * 1000 hidden FLOPs a token of the output head
    # (which the actor spends on the 101 positions that predict answer tokens)
    assert actor.seconds - critic.seconds == pytest.approx(2 * 1000 * 1000 * 2 * 101 / 1e12)
    reference, reward = (forward_call(WORKLOAD, role, placement, MACHINE) for role in ("reference", "reward"))
    assert reference.seconds - reward.seconds == pytest.approx(2 * 1000 * 1000 * 4 * 101 / 1e12)


def test_the_optimizer_step_costs_its_time_per_trained_parameter_sharded_from_zero_1():
    placement = build_placement("colocate", 4, ("actor", "reference"))
    lone = replace(WORKLOAD, critic=None, reward=None)
    step = {stage: training_calls(replace(lone, actor_zero_stage=stage), "actor", placement, MACHINE)[-1]
            for stage in (0, 1)}
    assert step[0].kind == "optimizer step" and step[0].seconds == pytest.approx(1e9 * 1e-9)
    assert step[1].seconds == pytest.approx(1e9 * 1e-9 / 4)
    lora = training_calls(replace(lone, actor_lora_dim=8), "actor", placement, MACHINE)[-1]
    # rank-8 adapters on every block's linear layers, estimated at 18 x 1000 features a block: 1.44e6 parameters
    assert lora.seconds == pytest.approx(8 * 18 * 1000 * 10 * 1e-9)


def test_the_gradient_all_reduce_runs_at_the_reduce_efficiency_of_the_link():
    placement = build_placement("colocate", 2)
    reduce = training_calls(WORKLOAD, "critic", placement, MACHINE)[2]
    # the copies (6 passes over 2e9 B at a copy bandwidth of 5e10 B/s) + 2 * 2e9 B * (2 - 1) / 2 = 2e9 B at
    # 1e10 B/s * 0.5
    assert reduce.kind == "gradient all-reduce" and reduce.seconds == pytest.approx(0.24 + 1e-5 + 0.4)
    full = training_calls(WORKLOAD, "critic", placement, replace(MACHINE, reduce_efficiency=1.0))[2]
    assert full.seconds == pytest.approx(0.24 + 1e-5 + 0.2)


def test_a_master_weight_model_all_reduces_and_holds_its_fp32_gradient_sums():
    """`MasterWeightAdamW` (bf16 at ZeRO-0 through torch's AdamW) sums each micro-batch's gradient in fp32 and hands
    the engine those sums to all-reduce (4 B a parameter, not 2); its hook frees each bf16 gradient once added, and
    its step casts nothing: 4 B of gradients a parameter held (not 2 + 4) and no optimizer-step transient."""
    master = replace(WORKLOAD, device="cpu")  # bf16 at ZeRO-0, --optimizer auto on a CPU: torch's AdamW
    reduce = training_calls(master, "critic", build_placement("colocate", 2), MACHINE)[2]
    # 6 copy passes over 4e9 B at 5e10 B/s + 2 * 4e9 B * (2 - 1) / 2 = 4e9 B at 1e10 B/s * 0.5
    assert reduce.kind == "gradient all-reduce" and reduce.bytes == 8e9
    assert reduce.seconds == pytest.approx(0.48 + 1e-5 + 0.8)
    lone = replace(master, critic=None, reward=None)
    placement = build_placement("colocate", 1, ("actor", "reference"))
    # actor: 2 B weights + 4 B fp32 sums + 12 B fp32 master and Adam moments; reference: 2 B weights; the largest
    # transient is the training micro-batch's (as in the ZeRO test above), not a 4 B-a-parameter cast
    transient = 1.36e8 + 4.04e5 + 3.2e6
    assert rank_memory_gib(lone, placement, MACHINE, 0) == pytest.approx(1.0 + (18e9 + 2e9 + transient) / GIB)


def test_the_workload_names_the_models_that_train_through_master_weights_as_training_decides():
    """`Step3Workload.master_weights` comes from the very rule that picks the optimizer (`uses_master_weights`),
    with `--optimizer auto` resolved for the device planned for: this CPU, or a hardware file's GPUs (FusedAdam)."""
    from step3_rlhf.main import parse_args
    from training.core.args import optimization_settings
    from training.placement.workload import step3_workload

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]

    def roles(*flags: str, dtype: str = "bf16") -> tuple[str, ...]:
        workload = step3_workload(parse_args([*base, *flags]), BILLION, BILLION, BILLION, dtype)
        return tuple(role for role in ("actor", "critic") if workload.master_weights(role))

    def trained_with_master_weights(*flags: str) -> tuple[str, ...]:
        """What step 3's engines on this CPU decide for the same flags."""
        args = parse_args([*base, *flags])
        return tuple(role for role, model in (("actor", args.actor), ("critic", args.critic))
                     if optimization_settings(model, args.schedule, "bf16", 1, 1).master_weights)

    for flags in [(), ("--actor_zero_stage", "1"), ("--critic_zero_stage", "2", "--critic_offload"),
                  ("--optimizer", "fused_adam"), ("--optimizer", "torch_adamw", "--actor_zero_stage", "3")]:
        assert roles(*flags) == trained_with_master_weights(*flags), flags
    assert roles() == ("actor", "critic") and roles("--actor_zero_stage", "1") == ("critic",)
    assert roles(dtype="fp16") == roles(dtype="fp32") == ()  # DeepSpeed's own precision
    assert roles("--hardware_file", "a100-80gb") == ()  # auto is FusedAdam on GPUs
    assert roles("--hardware_file", "a100-80gb", "--optimizer", "torch_adamw") == ("actor", "critic")


def test_a_plan_at_another_zero_stage_than_the_runs_is_sized_as_that_stage_trains():
    """The planner tries every ZeRO stage on the run's workload: a ZeRO-1 plan of a bf16 ZeRO-0 run on this CPU
    trains through DeepSpeed's ZeRO optimizer, not `MasterWeightAdamW`, and a ZeRO-0 plan of a ZeRO-1 run through
    it; each is estimated as the run at that stage is."""
    from step3_rlhf.main import parse_args
    from training.placement.workload import step3_workload

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]

    def workload(stage: int) -> Step3Workload:
        flags = ["--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage)]
        return step3_workload(parse_args([*base, *flags]), BILLION, BILLION, BILLION, "bf16")

    placement = build_placement("colocate", 2)
    for run, planned in ((0, 1), (1, 0)):
        tried = replace(workload(run), actor_zero_stage=planned, critic_zero_stage=planned)
        assert estimate_step(tried, placement, MACHINE) == estimate_step(workload(planned), placement, MACHINE), run


def test_a_model_trained_on_one_rank_at_zero_0_has_no_gradient_all_reduce():
    """The engine skips ZeRO-0's all-reduce over a single rank (a sum over one rank); at ZeRO-1 DeepSpeed still
    flattens, averages and copies the gradients back."""
    placement = build_placement("colocate", 1)
    kinds = {stage: [call.kind for call in training_calls(replace(WORKLOAD, critic_zero_stage=stage), "critic",
                                                          placement, MACHINE)] for stage in (0, 1)}
    assert kinds[0] == ["train forward", "backward", "optimizer step"]
    assert kinds[1] == ["train forward", "backward", "gradient all-reduce", "optimizer step"]
    reduce = training_calls(replace(WORKLOAD, critic_zero_stage=1), "critic", placement, MACHINE)[2]
    assert reduce.seconds == pytest.approx(6 * 2e9 / 5e10)


def test_the_decode_step_overhead_grows_the_generation_with_the_decode_steps():
    placement = build_placement("colocate", 1)

    def overhead_s(answer_len: int) -> float:
        workload = replace(WORKLOAD, answer_len=answer_len)
        quiet_machine = replace(MACHINE, decode_step_overhead_s=0.0, sampling_s_per_logit=0.0)
        quiet = estimate_step(workload, placement, quiet_machine).generation_s
        return estimate_step(workload, placement, MACHINE).generation_s - quiet

    # steps x (layers x per-layer overhead + rows x vocabulary x per-logit sampling cost)
    assert overhead_s(100) == pytest.approx(100 * (10 * 1e-4 + 4 * 1000 * 1e-9))
    assert overhead_s(200) == pytest.approx(2 * overhead_s(100))


def test_the_hybrid_engine_builds_an_inference_copy_each_pass():
    hybrid = replace(WORKLOAD, hybrid_engine=True)
    enter, prefill, decode = generation_calls(hybrid, build_placement("colocate", 1), MACHINE)
    # copied (read + write) then reordered (read + write): 4 x 2e9 B at a copy bandwidth of 5e10 B/s
    assert enter.kind == "enter generate mode" and enter.seconds == pytest.approx(0.16) and enter.count == 1
    assert len(generation_calls(WORKLOAD, build_placement("colocate", 1), MACHINE)) == 2


def test_zero3_divides_the_trained_models_states_by_the_group_on_four_ranks():
    placement = build_placement("colocate", 4, ("actor", "reference"))
    lone = replace(WORKLOAD, critic=None, reward=None)
    zero0 = rank_memory_gib(replace(lone, actor_zero_stage=0), placement, MACHINE, 0)
    zero3 = rank_memory_gib(replace(lone, actor_zero_stage=3), placement, MACHINE, 0)
    # actor: 2 B weights + 2 B grads + 4 B the fp32 master's grads + 12 B fp32 master and Adam moments per
    # parameter; reference: 2 B weights
    # (sharded with the actor under ZeRO-3); the largest transient is the optimizer step's fp32 casts of the
    # gradients (4 B per parameter; ZeRO-3 shards them), over the training micro-batch's
    # 34 * 2 rows * 200 * 1000 * 10 B activations + 2 * 101 * 1000 * 2 B logits (the answer's positions, model
    # dtype) + 4 * 2 * 200 * 1000 * 2 B
    assert zero0 == pytest.approx(1.0 + (20e9 + 2e9 + 4e9) / GIB)
    assert zero3 == pytest.approx(1.0 + (20e9 / 4 + 2e9 / 4 + 4e9 / 4) / GIB)
    small = replace(lone, actor_lora_dim=8, actor_zero_stage=0)  # 1.44e6 trainable: the micro-batch is the largest
    transient = 1.36e8 + 4.04e5 + 3.2e6
    assert rank_memory_gib(small, placement, MACHINE, 0) == pytest.approx(
        1.0 + (2e9 + 1.44e6 * 18 + 2e9 + transient) / GIB)
    fp32 = rank_memory_gib(replace(lone, dtype="fp32"), placement, MACHINE, 0)  # no master copy, no master grads
    fp32_transient = 2.72e8 + 8.08e5 + 6.4e6
    assert fp32 == pytest.approx(1.0 + (4e9 + 4e9 + 8e9 + 4e9 + fp32_transient) / GIB)


def test_a_kept_inference_copy_is_held_through_training():
    """--keep_inference_copy: the copy (2e9 B in bf16) is no longer generation's alone; where training's transient is
    the largest, the rank's peak grows by exactly the copy."""
    placement = build_placement("colocate", 1, ("actor", "reference"))
    lone = replace(WORKLOAD, critic=None, reward=None, hybrid_engine=True)
    default, kept = (rank_memory_gib(replace(lone, keep_inference_copy=keep), placement, MACHINE, 0)
                     for keep in (False, True))
    assert kept == pytest.approx(default + 2e9 / GIB)


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


def test_stage_fusion_scores_micro_batches_as_the_answers_end():
    placement = build_placement("disaggregate", 4)  # ranks 2-3 generate two chunks each, ranks 0-1 score them
    plain = replace(WORKLOAD, hybrid_engine=True)
    fused = replace(plain, stage_fusion=True, stage_fusion_micro_batch=2)
    per_pass = sum(call.seconds * call.count for call in generation_calls(fused, placement, MACHINE)) / 2
    per_chunk = sum(forward_call(plain, role, placement, MACHINE).seconds
                    for role in ("actor", "reference", "reward", "critic"))
    two_rows = replace(plain, prompts_per_rank=2)
    per_micro_batch = sum(forward_call(two_rows, role, placement, MACHINE).seconds
                          for role in ("actor", "reference", "reward", "critic"))
    assert estimate_step(plain, placement, MACHINE).scoring_s == pytest.approx(2 * per_chunk)
    # 4 rows a chunk end evenly over its pass: micro-batches of 2 ready at 1/2 and 1 pass (chunk 0), 3/2 and 2
    # (chunk 1); rank 0 scores each as soon as it is ready and it is free
    free = 0.0
    for ready in (0.5 * per_pass, per_pass, 1.5 * per_pass, 2 * per_pass):
        free = max(free, ready) + per_micro_batch
    estimate = estimate_step(fused, placement, MACHINE)
    assert estimate.generation_s == pytest.approx(2 * per_pass)
    assert estimate.scoring_s == pytest.approx(free - 2 * per_pass)
    assert estimate.step_s < estimate_step(plain, placement, MACHINE).step_s
    # co-located, a rank scores after its own generation, in more and smaller forwards: slower
    colocated = build_placement("colocate", 4)
    assert estimate_step(fused, colocated, MACHINE).scoring_s == pytest.approx(2 * per_micro_batch)
    assert estimate_step(fused, colocated, MACHINE).step_s > estimate_step(plain, colocated, MACHINE).step_s
    # the KV cache and a micro-batch's scoring forward are alive together (fp32: generation's memory, not the
    # optimizer's, is the largest transient)
    fp32 = {fusion: replace(fused, dtype="fp32", stage_fusion=fusion) for fusion in (False, True)}
    peaks = {fusion: estimate_step(workload, colocated, MACHINE).peak_memory_gib for fusion, workload in fp32.items()}
    assert peaks[True] > peaks[False]
    plans = search(plain, MACHINE, 4)
    assert {plan.stage_fusion for plan in plans} == {False, True}
    assert all(not plan.stage_fusion for plan in plans if 3 in (plan.actor_zero_stage, plan.critic_zero_stage))
    assert not plans[0].stage_fusion or plans[0].placement.has("rollout")
    best_disaggregated = next(plan for plan in plans if plan.placement.has("rollout"))
    assert best_disaggregated.stage_fusion and "--enable_stage_fusion" in best_disaggregated.flags
    assert all(plan.stage_fusion for plan in search(fused, MACHINE, 4))  # asked for: kept


def test_planner_keeps_only_plans_that_fit_fastest_first():
    tight = replace(MACHINE, memory_gib=16.0)  # 4 x 1B models: ZeRO-0 states alone take 44 GB per rank
    plans = search(WORKLOAD, tight, 4)
    assert plans and all(plan.estimate.peak_memory_gib <= 16.0 for plan in plans)
    assert all((plan.actor_zero_stage, plan.critic_zero_stage) != (0, 0) for plan in plans)
    times = [plan.estimate.step_s for plan in plans]
    assert times == sorted(times)
    best = choose_placement(WORKLOAD, tight, 4)
    assert best.estimate.step_s == times[0]
    assert best.flags[:2] == ["--placement", best.base] and "--per_device_training_batch_size" in best.flags
    table = format_plans(plans, top=3)
    assert "placement" in table and best.placement.name in table and "peak GiB" in table


def test_the_planner_offers_only_plans_step_3_accepts():
    """Its micro-batches make whole optimizer steps of --gradient_accumulation_steps in a PPO step (each generation
    batch split on its own), and a model whose optimizer state is offloaded is never planned at ZeRO-0; before,
    `auto` could pick a plan that failed mid-run or that step 3 refuses."""
    accumulated = replace(WORKLOAD, prompts_per_rank=8, generation_batches=2, accumulation=4)
    for plan in search(accumulated, MACHINE, 4):
        assert accumulated.whole_optimizer_steps(plan.micro_batch)
    # 4 rows a generation batch: micro-batches of 1 or 2 make 8 or 4 a step; of 4, 2 (half an optimizer step)
    assert {plan.micro_batch for plan in search(accumulated, MACHINE, 4)} == {1, 2}
    assert not accumulated.whole_optimizer_steps(4)
    offloaded = replace(WORKLOAD, optimizer_offloaded=("actor",), actor_zero_stage=2)
    assert all(plan.actor_zero_stage >= 1 for plan in search(offloaded, MACHINE, 4))
    assert {plan.actor_zero_stage for plan in search(offloaded, MACHINE, 1)} == {2}
    assert {plan.actor_zero_stage for plan in search(WORKLOAD, MACHINE, 1)} == {0}


def test_the_planner_tries_the_runs_own_micro_batch_and_one():
    """Only the largest power-of-two divisors of a generation batch's rows were tried: where none of them made whole
    optimizer steps, `auto` found no plan and told the user to use more ranks, although the run's own micro-batch
    (or 1) made them."""
    # 40 rows: micro-batches of 3 make 14 a step; of 1, 2, 4, 8, 40: 40, 20, 10, 5, 1
    own = replace(WORKLOAD, prompts_per_rank=40, train_micro_batch=3, accumulation=7)
    assert {plan.micro_batch for plan in search(own, MACHINE, 4)} == {3}
    one = replace(own, train_micro_batch=5, accumulation=40)  # of 5: 8
    assert {plan.micro_batch for plan in search(one, MACHINE, 4)} == {1}
    assert choose_placement(one, MACHINE, 4).micro_batch == 1


def test_auto_names_the_accumulation_when_no_micro_batch_makes_whole_optimizer_steps():
    """Not memory: more ranks would not help."""
    odd = replace(WORKLOAD, accumulation=3)  # 4 rows: micro-batches of 1, 2, 4 make 4, 2, 1 a step
    with pytest.raises(UserError, match=r"--gradient_accumulation_steps 3: a PPO step then has 4, 2, 1 micro-batches") \
            as refused:
        choose_placement(odd, MACHINE, 4)
    assert "more ranks" not in str(refused.value)


def test_lora_counts_as_adapters_only_when_only_they_train(tmp_path):
    from step3_rlhf.main import parse_args
    from training.placement.workload import step3_workload

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
            "--actor_lora_dim", "8"]
    # the base weights train too
    assert step3_workload(parse_args(base), BILLION, BILLION, BILLION).lora_adapters("actor")[0] == 0
    adapters = step3_workload(parse_args([*base, "--actor_only_optimize_lora", "--actor_lora_module_name", "attn."]),
                              BILLION, BILLION, BILLION)
    assert adapters.lora_adapters("actor") == (8, "attn.")


def test_a_critic_that_trains_only_its_adapters_is_costed_by_them():
    """The cost model took only the actor's adapters as LoRA: a --critic_only_optimize_lora critic's optimizer step,
    gradients and Adam state were counted for every parameter (review RV2). The critic is costed as the actor is."""
    from step3_rlhf.main import parse_args
    from training.placement.workload import step3_workload

    argv = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
            "--critic_lora_dim", "8", "--critic_only_optimize_lora", "--critic_lora_module_name", "attn."]
    workload = step3_workload(parse_args(argv), BILLION, BILLION, BILLION)
    assert workload.lora_adapters("critic") == (8, "attn.") and workload.lora_adapters("actor")[0] == 0
    placement = build_placement("colocate", 4)
    critic_lora = replace(WORKLOAD, critic_lora_dim=8)
    critic_step = training_calls(critic_lora, "critic", placement, MACHINE)[-1]
    actor_step = training_calls(replace(WORKLOAD, actor_lora_dim=8), "actor", placement, MACHINE)[-1]
    # rank-8 adapters on every block's linear layers, estimated at 18 x 1000 features a block: 1.44e6 parameters
    assert critic_step.seconds == actor_step.seconds == pytest.approx(8 * 18 * 1000 * 10 * 1e-9)
    assert rank_memory_gib(critic_lora, placement, MACHINE, 0) < rank_memory_gib(WORKLOAD, placement, MACHINE, 0) - 10


@pytest.mark.parametrize("arch, module_name", [("llama", None), ("llama", "self_attn."), ("gpt2", None),
                                               ("gpt2", "attn."), ("opt", None)])
def test_the_lora_parameters_counted_are_those_lora_trains(tiny_model_dir, arch, module_name):
    """The planners count a LoRA run's trained parameters from the model's linear layers, the rank and the layers
    `--lora_module_name` selects (default: every block's), as `apply_lora` makes them: a fixed 1% of the parameters
    was under a quarter of a rank-128 adapter on every linear layer of a 7B Llama (4.6%) and 8 times a rank-8 one on
    its attention alone (0.12%). A size read without its layers is estimated from its width and depth."""
    from transformers import AutoModelForCausalLM

    from training.core.lora import apply_lora
    from training.pipeline.hardware import lora_trainable_parameters, model_size

    folder = tiny_model_dir(arch)
    size = model_size(folder)
    for rank in (4, 8):
        model = apply_lora(AutoModelForCausalLM.from_pretrained(folder), rank, module_name or size.blocks_name,
                           only_optimize_lora=True)
        trained = sum(param.numel() for param in model.parameters() if param.requires_grad)
        assert lora_trainable_parameters(size, rank, module_name) == trained > 0, rank
    assert lora_trainable_parameters(replace(size, linear_features=()), 8) == \
        8 * 18 * size.hidden_size * size.num_layers


def test_check_fits_names_the_rank_the_models_and_the_gib():
    tiny = replace(MACHINE, memory_gib=8.0)
    with pytest.raises(UserError, match=r"cannot fit: rank 0 holds the actor, critic, reference, reward and needs "
                                        r"[\d.]+ GiB, but round has 8.0 GiB"):
        check_fits(WORKLOAD, build_placement("colocate", 4), tiny)
    check_fits(replace(WORKLOAD, actor_zero_stage=3, critic_zero_stage=3), build_placement("colocate", 4), MACHINE)
    with pytest.raises(UserError, match="cannot fit: rank 0") as refused:  # the co-located ZeRO-3 plan's error
        choose_placement(WORKLOAD, replace(MACHINE, memory_gib=1.0), 4)
    assert "ZeRO" not in str(refused.value)  # at ZeRO-3 already: no advice to raise the stages


def test_no_placement_fitting_one_rank_counts_it_in_the_singular(monkeypatch):
    """It said 'fits 1 rank(s)'."""
    monkeypatch.setattr("training.placement.planner.search", lambda *args: [])  # none offered; ZeRO-3 colocate fits
    for world, said in ((1, "fits 1 rank of round"), (4, "fits 4 ranks of round")):
        with pytest.raises(UserError, match=f"no placement of step 3's models {said}; use more ranks"):
            choose_placement(WORKLOAD, MACHINE, world)


def test_a_calibrated_machine_counts_one_rank_in_the_singular(monkeypatch):
    """Its name said '1 rank(s)'."""
    unmeasured = {"name", "nodes", "devices_per_node", "memory_gib", "inter_node_bandwidth", "baseline_memory_gib",
                  "usable_memory_fraction", "call_time_factors", "step_overhead_s", "others_busy_cores"}
    measured = {key: value for key, value in asdict(MACHINE).items() if key not in unmeasured}
    monkeypatch.setattr(calibration, "measure_ranks", lambda *args: measured)
    monkeypatch.setattr(calibration, "measure_baseline_memory_gib", lambda quick: 1.0)
    for world, said in ((1, ", 1 rank)"), (2, ", 2 ranks)")):
        assert calibration.calibrate("fp32", 1, world, quick=True).name.endswith(said)


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
    with pytest.raises(UserError, match="memory_bandwidth must be a positive, finite number, got -1"):
        load_machine_file(_write(tmp_path, GOOD.replace("1.0e12", "-1")))
    for infinite in (".inf", "inf", "1e400"):  # YAML's infinity, and text read as a number
        with pytest.raises(UserError, match="memory_bandwidth must be a positive, finite number, got inf"):
            load_machine_file(_write(tmp_path, GOOD.replace("1.0e12", infinite)))
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


def test_hardware_files_default_the_measured_constants_from_the_datasheet(tmp_path):
    machine = load_machine_file(_write(tmp_path, GOOD))
    assert machine.backward_flops == pytest.approx(2.0e12 * 0.5) == machine.matmul_flops
    assert machine.optimizer_s_per_param == pytest.approx(40 / 0.8e12)
    assert machine.forward_elementwise_s == pytest.approx(12 * 2 / 0.8e12)
    assert machine.backward_elementwise_s == pytest.approx(2 * machine.forward_elementwise_s)
    assert machine.copy_bandwidth == machine.memory_bandwidth == pytest.approx(0.8e12)
    assert machine.reduce_efficiency == 1.0 and machine.sampling_s_per_logit == pytest.approx(40 / 0.8e12)
    tuned = load_machine_file(_write(tmp_path, GOOD + "backward_efficiency: 0.25\nreduce_efficiency: 0.5\n"))
    assert tuned.backward_flops == pytest.approx(0.5e12) and tuned.reduce_efficiency == 0.5


@pytest.mark.parametrize("key", ["matmul_efficiency", "memory_efficiency", "link_efficiency", "backward_efficiency",
                                 "reduce_efficiency", "usable_memory_fraction"])
def test_a_share_of_a_peak_above_one_is_refused(tmp_path, key):
    """reduce_efficiency and usable_memory_fraction above 1 were capped at 1 without a word; the others planned rates
    above the datasheet's peaks. 1 itself is a peak reached."""
    with pytest.raises(UserError, match=f"hardware file .*: {key} 1.5 above 1; each is the share of a peak"):
        load_machine_file(_write(tmp_path, GOOD + f"{key}: 1.5\n"))
    load_machine_file(_write(tmp_path, GOOD + f"{key}: 1\n"))


def test_each_of_two_ranks_on_two_cores_is_calibrated_on_one_core(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []
    monkeypatch.setattr(auto, "calibrate", lambda dtype, threads, world, quick=False: asked.append((threads, world))
                        or MACHINE)
    auto.planning_machine(None, False, "bf16", 2, cores=2)
    auto.planning_machine(None, False, "bf16", 1, cores=2)
    assert asked == [(1, 2), (2, 1)]  # two groups at once: a core each; alone: both


def test_a_calibration_times_the_gradient_all_reduce_in_the_dtype_training_reduces(monkeypatch):
    """bf16 on a CPU trains through `MasterWeightAdamW`, whose fp32 gradient sums DeepSpeed all-reduces: a rank of the
    calibration times its all-reduce in fp32 there (it timed bf16); fp16 and fp32 reduce in their own dtype."""
    import queue

    import torch
    import torch.distributed as dist

    import utils.dist

    reduced = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(utils.dist, "launcher_variables", lambda environ: [])
    monkeypatch.setattr(utils.dist, "leave_spawned_rank", lambda: None)
    monkeypatch.setattr(calibration, "measure_rank", lambda dtype, quick, sync: {})
    monkeypatch.setattr(calibration, "measure_collectives", lambda world, dtype: reduced.append(dtype) or {})
    for dtype in ("bf16", "fp16", "fp32"):
        calibration._rank_worker(1, 2, 0, dtype, torch.get_num_threads(), True, queue.SimpleQueue())
    assert reduced == [torch.float32, torch.float16, torch.float32]


def test_the_profiled_steps_workload_is_the_one_its_flags_give():
    """A calibration scales each kind of call by its time in a profiled step over the cost model's estimate of that
    step: the estimate must be of the step its flags run (master weights included: a bf16 step on this CPU trains
    through `MasterWeightAdamW`), or the factors carry the difference into every later plan."""
    from pathlib import Path

    from step3_rlhf.main import parse_args
    from training.placement.step_profile import profile_argv, profile_workload
    from training.placement.workload import step3_workload

    for dtype in ("bf16", "fp32"):
        args = parse_args(profile_argv(Path("actor"), Path("reward"), Path("run"), dtype))
        assert profile_workload(BILLION, SMALL, dtype) == step3_workload(args, BILLION, SMALL, SMALL, dtype), dtype


def test_call_times_are_exclusive_of_the_calls_nested_in_them():
    timer = CallTimer()

    class Engine:
        def step(self):
            with timer.time("inner"):
                time.sleep(0.02)
            time.sleep(0.01)

    engine = Engine()
    assert timer.wrap(engine, "step", "outer") and not timer.wrap(engine, "missing.step", "none")
    engine.step()
    engine.step()
    taken = timer.take()
    assert taken["outer"]["n"] == taken["inner"]["n"] == 2
    assert 0.02 <= taken["outer"]["s"] < 0.04 <= taken["inner"]["s"]
    assert timer.take() == {}


def test_a_decoder_handed_back_at_every_entry_is_timed_once_per_call():
    """The kept inference copy (--keep_inference_copy) returns the same decoder at every entry into generate mode:
    its prefill and decode step were wrapped again each time, so after k rollouts each call counted k times (and
    ~1,000 rollouts overflowed the stack)."""
    timer = CallTimer()

    class Model:
        def prefill(self):
            return None

        def step(self):
            return None

    class Generator:
        decoder = type("Decoder", (), {"model": Model()})()

        def _enter(self):
            return self.decoder

        def generate(self):
            self._enter().model.prefill()
            for _ in range(3):
                self.decoder.model.step()

    generator = Generator()
    timer.instrument({}, {}, generator, "actor")
    for _ in range(4):
        generator.generate()
        taken = timer.take()
        assert (taken["actor/prefill"]["n"], taken["actor/decode step"]["n"]) == (1, 3)


def test_calibration_is_saved_then_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("RLHF_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(calibration, "calibrate", lambda dtype, threads, world, quick=False: measured.append(1)
                        or replace(MACHINE, name=f"measured {len(measured)}"))
    first = calibration.load_or_calibrate("bf16", 2, 1)
    again = calibration.load_or_calibrate("bf16", 2, 1)
    assert first == again and len(measured) == 1
    path = calibration.cache_path("bf16", 2, 1)
    assert path.parent == tmp_path / "rlhf_pipeline" / "calibration" and path.name.endswith("-bf16-t2-w1.json")
    assert {"cpu_model", "torch", "date", "machine"} <= set(json.loads(path.read_text()))
    assert calibration.load_or_calibrate("bf16", 2, 1, recalibrate=True).name == "measured 2"
    # under the project's one cache root, which RLHF_CACHE_DIR moves (it went to ~/.cache/rlhf-pipeline regardless)
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert calibration.cache_path("bf16", 2, 1).parent == tmp_path / "elsewhere" / "calibration"


def test_a_calibration_records_the_cores_other_processes_kept_busy(monkeypatch):
    """On a busy machine the calibration's rates are slower than the machine's (a quick profile predicted a 247 s PPO
    step for a ~20 s one) and nothing said so. The cores other processes took meanwhile are recorded; this process's
    own work, and its ranks' once they ended, are not counted."""
    import subprocess

    def measure_ranks(dtype, threads, world_size, quick):  # a rank in a child process, waited for, burns a second
        subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 1.0\n"
                        "while time.process_time() < end: pass"], check=True)
        end = time.process_time() + 0.5
        while time.process_time() < end:  # and this process half a second
            pass
        return {field: 1.0 for field in ("matmul_flops", "memory_bandwidth", "copy_bandwidth", "intra_node_bandwidth",
                                         "collective_latency_s", "call_overhead_s", "decode_step_overhead_s",
                                         "backward_flops", "attention_flops", "attention_backward_flops",
                                         "forward_elementwise_s", "backward_elementwise_s", "optimizer_s_per_param",
                                         "reduce_efficiency", "sampling_s_per_logit")}

    monkeypatch.setattr(calibration, "measure_ranks", measure_ranks)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # another program, busy throughout
    try:
        machine = calibration.calibrate("bf16", 1, 1, quick=True)
    finally:
        burner.kill()
        burner.wait()
    assert machine.others_busy_cores >= 0.5

    ticks = iter([(0.0, 10.0, 1.0), (2.0, 15.0, 4.0)])  # (wall s, machine busy s, own + waited children's s)
    monkeypatch.setattr(calibration.OthersBusyCores, "_cpu_seconds", staticmethod(lambda: next(ticks)))
    with calibration.OthersBusyCores() as others:
        pass
    assert others.cores == 1.0  # 5 busy seconds less 3 of its own, over 2 s


def test_the_busy_cores_are_counted_on_the_cores_this_process_may_use(monkeypatch):
    """The whole host's CPU time was counted: pinned to 1 core of 2, with the other one busy, it said '1.99 of 1
    cores busy'."""
    from collections import namedtuple

    times = namedtuple("scputimes", "user system idle iowait")
    readings = iter([[times(0, 0, 10, 0), times(0, 0, 10, 0)], [times(0, 0, 12, 0), times(2, 0, 10, 0)]])

    def cpu_times(percpu=False):  # each core's, or the host's sum
        cores = next(readings)
        return cores if percpu else times(*map(sum, zip(*cores)))

    monkeypatch.setattr(calibration.psutil, "cpu_times", cpu_times)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with calibration.OthersBusyCores() as others:
        pass
    assert others.cores == 0.0  # core 1 was busy, but this process may not run there


def test_the_planners_basis_says_how_busy_the_machine_was_while_calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    path = calibration.cache_path("bf16", 2, 1)
    for busy, said in ((None, ""), (0.1, "; other processes kept 0.1 of 2 cores busy while it measured"),
                       (1.5, "; measured while other processes kept 1.5 of 2 cores busy, so its times (and the "
                             "predicted steps) are slower than this machine's when it is idle: calibrate again then "
                             "(--calibrate)")):
        calibration.save_calibration(replace(MACHINE, devices_per_node=1, others_busy_cores=busy), path)
        machine, source = auto.planning_machine(None, False, "bf16", 1, cores=2)
        assert machine.others_busy_cores == busy and source == f"machine constants: the saved calibration {path}{said}"


def _dry_run(tmp_path, fakes, extra):
    entries = {step: entry for step, entry in fakes.entries().items() if step != 3}  # step 3's real CLI parses
    config = parse_config(common(tmp_path, fakes.model_dir) + ["--placement", "auto", "--dry-run", *extra])
    return run_pipeline(config, entries=entries, hardware=TWO_CORES)


def test_dry_run_with_placement_auto_prints_the_ranked_plans(tmp_path, tiny_model_dir, capsys, monkeypatch):
    fakes = FakeSteps(tiny_model_dir("llama"))
    _dry_run(tmp_path, fakes, ["--hardware_file", "a100-80gb"])
    out = capsys.readouterr().out
    assert ("step 3 --placement auto on 8 ranks (the hardware file's nodes x GPUs); machine constants: a100-80gb "
            "from the hardware file") in out
    assert "placements, fastest first" in out and "the top plan's step-3 flags: --placement" in out

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a saved calibration of this machine is used
    calibration.save_calibration(replace(MACHINE, devices_per_node=1), calibration.cache_path("bf16", 2, 1))
    _dry_run(tmp_path, fakes, [])
    out = capsys.readouterr().out
    assert "on 1 rank (the run's); machine constants: the saved calibration" in out and "1 │ colocate" in out


def test_a_gpu_deployments_dry_run_plans_its_own_ranks_with_a_hardware_files_gpus(tmp_path, tiny_model_dir, capsys):
    """The dry run planned the hardware file's 8 ranks for a one-GPU run and a 16-GPU one, whose step 3 then planned
    its own ranks: the plans printed were not the ones the run would take."""
    fakes = FakeSteps(tiny_model_dir("llama"))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    for deployment, ranks in ((["single_gpu"], "1 rank"), (["multi_node", "--hostfile", str(hostfile)], "16 ranks")):
        _dry_run(tmp_path, fakes, ["--hardware_file", "a100-80gb", "--deployment-type", *deployment])
        out = capsys.readouterr().out
        assert f"step 3 --placement auto on {ranks} (the run's); machine constants: a100-80gb" in out
        if ranks == "1 rank":  # one rank shards nothing and lends no rank to a rollout
            assert "flags: --placement colocate --placement_ratio actor=1,critic=1,reference=1,reward=1,rollout=0 " \
                   "--actor_zero_stage 0 --critic_zero_stage 0" in out


def test_a_hardware_file_of_other_nodes_than_the_hostfiles_is_refused_before_planning(tmp_path, tiny_model_dir):
    """--placement auto took the run's ranks from the hostfile but their layout from the hardware file: a hostfile of
    4-GPU nodes planned with a preset of 8-GPU nodes was planned as one NVLink node (collectives at its bandwidth,
    tensor parallelism up to 8 across the two nodes), unsaid."""
    fakes = FakeSteps(tiny_model_dir("llama"))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=4\nworker-2 slots=4\n")
    with pytest.raises(UserError, match=r"--hardware_file a100-80gb describes nodes of 8 GPUs, but the hostfile gives "
                                        r"its nodes 4 slots: .*gpus_per_node: 4"):
        _dry_run(tmp_path, fakes, ["--hardware_file", "a100-80gb", "--deployment-type", "multi_node", "--hostfile",
                                   str(hostfile)])
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\nworker-3 slots=8\n")  # more nodes than the file's: fine
    _dry_run(tmp_path, fakes, ["--hardware_file", "a100-80gb", "--deployment-type", "multi_node", "--hostfile",
                               str(hostfile)])

def test_published_setups_get_finite_predictions():
    from bench.placement_published import predict_published, published_setups

    presets = {name: load_machine_file(name) for name in preset_names()}
    setups = published_setups()
    assert len(setups) >= 7 and {setup.machine for setup in setups} <= set(presets)
    eight, thirty_two = predict_published(presets, setups[:2])  # 7B x4 on 8 and on 32 A100s
    assert thirty_two["gpus"] == 32 and thirty_two["published"] > 1 and isinstance(thirty_two["agrees"], bool)
    assert 0 < thirty_two["predicted"] < float("inf")
    # on 8 GPUs the 7B critic needs ZeRO-3, which would partition the reward model Interleave1 puts on half
    assert eight["gpus"] == 8 and eight["predicted"] is None and eight["agrees"] is False


def test_published_bench_help_writes_nothing_and_its_report_goes_to_output(tmp_path, monkeypatch, capsys):
    """`--help` printed the usage only after the bench had overwritten the committed report; `--output` names the
    file, and the command recorded in it is the one that ran."""
    import bench.placement_published as published

    monkeypatch.setattr(published, "RESULTS", tmp_path / "committed.json")
    monkeypatch.setattr(sys, "argv", ["placement_published.py", "--help"])
    with pytest.raises(SystemExit) as stopped:
        published.main()
    assert stopped.value.code == 0 and "--output" in capsys.readouterr().out
    assert not (tmp_path / "committed.json").exists()
    monkeypatch.setattr(published, "predict_published", lambda presets: [])
    published.main(["--output", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["command"] == f"python -m bench.placement_published --output {tmp_path / 'report.json'}"
    assert report["rows"] == [] and not (tmp_path / "committed.json").exists()


def test_placement_auto_for_gpu_ranks_needs_a_hardware_file(tmp_path, tiny_model_dir, monkeypatch):
    """Without --hardware_file, --placement auto took this machine's calibration, of its CPU, for GPU ranks: a login
    node's dry run spawned a calibration rank per GPU of the cluster, and step 3 on an 8-GPU node planned its GPUs
    with the CPU's rates and an eighth of the host's RAM as each one's memory."""
    monkeypatch.setattr(auto, "calibrate", lambda *args, **kwargs: pytest.fail("calibrated the CPU for GPU ranks"))
    with pytest.raises(UserError, match=r"--placement auto plans GPU ranks here.*pass --hardware_file with a preset "
                                        r"\(a100-80gb, h100-80gb\)"):
        auto.planning_machine(None, False, "bf16", 8, cores=2, gpus=True)
    assert auto.planning_machine("a100-80gb", False, "bf16", 8, cores=2, gpus=True)[0].name == "a100-80gb"

    fakes = FakeSteps(tiny_model_dir("llama"))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    with pytest.raises(UserError, match="--placement auto plans GPU ranks here"):
        _dry_run(tmp_path, fakes, ["--deployment-type", "multi_node", "--hostfile", str(hostfile)])


@pytest.mark.parametrize("layout", ["colocate", "interleave", "disaggregate"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_predictions_grow_with_the_work_and_memory_falls_with_sharding(layout, stage):
    """The planner's ranking leans on these directions: more or longer rows, a bigger model or another PPO epoch cost
    more time and no less memory; a faster machine takes less time; a higher ZeRO stage, or more ranks at ZeRO-3,
    no more memory per rank."""
    roles = ("actor", "critic", "reference", "reward")
    workload = replace(WORKLOAD, actor_zero_stage=stage, critic_zero_stage=stage, hybrid_engine=True)

    def estimate(changed, world=8, name=layout, machine=MACHINE):
        return estimate_step(changed, build_placement(name, world, roles), machine)

    base = estimate(workload)
    for more in (replace(workload, actor=replace(BILLION, parameters=2 * 10**9, hidden_size=1400)),
                 replace(workload, prompts_per_rank=8), replace(workload, answer_len=200),
                 replace(workload, prompt_len=200), replace(workload, samples_per_prompt=2),
                 replace(workload, ppo_epochs=2)):
        grown = estimate(more)
        assert grown.step_s > base.step_s and grown.peak_memory_gib >= base.peak_memory_gib, more
    faster = replace(MACHINE, matmul_flops=2 * MACHINE.matmul_flops, memory_bandwidth=2 * MACHINE.memory_bandwidth)
    assert estimate(workload, machine=faster).step_s < base.step_s
    sharded = replace(workload, actor_zero_stage=stage + 1, critic_zero_stage=stage + 1)
    assert estimate(sharded, name="colocate").peak_memory_gib <= estimate(workload, name="colocate").peak_memory_gib
    zero3 = replace(workload, actor_zero_stage=3, critic_zero_stage=3)
    per_rank = [estimate(zero3, world=world, name="colocate").peak_memory_gib for world in (2, 4, 8, 16)]
    assert per_rank == sorted(per_rank, reverse=True) and per_rank[-1] < per_rank[0]


def test_the_placement_benchmark_shares_out_the_cores_this_process_may_use(monkeypatch):
    """It divided os.cpu_count(), the host's cores: pinned to 2 of 64, each of 2 ranks ran (and was calibrated)
    with 32 threads."""
    from bench.placement import threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert (threads_per_rank(1), threads_per_rank(2), threads_per_rank(4)) == (2, 1, 1)
