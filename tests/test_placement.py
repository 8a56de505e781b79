"""Placement: the layout rule and its errors, and every placement on 2 and 4 gloo ranks training exactly the
co-located run's PPO (same seed: same trained actor and critic, same held-out figures)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.run
from safetensors.torch import load_file

from conftest import REPO_ROOT, TESTS_DIR
from supervised_data import arithmetic_rows, write_arithmetic_jsonl
from tiny_models import make_custom_code_model_dir
from crash_resume import (
    assert_same_weights,
    finished_output,
    kill_after_checkpoint,
    latest_checkpoint_step,
    launch_step,
    run_step,
)
from test_step3_rlhf import make_step3_inputs
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.placement.spec import build_placement, parse_placement_ratio
from utils.dist import free_port
from utils.errors import UserError

ROLES = ("actor", "critic", "reference", "reward")


def test_presets_lay_out_the_models_and_chunks():
    interleave = build_placement("interleave", 4, ROLES)
    assert interleave.ranks == {"actor": (0, 1, 2, 3), "critic": (0, 1, 2, 3), "reference": (0, 1),
                                "reward": (2, 3)}
    assert interleave.chunks("reference", 1) == [2, 3] and interleave.chunks("reward", 1) == []
    assert interleave.concurrent("reference", "reward") and not interleave.is_colocated
    disaggregate = build_placement("disaggregate", 4, ROLES)
    assert disaggregate.ranks["rollout"] == (2, 3) and disaggregate.generation_role == "rollout"
    assert disaggregate.chunks("actor", 0) == [0, 1] and disaggregate.chunks_per_member("actor") == 2
    assert build_placement("colocate", 2, ("actor", "reference")).is_colocated
    split = build_placement("colocate", 4, ROLES, parse_placement_ratio("[0.5, 0.5, 1, 1]"))
    assert split.ranks["actor"] == (0, 1) and split.ranks["critic"] == (2, 3)


@pytest.mark.parametrize("name, world, ratio, message", [
    ("interleave", 1, None, "without a rank"),
    ("colocate", 4, "reference=0.1", "without a rank"),
    ("colocate", 4, "reward=0", "without a rank"),
    ("colocate", 4, "reference=0.75,reward=0.5", "more shares than ranks"),
    ("disaggregate", 4, "actor=1", "more shares than ranks"),
    ("colocate", 2, "rollout=1", "leaves none"),
    ("colocate", 4, "reference=0.3", "whole number"),
    ("colocate", 6, "reference=0.5,reward=0.5", None),
    ("colocate", 2, "critc=0.5", "unknown model 'critc'"),
    ("colocate", 2, "reward=half", "not a number"),
    ("colocate", 2, "[1,1,1,1,0,1]", "at most 5"),
    ("spread", 2, None, "unknown placement 'spread'"),
])
def test_a_bad_placement_is_one_clear_error(name, world, ratio, message):
    def build():
        return build_placement(name, world, ROLES, parse_placement_ratio(ratio) if ratio else None)

    if message is None:
        build()
        return
    with pytest.raises(UserError, match=message):
        build()


@pytest.mark.parametrize("name, world, ratio, message", [
    ("disaggregate", 1, None, ("a share of 0.5 of 1 rank, which leaves it without a rank; give it at least 1 "
                               "(shares that work on 1 rank: 1)")),
    ("colocate", 1, {"rollout": 1}, "the rollout share 1 takes every rank (1 rank) and leaves none"),
    ("disaggregate", 2, {"actor": 1}, "the actor asks for 2 of 2 ranks, but the rollout takes 1 rank and leaves 1"),
])
def test_a_placement_error_counts_one_rank_in_the_singular(name, world, ratio, message):
    """The errors said '1 ranks' (on 1 ranks, all 1 ranks) and 'only 1 are left'."""
    with pytest.raises(UserError) as refused:
        build_placement(name, world, ROLES, ratio)
    assert message in str(refused.value)


def test_shares_of_a_world_over_a_thousand_ranks_come_to_whole_ranks():
    """Shares were rounded to a denominator of at most 1000: 1/2048 of 2048 ranks came to no rank, 3/1024 of 1024
    to 2.99854 ranks."""
    layout = build_placement("colocate", 2048, ROLES, {"reference": 1 / 2048, "reward": 1 / 1024})
    assert layout.ranks["reference"] == (0,) and layout.ranks["reward"] == (1, 2)
    with pytest.raises(UserError, match="the reference is on 3 of 1024 ranks"):
        build_placement("colocate", 1024, ROLES, {"reference": 3 / 1024})


def test_a_share_that_is_no_whole_number_of_ranks_is_refused_naming_the_shares_that_work():
    """interleave on 3 ranks (half of them: 1.5 ranks) and a share of 3 of 4 ranks were refused without a share that
    works (0.333333, the six digits a user would type for a third, is 0.999999 ranks: refused, now naming
    0.33333333). Each share named is one --placement_ratio reads back as a layout."""
    for name, world, ratio, shares in (("interleave", 3, None, "0.33333333 or 1"),
                                       ("colocate", 3, "reference=0.333333", "0.33333333 or 1"),
                                       ("colocate", 4, "reference=0.75", "0.25, 0.5 or 1"),
                                       ("colocate", 6, "reward=0.1", "0.16666667, 0.33333333, 0.5 or 1")):
        with pytest.raises(UserError, match=f"(give|give it|work on {world} ranks:) {shares}"):
            build_placement(name, world, ROLES, parse_placement_ratio(ratio) if ratio else None)
        for share in shares.replace(" or ", ", ").split(", "):
            assert build_placement("colocate", world, ROLES, {"reference": float(share)}).ranks["reference"]


def test_a_share_of_a_model_the_run_does_not_hold_is_refused():
    """GRPO trains no critic and --reward_fn alone loads no reward model: --placement_ratio critic=0.5 was ignored
    and the run went on co-located. A list's critic position at the preset's share still passes."""
    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import check_placement_flags

    def flags(*extra: str):
        return parse_args(["--actor_model_name_or_path", "a", "--output_dir", "o", "--algorithm", "grpo",
                           "--n_samples_per_prompt", "2", *extra])

    with pytest.raises(UserError, match=r"gives the critic a share, but this run holds no critic"):
        check_placement_flags(flags("--critic_model_name_or_path", "c", "--placement_ratio", "critic=0.5"), 2)
    with pytest.raises(UserError, match=r"gives the critic and the reward a share.*its models: actor, reference;"):
        check_placement_flags(flags("--reward_fn", "builtin:math", "--placement_ratio", "[1,0.5,1,0.5]"), 2)
    check_placement_flags(flags("--critic_model_name_or_path", "c", "--placement_ratio", "[1,1,0.5,0.5]"), 2)


@pytest.mark.parametrize("ratio, advice", [
    ("1,0.5,0.5,0.5", ("a list cannot leave a position out: give the critic's position colocate's share, "
                       "--placement_ratio '[1,1,0.5,0.5]', or name the shares by model, "
                       "--placement_ratio 'actor=1,reference=0.5,reward=0.5'")),
    ("actor=1,critic=0.5,reward=0.5", "leave out the share of the critic: --placement_ratio 'actor=1,reward=0.5'"),
    ("critic=0.5", "leave out the share of the critic: give no --placement_ratio"),
])
def test_a_refused_share_of_an_absent_model_says_what_to_give_in_the_form_given(ratio, advice):
    """The refusal said "drop that share", which a positional list cannot do: dropping the critic's 0.5 from
    `1,0.5,0.5,0.5` moves the reference's share into the critic's position. Each form is told what to give."""
    with pytest.raises(UserError) as refusal:
        build_placement("colocate", 2, ("actor", "reference", "reward"), parse_placement_ratio(ratio))
    assert str(refusal.value).endswith(advice)
    for given in re.findall(r"--placement_ratio '([^']+)'", advice):  # each value it names is taken
        build_placement("colocate", 2, ("actor", "reference", "reward"), parse_placement_ratio(given))


@pytest.mark.parametrize("text, message", [
    ("[1,,0.5,0.5]", "empty item"),  # was read as [1, 0.5, 0.5]: the later shares moved to other models
    ("1,1,", "empty item"),
    ("reward=0.5,reward=1", "the reward twice"),  # the last one was kept
    ("[1,1,0.5,0.5", "unbalanced"),
    ("1,1,0.5,0.5]", "unbalanced"),
    ("(1,1,0.5,0.5]", "unbalanced"),
    ("1,critic=1", "mixes named shares"),
])
def test_a_malformed_placement_ratio_is_one_clear_error(text, message):
    with pytest.raises(UserError, match=message):
        parse_placement_ratio(text)


def test_a_placement_ratio_may_space_its_items_and_shares():
    assert parse_placement_ratio(" actor = 0.5 , critic= 0.5") == {"actor": 0.5, "critic": 0.5}
    assert parse_placement_ratio("[ 1, 1 , 0.5,0.5 ]") == {"actor": 1.0, "critic": 1.0, "reference": 0.5,
                                                          "reward": 0.5}


def test_step3_refuses_a_bad_placement_before_loading_anything(tmp_path):
    """The error comes from the flags alone: the model paths do not even exist."""
    from step3_rlhf.main import main

    with pytest.raises(SystemExit) as stopped:
        main(["--actor_model_name_or_path", str(tmp_path / "missing"), "--reward_fn", "builtin:math",
              "--output_dir", str(tmp_path / "run"), "--placement", "interleave"])
    assert stopped.value.code != 0
    assert not (tmp_path / "run" / "args.json").exists()


def test_placement_auto_refuses_a_placement_ratio(monkeypatch):
    """The planner chooses the shares: a --placement_ratio beside auto (even an invalid one) was silently ignored."""
    from step3_rlhf import placement_setup
    from step3_rlhf.main import parse_args

    monkeypatch.setattr(placement_setup, "_auto_plan", lambda *args: pytest.fail("planned despite --placement_ratio"))
    for ratio in ("reference=0.5", "reference=7"):
        args = parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                           "--placement", "auto", "--placement_ratio", ratio])
        with pytest.raises(UserError, match=r"--placement_ratio '.*' with --placement auto"):
            placement_setup.resolve_placement(args)


def test_a_resumed_placement_auto_run_takes_the_plan_it_started_with(tmp_path_factory, monkeypatch):
    """The planner's quick profile is timing: planning again on --resume could pick another plan, and the resume was
    then refused for flags (ZeRO stages, micro-batch) the user never gave. The run keeps its first plan."""
    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import AUTO_PLAN_FILE, record_auto_plan, resolve_placement
    from test_step3_rlhf import step3_argv
    from training.placement import auto, planner
    from training.placement.planner import PlanChoice

    inputs = make_step3_inputs(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("auto") / "run"
    plans = iter([PlanChoice(base="colocate", shares={}, actor_zero_stage=stage, critic_zero_stage=stage,
                             inference_tp=1, micro_batch=micro, stage_fusion=False)
                  for stage, micro in ((2, 4), (3, 2))])
    monkeypatch.setattr(auto, "planning_machine", lambda *args: (None, "a stand-in machine"))
    monkeypatch.setattr(planner, "choose_placement", lambda *args: next(plans))

    def resolved(*extra: str):
        args = parse_args(step3_argv(inputs, run_dir, "--placement", "auto", *extra))
        placement, plan = resolve_placement(args)
        assert placement is None  # co-located on one rank
        return args, plan

    started, plan = resolved()
    assert (started.actor.zero_stage, started.loop.per_device_training_batch_size) == (2, 4)
    run_dir.mkdir()
    record_auto_plan(run_dir, plan)
    assert json.loads((run_dir / AUTO_PLAN_FILE).read_text())["actor_zero_stage"] == 2
    resumed, _ = resolved("--resume")
    assert (resumed.actor.zero_stage, resumed.critic.zero_stage, resumed.loop.per_device_training_batch_size) == (2, 2, 4)
    again, _ = resolved()  # a fresh start plans anew
    assert again.actor.zero_stage == 3


def test_step3_placement_auto_on_gpus_refuses_to_plan_them_from_a_cpu_calibration(tmp_path_factory, monkeypatch):
    """On GPUs, step 3's --placement auto without --hardware_file planned them from this machine's calibration, which
    measures its CPU (the cores' rates, the host's RAM as each rank's memory); every rank now refuses it."""
    import deepspeed.accelerator

    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import resolve_placement
    from test_step3_rlhf import step3_argv
    from training.placement import auto

    class Gpu:
        def device_name(self, index=None):
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", Gpu)
    monkeypatch.setattr(auto, "calibrate", lambda *args, **kwargs: pytest.fail("calibrated the CPU for GPU ranks"))
    args = parse_args(step3_argv(make_step3_inputs(tmp_path_factory), tmp_path_factory.mktemp("auto") / "run",
                                 "--placement", "auto"))
    with pytest.raises(UserError, match="--placement auto plans GPU ranks here, and without --hardware_file"):
        resolve_placement(args)


def test_step3_placement_auto_plans_a_model_with_its_own_code_with_trust_remote_code(tmp_path):
    """--placement auto read the models' sizes without step 3's --trust_remote_code: the plan of an actor that ships
    its own code failed on every rank with the error that asks for the flag the run was given."""
    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import _auto_plan
    from training.placement.planner import PlanChoice

    actor = make_custom_code_model_dir(tmp_path / "custom")
    args = parse_args(["--actor_model_name_or_path", actor, "--output_dir", str(tmp_path / "run"),
                       "--data_path", write_arithmetic_jsonl(tmp_path / "pairs.jsonl", 8), "--data_split", "0,0,1",
                       "--algorithm", "grpo", "--reward_fn", "builtin:math", "--dtype", "fp32",
                       "--placement", "auto", "--hardware_file", "a100-80gb", "--trust_remote_code"])
    assert isinstance(_auto_plan(args, 8, ["actor", "reference"]), PlanChoice)


def test_step3_launched_directly_refuses_a_hardware_file_of_other_nodes_than_the_launchers(tmp_path_factory,
                                                                                           monkeypatch):
    """Step 3 started by a launcher on nodes of 4 GPUs, with the 8-GPU preset: --placement auto planned its ranks as
    8-GPU nodes (train.py refuses that layout against its hostfile; step 3 alone did not compare it to its launcher's)."""
    import deepspeed.accelerator

    from step3_rlhf import placement_setup
    from step3_rlhf.main import parse_args
    from test_step3_rlhf import step3_argv

    class Gpu:
        def device_name(self, index=None):
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", Gpu)
    monkeypatch.setattr(placement_setup, "get_world_size", lambda: 8)  # two nodes of 4 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = parse_args(step3_argv(make_step3_inputs(tmp_path_factory), tmp_path_factory.mktemp("auto") / "run",
                                 "--placement", "auto", "--hardware_file", "a100-80gb"))
    with pytest.raises(UserError, match=r"--hardware_file a100-80gb describes nodes of 8 GPUs, but the launcher runs "
                                        r"4 ranks a node: .*gpus_per_node: 4\), or launch 8 ranks a node"):
        placement_setup.resolve_placement(args)


