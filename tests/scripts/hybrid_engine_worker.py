"""Helpers for the hybrid-engine tests, and the worker the 2-process tests launch.

As a worker (`torchrun --nproc_per_node 2 hybrid_engine_worker.py MODELS_DIR MODE...`, with a tiny
model of each mode's architecture at MODELS_DIR/tiny-ARCH), each rank
generates for its own prompts with the hybrid engine and checks, on every rank: greedy tokens equal
the `hf` backend's, the reported log-probs equal the train-mode forward's, two continuations per
prompt repeat each greedy answer twice, and the next training
step's loss equals that of a twin engine that never generated (a `LONG_POSITION_MODES` mode instead checks bf16
distributions past position 500, on MODELS_DIR/`LONG_POSITION_LLAMA`, a tiny-llama made with LONG_POSITION_MODEL).
Rank 0 prints `HYBRID_OK <mode>` when all ranks passed; a failing mode ends the launch, its later modes unrun.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from tiny_models import RECENT_ARCHITECTURES
from torch.nn.attention import SDPBackend, sdpa_kernel

from training.core.attention_kernels import exclude_cudnn_attention
from training.core.ds_config import get_eval_ds_config
from training.core.engine import OptimizationSettings, create_frozen_engine, load_frozen_causal_lm
from training.core.lora import apply_lora
from training.core.model_loading import load_causal_lm, load_tokenizer, resolve_dtype
from training.core.sequences import answer_logits, answer_logprobs
from training.generation.generator import GenerationConfig, HFGenerator, TokenChoice
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings

LORA_MODULE_NAMES = {"llama": "layers.", "qwen2": "layers.", "qwen3": "layers.", "mistral": "layers.", "gpt2": "h.",
                     "opt": "decoder.layers.", **dict.fromkeys(RECENT_ARCHITECTURES, "layers.")}
PROMPTS = [
    "Human: What is the capital of France? Assistant:",
    "Human: hi",
    "The quick brown fox",
    "yes no maybe",
    "Human: Tell me a joke. Assistant: Why",
    "0 1 2 3",
]


def build_engine(model_path: str, stage: int, lora_arch: str | None = None, dtype: str = "fp32", seed: int = 0,
                 lora_alpha: float | None = None):
    """A training engine for a tiny model; at ZeRO-3 no parameter is persistent, so every one is really partitioned.
    Its attention kernels are the ones `create_train_engine` leaves the process. `lora_alpha` other than 4 scales
    the adapters (peft's alpha / r), so that a merge leaving the scale out shows."""
    exclude_cudnn_attention(get_accelerator().device_name())
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_path)
    settings = OptimizationSettings(learning_rate=1e-2, num_training_steps=8, zero_stage=stage, micro_batch_size=2,
                                    dtype=dtype, lr_scheduler_type="constant")
    config = fully_partitioned(settings.ds_config())
    model = load_causal_lm(model_path, tokenizer, dtype=resolve_dtype(dtype), ds_config=config,
                           disable_dropout_layers=True)
    if lora_arch is not None:
        model = apply_lora(model, lora_dim=4, lora_module_name=LORA_MODULE_NAMES[lora_arch], lora_alpha=lora_alpha)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, tokenizer


def fully_partitioned(config: dict) -> dict:
    """A DeepSpeed config with no persistent parameter at ZeRO-3, so every one of a tiny model is really
    partitioned (DeepSpeed keeps parameters under its threshold whole on every rank)."""
    if config["zero_optimization"]["stage"] == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def fully_partitioned_eval_config(*args, **kwargs) -> dict:
    """`get_eval_ds_config`, `fully_partitioned` (tests patch it into training.core.engine)."""
    return fully_partitioned(get_eval_ds_config(*args, **kwargs))


