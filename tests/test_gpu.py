"""GPU tests (`pytest -m gpu`), skipped without CUDA: the hybrid engine's parity on the GPU (bf16 and fp16
distributions past position 500, greedy tokens equal to `hf`, CUDA-graph decoding equal to eager, LoRA), the fp32
partials of tensor-parallel shards, ZeRO-2 and ZeRO-3 training steps over NCCL at world size 1 (fp16 loss scaling,
bf16, FusedAdam, offload), and one PPO step of step 3. Each check but the partials' runs in its own process
(tests/scripts/gpu_worker.py, or step 3's entry point) with CUDA DeepSpeed, apart from this process's CPU world.
Each run on a GPU is recorded in bench/results/gpu_session*.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, TESTS_DIR
from crash_resume import step_env
from scripts.hybrid_engine_worker import LONG_POSITION_BIASED_MODEL, LONG_POSITION_MODEL
from test_step3_rlhf import make_step3_inputs, step3_argv

from bench.gpu.stages import REQUIRE_CUDA_ENV

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False): run `pytest -m gpu` on a GPU machine"
if not torch.cuda.is_available() and os.environ.get(REQUIRE_CUDA_ENV) == "1":
    # the GPU runner's tests stage: every test skipping would pass as ok
    pytest.fail(f"{REQUIRE_CUDA_ENV}=1 but torch {torch.__version__} sees no CUDA device", pytrace=False)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
WORKER = TESTS_DIR / "scripts" / "gpu_worker.py"


def gpu_env() -> dict[str, str]:
    """A step subprocess's environment (crash_resume.step_env) with CUDA DeepSpeed and the tests' helpers importable."""
    env = step_env()
    return {**env, "DS_ACCELERATOR": "cuda", "PYTHONPATH": f"{TESTS_DIR}:{env['PYTHONPATH']}"}


def run_worker(check: str, *args: str, timeout: float = 900) -> str:
    result = subprocess.run([sys.executable, str(WORKER), check, *args], cwd=REPO_ROOT, env=gpu_env(),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert f"GPU_OK {check}" in result.stdout, result.stdout[-3000:]
    return result.stdout


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
# the fused decode path (plain, with Qwen3's head norms, with Qwen2's biases against ZeRO-3's training forward, with
# trained LoRA adapters) and the transformers-forward one (compiled with CUDA graphs; with LoRA hooks inside them;
# GPT-2's tanh GELU, whose compiled CPU kernel rounds otherwise than eager's: 2.4e-3 on CPU)
@pytest.mark.parametrize("arch,decode_path,stage,lora", [
    ("llama", "fused", 2, False), ("qwen3", "fused", 2, False), ("qwen2", "fused", 3, False),
    ("llama", "fused", 3, True), ("llama", "transformers", 2, False), ("llama", "transformers", 3, True),
    ("gpt2", "transformers", 2, False)])
def test_half_precision_generation_samples_from_the_trained_distribution_past_position_500(tiny_model_dir, arch,
                                                                                         decode_path, stage, lora,
                                                                                         dtype):
    model = tiny_model_dir(arch, **(LONG_POSITION_BIASED_MODEL if arch == "qwen2" else LONG_POSITION_MODEL))
    run_worker("long_positions", model, dtype, decode_path, str(stage), arch if lora else "none")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_product_returns_its_fp32_sum_unrounded(dtype):
    """The GEMM a tensor-parallel shard's row-parallel partial comes from (`torch.mm`'s `out_dtype`, CUDA only)."""
    from training.generation.cpu_linear import fp32_product

    x, weight = (torch.randn(shape, dtype=dtype, device="cuda") for shape in ((8, 512), (96, 512)))
    out = fp32_product(x, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ weight.float().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("length", [192, 320])
def test_a_left_padded_bf16_batch_trains_with_finite_gradients(cudnn_attention_restored, length):
    """A bf16 batch of `length` positions (64 past a multiple of 128) whose rows are left-padded from none to half,
    as a PPO batch's prompts are: the padding's queries see no key. Through the attention kernels this project's
    engines keep (`exclude_cudnn_attention`), every gradient is finite. cuDNN's kernel, torch's first pick on
    H100/H200, returns NaN query gradients for such rows at such lengths from torch 2.11 (pytorch issue 196678),
    behind a finite loss (`bench/attention_backward.py` runs both)."""
    from tiny_models import make_tiny_model

    from bench.attention_backward import left_padded_batch, train_pass
    from training.core.attention_kernels import exclude_cudnn_attention

    exclude_cudnn_attention("cuda")
    model, _ = make_tiny_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, max_positions=512)
    model = model.to("cuda", torch.bfloat16)
    ids, mask = left_padded_batch(model.config.vocab_size, length, 4, torch.Generator().manual_seed(0),
                                  torch.device("cuda"))
    loss, non_finite = train_pass(model, ids, mask)
    assert torch.isfinite(torch.tensor(loss)) and non_finite == 0, (loss, non_finite)


@pytest.mark.parametrize("arch,stage", [("llama", 0), ("llama", 3), ("qwen2", 3), ("gpt2", 3), ("opt", 3)])
def test_greedy_equals_hf_and_logprobs_equal_train_forward(tiny_model_dir, arch, stage):
    run_worker("greedy", tiny_model_dir(arch), str(stage))


# the fused path's bucket graphs (Qwen2: with q/k/v biases); torch.compile's
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt"])
def test_cuda_graph_decoding_equals_eager(tiny_model_dir, arch):
    run_worker("cuda_graph", tiny_model_dir(arch))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # the fused path's bucket graphs; torch.compile's
def test_a_kept_inference_copy_replays_its_graphs_with_each_rollouts_weights(tiny_model_dir, arch):
    run_worker("kept_copy", tiny_model_dir(arch))


def test_the_compiled_step_keeps_its_cuda_graphs_over_many_rollouts_of_new_copies(tiny_model_dir):
    run_worker("many_rollouts", tiny_model_dir("gpt2"))


@pytest.mark.parametrize("stage,dtype,optimizer,offload", [
    (0, "bf16", "torch_adamw", "none"),  # MasterWeightAdamW
    (2, "fp16", "torch_adamw", "none"), (3, "fp16", "torch_adamw", "none"),
    (2, "bf16", "torch_adamw", "none"), (3, "bf16", "torch_adamw", "none"),
    (2, "bf16", "auto", "none"),  # DeepSpeed's FusedAdam, compiled at first use
    (3, "bf16", "auto", "offload"),  # optimizer state and parameters on the CPU, DeepSpeedCPUAdam
])
def test_zero_training_steps_over_nccl(tiny_model_dir, stage, dtype, optimizer, offload):
    run_worker("train_steps", tiny_model_dir("llama"), str(stage), dtype, optimizer, offload)


def test_lora_is_merged_for_generation_at_zero3(tiny_model_dir):
    run_worker("lora", tiny_model_dir("llama"), "llama")


def test_one_ppo_step_of_step3_in_bf16_at_zero3(tmp_path_factory):
    inputs = make_step3_inputs(tmp_path_factory)
    run = inputs["root"] / "run"
    argv = step3_argv(inputs, run, "--max_steps", "1", "--enable_hybrid_engine", "--actor_zero_stage", "3",
                      "--critic_zero_stage", "3", "--optimizer", "torch_adamw", "--dtype", "bf16")  # the last --dtype
    result = subprocess.run([sys.executable, "step3_rlhf/main.py", *argv], cwd=REPO_ROOT, env=gpu_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert json.loads((run / "summary.json").read_text())["ppo_steps"] == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/score_mean" in record and "train/actor_loss" in record for record in records)
    # a PPO batch is left-padded: no update lost to the attention backward's NaN (`exclude_cudnn_attention`)
    assert all(record.get("train/actor_skipped_steps", 0) == record.get("train/critic_skipped_steps", 0) == 0
               for record in records)
