"""The work each step-3 phase must do, and the time this machine needs for it at best (the phase's floor).

Work counts real tokens only (no padding), the LM head only where an answer token is predicted, and:
- a forward over a row of t tokens: 2 * (linear weights) * t FLOPs, plus causal attention 2 * layers *
  (attention width) * t^2 (scores and weighted sum, half the t x t square each), plus the LM head's 2 * hidden *
  vocab per predicted token;
- training: 3x its forward (backward = two products per forward product) plus the optimizer, which reads and
  writes every parameter's weight, gradient and two Adam moments (28 bytes per fp32 parameter);
- generation: the prompts' forward (prefill), then one decode step per answer position after the first, each
  reading every weight once for the rows still decoding (and their KV cache).

The floors use this machine's measured rates: `matmul_flops_per_s`, the best torch.matmul throughput over the
model's own linear shapes at a scoring batch's token count; `weight_pass_s[b]`, one b-row product with every
weight matrix through the kernel the hybrid engine decodes with (bench/generation.py's weight pass: the decode
step's weight-streaming ceiling); the streaming rate they imply for KV-cache and optimizer bytes.
A phase floor is the larger of its FLOP time and its byte time, summed over decode steps for generation.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from bench.decode_floor import attention_widths, kv_cache_bytes, streamed_matrix_shapes, weight_pass_tokens_per_s
from training.core.zero import full_numel, full_shape

ADAM_BYTES_PER_PARAMETER = 28  # read weight, grad, m, v (16) and write weight, m, v (12), fp32


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of one model."""

    linear_parameters: int  # 2-D weights of the decoder layers (no embeddings, no LM head)
    trained_parameters: int
    layers: int
    hidden: int
    attention_width: int  # heads * head dim
    kv_width: int  # KV heads * head dim
    vocab: int  # 0 for a value model (its head is one number per token)
    bytes_per_weight: int

    @classmethod
    def of(cls, model: torch.nn.Module, config, lm_head: bool) -> "ModelShape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers, attention_width, kv_width = attention_widths(text)
        embeddings = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
        lm_weight = model.get_output_embeddings().weight if lm_head else None
        # full sizes: under ZeRO-3 a parameter's own shape is empty (`training.core.zero`)
        linear = sum(full_numel(p) for p in model.parameters() if len(shape := full_shape(p)) == 2
                     and id(p) not in embeddings and p is not lm_weight and shape[0] > 1)
        trained = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
        return cls(linear, trained, layers, text.hidden_size, attention_width, kv_width,
                   text.vocab_size if lm_head else 0, next(model.parameters()).element_size())

    def forward_flops(self, lengths: list[int], predicted: int) -> float:
        """A forward over rows of `lengths` real tokens, with the LM head on `predicted` tokens."""
        body = sum(2 * self.linear_parameters * t + 2 * self.layers * self.attention_width * t * t for t in lengths)
        return float(body + 2 * self.hidden * self.vocab * predicted)

    def decode_step_flops(self, contexts: list[int]) -> float:
        """One decode step of rows at `contexts` tokens: every weight once per row, attention over the context."""
        per_row = 2 * self.linear_parameters + 2 * self.hidden * self.vocab
        return float(sum(per_row + 4 * self.layers * self.attention_width * context for context in contexts))

    def kv_bytes(self, context: int) -> int:
        """The KV cache one row reads per decode step at `context` tokens."""
        return int(kv_cache_bytes(self.layers, self.kv_width, context, self.bytes_per_weight))


