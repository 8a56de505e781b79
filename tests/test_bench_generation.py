"""bench/generation.py on a tiny model: both backends and transformers' static cache + torch.compile baseline
timed in one run, same tokens, JSON consistent."""
import json
import subprocess
import sys

from conftest import REPO_ROOT
from crash_resume import step_env


def test_the_generation_benchmark_times_every_backend_and_writes_its_json(tiny_model_dir, tmp_path):
    output = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "bench/generation.py", "--model", tiny_model_dir("llama"), "--zero_stage", "3",
         "--batch_size", "3", "--max_new_tokens", "6", "--ignore_eos", "--repeats", "1", "--context_tokens", "30",
         "--prompt_length", "80", "--static_compiled_baseline", "--output", str(output)],
        cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(output.read_text())
    assert "speedup" in result.stdout and "weight-streaming ceiling" in result.stdout
    assert summary["identical_sequences"] is True
    assert max(summary["max_logprob_diff_vs_train_forward"].values()) < 1e-4
    for backend, mean in summary["mean_logprob_diff_vs_train_forward"].items():
        assert 0 <= mean <= summary["max_logprob_diff_vs_train_forward"][backend]
    assert summary["prompt_tokens"] > 30, "the context goes before each question"
    assert summary["device"] and set(summary["versions"]) == {"torch", "transformers", "deepspeed"}
    assert "bench/generation.py" in summary["command"]
    for backend, key in (("hybrid", "hybrid"), ("hf", "hf"), ("hf_static_compiled", "static_compiled")):
        row = summary["backends"][backend]
        assert row["tokens"] == 3 * 6
        assert summary[f"{key}_tokens_per_s"] == row["tokens_per_s"] > 0
        assert row["peak_memory_gib"] is None, "peak memory is reported on CUDA only"
    assert summary["identical_sequences_vs_static_compiled"] is True
    assert summary["speedup_vs_static_compiled"] == round(
        summary["hybrid_tokens_per_s"] / summary["static_compiled_tokens_per_s"], 2)
    assert summary["compile_seconds"] > 0
    assert summary["speedup"] == round(summary["hybrid_tokens_per_s"] / summary["hf_tokens_per_s"], 2)
    assert summary["weight_pass_tokens_per_s"] > 0 and summary["weight_pass_matmul_tokens_per_s"] > 0
    assert summary["hybrid_share_of_weight_pass"] == round(
        summary["hybrid_tokens_per_s"] / summary["weight_pass_tokens_per_s"], 3)