def _run_workers(tmp_path_factory, ranks: int, placements: list[str], **settings) -> str:
    inputs = make_step3_inputs(tmp_path_factory)
    inputs = {**{key: str(value) for key, value in inputs.items()}, **settings}
    spec = tmp_path_factory.mktemp("placement") / "inputs.json"
    spec.write_text(json.dumps(inputs))
    env = {**os.environ, "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{REPO_ROOT}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
         str(free_port()), str(TESTS_DIR / "scripts" / "placement_worker.py"), str(spec), str(spec.parent / "runs"),
         "colocate", *placements],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for placement in placements:
        assert f"PLACEMENT_OK {placement}" in result.stdout, result.stdout[-3000:]
    return result.stdout


@pytest.mark.slow
def test_every_placement_on_two_ranks_trains_the_colocated_ppo(tmp_path_factory):
    _run_workers(tmp_path_factory, 2, ["interleave", "disaggregate", "interleave:actor=0.5,critic=0.5"])


@pytest.mark.slow
def test_every_placement_on_four_ranks_trains_the_colocated_ppo(tmp_path_factory):
    _run_workers(tmp_path_factory, 4, ["interleave", "disaggregate", "colocate:reference=0.25,reward=0.25",
                                       "disaggregate:rollout=0.25,actor=0.25,critic=0.5,reference=0.25,reward=0.5"])


