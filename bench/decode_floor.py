"""What bounds a decode step from below: the bytes it must read at the device's copy bandwidth, and the weight pass.

At the batch sizes of a rollout a decode step is bound by memory, not arithmetic: it reads every weight it uses
once (all but an input embedding not tied to the output head, of which it gathers one row per token), and each
row's cached keys and values over its context. `DecodeWork` counts those bytes in the generation dtype;
`copy_bandwidth_bytes_per_s` measures the device's rate on one large tensor copy, counting the bytes read and
written (what "device-to-device copy bandwidth" usually means); their quotient is the time no decode step can beat.

`weight_pass_tokens_per_s` is the other ceiling: one batch-row product with every weight matrix through the kernel
the hybrid engine decodes with, timed (on a GPU replayed as one CUDA graph, as the decode step is), which
bench/generation.py reports beside the floor and bench/step3_work.py builds its floors on.
Parameters are counted at their full size under ZeRO-3 too (`training.core.zero`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from training.core.zero import full_numel, full_shape
from training.generation.cpu_linear import LinearWeight
from training.generation.decode_graphs import captured


def streamed_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a decode step reads whole: every one but LoRA adapters (generation reads them merged into
    the base weights) and an input embedding not tied to the output head."""
    input_embedding = model.get_input_embeddings().weight
    output_embedding = model.get_output_embeddings().weight
    return [p for name, p in model.named_parameters()
            if "lora_" not in name and (p is not input_embedding or p is output_embedding)]


def streamed_matrix_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The full (ZeRO-3: `ds_shape`) shapes of the weight matrices among `streamed_parameters`: what a weight pass
    multiplies by."""
    return [shape for shape in map(full_shape, streamed_parameters(model)) if len(shape) == 2]


def weight_pass_tokens_per_s(model: torch.nn.Module, batch_size: int, dtype: torch.dtype, device: torch.device,
                             pack: bool, repeats: int = 4) -> float:
    """Tokens/s of a decode step that did nothing but one batch-row product with each weight matrix,
    through `LinearWeight` (oneDNN-prepacked where available when `pack`, `torch.matmul` otherwise).

    Only the shapes matter, so the matrices are fresh tensors of the model's full (ZeRO-3: `ds_shape`) weight
    shapes; the model is neither gathered nor loaded again."""
    shapes = streamed_matrix_shapes(model)
    matrices = [LinearWeight(torch.randn(shape, dtype=dtype, device=device), pack=pack) for shape in shapes]
    inputs = {width: torch.randn(batch_size, width, dtype=dtype, device=device) for width in {s[1] for s in shapes}}

    def one_pass() -> None:
        for matrix in matrices:
            matrix(inputs[matrix.in_features])

    with torch.no_grad():
        # on a GPU the pass replays as one CUDA graph, as the decode step does: timed eagerly, its ~200 small
        # products would measure their launches, not the weights' streaming
        run = captured(one_pass) if device.type == "cuda" else one_pass
        best = min(_seconds(run, device) for _ in range(repeats))
    return batch_size / best


def attention_widths(config) -> tuple[int, int, int]:
    """(layers, query heads x head dim, key/value heads x head dim) of a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads * head_dim, (getattr(text, "num_key_value_heads", None) or heads) * head_dim


def kv_cache_bytes(layers: int, kv_width: int, tokens: float, bytes_per_value: int) -> float:
    """The keys and values `tokens` cached tokens hold over every layer."""
    return 2 * layers * kv_width * tokens * bytes_per_value


def mean_decode_context(prompt_width: int, steps: int, first_step: int = 1) -> float:
    """The mean number of cache columns decode steps first_step..steps attend over. The prefill yields the first
    answer token; decode step j feeds answer token j and attends over the prompt's columns (padding included: every
    backend reads them) and j answer columns."""
    return prompt_width + (first_step + steps) / 2


@dataclass(frozen=True)
class DecodeWork:
    """The bytes a decode step reads, in the generation dtype."""

    weight_bytes: int  # `streamed_parameters`, once per step whatever the batch
    kv_bytes_per_token: int  # one cached token's keys and values, every layer

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype) -> "DecodeWork":
        size = torch.empty((), dtype=dtype).element_size()
        layers, _, kv_width = attention_widths(model.config)
        return cls(sum(map(full_numel, streamed_parameters(model))) * size,
                   int(kv_cache_bytes(layers, kv_width, 1, size)))

    def step_bytes(self, rows: int, context: float) -> float:
        """One step of `rows` rows, each attending over `context` cached tokens."""
        return self.weight_bytes + rows * context * self.kv_bytes_per_token


def _seconds(work: Callable[[], object], device: torch.device) -> float:
    """Wall time of `work` on `device`: CUDA events on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes read plus bytes written per second by the fastest of `repeats` copies of one `nbytes` tensor into
    another on `device`, after an untimed copy (pages touched, kernels loaded). Pick `nbytes` well beyond the
    device's caches."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(_seconds(lambda: target.copy_(source), device) for _ in range(repeats))
    return 2 * nbytes / best
