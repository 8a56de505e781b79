"""bench/generation.py on a tiny model: both backends and transformers' static cache + torch.compile baseline
timed in one run, same tokens, JSON consistent; each decode step beside the bytes it must read at the device's copy
bandwidth (bench/decode_floor.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from crash_resume import step_env
from tiny_models import make_padded_vocab_model_dir, make_tiny_model, make_tokenizer
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from transformers import AutoModelForCausalLM

from bench.decode_floor import DecodeWork, copy_bandwidth_bytes_per_s, mean_decode_context
from bench.generation import build_actor, logprob_diff_vs_train_forward, make_prompts, parse_args
from training.core.model_loading import load_tokenizer
from utils.errors import UserError


def test_a_decode_step_reads_every_weight_but_an_untied_input_embedding_and_each_rows_kv_cache():
    model, _ = make_tiny_model("llama")  # 2 layers, 4 heads of 8, 2 key/value heads, embeddings not tied
    embedding = model.get_input_embeddings().weight
    work = DecodeWork.of(model, torch.bfloat16)
    assert work.weight_bytes == (sum(p.numel() for p in model.parameters()) - embedding.numel()) * 2
    assert work.kv_bytes_per_token == 2 * 2 * (2 * 8) * 2  # keys and values, 2 layers, 2 heads x 8, bf16
    assert work.step_bytes(rows=3, context=10.5) == work.weight_bytes + 3 * 10.5 * work.kv_bytes_per_token
    tied, _ = make_tiny_model("gpt2")
    assert DecodeWork.of(tied, torch.float32).weight_bytes == sum(p.numel() for p in tied.parameters()) * 4
    # the prefill yields token 1; steps 1..3 attend over 5 prompt columns and 1, 2, 3 answer columns
    assert mean_decode_context(prompt_width=5, steps=3) == (6 + 7 + 8) / 3
    assert mean_decode_context(prompt_width=5, steps=3, first_step=2) == (7 + 8) / 2


def test_the_log_prob_parity_of_a_model_with_rows_beyond_its_tokenizer_is_over_the_tokenizers_ids(tmp_path):
    """The benchmark's parity figure compares what step 3 compares: the generator's log-probs with the training
    forward's over the tokenizer's ids (a model such as Qwen2.5 has rows beyond them, here holding nearly all of the
    whole distribution's mass); over every row it reported the mass there as a parity error."""
    from training.generation.generator import GenerationConfig, HFGenerator

    folder = make_padded_vocab_model_dir(tmp_path / "padded", extra_row_scale=50.0)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), load_tokenizer(folder)
    ids = torch.randint(3, len(tokenizer), (4, 5), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=8, seed=0, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id,
                              tokenizer_size=len(tokenizer))
    out = HFGenerator(model).generate(ids, torch.ones_like(ids), config)
    assert logprob_diff_vs_train_forward(model, out, config)["max"] < 1e-4


def test_the_copy_bandwidth_counts_bytes_read_and_written():
    assert 0.1e9 < copy_bandwidth_bytes_per_s(torch.device("cpu"), 8 << 20, repeats=2) < 1e13


def test_the_benchmarks_prompts_begin_as_step_3s_do():
    """Without a chat template the benchmark encoded its prompts without the tokenizer's special tokens, where step 3
    encodes them with: a Llama-style tokenizer's BOS, which the model always read first in training, was missing (and
    a prompt cut to --prompt_length lost its beginning as step 3's does not)."""
    tokenizer = make_tokenizer(chat_template=False, with_pad=True)
    tokenizer.add_bos_token = True
    ids, mask = make_prompts(tokenizer, 2, 64)
    whole = [row[row_mask.bool()].tolist() for row, row_mask in zip(ids, mask)]
    assert [row[0] for row in whole] == [tokenizer.bos_token_id] * 2
    cut, cut_mask = make_prompts(tokenizer, 1, 6)
    assert cut[0][cut_mask[0].bool()].tolist() == [tokenizer.bos_token_id, *whole[0][-5:]]