@pytest.mark.slow
def test_placements_on_three_ranks_train_the_colocated_ppo(tmp_path_factory):
    """A world no power of two: the actor alone on rank 0 serves 3 chunks, the rollout on rank 2. The co-located run
    averages 3 ranks' gradients and a placed rank weighs each chunk's loss by a third, which round differently in
    fp32 (1/3 is no binary fraction); Adam's normalised steps carry that to ~2e-5 after two steps, hence 1e-4."""
    third = "0.33333333"
    _run_workers(tmp_path_factory, 3, [f"interleave:actor={third},critic={third},reference={third},reward={third}",
                                       f"disaggregate:rollout={third},actor={third},critic={third},"
                                       f"reference={third},reward={third}"], tolerance=1e-4)


@pytest.mark.slow
def test_placements_match_in_bf16(tmp_path_factory):
    """bf16: every chunk keeps its shapes and order, so the placements stay within bf16 rounding of colocate."""
    _run_workers(tmp_path_factory, 2, ["interleave", "disaggregate"], dtype="bf16", tolerance=1e-3)


@pytest.mark.slow
def test_placements_keep_the_colocated_actor_ema(tmp_path_factory):
    """--enable_ema: the EMA follows the actor's optimizer steps on the actor's own ranks and is written by the
    first of them, equal to the co-located run's (and, at beta 0.5 after two steps, not the actor itself)."""
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5", "disaggregate"],
                 extra=["--enable_ema", "--ema_beta", "0.5"])
    runs = sorted(tmp_path_factory.getbasetemp().glob("placement*/runs"))[-1]
    for placement in ("colocate", "interleave_actor0.5_critic0.5", "disaggregate"):
        actor = load_file(str(runs / placement / "actor" / "model.safetensors"))
        ema = load_file(str(runs / placement / "actor_ema" / "model.safetensors"))
        assert max((actor[k].float() - ema[k].float()).abs().max().item() for k in actor) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "remax"])
