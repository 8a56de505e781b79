"""The calibration's micro-benchmarks of what a scoring or training call does besides streaming its weights.

`measure_layer` runs a Llama-style decoder layer forward and forward + backward under the profiler and splits the
quietest run by op: the matmuls' time gives the forward and backward matmul rates, the attention kernel's its
rates, and the rest of the wall time (norms, activations, residuals, Python) a time per token per hidden unit. One
run's parts are consistent with each other even when other processes slow some runs. `measure_optimizer_s_per_param`
times the mixed-precision optimizer step. Each runs on one rank's threads while the other ranks of the calibration
run the same. Shapes are those of a small decoder (`REFERENCE`): a much wider model's layers run at other rates, so
the constants fit models near the reference width best.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from training.core.master_weights import MasterWeightAdamW
from training.core.optim import optimizer_of_kind, resolve_optimizer_kind, uses_master_weights


@dataclass(frozen=True)
class LayerShape:
    """A Llama-style decoder layer's width and the batch it is run on."""

    hidden: int
    rows: int
    seq: int
    heads: int

    @property
    def intermediate(self) -> int:
        return 64 * round(8 * self.hidden / 3 / 64)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def matmul_flops(self) -> float:
        """A forward's projections (q, k, v, o and the gated MLP's three) at `tokens` rows."""
        return 2.0 * self.tokens * (4 * self.hidden**2 + 3 * self.hidden * self.intermediate)

    @property
    def attention_flops(self) -> float:
        """QK^T and AV over the full square, as the cost model counts them."""
        return 4.0 * self.rows * self.seq**2 * self.hidden


REFERENCE = LayerShape(hidden=512, rows=2, seq=256, heads=8)
QUICK = LayerShape(hidden=256, rows=1, seq=128, heads=4)


def best_of(repeats: int, run: Callable[[], object], prepare: Callable[[], object] = lambda: None) -> float:
    """The shortest of `repeats` timed calls of `run`, after a warm-up one; `prepare` runs untimed before each."""
    prepare()
    run()  # warm-up: first-call allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        prepare()
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


class DecoderLayer(torch.nn.Module):
    """RMSNorm, q/k/v/o projections, causal SDPA, RMSNorm, gated SiLU MLP, two residuals (a Llama layer)."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        h, i = shape.hidden, shape.intermediate
        self.heads = shape.heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(h, h, bias=False) for _ in range(3))
        self.out = torch.nn.Linear(h, h, bias=False)
        self.gate, self.up = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.down = torch.nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq, hidden = x.shape
        normed = self.norm1(x)
        q, k, v = (proj(normed).view(rows, seq, self.heads, -1).transpose(1, 2) for proj in self.qkv)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, seq, hidden))
        normed = self.norm2(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


@dataclass(frozen=True)
class LayerRates:
    """A decoder layer's forward and backward split by kind of work: FLOP/s of its matmuls and of its attention
    kernel, and the seconds per token per hidden unit of the rest (norms, activations, residuals, Python)."""

    matmul_flops: float
    backward_flops: float
    attention_flops: float
    attention_backward_flops: float
    forward_elementwise_s: float
    backward_elementwise_s: float


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def _split(run: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(wall, matmul, attention) seconds of the quietest of `repeats` profiled runs (a noisy machine slows some
    runs; the split is that one run's, so its parts agree with each other)."""
    from torch.profiler import profile

    run()
    best = (float("inf"), 0.0, 0.0)
    for _ in range(repeats):
        with profile() as profiler:
            started = time.perf_counter()
            run()
            wall = time.perf_counter() - started
        if wall < best[0]:
            events = profiler.key_averages()
            matmul = sum(event.self_cpu_time_total for event in events if event.key in MATMUL_OPS) / 1e6
            attention = sum(event.self_cpu_time_total for event in events
                            if "scaled_dot_product" in event.key) / 1e6
            best = (wall, matmul, attention)
    return best