def run_bench(model: str, output: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """bench/generation.py on `model`, 3 rows of 6 tokens (EOS ignored), once per backend: its output and JSON."""
    result = subprocess.run(
        [sys.executable, "bench/generation.py", "--model", model, "--batch_size", "3", "--max_new_tokens", "6",
         "--ignore_eos", "--repeats", "1", "--copy_mib", "16", *flags, "--output", str(output)],
        cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(output.read_text())


def test_the_generation_benchmark_times_every_backend_and_writes_its_json(tiny_model_dir, tmp_path):
    result, summary = run_bench(tiny_model_dir("llama"), tmp_path / "bench.json", "--zero_stage", "3",
                                "--context_tokens", "30", "--prompt_length", "80", "--static_compiled_baseline")
    assert summary["frozen_actor"] is False
    assert summary["hybrid_decode_path"] == "fused Llama"
    assert "speedup" in result.stdout and "weight-streaming ceiling" in result.stdout
    assert summary["identical_sequences"] is True
    assert max(summary["max_logprob_diff_vs_train_forward"].values()) < 1e-4
    for backend, mean in summary["mean_logprob_diff_vs_train_forward"].items():
        assert 0 <= mean <= summary["max_logprob_diff_vs_train_forward"][backend]
    assert summary["prompt_tokens"] > 30, "the context goes before each question"
    assert summary["device"] and set(summary["versions"]) == {"torch", "transformers", "deepspeed"}
    assert "bench/generation.py" in summary["command"]
    assert len(summary["git_commit"]) == 40 and isinstance(summary["git_uncommitted_changes"], bool)
    for backend, key in (("hybrid", "hybrid"), ("hf", "hf"), ("hf_static_compiled", "static_compiled")):
        row = summary["backends"][backend]
        assert row["tokens"] == 3 * 6
        assert summary[f"{key}_tokens_per_s"] == row["tokens_per_s"] > 0
        assert row["peak_memory_gib"] is None, "peak memory is reported on CUDA only"
    assert summary["identical_sequences_vs_static_compiled"] is True
    assert summary["speedup_vs_static_compiled"] == round(
        summary["hybrid_tokens_per_s"] / summary["static_compiled_tokens_per_s"], 2)
    assert summary["compile_seconds"] > 0
    assert summary["torch_compile_cudagraph_skips"] is None, "counted on CUDA only (a CPU has no CUDA graphs to skip)"
    assert summary["speedup"] == round(summary["hybrid_tokens_per_s"] / summary["hf_tokens_per_s"], 2)
    assert summary["weight_pass_tokens_per_s"] > 0 and summary["weight_pass_matmul_tokens_per_s"] > 0
    assert summary["hybrid_share_of_weight_pass"] == round(
        summary["hybrid_tokens_per_s"] / summary["weight_pass_tokens_per_s"], 3)
    assert "decode floor" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))  # the same seed: the same shape
    streamed = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert summary["decode_weight_bytes"] == streamed * 4, "fp32, counted at full size under ZeRO-3"
    assert summary["decode_kv_bytes_per_token"] == DecodeWork.of(model, torch.float32).kv_bytes_per_token
    bandwidth = summary["copy_bandwidth_gb_s"] * 1e9
    assert bandwidth > 0
    for backend, row in summary["backends"].items():
        assert row["decode_steps"] == 6 - 1, backend
        assert row["first_step_seconds"] > 0  # (at 6 tokens of a tiny model, not always below the whole run's)
        assert row["decode_step_s"] == pytest.approx((row["seconds"] - row["first_step_seconds"]) / 4)
        context = summary["prompt_tokens"] + 3.5  # decode steps 2..5 over 2..5 answer columns
        floor = (summary["decode_weight_bytes"] + 3 * context * summary["decode_kv_bytes_per_token"]) / bandwidth
        assert row["decode_floor_s"] == pytest.approx(floor, rel=2e-3)
        assert row["decode_vs_floor"] == round(row["decode_step_s"] / row["decode_floor_s"], 3)


def test_each_backends_decode_floor_counts_the_bytes_of_the_dtype_it_decodes_in(tiny_model_dir, tmp_path):
    """`hf` decodes the engine's own model (`--dtype`), the hybrid engine its inference copy (`--generation_dtype`):
    with an fp32 engine generating in bf16, hf's floor counted bf16 bytes, half of what its decode steps read."""
    _, summary = run_bench(tiny_model_dir("llama"), tmp_path / "bench.json", "--zero_stage", "0", "--dtype", "fp32",
                           "--generation_dtype", "bf16")
    hybrid, hf = summary["backends"]["hybrid"], summary["backends"]["hf"]
    assert hybrid["decode_steps"] == hf["decode_steps"]  # the same steps at the same contexts (EOS ignored)
    assert hf["decode_floor_s"] == pytest.approx(2 * hybrid["decode_floor_s"])