def test_placements_train_the_colocated_critic_free_algorithms(tmp_path_factory, algorithm):
    """GRPO, RLOO and ReMax hold no critic: the reference and reward model score side by side (interleave), the
    actor on one rank beside them (Interleave2 without a critic), a shadow actor generates (disaggregate); ReMax's
    greedy baseline is scored where the reward model is."""
    samples = [] if algorithm == "remax" else ["--n_samples_per_prompt", "2"]
    _run_workers(tmp_path_factory, 2, ["interleave", "disaggregate", "interleave:actor=0.5"], critic_flags=[],
                 extra=["--algorithm", algorithm, *samples])


@pytest.mark.slow
def test_placements_train_the_colocated_ppo_over_several_batches_passes_and_accumulations(tmp_path_factory):
    """--generation_batches 2 --ppo_epochs 2 --gradient_accumulation_steps 2: a rank serving two chunks accumulates
    over both (its engine's accumulation doubled), so each optimizer step averages the co-located run's
    micro-batches."""
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5", "disaggregate"],
                 extra=["--generation_batches", "2", "--ppo_epochs", "2", "--gradient_accumulation_steps", "2"])


@pytest.mark.slow
def test_placements_train_the_colocated_ppo_with_lora_and_an_adaptive_kl(tmp_path_factory):
    """LoRA on both trained models, only the actor's adapters optimized (the shadow actor receives the adapters
    alone), and --target_kl moving the KL coefficient from every chunk's answers."""
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5", "disaggregate"],
                 extra=["--actor_lora_dim", "4", "--critic_lora_dim", "4", "--actor_only_optimize_lora",
                        "--target_kl", "0.01", "--kl_ctl", "0.1"])