def measure_layer(dtype: torch.dtype, shape: LayerShape, repeats: int) -> LayerRates:
    """A decoder layer's forward (no gradients) and forward + backward at `shape`, profiled by op."""
    layer = DecoderLayer(shape).to(dtype)
    x = torch.randn(shape.rows, shape.seq, shape.hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def train() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    forward_s, forward_matmul, forward_attention = _split(forward, repeats)
    train_s, train_matmul, train_attention = _split(train, repeats)
    backward_s = train_s - forward_s
    backward_matmul = max(train_matmul - forward_matmul, 1e-9)
    backward_attention = max(train_attention - forward_attention, 1e-9)
    units = shape.tokens * shape.hidden
    return LayerRates(
        matmul_flops=shape.matmul_flops / forward_matmul, backward_flops=2 * shape.matmul_flops / backward_matmul,
        attention_flops=shape.attention_flops / forward_attention,
        attention_backward_flops=2 * shape.attention_flops / backward_attention,
        forward_elementwise_s=max(forward_s - forward_matmul - forward_attention, 0.0) / units,
        backward_elementwise_s=max(backward_s - backward_matmul - backward_attention, 0.0) / units)


def measure_optimizer_s_per_param(dtype: torch.dtype, parameters: int, repeats: int) -> float:
    """Seconds per trained parameter of one optimizer step as a ZeRO-0 engine runs it: bf16 on a CPU machine
    through `MasterWeightAdamW`; other mixed precision through DeepSpeed's wrapper (an overflow check of every
    low-precision gradient, summed in fp32, the gradients cast to fp32 and flattened into one buffer, its norm and
    the clip, the Adam that training builds (`training.core.optim`) on the flat fp32 master weights, and the master
    copied back into the low-precision weights); fp32 training: the norm, the clip and the Adam on the weights."""
    chunks = 16
    numel = parameters // chunks
    mixed = dtype != torch.float32
    weights = [torch.randn(numel, dtype=dtype) for _ in range(chunks)]
    grads = [torch.randn(numel, dtype=dtype) for _ in range(chunks)]
    if dtype == torch.bfloat16 and uses_master_weights("bf16", 0, False, "auto"):
        trained = [torch.nn.Parameter(weight) for weight in weights]
        optimizer = MasterWeightAdamW([{"params": trained}], lr=1e-6, betas=(0.9, 0.95), max_grad_norm=1.0)

        def sum_gradients() -> None:
            """What training's backward hooks do (a backward's cost): each gradient cast into its fp32 sum."""
            for parameter, grad in zip(trained, grads):
                parameter.grad = grad
            optimizer.get_grads_for_reduction()

        return best_of(repeats, optimizer.step, sum_gradients) / (numel * chunks)
    master = [torch.nn.Parameter(torch.cat([w.float() for w in weights]))] if mixed else \
        [torch.nn.Parameter(w) for w in weights]
    optimizer = optimizer_of_kind(resolve_optimizer_kind("auto", offload=False), [{"params": master}], 1e-6)

    def step() -> None:
        if mixed:
            for grad in grads:
                float(grad.float().sum())  # DeepSpeed's inf/nan check
            master[0].grad = torch.cat([grad.float() for grad in grads])
        else:
            for parameter, grad in zip(master, grads):
                parameter.grad = grad
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in master]))
        for parameter in master:
            parameter.grad.mul_(1.0 / max(float(norm), 1.0))
        optimizer.step()
        if mixed:
            for weight, piece in zip(weights, master[0].detach().split(numel)):
                weight.copy_(piece)

    return best_of(repeats, step) / (numel * chunks)


@dataclass(frozen=True)
class DecodeOverheads:
    """What a decode step of the hybrid engine's decoder costs besides streaming its weights: seconds per decoder
    layer, and seconds per logit (row x vocabulary entry) of drawing the next token and its log-probability."""

    per_layer_s: float
    per_logit_s: float


def _decode_step_s(dtype: torch.dtype, layers: int, vocab: int, rows: int, quick: bool) -> float:
    """Seconds per decode step of the hybrid engine's decoder on a tiny random Llama (its weights are negligible:
    what is left is the step's fixed costs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.generation.generator import GenerationConfig
    from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings

    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=256)
    engine = HybridEngine(LlamaForCausalLM(config).to(dtype).eval(), HybridEngineSettings())
    prompts = torch.randint(0, vocab, (rows, 16))
    short, long = (4, 12) if quick else (8, 40)

    def decode(steps: int) -> float:
        settings = GenerationConfig(max_new_tokens=steps, eos_token_id=vocab, pad_token_id=0)
        return best_of(2 if quick else 5, lambda: engine.generate(prompts, torch.ones_like(prompts), settings))

    with engine.generate_mode():
        return (decode(long) - decode(short)) / (long - short)


def measure_decode_overheads(dtype: torch.dtype, bandwidth: float, quick: bool) -> DecodeOverheads:
    """Decode steps at 2 and 8 layers give the per-layer cost; at a 256- and a 49152-entry vocabulary the
    per-logit cost (less streaming the larger output head, which the cost model counts with the weights)."""
    rows, small, large = 4, 256, 49152
    few, many = _decode_step_s(dtype, 2, small, rows, quick), _decode_step_s(dtype, 8, small, rows, quick)
    wide = _decode_step_s(dtype, 2, large, rows, quick)
    head_s = (large - small) * 64 * (torch.finfo(dtype).bits // 8) / bandwidth
    return DecodeOverheads(per_layer_s=max(many - few, 0.0) / 6,
                           per_logit_s=max(wide - few - head_s, 0.0) / (rows * (large - small)))