def build_frozen_engine(model_path: str, stage: int, lora_arch: str | None = None, lora_alpha: float | None = None):
    """An inference-only engine for a tiny model (`create_frozen_engine`, as bench/generation.py's --frozen_actor
    builds it), its LoRA adapters' B made non-zero so that merging them matters (`lora_alpha` as `build_engine`)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_path)
    model = load_frozen_causal_lm(model_path, tokenizer, "fp32", stage)
    if lora_arch is not None:
        model = apply_lora(model, lora_dim=4, lora_module_name=LORA_MODULE_NAMES[lora_arch], lora_alpha=lora_alpha)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.5)
    return create_frozen_engine(model, stage), tokenizer


def hybrid_engine(engine, **settings) -> HybridEngine:
    """The hybrid engine the checks run, gathering every ZeRO-3 parameter group at once."""
    return HybridEngine(engine, HybridEngineSettings(enable=True, tp_gather_partition_size=1, **settings))


def train_step(engine, tokenizer, texts=PROMPTS[:2]) -> float:
    """One training step on `texts`, on the engine's device (DeepSpeed's forward does not move its inputs)."""
    tokenizer.padding_side = "right"
    enc = tokenizer(list(texts), return_tensors="pt", padding=True).to(engine.device)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    loss = engine(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def prompt_batch(tokenizer, texts):
    """Left-padded prompts, as the data layer's PromptCollator produces them."""
    tokenizer.padding_side = "left"
    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    tokenizer.padding_side = "right"
    return enc["input_ids"], enc["attention_mask"]


def greedy_config(tokenizer, max_new_tokens=10, eos_token_id=None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id if eos_token_id is None else eos_token_id)


def frequent_token(sequences: torch.Tensor, prompt_length: int) -> int:
    """A token the model emits early in the first answer (rank 0's, so all ranks agree): used as EOS so
    that rows finish at different steps."""
    token = sequences[0, prompt_length + 2].clone()
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(token, src=0)
    return int(token)


