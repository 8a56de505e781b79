"""bench/step3.py: the work and floor of each phase from the real token counts, and the whole bench on tiny models
(this project and TRL in one run, the JSON a user reads)."""
import argparse
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from crash_resume import step_env
from tiny_models import make_tiny_model, make_tiny_model_dir, make_tokenizer

from bench.step3_work import MachineRates, ModelShape, RolloutShape, generation_floor, scoring_floor, training_floor
from training.core.model_loading import load_tokenizer
from training.core.reward_model import RewardModel

RATES = MachineRates(matmul_flops_per_s=1e9, weight_pass_s={1: 0.01, 2: 0.015}, stream_bytes_per_s=1e8)


def test_work_counts_real_tokens_attention_and_the_head_only_where_answers_are_predicted():
    tokenizer = make_tokenizer()
    model, _ = make_tiny_model("llama", tokenizer)
    shape = ModelShape.of(model, model.config, lm_head=True)
    layers, hidden, vocab = 2, 32, model.config.vocab_size
    per_layer = hidden * hidden * 2 + hidden * 16 * 2 + 3 * hidden * 64  # q, o; k, v (2 KV heads of 8); MLP
    assert (shape.linear_parameters, shape.layers, shape.attention_width, shape.kv_width) == (
        layers * per_layer, layers, hidden, 16)
    flops = shape.forward_flops([3, 5], predicted=2)
    assert flops == 2 * layers * per_layer * 8 + 2 * layers * hidden * (9 + 25) + 2 * hidden * vocab * 2
    value_model = ModelShape.of(RewardModel.from_causal_lm(model, tokenizer), model.config, lm_head=False)
    assert value_model.linear_parameters == shape.linear_parameters, "the value head is no weight matrix"
    assert value_model.forward_flops([3, 5], predicted=2) == flops - 2 * hidden * vocab * 2, "and no vocabulary head"


def test_a_zero3_partitioned_model_has_the_shape_of_the_whole_model():
    """bench/step3.py reads the shapes off its engines' modules, partitioned at ZeRO-3: there a parameter's data is
    an empty tensor and its size is in `ds_shape` / `ds_numel` (what DeepSpeed's zero.Init leaves)."""
    model, _ = make_tiny_model("llama", make_tokenizer())
    whole = ModelShape.of(model, model.config, lm_head=True)
    for number, param in enumerate(model.parameters()):
        param.ds_id, param.ds_shape, param.ds_numel = number, param.shape, param.numel()
        param.data = torch.empty(0, dtype=param.dtype)
    assert ModelShape.of(model, model.config, lm_head=True) == whole
    assert whole.linear_parameters > 0 and whole.trained_parameters > whole.linear_parameters


def test_generation_floor_decodes_only_the_rows_still_going():
    model, _ = make_tiny_model("llama", make_tokenizer())
    shape = ModelShape.of(model, model.config, lm_head=True)
    rollout = RolloutShape(prompt_lengths=[3, 4], answer_lengths=[1, 3])
    _, seconds = generation_floor(shape, rollout, RATES)
    prefill = shape.forward_flops([3, 4], 2) / RATES.matmul_flops_per_s
    # the first answer token comes from the prefill; steps 1 and 2 decode row 1 alone (row 0 had one token)
    decode = sum(RATES.weight_pass_s[1] + shape.kv_bytes(4 + step) / RATES.stream_bytes_per_s for step in (1, 2))
    assert seconds == pytest.approx(prefill + decode)
    scoring = scoring_floor(shape, rollout, RATES)
    assert scoring[0] == shape.forward_flops([4, 7], 4)
    training = training_floor(shape, rollout, RATES)
    assert training[0] == 3 * scoring[0] and training[1] > training[0] / RATES.matmul_flops_per_s


def test_the_floor_takes_the_best_of_several_rate_measurements():
    slower = MachineRates(matmul_flops_per_s=5e8, weight_pass_s={1: 0.02, 2: 0.01}, stream_bytes_per_s=2e8)
    best = MachineRates.best([RATES, slower])
    assert best == MachineRates(matmul_flops_per_s=1e9, weight_pass_s={1: 0.01, 2: 0.01}, stream_bytes_per_s=2e8)