def eos_prone_actor(tmp_path_factory) -> str:
    """The test actor with its EOS row scaled, so the answers of a batch end at scattered steps (stage fusion then
    has rows to score before the last answer ends)."""
    inputs = make_step3_inputs(tmp_path_factory)
    tokenizer = load_tokenizer(inputs["actor"])
    model = load_causal_lm(inputs["actor"], tokenizer)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 40.0
    folder = tmp_path_factory.mktemp("eos_prone_actor")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_stage_fusion_under_placements_trains_the_colocated_ppo(tmp_path_factory):
    """--enable_stage_fusion, micro-batches of one row: the generating rank sends each finished row to the ranks
    that score it (interleave: each rank scores its own chunk's rows and sends the other's reference or reward
    call; disaggregate: the rollout rank sends every row to the scoring rank), and the trained weights equal the
    co-located fused run's. The scoring rank's reference forwards show the rows were scored in several micro-batches."""
    _run_workers(tmp_path_factory, 2, ["interleave", "disaggregate"], actor=eos_prone_actor(tmp_path_factory),
                 extra=["--enable_stage_fusion", "--stage_fusion_micro_batch_size", "1", "--profile_calls",
                        "--per_device_generation_batch_size", "4"])
    runs = sorted(tmp_path_factory.getbasetemp().glob("placement*/runs"))[-1]
    # rank 0 holds the reference for 1 chunk (colocate) or 2 (interleave, disaggregate): unfused, one forward each
    for placement, chunks in (("colocate", 1), ("interleave", 2), ("disaggregate", 2)):
        records = [json.loads(line) for line in (runs / placement / "call_times.jsonl").read_text().splitlines()]
        forwards = [record["ranks"][0]["calls"]["reference/forward"]["n"] for record in records]
        assert sum(forwards) > chunks * len(forwards), (placement, forwards)