def test_transformers_baseline_compiles_its_decode_step_once_and_prefills_eagerly(tiny_model_dir):
    """transformers' static-cache `generate` compiles the decode step itself (here on CPU too), as one graph reused
    by the next call; the prefill, where the cache is allocated and marked static, is not compiled (a whole
    compiled `model.forward` allocated the cache inside the graph, unmarked)."""
    from scripts.hybrid_engine_worker import PROMPTS, prompt_batch
    from torch._dynamo.utils import counters

    from bench.generation import static_compiled_generator
    from training.generation.generator import GenerationConfig

    model_dir = tiny_model_dir("llama")
    tokenizer = load_tokenizer(model_dir)
    generator = static_compiled_generator(model_dir, tokenizer, torch.float32, torch.device("cpu"))
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    torch._dynamo.reset()
    counters.clear()
    first, second = generator.generate(ids, mask, config), generator.generate(ids, mask, config)
    assert torch.equal(first.sequences, second.sequences)
    assert counters["stats"]["unique_graphs"] == 1, "the decode step alone, compiled once"
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_the_generation_benchmark_times_the_transformers_forward_and_a_kept_copy_beside_the_fused_path(
        tiny_model_dir, tmp_path):
    result, summary = run_bench(tiny_model_dir("qwen3"), tmp_path / "bench.json", "--zero_stage", "0",
                                "--transformers_forward_baseline", "--kept_copy_variant", "--repeats", "2")
    assert summary["hybrid_decode_path"] == "fused Llama"
    assert summary["transformers_forward_decode_path"] == "transformers forward"
    row = summary["backends"]["hybrid_transformers_forward"]
    assert row["tokens"] == 3 * 6 and summary["transformers_forward_tokens_per_s"] == row["tokens_per_s"] > 0
    assert summary["speedup_vs_transformers_forward"] == round(
        summary["hybrid_tokens_per_s"] / summary["transformers_forward_tokens_per_s"], 2)
    assert summary["identical_sequences_vs_transformers_forward"] is True
    assert max(summary["max_logprob_diff_vs_train_forward"].values()) < 1e-4
    assert "vs its transformers forward" in result.stdout
    row = summary["backends"]["hybrid_kept_copy"]
    assert row["tokens"] == 3 * 6 and len(row["runs_seconds"]) == 2
    assert summary["kept_copy_tokens_per_s"] == row["tokens_per_s"] > 0
    assert summary["speedup_vs_kept_copy"] == round(summary["hybrid_tokens_per_s"] / row["tokens_per_s"], 2)
    assert summary["identical_sequences_vs_kept_copy"] is True
    assert "vs keeping it" in result.stdout


@pytest.mark.parametrize("stage,flag", [("3", "--static_compiled_baseline"), ("0", "--lora_dim=4")])
def test_the_generation_benchmark_runs_on_a_frozen_actor(tiny_model_dir, tmp_path, stage, flag):
    """--frozen_actor: the same generation (greedy tokens equal across backends, log-probs equal to the actor's
    forward's) on an inference-only engine, at ZeRO-3 with the static-compiled baseline and at ZeRO-0 with LoRA."""
    _, summary = run_bench(tiny_model_dir("llama"), tmp_path / "bench.json", "--zero_stage", stage, "--frozen_actor",
                           flag)
    assert summary["frozen_actor"] is True and summary["zero_stage"] == int(stage)
    assert summary["hybrid_decode_path"] == "fused Llama"
    assert summary["identical_sequences"] is True
    assert summary.get("identical_sequences_vs_static_compiled", True) is True
    assert max(summary["max_logprob_diff_vs_train_forward"].values()) < 1e-4
    assert all(row["tokens"] == 3 * 6 for row in summary["backends"].values())


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (3, "bf16")])
def test_a_frozen_actor_has_no_optimizer_and_nothing_requires_grad(distributed, tiny_model_dir, stage, dtype):
    """Without --frozen_actor the engine has torch's AdamW (ZeRO-0) or ZeRO-3's optimizer, with its fp32 partitions
    and gradient buffer; a frozen actor has none (at ZeRO-3 only DeepSpeedZeRoOffload, the parameter partitioning)."""
    model = tiny_model_dir("llama")
    engine = build_actor(parse_args(["--model", model, "--zero_stage", str(stage), "--dtype", dtype,
                                     "--frozen_actor"]), load_tokenizer(model))
    assert engine.optimizer is None or type(engine.optimizer) is DeepSpeedZeRoOffload
    assert not any(p.requires_grad for p in engine.module.parameters())


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_frozen_actor_refuses_the_zero_stages_that_shard_only_optimizer_state(stage):
    with pytest.raises(UserError, match="pass --zero_stage 0 or 3"):
        parse_args(["--frozen_actor", "--zero_stage", stage])


def test_no_timed_run_is_refused_before_the_model_loads():
    """--repeats 0 loaded the model, measured the ceilings and ended in a KeyError traceback: no backend had a run."""
    with pytest.raises(UserError, match="--repeats 0: each backend needs at least one timed run"):
        parse_args(["--repeats", "0"])