def write_pairs(path, count: int) -> str:
    rows = [{"chosen": f"\n\nHuman: What is {i} plus {i + 2}?\n\nAssistant: {2 * i + 2}.",
             "rejected": f"\n\nHuman: What is {i} plus {i + 2}?\n\nAssistant: No idea."} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_step3_benchmark_times_both_systems_per_phase_and_writes_its_json(tmp_path):
    pytest.importorskip("trl.experimental.ppo")
    actor = make_tiny_model_dir(tmp_path / "actor", "llama", with_pad=True)
    tokenizer = load_tokenizer(actor)
    torch.manual_seed(1)
    RewardModel.from_causal_lm(actor, tokenizer).save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")
    output = tmp_path / "step3.json"
    result = subprocess.run(
        [sys.executable, "bench/step3.py", "--actor", actor, "--reward", str(tmp_path / "reward"),
         "--prompts", write_pairs(tmp_path / "pairs.jsonl", 8), "--num_prompts", "6", "--batch", "2",
         "--answer_len", "5", "--prompt_len", "64", "--peer", "trl", "--output", str(output)],
        check=False, cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    phases = [row["phase"] for row in report["results"]]
    assert phases == ["generation", "score actor (old log-probs)", "score reference", "score reward", "score critic",
                      "train actor + critic", "step"]
    step = report["results"][-1]
    assert report["speedup_vs_trl"] == step["TRL / this project"]
    assert step["TRL / this project"] == pytest.approx(step["TRL s"] / step["this project s"], rel=0.05)  # rounded
    assert report["old_logprobs"] == "from the rollout"  # fp32 hybrid engine: no actor scoring forward
    assert report["results"][1]["this project s"] == 0
    assert report["trl_reward_conversion_max_difference"] <= 1e-4
    assert len(report["steps"]["this project"]) == len(report["steps"]["TRL 1.12.0"]) == 3
    assert all(row["this project / floor"] > 0 for row in report["results"]
               if row["phase"] != "score actor (old log-probs)")
    # the profiled step finds every timed phase's matrix-product kernels (none for the reused old log-probs)
    kernels = {row["phase"]: row["matmul kernels / floor"] for row in report["results"]}
    assert kernels.pop("score actor (old log-probs)") == "-"
    assert all(isinstance(ratio, float) and ratio > 0 for ratio in kernels.values()), kernels
    assert report["profiled_step"]["matmul_s"]["train_actor"] > 0
    # measured after each system's steps; the floors use the best
    assert len(report["rate_measurements"]) == 2
    assert report["rates"]["matmul_gflops"] == max(m["matmul_gflops"] for m in report["rate_measurements"])
    assert report["totals_after_first_step"]["this project"]["answer_tokens"] > 0
    assert "per answer token" in result.stdout and report["device"]
    # what every GPU JSON carries at the top level; peak GPU memory is reported on CUDA only
    assert (report["model"], report["batch_size"], report["dtype"], report["zero_stage"]) == (actor, 2, "fp32", 0)
    assert report["seconds_per_ppo_step"] == step["this project s"]
    assert set(report["phase_seconds"]) == set(phases[:-1]) and report["peak_gpu_memory_gib"] is None


def test_the_trl_peer_trains_with_this_projects_step3_settings():
    """The peer's PPO coefficients, learning rates and schedule are the step-3 run's, not defaults of its own
    (it once trained its actor at 3e-5 beside this project's 1e-5)."""
    pytest.importorskip("trl.experimental.ppo")
    from bench.step3 import step3_settings, trl_peer_settings

    args = argparse.Namespace(actor="actor", reward="reward", batch=8, answer_len=128, dtype="fp32", seed=3,
                              prompt_len=128, zero_stage=0, backend="hybrid", recompute_old_logprobs=False,
                              optimizer="auto")
    step3 = step3_settings(args, "out")
    peer = trl_peer_settings(args, step3, "converted")
    assert (peer.actor_learning_rate, peer.critic_learning_rate) == (step3.actor.learning_rate,
                                                                     step3.critic.learning_rate)
    assert (peer.kl_coef, peer.cliprange, peer.cliprange_value, peer.gamma, peer.lam, peer.temperature) == (
        step3.ppo.kl_ctl, step3.ppo.cliprange, step3.ppo.cliprange_value, step3.ppo.gamma, step3.ppo.lam,
        step3.sampling.temperature)
    assert (peer.lr_scheduler_type, peer.num_warmup_steps) == (step3.schedule.lr_scheduler_type,
                                                               step3.schedule.num_warmup_steps)
    assert (peer.reward_path, peer.critic_path, peer.batch_size, peer.seed) == ("converted", "converted", 8, 3)


def test_compile_layers_compiles_every_decoder_layer_of_every_model_held():
    """`--compile_layers` reaches the layers of the DeepSpeed engines' modules and of the models without one."""
    from types import SimpleNamespace

    from bench.step3 import compile_decoder_layers

    tokenizer = make_tokenizer()
    actor, _ = make_tiny_model("llama", tokenizer)
    critic = RewardModel.from_causal_lm(make_tiny_model("llama", tokenizer)[0], tokenizer)
    engine = SimpleNamespace(actor=SimpleNamespace(module=actor), reference=None, critic=critic, reward=None)
    assert compile_decoder_layers(engine) == 4
    layers = [*actor.model.layers, *critic.backbone.layers]
    assert all(layer._compiled_call_impl is not None for layer in layers)


def test_the_profiled_step_decodes_without_cuda_graphs_and_restores_the_setting():
    """A replayed CUDA graph's kernels have no operator the profile could credit them to: the profiled step turns
    the hybrid engine's graphs off, and back on after it (also when the step fails)."""
    from types import SimpleNamespace

    from bench.step3 import profile_matmul_kernels
    from training.generation.hybrid_engine import HybridEngineSettings

    seen = []

    def generate_experience(batch):
        seen.append(trainer.generator.settings.cuda_graph)
        raise RuntimeError("stop after generation")

    settings = HybridEngineSettings(enable=True)
    trainer = SimpleNamespace(generator=SimpleNamespace(settings=settings), generate_experience=generate_experience)
    with pytest.raises(RuntimeError, match="stop after generation"):
        profile_matmul_kernels(trainer, {})
    assert seen == [False] and settings.cuda_graph and trainer.generator.settings is settings


def test_prompts_that_do_not_make_whole_batches_are_refused_before_anything_runs():
    """This project's PPO steps used the whole batches and left the rest out; with `--peer trl`, TRL's run then
    refused the prompts in a ValueError traceback, after this project's steps had all run."""
    from bench.step3 import parse_args
    from utils.errors import UserError

    with pytest.raises(UserError, match="--num_prompts 20 is not a multiple of --batch 8"):
        parse_args(["--num_prompts", "20", "--batch", "8", "--peer", "trl"])
    with pytest.raises(UserError, match="--batch 0: a PPO step needs at least one prompt"):
        parse_args(["--batch", "0"])  # not a ZeroDivisionError of the check above


def test_trl_runs_with_the_thread_count_of_the_process_it_shares(distributed, tmp_path, monkeypatch):
    """The accelerate state TRL's trainer sets up sets torch's thread count where OMP_NUM_THREADS is unset: the
    host's physical cores over the ranks (in a container pinned to 2 of a 64-core host's cores, 32 threads). TRL's
    steps then ran with other threads than this project's steps beside them in the same process."""
    pytest.importorskip("trl.experimental.ppo")
    import psutil
    from accelerate.state import AcceleratorState

    from bench import trl_peer

    actor = make_tiny_model_dir(tmp_path / "actor", "llama", with_pad=True)
    tokenizer = load_tokenizer(actor)
    RewardModel.from_causal_lm(actor, tokenizer).save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")
    scored = trl_peer.convert_scored_model(str(tmp_path / "reward"), str(tmp_path / "scored"))
    settings = trl_peer.TRLPeerSettings(actor_path=actor, reward_path=scored, critic_path=scored, batch_size=2,
                                        max_answer_tokens=3)
    prompts = [tokenizer("What is 2 plus 2?")["input_ids"], tokenizer("Name a colour.")["input_ids"]]
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: threads + 1)  # a host with more cores than ours
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        steps = trl_peer.run_trl_ppo(settings, prompts)
        after = torch.get_num_threads()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)
    assert after == threads
    assert [step["threads"] for step in steps] == [threads]


def test_the_trl_peer_without_trl_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """`--peer trl` checked for TRL only once this project's PPO steps and the rate measurements had run (minutes at
    the default sizes), then stopped there."""
    from bench.step3 import parse_args
    from utils.errors import UserError

    (tmp_path / "pairs.jsonl").write_text("")
    flags = ["--actor", str(tmp_path), "--reward", str(tmp_path), "--prompts", str(tmp_path / "pairs.jsonl")]
    monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed: importing it raises ImportError
    assert parse_args(flags).peer == "none"
    with pytest.raises(UserError, match=r"--peer trl needs TRL 1\.12\.0: pip install"):
        parse_args([*flags, "--peer", "trl"])
