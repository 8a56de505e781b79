"""Worker for the GPU tests (tests/test_gpu.py): one check per process, on CUDA DeepSpeed over NCCL at world size 1.

    python gpu_worker.py CHECK ARGS...

Each check asserts on the GPU what the CPU tests assert on CPU, through the same helpers
(scripts/hybrid_engine_worker.py), and prints `GPU_OK CHECK` when it passed. Run on an H200 in two sessions (bench/results/gpu_session*_h200.json).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import warnings

import torch
import torch.distributed as torch_dist
from torch._dynamo.utils import counters
from scripts.hybrid_engine_worker import (
    PROMPTS,
    build_engine,
    check_long_position_parity,
    check_lora_merge,
    check_parity,
    greedy_config,
    hybrid_engine,
    prompt_batch,
    train_step,
)

from training.core.engine import OptimizationSettings, create_train_engine
from training.core.model_loading import load_causal_lm, load_tokenizer, resolve_dtype
from training.core.optim import resolve_optimizer_kind
from training.generation.compiled_step import compile_failure
from utils.dist import init_distributed

TRAIN_STEPS = 12


def on_cuda(engine) -> None:
    assert engine.device.type == "cuda", f"DeepSpeed placed the engine on {engine.device}"


def long_positions(model_path: str, dtype: str, decode_path: str, stage: str, lora_arch: str) -> None:
    """bf16 / fp16: the distributions sampled from at positions 520-551 are the train forward's (ZeRO `stage`; LoRA
    adapters of `lora_arch` unless "none"), on the fused decode path or ("transformers") on the model's own forward,
    compiled: within twice what the attention kernels' own rounding moves the train forward by
    (`check_long_position_parity`)."""
    distances = check_long_position_parity(model_path, dtype, functools.partial(
        hybrid_engine, fused_decode=decode_path == "fused"), stage=int(stage),
        lora_arch=None if lora_arch == "none" else lora_arch)
    print(f"total variation mean {distances.mean():.2e} max {distances.max():.2e}")


def greedy(model_path: str, stage: str) -> None:
    """fp32: greedy tokens equal the hf backend's, log-probs the train forward's within 1e-4, on the eager decode
    path (`cuda_graph` checks the graphed paths against it: torch.compile's compilations are what makes a check of
    the transformers-forward path slow, so each architecture pays them once)."""
    engine, tokenizer = build_engine(model_path, int(stage))
    on_cuda(engine)
    check_parity(engine, hybrid_engine(engine, cuda_graph=False), tokenizer, PROMPTS)


def cuda_graph(model_path: str) -> None:
    """The decode path captured as CUDA graphs (fused Llama: one graph per batch bucket, the token choice inside;
    the transformers forward: torch.compile's) gives the eager path's tokens and log-probs, greedy and sampled,
    and passes `check_parity` itself."""
    engine, tokenizer = build_engine(model_path, stage=3)
    graphed, eager = hybrid_engine(engine, cuda_graph=True), hybrid_engine(engine, cuda_graph=False)
    with graphed.generate_mode():
        step_model = graphed._decoder.model
        check_parity(engine, graphed, tokenizer, PROMPTS)
        if hasattr(step_model, "fused"):
            buckets = step_model.graphed_steps.buckets_used
            assert step_model.graphed_steps.capture and len(buckets) > 1, f"graphs captured for buckets {buckets}"
        else:
            assert not step_model.shrinks, "the CUDA-graph decode path was not taken"

        def decode() -> None:
            graphed.generate(*prompt_batch(tokenizer, PROMPTS), greedy_config(tokenizer, max_new_tokens=16))

        decode()  # its buckets captured (a capture synchronizes) before the syncs are counted
        syncs = device_syncs(decode)
        assert syncs <= 16 + 12, f"{syncs} device syncs in 16 decode steps: one a step, a few around them"
        ids, mask = prompt_batch(tokenizer, PROMPTS)
        configs = [greedy_config(tokenizer, max_new_tokens=16),
                   dataclasses.replace(greedy_config(tokenizer, max_new_tokens=16), do_sample=True, temperature=0.8,
                                       top_k=20, top_p=0.9, seed=0)]
        with_graphs = [graphed.generate(ids, mask, config) for config in configs]
        skipped = counters["inductor"]["cudagraph_skips"]
        assert skipped == 0, f"torch.compile ran {skipped} step(s) without CUDA graphs (a cache write not static?)"
    for config, graphed_out in zip(configs, with_graphs):  # sampled: the same uniform numbers drawn on both paths
        without = eager.generate(ids, mask, config)
        assert torch.equal(graphed_out.sequences, without.sequences), config
        torch.testing.assert_close(graphed_out.logprobs, without.logprobs, rtol=0, atol=1e-5)


def kept_copy(model_path: str) -> None:
    """--keep_inference_copy on the graphed decode path: after a training step the next rollout replays the graphs
    captured over the kept copy (none is captured again; torch.compile's are never skipped) and decodes, sampled, as
    an eager copy built afresh does."""
    engine, tokenizer = build_engine(model_path, stage=3)
    kept = hybrid_engine(engine, keep_inference_copy=True)
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = dataclasses.replace(greedy_config(tokenizer, max_new_tokens=16, eos_token_id=-1), do_sample=True,
                                 temperature=0.8, seed=0)  # no row ends: every rollout decodes in the same bucket
    first = kept.generate(ids, mask, config)
    step_model = kept._kept[1]
    graphs = step_model.graphed_steps if hasattr(step_model, "fused") else None
    runners = dict(graphs.runners) if graphs is not None else {}
    assert graphs is not None and graphs.capture and runners or graphs is None and not step_model.shrinks
    train_step(engine, tokenizer)
    second = kept.generate(ids, mask, config)
    if graphs is not None:
        assert step_model.graphed_steps is graphs and all(graphs.runners[k] is v for k, v in runners.items())
    assert counters["inductor"]["cudagraph_skips"] == 0
    afresh = hybrid_engine(engine, cuda_graph=False).generate(ids, mask, config)
    assert not torch.equal(first.logprobs, second.logprobs), "the training step changed nothing the check can see"
    assert torch.equal(second.sequences, afresh.sequences)
    torch.testing.assert_close(second.logprobs, afresh.logprobs, rtol=0, atol=1e-5)


def many_rollouts(model_path: str) -> None:
    """The compiled transformers-forward step over a new inference copy each rollout (no kept copy): torch.compile's
    CUDA graphs are re-recorded at each copy's weights. 130 rollouts, past inductor's re-record limit (128), still
    run with graphs; the memory held after them is printed beside the first's."""
    engine, tokenizer = build_engine(model_path, stage=3)
    hybrid = hybrid_engine(engine, cuda_graph=True)
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = greedy_config(tokenizer, max_new_tokens=4, eos_token_id=-1)
    first = hybrid.generate(ids, mask, config)
    assert hybrid.decode_path == "transformers forward (CUDA graphs)", hybrid.decode_path
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(130):
        last = hybrid.generate(ids, mask, config)
    torch.cuda.synchronize()
    grown = (torch.cuda.memory_allocated() - held) / 2**20
    skipped = counters["inductor"]["cudagraph_skips"]
    print(f"130 rollouts: {grown:.1f} MiB more held than after the first; {skipped} steps without CUDA graphs")
    assert torch.equal(first.sequences, last.sequences)
    assert skipped == 0, f"torch.compile ran {skipped} step(s) without CUDA graphs after re-recording"


def device_syncs(work) -> int:
    """How many times `work` made the host wait for the GPU (torch's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def train_steps(model_path: str, stage: str, dtype: str, optimizer: str, offload: str) -> None:
    """ZeRO `stage` training steps in `dtype` (fp16: DeepSpeed's dynamic loss scaling) over NCCL: the loss falls,
    and the optimizer is the one `optimizer` resolves to (auto: FusedAdam, or DeepSpeedCPUAdam with offload;
    bf16 at ZeRO-0 with torch's AdamW: `MasterWeightAdamW`, its fp32 masters on the GPU)."""
    assert torch_dist.get_backend() == "nccl", torch_dist.get_backend()
    offloaded = offload == "offload"
    tokenizer = load_tokenizer(model_path)
    settings = OptimizationSettings(learning_rate=5e-3, num_training_steps=TRAIN_STEPS, zero_stage=int(stage),
                                    offload=offloaded, dtype=dtype, micro_batch_size=4, optimizer=optimizer,
                                    lr_scheduler_type="constant_with_warmup")
    model = load_causal_lm(model_path, tokenizer, dtype=resolve_dtype(dtype), ds_config=settings.ds_config())
    engine = create_train_engine(model, settings)
    on_cuda(engine)
    if settings.master_weights:  # bf16 at ZeRO-0 with torch's AdamW: the engine's optimizer is the update itself
        assert type(engine.optimizer).__name__ == "MasterWeightAdamW", type(engine.optimizer)
        assert engine.optimizer.masters()[0].device.type == "cuda"
    else:
        kind = resolve_optimizer_kind(optimizer, offloaded)
        expected = {"fused_adam": "FusedAdam", "cpu_adam": "DeepSpeedCPUAdam", "torch_adamw": "AdamW"}[kind]
        assert type(engine.optimizer.optimizer).__name__ == expected, type(engine.optimizer.optimizer)
    texts = [f"Human: question {i} Assistant: answer {i} is good." for i in range(4)]
    enc = tokenizer(texts, return_tensors="pt", padding=True).to(engine.device)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    losses = []
    for _ in range(TRAIN_STEPS):
        loss = engine(**enc, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    if dtype == "fp16":
        assert engine.fp16_enabled() and engine.dynamic_loss_scale()
        assert 0 < engine.optimizer.loss_scale <= 2**16 and engine.skipped_steps < TRAIN_STEPS, (
            engine.optimizer.loss_scale, engine.skipped_steps)
    print(f"losses {losses[0]:.3f} -> {losses[-1]:.3f}, skipped steps {engine.skipped_steps}")


def lora(model_path: str, arch: str) -> None:
    """LoRA at ZeRO-3: the adapters are folded into the generation copy, the training weights stay untouched."""
    engine, tokenizer = build_engine(model_path, stage=3, lora_arch=arch)
    on_cuda(engine)
    check_lora_merge(engine, hybrid_engine(engine), tokenizer)


CHECKS = {"long_positions": long_positions, "greedy": greedy, "cuda_graph": cuda_graph, "kept_copy": kept_copy,
          "many_rollouts": many_rollouts, "train_steps": train_steps, "lora": lora}


if __name__ == "__main__":
    init_distributed()
    CHECKS[sys.argv[1]](*sys.argv[2:])
    # a compiled step whose compiler failed decodes eagerly and would pass every check above
    assert compile_failure() is None, f"torch.compile failed, the step decoded eagerly: {compile_failure()}"
    torch_dist.barrier()
    print("GPU_OK", sys.argv[1], flush=True)
    torch_dist.destroy_process_group()