def test_an_offloaded_frozen_model_must_be_on_every_rank():
    """Refused by step 3 and never planned; the planner tries no stage fusion with it on several ranks."""
    from dataclasses import replace

    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import check_placement_args
    from training.placement.planner import fusion_runnable, runnable
    from training.placement.workload import step3_workload
    from training.pipeline.hardware import ModelSize

    args = parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                       "--placement", "interleave", "--offload_reward_model"])
    with pytest.raises(UserError, match="--offload_reward_model with the reward on 1 of 2 ranks"):
        check_placement_args(args, build_placement("interleave", 2, ROLES))
    check_placement_args(args, build_placement("interleave", 2, ROLES, {"reward": 1.0}))
    assert not runnable(build_placement("interleave", 2, ROLES), 0, 0, 1, offloaded=("reward",))
    assert runnable(build_placement("interleave", 2, ROLES, {"reward": 1.0}), 0, 0, 1, offloaded=("reward",))
    size = ModelSize(parameters=10**8, hidden_size=512, num_layers=8, vocab_size=1000)
    workload = replace(step3_workload(args, size, size, size, dtype="bf16"), hybrid_engine=True)
    assert workload.offloaded == ("reward",)
    assert not fusion_runnable(workload, 0, 0, 1, world_size=2) and fusion_runnable(workload, 0, 0, 1, world_size=1)
    assert fusion_runnable(replace(workload, offloaded=()), 0, 0, 1, world_size=2)


@pytest.mark.slow
def test_an_offloaded_reference_on_every_rank_trains_the_colocated_ppo(tmp_path_factory):
    """--offload_reference_model (ZeRO-3 parameter offload) with the reference on both ranks beside Interleave2's
    actor on rank 0 and critic on rank 1 (the reward model on rank 1)."""
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5,reference=1"],
                 extra=["--offload_reference_model"])


def prompts_with_one_long_held_out_prompt(tmp_path_factory) -> str:
    """Arithmetic prompts, 'What is 3 plus 5?' behind a long preamble: on 2 ranks the first held-out batches are
    (1+3, 5+9) on rank 0 and (3+5, 1+4) on rank 1, so rank 1's rows take two groups of their own (`RowGroups`),
    rank 0's one, and a ZeRO-3 forward's ranks agree on one."""
    rows = arithmetic_rows(60)
    for row in rows:
        row["prompt"] = row["prompt"].replace("Human: What is 3 plus 5?", "Human: Reinforcement learning from human "
                                              "feedback trains a reward model and a policy. What is 3 plus 5?")
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_exact_kl_pairs_each_row_of_an_actor_and_a_zero3_reference_on_other_ranks(tmp_path_factory):
    """Interleave2 with an offloaded (ZeRO-3) reference on both ranks: a chunk's actor and reference score on
    different ranks, one cutting the rows into the count of groups the ZeRO-3 ranks agree on, the other into its
    own; the held-out exact KL paired the two sides' groups as if they held the same rows (a 2-row group's logits
    broadcast against a 1-row group's) and differed from the co-located run's."""
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5,reference=1"],
                 data=prompts_with_one_long_held_out_prompt(tmp_path_factory),
                 extra=["--offload_reference_model", "--max_prompt_seq_len", "128", "--eval_samples", "8"])