def train_mode_logprobs(engine, output, temperature: float = 1.0, tokenizer_size: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        return answer_logprobs(engine.module, output.sequences, output.attention_mask, output.prompt_length,
                               temperature, tokenizer_size=tokenizer_size)


def check_group_repeats(generator, ids, mask, config, single, per_prompt=2, atol=1e-4):
    """`per_prompt` greedy continuations per prompt are the prompt's greedy answer `single` that many times,
    prompt-major (rows i*K .. i*K + K-1 continue prompt i)."""
    group = generator.generate(ids, mask, dataclasses.replace(config, num_return_sequences=per_prompt))
    assert torch.equal(group.sequences, single.sequences.repeat_interleave(per_prompt, 0)), group.sequences
    assert torch.equal(group.attention_mask, single.attention_mask.repeat_interleave(per_prompt, 0))
    torch.testing.assert_close(group.logprobs, single.logprobs.repeat_interleave(per_prompt, 0), rtol=0, atol=atol)
    return group


def check_parity(engine, hybrid, tokenizer, texts, atol=1e-4):
    """Greedy tokens equal to the hf backend's, log-probs equal to the train-mode forward's, and two
    continuations per prompt repeat each answer."""
    ids, mask = prompt_batch(tokenizer, texts)
    probe = hybrid.generate(ids, mask, greedy_config(tokenizer))
    config = greedy_config(tokenizer, eos_token_id=frequent_token(probe.sequences, probe.prompt_length))
    fast = hybrid.generate(ids, mask, config)
    baseline = HFGenerator(engine).generate(ids, mask, config)
    assert torch.equal(fast.sequences, baseline.sequences), (fast.sequences, baseline.sequences)
    assert torch.equal(fast.attention_mask, baseline.attention_mask)
    expected = train_mode_logprobs(engine, fast) * fast.answer_mask
    torch.testing.assert_close(fast.logprobs, expected, rtol=0, atol=atol)
    check_group_repeats(hybrid, ids, mask, config, fast, atol=atol)
    return fast


def full_weights(engine) -> dict[str, torch.Tensor]:
    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights[name] = param.detach().clone()
    return weights


def check_lora_merge(engine, hybrid, tokenizer) -> None:
    """After two training steps (lora_B non-zero, so merging matters), generation with the adapters folded in
    passes `check_parity`, and the training weights are exactly as they were."""
    for _ in range(2):
        train_step(engine, tokenizer)
    before = full_weights(engine)
    assert any("lora_B" in n and w.abs().sum() > 0 for n, w in before.items())
    check_parity(engine, hybrid, tokenizer, PROMPTS)
    after = full_weights(engine)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


@dataclasses.dataclass(frozen=True)
class RecordingChoice(TokenChoice):
    """A token choice that first copies the step's logits into `seen`: a copy into a buffer, which a captured
    graph replays at every step (a Python-side append would run at capture only)."""

    seen: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen[:logits.shape[0]].copy_(logits)
        return super().__call__(logits, uniforms)


class LogitsRecorder:
    """Stands in for a decoder's step model (of one decode) and keeps the logits of every step ([B, V] each,
    fp32): the prefill's as it returns them, each step's through a `RecordingChoice`."""

    def __init__(self, inner):
        self.inner, self.shrinks, self.logits = inner, inner.shrinks, []
        self.seen: torch.Tensor | None = None
        self.dtype = torch.float32  # of the model's logits

    def prefill(self, *args) -> torch.Tensor:
        logits = self.inner.prefill(*args)
        self.logits.append(logits.float().clone())
        self.dtype = logits.dtype
        return logits

    def repeat_rows(self, k: int) -> None:
        self.inner.repeat_rows(k)

    def step(self, tokens, mask, positions, column, choose: TokenChoice, uniforms):
        if self.seen is None:  # the first step has the most rows: the batch only shrinks
            self.seen = torch.empty(tokens.shape[0], self.logits[0].shape[-1], dtype=self.dtype, device=tokens.device)
        recording = RecordingChoice(**{f.name: getattr(choose, f.name) for f in dataclasses.fields(TokenChoice)},
                                    seen=self.seen)
        chosen = self.inner.step(tokens, mask, positions, column, recording, uniforms)
        self.logits.append(self.seen[:tokens.shape[0]].float().clone())
        return chosen

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.inner.keep_rows(keep)


# a tiny model for positions past 500 whose weights are drawn with std 0.3, so its distributions are peaked and
# attention depends on position as a trained model's does
LONG_POSITION_MODEL = dict(max_positions=1024, initializer_range=0.3)
# the same with biases drawn too (Qwen2's q/k/v: ZeRO-3's training forward adds them after the product)
LONG_POSITION_BIASED_MODEL = dict(LONG_POSITION_MODEL, bias_std=0.3)


def attention_kernel_noise(model: torch.nn.Module, output) -> tuple[torch.Tensor, float]:
    """How far `model`'s answer distributions move when its attention runs through SDPA's math kernel instead of
    the kernels torch picks for its shapes: the total-variation distances [B, N] and the largest change of a
    generated token's log-prob. What two correct forwards differ by for their attention kernels' rounding alone."""
    with torch.no_grad():
        picked = answer_logits(model, output.sequences, output.attention_mask, output.prompt_length).float()
        with sdpa_kernel(SDPBackend.MATH):
            math = answer_logits(model, output.sequences, output.attention_mask, output.prompt_length).float()
    tokens = output.sequences[:, output.prompt_length:, None]
    logprob_change = (math.log_softmax(-1) - picked.log_softmax(-1)).gather(-1, tokens).abs().max().item()
    return 0.5 * (math.softmax(-1) - picked.softmax(-1)).abs().sum(-1), logprob_change


def check_long_position_parity(model_path: str, dtype: str, make_hybrid, stage: int = 2,
                               lora_arch: str | None = None, kernel_bound: bool | None = None) -> torch.Tensor:
    """In half precision (`dtype`), the next-token distributions the hybrid engine (`make_hybrid(engine)`) samples
    32 tokens from at positions 520-551 are within total-variation distance 1e-3 on average and 2e-2 at worst of
    the train forward's (ZeRO `stage`; with `lora_arch`, LoRA adapters after two training steps), and its log-probs
    within 1e-1; returns the distances [2, 32].

    `kernel_bound` (default: on a GPU): each bound is raised to twice what the train forward moves by when its
    attention runs through the math kernel (`attention_kernel_noise`), measured here. On a GPU a decode step (one
    query over a masked cache) and the train forward (a causal pass) attend through different kernels, which round
    bf16 in their own order. On the H200, decode and train forward through the math kernel alone agreed exactly;
    through the kernels torch picked they came 5.8e-3 apart on average (1.5e-2 at worst), eager or compiled alike,
    and the train forward moved 7.0e-3 between the two kernels. A step that differs for more than that (RoPE rounded
    to bf16 came 0.03 from it) still fails."""
    engine, tokenizer = build_engine(model_path, stage=stage, dtype=dtype, lora_arch=lora_arch)
    if lora_arch is not None:
        for _ in range(2):
            train_step(engine, tokenizer)
    hybrid = make_hybrid(engine)
    prompts = torch.randint(3, len(tokenizer), (2, 520), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=32, seed=1, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    with hybrid.generate_mode():
        recorder = LogitsRecorder(hybrid._decoder.model)
        hybrid._decoder.model = recorder
        out = hybrid.generate(prompts, torch.ones_like(prompts), config)
    generated = torch.stack(recorder.logits, dim=1)
    if hybrid.tp is not None:  # the group decoded its ranks' prompts as one batch, rank-major: this rank's rows
        generated = generated[hybrid.tp.rank * len(prompts):][:len(prompts)]
    with torch.no_grad():
        trained = answer_logits(engine.module, out.sequences, out.attention_mask, out.prompt_length).float()
    assert generated.shape == trained.shape == (2, 32, len(tokenizer))
    total_variation = 0.5 * (generated.softmax(-1) - trained.softmax(-1)).abs().sum(-1)
    # the mean catches a step that rounds otherwise (every fix below was over 7e-3 on average); one position may move
    # more, and a log-prob by a bf16 step of its logit (0.0625 in [8, 16)): on an AMD EPYC with AVX512-BF16, where
    # the tensor-parallel group decodes its ranks' 4 rows as one batch and each rank's train forward its own 2, one of
    # 64 positions came 1.02e-2 apart (mean 3.9e-4) and its log-prob 5.5e-2, where the train forward moves by 7e-3 on
    # average between attention kernels
    mean_bound, max_bound, logprob_bound = 1e-3, 2e-2, 1e-1
    if kernel_bound if kernel_bound is not None else engine.device.type == "cuda":
        noise, logprob_noise = attention_kernel_noise(engine.module, out)
        print(f"the train forward's own distance between attention kernels: total variation mean {noise.mean():.2e} "
              f"max {noise.max():.2e}, log-prob {logprob_noise:.2e}")
        mean_bound, max_bound = max(mean_bound, 2 * noise.mean().item()), max(max_bound, 2 * noise.max().item())
        logprob_bound = max(logprob_bound, 2 * logprob_noise)
    assert total_variation.mean() < mean_bound and total_variation.max() < max_bound, total_variation
    torch.testing.assert_close(out.logprobs, train_mode_logprobs(engine, out), rtol=0, atol=logprob_bound)
    return total_variation


MODES = {  # mode: (architecture, ZeRO stage, LoRA, hybrid engine settings)
    "zero3": ("llama", 3, False, dict(tp_gather_partition_size=1)),
    "zero3_lora_tp2": ("llama", 3, True, dict(inference_tp_size=2)),
    # the kept copy's shards take up the next step's weights (parity checked again after it)
    "zero3_lora_tp2_kept": ("llama", 3, True, dict(inference_tp_size=2, keep_inference_copy=True)),
    "zero2_tp2": ("llama", 2, False, dict(inference_tp_size=2)),
    "zero3_unpinned": ("llama", 3, False, dict(unpin_actor_parameters=True)),
    # Qwen2 decodes through the fused path, its q/k/v biases sharded with the projections; the windowed Mistral
    # through the transformers forward, whose linear layers packing replaces
    "qwen2_zero3_tp2_packed": ("qwen2", 3, False, dict(inference_tp_size=2, onednn_packing=True)),
    "qwen2_zero3_tp2_unpacked": ("qwen2", 3, False, dict(inference_tp_size=2, onednn_packing=False)),
    "mistral_windowed_zero2_tp2_packed": ("mistral_windowed", 2, False, dict(inference_tp_size=2, onednn_packing=True)),
    "mistral_windowed_zero2_tp2_unpacked": ("mistral_windowed", 2, False,
                                            dict(inference_tp_size=2, onednn_packing=False)),
}


# bf16 at ZeRO-3 decoded by two tensor-parallel ranks, `check_long_position_parity` on each (a tiny-llama made with
# LONG_POSITION_MODEL): mode: (LoRA, hybrid engine settings)
LONG_POSITION_LLAMA = "tiny-llama-long-positions"  # the folder under MODELS_DIR of LONG_POSITION_MODES' model
LONG_POSITION_MODES = {
    "bf16_zero3_tp2_long_positions": (False, dict(inference_tp_size=2)),
    "bf16_zero3_lora_tp2_long_positions": (True, dict(inference_tp_size=2)),
    "bf16_zero3_lora_tp2_transformers_long_positions": (True, dict(inference_tp_size=2, fused_decode=False)),
}


def modes_architectures(modes) -> set[str]:
    return {MODES[mode][0] for mode in modes}


def check_mode(models_dir: str, mode: str, rank: int) -> None:
    """Parity on this rank, then the next training step's loss equals a twin engine's that never generated."""
    texts = PROMPTS[:3] if rank == 0 else PROMPTS[3:5]  # unequal batches on purpose
    arch, stage, lora, settings = MODES[mode]
    model_path = str(Path(models_dir) / f"tiny-{arch}")
    engine, tokenizer = build_engine(model_path, stage, lora_arch=arch if lora else None)
    twin, _ = build_engine(model_path, stage, lora_arch=arch if lora else None)
    if lora:
        for trained in (engine, twin):
            train_step(trained, tokenizer)  # makes lora_B non-zero, so merging matters
    hybrid = HybridEngine(engine, HybridEngineSettings(enable=True, **settings))
    check_parity(engine, hybrid, tokenizer, texts)
    loss, twin_loss = train_step(engine, tokenizer), train_step(twin, tokenizer)
    assert loss == twin_loss, (loss, twin_loss)
    if hybrid.settings.keep_inference_copy:
        check_parity(engine, hybrid, tokenizer, texts)


def check_long_position_mode(models_dir: str, mode: str) -> None:
    """Long-position parity in bf16 on this rank (`LONG_POSITION_MODES`)."""
    lora, settings = LONG_POSITION_MODES[mode]
    check_long_position_parity(str(Path(models_dir) / LONG_POSITION_LLAMA), "bf16",
                               lambda engine: hybrid_engine(engine, **settings), stage=3,
                               lora_arch="llama" if lora else None)


def main(models_dir: str, mode: str) -> None:
    """`mode`'s checks on every rank; rank 0 prints `HYBRID_OK <mode>` once all ranks passed."""
    from utils.dist import get_rank, init_distributed

    init_distributed()
    rank = get_rank()
    if mode in LONG_POSITION_MODES:
        check_long_position_mode(models_dir, mode)
    else:
        check_mode(models_dir, mode, rank)
    torch.distributed.barrier()
    if rank == 0:
        print("HYBRID_OK", mode, flush=True)


if __name__ == "__main__":
    for worker_mode in sys.argv[2:]:
        main(sys.argv[1], worker_mode)
    torch.distributed.destroy_process_group()