@dataclass(frozen=True)
class MachineRates:
    matmul_flops_per_s: float
    weight_pass_s: dict[int, float]  # rows -> seconds of one pass over every weight
    stream_bytes_per_s: float

    @classmethod
    def measure(cls, model: torch.nn.Module, max_rows: int, tokens: int, dtype: torch.dtype,
                pack: bool, device: torch.device = torch.device("cpu")) -> "MachineRates":
        """The rates on `device` over `model`'s weight shapes (only its shapes: the model may live elsewhere)."""
        passes = {rows: rows / weight_pass_tokens_per_s(model, rows, dtype, device, pack)
                  for rows in range(1, max_rows + 1)}
        streamed = sum(math.prod(shape) for shape in streamed_matrix_shapes(model))
        weight_bytes = streamed * torch.empty((), dtype=dtype).element_size()
        return cls(_matmul_flops_per_s(model, tokens, dtype, device), passes, weight_bytes / passes[1])

    @classmethod
    def best(cls, measurements: list["MachineRates"]) -> "MachineRates":
        """The fastest of several measurements, rate by rate (a floor is the best the machine has shown)."""
        return cls(max(m.matmul_flops_per_s for m in measurements),
                   {rows: min(m.weight_pass_s[rows] for m in measurements) for rows in measurements[0].weight_pass_s},
                   max(m.stream_bytes_per_s for m in measurements))


def _matmul_flops_per_s(model: torch.nn.Module, tokens: int, dtype: torch.dtype, device: torch.device,
                        repeats: int = 3) -> float:
    """Best torch.matmul throughput on `device` over the distinct 2-D weight shapes of `model` at `tokens` rows
    (the first pass on CUDA is a warm-up: it pays the kernels' selection)."""
    shapes = sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2 and min(p.shape) > 1})
    weights = [torch.randn(shape, dtype=dtype, device=device) for shape in shapes]
    inputs = {shape[1]: torch.randn(tokens, shape[1], dtype=dtype, device=device) for shape in shapes}
    flops = sum(2 * tokens * shape[0] * shape[1] for shape in shapes)
    cuda = device.type == "cuda"
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + cuda):
            started = time.perf_counter()
            for weight in weights:
                torch.matmul(inputs[weight.shape[1]], weight.T)
            if cuda:
                torch.cuda.synchronize(device)
            if attempt >= cuda:
                best = min(best, time.perf_counter() - started)
    return flops / best


@dataclass
class RolloutShape:
    """The real token counts of one PPO step's batch."""

    prompt_lengths: list[int]
    answer_lengths: list[int]

    @property
    def lengths(self) -> list[int]:
        return [p + n for p, n in zip(self.prompt_lengths, self.answer_lengths)]

    @property
    def answer_tokens(self) -> int:
        return sum(self.answer_lengths)


def generation_floor(actor: ModelShape, rollout: RolloutShape, rates: MachineRates) -> tuple[float, float]:
    """(FLOPs, floor seconds) of generating the rollout: prefill, then decode steps over the rows still going."""
    prefill = actor.forward_flops(rollout.prompt_lengths, len(rollout.prompt_lengths))
    flops, seconds = prefill, prefill / rates.matmul_flops_per_s
    for step in range(1, max(rollout.answer_lengths)):
        live = [p + step for p, n in zip(rollout.prompt_lengths, rollout.answer_lengths) if n > step]
        step_flops = actor.decode_step_flops(live)
        kv_seconds = sum(actor.kv_bytes(context) for context in live) / rates.stream_bytes_per_s
        flops += step_flops
        seconds += max(rates.weight_pass_s[len(live)] + kv_seconds, step_flops / rates.matmul_flops_per_s)
    return flops, seconds


def scoring_floor(model: ModelShape, rollout: RolloutShape, rates: MachineRates) -> tuple[float, float]:
    """One scoring forward over the rollout (the LM head on the answer tokens for a causal LM)."""
    flops = model.forward_flops(rollout.lengths, rollout.answer_tokens)
    return flops, flops / rates.matmul_flops_per_s


def training_floor(model: ModelShape, rollout: RolloutShape, rates: MachineRates) -> tuple[float, float]:
    """One update on the rollout: forward + backward and one Adam step."""
    flops = 3 * model.forward_flops(rollout.lengths, rollout.answer_tokens)
    optimizer_s = model.trained_parameters * ADAM_BYTES_PER_PARAMETER / rates.stream_bytes_per_s
    return flops, flops / rates.matmul_flops_per_s + optimizer_s