@pytest.mark.slow
def test_the_pretraining_mixture_under_placements_trains_the_colocated_ppo(tmp_path_factory):
    """PPO-ptx: each rank draws its pretraining batches as co-located, and the actor's ranks train each chunk's
    micro-batches with that chunk's draws (Interleave2: rank 0 trains the actor on both chunks)."""
    text = make_step3_inputs(tmp_path_factory)["text"]
    _run_workers(tmp_path_factory, 2, ["interleave:actor=0.5,critic=0.5", "disaggregate"],
                 extra=["--unsupervised_dataset_name", str(text), "--unsup_coef", "1.0"])


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["disaggregate", "interleave:actor=0.5,critic=0.5"])
def test_a_placed_run_stopped_by_a_signal_resumes_to_the_uninterrupted_weights(tmp_path_factory, placement):
    """2 gloo ranks, --save_interval 1, EMA. disaggregate: rank 0 holds every engine and rank 1 none (DeepSpeed's
    world barriers in save_checkpoint would wait for rank 1 forever), rank 1 the shadow actor and its chunks'
    random streams; Interleave2: the actor's engine on rank 0 and the critic's on rank 1, saved at the same time.
    SIGTERM to the launcher after the first checkpoint: the ranks stop after a step and save; `--resume` then
    ends with the same actor, critic and EMA bits as an uninterrupted run."""
    preset, _, ratio = placement.partition(":")
    inputs = make_step3_inputs(tmp_path_factory)
    root = tmp_path_factory.mktemp("placed_resume")
    launcher = Path(torch.distributed.run.__file__)

    def argv(name: str) -> list[str]:
        return ["--nproc_per_node", "2", "--master_port", str(free_port()), str(REPO_ROOT / "step3_rlhf" / "main.py"),
                "--actor_model_name_or_path", str(inputs["actor"]), "--critic_model_name_or_path", str(inputs["reward"]),
                "--output_dir", str(root / name), "--data_path", str(inputs["data"]), "--data_split", "0,0,1",
                "--data_output_path", str(root / "cache"), "--max_prompt_seq_len", "96", "--max_answer_seq_len", "8",
                "--eval_samples", "4", "--dtype", "fp32", "--max_steps", "5", "--save_interval", "1",
                "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "1",
                "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--enable_hybrid_engine",
                "--enable_ema", "--ema_beta", "0.5", "--placement", preset,
                *(["--placement_ratio", ratio] if ratio else [])]

    uninterrupted = launch_step(launcher, argv("uninterrupted"), root / "uninterrupted.log")  # beside the stopped run
    stopped = argv("stopped")
    run = launch_step(launcher, stopped, root / "stopped.log")
    kill_after_checkpoint(run, min_step=1, sig=signal.SIGTERM)
    run.wait(timeout=120)
    assert "stopped on SIGTERM" in run.output(), run.output()[-3000:]
    assert latest_checkpoint_step(root / "stopped") < 5
    finished_output(uninterrupted)
    # a fresh port: the launcher's own port may still be closing
    resumed = run_step(launcher, [*argv("stopped"), "--resume"], root / "resumed.log")
    assert "resuming step 3 after PPO step" in resumed
    for folder in ("actor", "critic", "actor_ema"):
        assert_same_weights(root / "uninterrupted" / folder, root / "stopped" / folder)


def test_zero3_is_refused_where_it_would_partition_a_model_over_part_of_the_ranks():
    """The reference is built at the actor's stage and the reward model at the critic's: interleave puts them on
    halves, so ZeRO-3 for the actor or the critic is refused there (it hung in DeepSpeed's partitioning)."""
    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import check_placement_args
    from training.placement.planner import runnable

    interleave = build_placement("interleave", 2, ROLES)
    for owner, role in (("actor", "reference"), ("critic", "reward")):
        args = parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                           "--placement",
                           "interleave", f"--{owner}_zero_stage", "3"])
        with pytest.raises(UserError, match=f"the {role} on 1 of 2 ranks.*built at the {owner}'s ZeRO stage"):
            check_placement_args(args, interleave)
    assert not runnable(interleave, 3, 0, 1) and not runnable(interleave, 0, 3, 1) and runnable(interleave, 2, 2, 1)
    assert runnable(build_placement("interleave", 2, ROLES, {"reference": 1.0}), 3, 0, 1)


