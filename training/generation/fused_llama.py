"""A decode-only forward for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3), the hybrid engine's fast path
(its steps replayed as CUDA graphs on a GPU: `decode_graphs.py`).

The transformers forward spends much of a decode step outside the matmuls: building the 4-D mask,
updating the cache object, and many small ops per layer. This forward runs the same math on the
same weights with fewer, larger ops: q/k/v and gate/up each in one matmul, every projection through
a `LinearWeight` (oneDNN-prepacked on CPU, see `cpu_linear.py`), keys and values written into one
preallocated buffer, attention only over the columns filled so far, and fused RMSNorm. Per layer it also saves
what a replayed GPU step still pays for each small kernel: the attention mask is made additive once for all
layers, and rotary embeddings swap halves in one copy. Every trim keeps the training forward's roundings (a residual
added inside the out and down products, rounded once where transformers rounds twice, moved bf16 rollouts' next-token
distributions 8e-3 in total variation from the trained ones past position 500).

The family shares one layer: RMSNorm, rotary attention with grouped key/value heads, a SiLU-gated MLP. Its members
differ in what this forward reads from the weights themselves: projection biases (Qwen2's q/k/v; Llama's with
`attention_bias` or `mlp_bias`) ride in the fused products, and Qwen3's per-head RMSNorm of queries and keys
(`q_norm`, `k_norm`) runs on both at once before the rotation. A model whose attention is windowed anywhere its
sequences can reach (Mistral's `sliding_window`, Qwen's sliding layers) takes the transformers forward instead.

It serves an inference copy (plain, or one tensor-parallel shard: head counts are read from the
weight shapes, and a shard's row-parallel projections are `ReducedLinear` layers, whose cross-rank
sum their `LinearWeight` keeps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from training.generation.cpu_linear import LinearWeight, ReducedLinear
from training.generation.lora_terms import LoRATerm, fuse_lora_terms

FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_TYPED_MODEL_TYPES = ("qwen2", "qwen3")  # their attention windows the layers `layer_types` names
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")
_MASK_ALIGNMENT = 16  # elements between rows of an attention mask that GPU attention kernels take without a copy
LoRAOf = Callable[[torch.nn.Module], LoRATerm | None]  # a projection's LoRA term, if it has one


def fused_llama_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `FusedLlama` cannot run this model, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if (windowed := _sliding_window_reason(config)) is not None:
        return windowed
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    return None


def _sliding_window_reason(config) -> str | None:
    """Why attention is windowed somewhere a sequence can reach, or None. Qwen2 and Qwen3 name each layer's kind
    (`layer_types`); Mistral windows every layer when `sliding_window` is set, which changes nothing for sequences
    no longer than the window, and ignores `layer_types` (a Mistral config may still carry it)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and config.model_type in _LAYER_TYPED_MODEL_TYPES:
        windowed = sum(kind != "full_attention" for kind in layer_types)
        return f"{windowed} sliding-window attention layers" if windowed else None
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        return f"sliding-window attention ({window} positions)"
    return None


@dataclass
class FusedKVBuffers:
    """Keys and values of every layer: [layers, rows, kv_heads, length, head_dim]."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[3]


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: LinearWeight
    head_norm: torch.Tensor | None  # Qwen3: [q heads + kv heads, head_dim], q_norm's weight then k_norm's
    out: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight


def _detached_bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def _fuse(linears: list[torch.nn.Linear], pack: bool, lora: LoRAOf) -> LinearWeight:
    """One projection for several Linears: their weights (and biases, zeros standing in for a missing one, and LoRA
    terms) concatenated by output rows. The Linears' parameters (and terms) are then rebound as views of the fused
    tensors, so the inference copy holds each weight once (not also a fused duplicate: 4.5 of a 7B Llama's 6.7 B
    weights), and weights loaded into the copy afterwards land in the fused product (see `FusedLlama.refresh`)."""
    term = fuse_lora_terms([lora(linear) for linear in linears], [linear.weight.shape[0] for linear in linears])
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([_detached_bias(linear) if linear.bias is not None
                          else linear.weight.new_zeros(linear.weight.shape[0]) for linear in linears])
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.weight.shape[0])
        linear.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
        start = rows.stop
    return LinearWeight(weight, bias, pack=pack, keep_source=True, lora=term)


def _single(linear: torch.nn.Linear, pack: bool, lora: LoRAOf) -> LinearWeight:
    """One Linear's projection, its cross-rank sum included when it is a row-parallel shard."""
    reduce = linear.reduce if isinstance(linear, ReducedLinear) else None
    return LinearWeight(linear.weight.detach(), _detached_bias(linear), pack=pack, reduce=reduce, keep_source=True,
                        lora=lora(linear))