@pytest.mark.slow
def test_a_zero3_actor_on_every_rank_saves_under_a_placement(tmp_path_factory):
    """ZeRO-3 for the actor where it and the reference are on every rank (the reward model on half): saving the
    actor and its EMA gathers on every rank, so all of them take part while the first one writes."""
    _run_workers(tmp_path_factory, 2, ["interleave:reference=1"], extra=["--actor_zero_stage", "3", "--enable_ema"])


@pytest.mark.slow
def test_profiled_calls_change_nothing_and_every_rank_reports_its_calls(tmp_path_factory):
    """--profile_calls on every run (the reference colocate's too): the placements still train the same weights,
    and each run's call_times.jsonl holds both ranks' model calls per PPO step."""
    _run_workers(tmp_path_factory, 2, ["disaggregate"], extra=["--profile_calls"])
    runs = sorted(tmp_path_factory.getbasetemp().glob("placement*/runs"))[-1]
    for placement, expected in (("colocate", {"actor/decode step", "reference/forward", "critic/backward",
                                              "actor/optimizer step", "critic/gradient all-reduce"}),
                                ("disaggregate", {"rollout/decode step", "exchange/all-gather rollouts",
                                                  "exchange/weight broadcast", "actor/backward"})):
        records = [json.loads(line) for line in (runs / placement / "call_times.jsonl").read_text().splitlines()]
        assert [record["step"] for record in records] == [1, 2] and len(records[0]["ranks"]) == 2
        names = set().union(*(rank["calls"] for rank in records[-1]["ranks"]))
        assert expected <= names, names
        assert all(rank["peak_rss_gb"] > 0 for rank in records[-1]["ranks"])


_STAGE_FUSION_WAIT = """
import datetime, sys, time
import torch.distributed as dist
from training.placement.exchange import Inbox, Outbox
rank, port, peer, waiting = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
group = dist.new_group(backend="gloo")
if rank == 1:
    time.sleep(900 if peer == "hangs" else 0)  # neither sends nor takes: alive and stuck (the test ends it), or gone
    sys.exit(0)
if rank == 2:  # a live peer of rank 0, which the error must not name
    if waiting == "receiver":
        outbox = Outbox(group)
        outbox.post(0, "rows")
        outbox.close(0)
        outbox.wait()
    else:
        list(Inbox(group, [0]).remaining())
    sys.exit(0)
timeout = datetime.timedelta(seconds=2)
try:
    if waiting == "receiver":
        for rows in Inbox(group, [1, 2], timeout=timeout).remaining():
            print(rows)
    else:
        outbox = Outbox(group, timeout=timeout)
        for destination in (2, 1):
            outbox.post(destination, "rows")
            outbox.close(destination)
        outbox.wait()
except RuntimeError as error:
    print(error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["hangs", "dies"])
@pytest.mark.parametrize("waiting, said", [
    ("receiver", "rows\nstage fusion: rank 0 got nothing from rank 1 within 2 s"),
    ("sender", "stage fusion: rank 0 could not hand its finished rows to rank 1 within 2 s"),
])
def test_stage_fusion_waits_for_a_silent_peer_a_bounded_time_and_names_it(peer, waiting, said):
    """A stage-fusion rank received its rows with a blocking gloo recv, which has no bound: a sender that hung, or
    died (gloo's recv kept waiting after the peer's process had exited), left the receiver waiting forever; and a
    sender's Outbox.wait at the end of a phase, which lasts until each receiver takes its rows, waited forever for a
    receiver that hung. Both waits are now bounded, and end in an error naming the silent rank (not rank 2, which
    sent or took its rows: the receiver knows each message's sender from its header) and what to check."""
    from crash_resume import step_env

    port = str(free_port())
    command = [sys.executable, "-c", _STAGE_FUSION_WAIT]
    peers = [subprocess.Popen([*command, str(rank), port, peer, waiting], cwd=REPO_ROOT, env=step_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in (1, 2)]
    try:
        waiter = subprocess.run([*command, "0", port, peer, waiting], cwd=REPO_ROOT, env=step_env(),
                                capture_output=True, text=True, timeout=900, check=False)
    finally:
        for process in peers:
            process.kill()
            process.wait()
    assert waiter.returncode == 0, waiter.stderr[-2000:]
    assert said in waiter.stdout, waiter.stdout
    assert "look for its error in its log" in waiter.stdout and "DEEPSPEED_TIMEOUT" in waiter.stdout