def _head_norm(attention: torch.nn.Module, heads: int, kv_heads: int) -> torch.Tensor | None:
    """Qwen3's per-head RMSNorm weights of queries and keys, one row per head of the fused q/k layout, or None."""
    if getattr(attention, "q_norm", None) is None:
        return None
    return torch.cat((attention.q_norm.weight.expand(heads, -1), attention.k_norm.weight.expand(kv_heads, -1)))


class FusedLlama:
    """Prefill and single-token steps over `FusedKVBuffers` for a Llama-family causal LM (`FUSED_MODEL_TYPES`)."""

    def __init__(self, model: torch.nn.Module, pack: bool = True, lora_terms: dict[str, LoRATerm] | None = None):
        by_module = {id(model.get_submodule(name)): term for name, term in (lora_terms or {}).items()}

        def lora(module: torch.nn.Module) -> LoRATerm | None:
            return by_module.get(id(module))

        inner = model.model
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        first = inner.layers[0].self_attn
        self.heads = first.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = first.k_proj.weight.shape[0] // self.head_dim
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = LinearWeight(model.lm_head.weight.detach(), pack=pack, keep_source=True,
                                    lora=lora(model.lm_head))
        self.rotary = inner.rotary_emb
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=_fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], pack, lora),
                head_norm=_head_norm(layer.self_attn, self.heads, self.kv_heads),
                out=_single(layer.self_attn.o_proj, pack, lora),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=_fuse([layer.mlp.gate_proj, layer.mlp.up_proj], pack, lora),
                down=_single(layer.mlp.down_proj, pack, lora),
            )
            for layer in inner.layers
        ]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self._cos = self._sin = None
        self._model = model

    @torch.no_grad()
    def refresh(self) -> None:
        """Take up new weights loaded into the model in place (`InferenceCopy.load_from`): a plain projection
        already reads them (its weight is the model's, or a fused tensor the model's weights are views of), as do
        the norms and the embedding; a packed one is packed again, and Qwen3's stacked head norms are rebuilt in
        place. Every tensor a plain step reads keeps its address, so captured CUDA graphs stay valid."""
        for linear in self.linear_weights():
            linear.repack()
        for layer, module in zip(self.layers, self._model.model.layers):
            if layer.head_norm is not None:
                layer.head_norm.copy_(_head_norm(module.self_attn, self.heads, self.kv_heads))

    def linear_weights(self) -> list[LinearWeight]:
        return [w for layer in self.layers for w in (layer.qkv, layer.out, layer.gate_up, layer.down)] + [self.lm_head]

    def allocate(self, rows: int, length: int) -> FusedKVBuffers:
        shape = (len(self.layers), rows, self.kv_heads, length, self.head_dim)
        return FusedKVBuffers(torch.zeros(shape, dtype=self.dtype, device=self.device),
                              torch.zeros(shape, dtype=self.dtype, device=self.device))

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for positions 0..length-1 ([length, head_dim]), computed as the model's rotary
        module does; kept (and reused by later calls) until a longer one is asked for. The sin table's first half
        is negated, so that rotating a vector is a swap of its halves (`_rotate`): -(x * s) and x * (-s) are the
        same number."""
        if self._cos is None or self._cos.shape[0] < length:
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(length, device=self.device)[None])
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos, self._sin

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' Llama RMSNorm over the last dimension: normalised in fp32, rounded to the model dtype, then
        scaled (one op in fp32, where the rounding is none, for a weight of that dimension's size; a head norm's
        weight has one row per head). `F.rms_norm` of a half-precision input computes in fp32 and rounds its result
        (to the bit what an explicit upcast, the fp32 op and a downcast give: `tests/test_hybrid_engine.py`), in one
        kernel where those were three, a replayed GPU step's cost."""
        if hidden.dtype == torch.float32 and weight.dim() == 1:
            return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps=self.eps)
        return weight * F.rms_norm(hidden, (hidden.shape[-1],), eps=self.eps)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention through the kernel the transformers forward uses (sdpa): q [B, H, S, D],
        keys/values [B, KV, T, D], mask [B, 1, S, T] (additive: 0 or -inf) -> [B, H, S, D]. Its scores accumulate
        in fp32; two bf16 batched matmuls would round them to bf16 first and sample from a visibly different
        distribution at long positions.

        A decode step (S = 1) lays the query heads that share a key/value head out as that head's queries
        ([B, KV, H/KV, D]): the same products without the kernel's per-head GQA indexing (2.5 -> 1.9 ms a step
        over SmolLM2's 30 layers at batch 8 on CPU)."""
        batch, heads, length, head_dim = q.shape
        if length == 1 and heads != self.kv_heads:
            grouped = q.reshape(batch, self.kv_heads, heads // self.kv_heads, head_dim)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            return out.reshape(batch, heads, 1, head_dim)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != self.kv_heads)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """transformers' rotary embedding, x * cos + rotate_half(x) * sin, to the bit: rotate_half's negation is in
        `signed_sin`, so its swap of halves is one copy (a flip) instead of a negation and a concatenation."""
        halves = x.unflatten(-1, (2, x.shape[-1] // 2))
        return x * cos + halves.flip(-2).flatten(-2) * signed_sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: FusedKVBuffers,
                column: int | torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last position. `input_ids` [B, S] fill cache columns column..column+S-1.

        With an int `column`, attention runs over the columns filled so far and `attend` [B, 1, S, column+S]
        (bool) says which of them each query may see. A step replayed as a CUDA graph may not depend on host
        values, so there `column` is a [S] long tensor of the columns written, attention runs over every cache
        column (`attend` [B, 1, S, T] masks the unfilled ones) and the RoPE tables must already cover every
        position (`rope_tables(T)`)."""
        batch, length = input_ids.shape
        if isinstance(column, int):
            end = column + length
            cos_table, sin_table = self.rope_tables(int(positions.max()) + 1)
        else:
            end = cache.length
            cos_table, sin_table = self._cos, self._sin
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mask = _additive_mask(attend, self.dtype)
        hidden = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(hidden, layer.input_norm))
            qk, v = qkv.split((q_size + kv_size, kv_size), dim=-1)
            # queries and keys normed (Qwen3) and rotated together: one set of elementwise ops per layer, not two
            qk = qk.view(batch, length, self.heads + self.kv_heads, self.head_dim)
            if layer.head_norm is not None:
                qk = self._norm(qk, layer.head_norm)
            qk = self._rotate(qk.transpose(1, 2), cos, sin)
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            keys, values = cache.keys[index], cache.values[index]
            _store(keys, k, column)
            _store(values, v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2), column)
            attention = self._attend(q, keys[:, :, :end], values[:, :, :end], mask)
            hidden = hidden + layer.out(attention.transpose(1, 2).reshape(batch, length, q_size))
            gate, up = layer.gate_up(self._norm(hidden, layer.post_norm)).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return self.lm_head(self._norm(hidden[:, -1], self.norm))


def _additive_mask(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (0 where `attend`, -inf elsewhere) attention would make of the boolean one in every layer,
    made once for all of them. Its rows are laid out 16 columns apart, whatever the width: a GPU's
    memory-efficient attention copies a mask whose rows are not aligned into one that is, layer after layer."""
    width = -(-attend.shape[-1] // _MASK_ALIGNMENT) * _MASK_ALIGNMENT
    mask = torch.zeros(*attend.shape[:-1], width, dtype=dtype, device=attend.device)[..., :attend.shape[-1]]
    return mask.masked_fill_(~attend, float("-inf"))


def _store(buffer: torch.Tensor, new: torch.Tensor, column: int | torch.Tensor) -> None:
    """Write `new` [B, KV, S, D] into `buffer` [B, KV, T, D] at columns column..column+S-1 (int), or at the
    columns a [S] long tensor names (in place, so a CUDA graph replays the write to the same buffer)."""
    if isinstance(column, int):
        buffer[:, :, column:column + new.shape[2]] = new
    else:
        buffer.index_copy_(2, column, new)
