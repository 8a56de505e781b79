"""Linear layers for generation with the weights prepacked for oneDNN where that is faster (CPU).

On CPU, PyTorch sends a float32 `x @ W.T` to MKL's sgemm, which at decode-sized inputs (a few rows
against a large weight) runs far below the machine's speed, on AMD CPUs especially: on the 2-core
EPYC this project is built on, one pass over SmolLM2-135M's weight matrices at 8 rows took 101 ms
with `torch.matmul` and 44 ms with oneDNN's kernel on weights reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking PyTorch's own CPU compiler uses). The hybrid
engine builds a fresh inference copy per rollout, so it packs there once and every decode step gains.

`LinearWeight` is one weight ready for `x @ W.T (+ b)`: packed where oneDNN supports the device and
dtype (checked once per dtype by running it), the plain matmul otherwise (GPU, or bf16 on a CPU
without native bf16 instructions). `pack_linear_layers` swaps a model's `nn.Linear`, GPT-2-style
`Conv1D` and `ReducedLinear` layers for `PackedLinear` modules holding such weights.

`ReducedLinear` is a linear layer whose output is summed across ranks (a tensor-parallel shard's
row-parallel projection). The sum is part of the layer, and of its `LinearWeight`, so every decode
path keeps it, packed or not; a forward hook would be lost with the module it hangs on. The partial products are
summed in fp32 and rounded once after the sum, as the whole product is rounded (`reduced_linear`).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from transformers.pytorch_utils import Conv1D

if TYPE_CHECKING:
    from training.generation.lora_terms import LoRATerm

_PACKING_BATCH_HINT = 8  # rows oneDNN tunes the packed layout for; any row count works

Reduce = Callable[[torch.Tensor], torch.Tensor]
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x [n, in], a weight -> x @ W.T [n, out] in fp32


@functools.lru_cache(maxsize=None)
def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build and CPU run oneDNN's prepacked linear for `dtype` (tried on a tiny weight)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        weight = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 8).all())


def _packable(weight: torch.Tensor, reduced: bool) -> bool:
    """Whether oneDNN packs `weight` here: on a CPU whose oneDNN runs its dtype, and for a row-parallel shard
    (`reduced`) in fp32 only, where oneDNN's product is the fp32 partial that `reduced_linear` sums."""
    return (weight.device.type == "cpu" and onednn_packing_available(weight.dtype)
            and (not reduced or weight.dtype == torch.float32))


def bias_added_after_product(x: torch.Tensor) -> bool:
    """Whether the training forward adds a linear layer's bias to `x @ W.T` after the product (a matmul and an add:
    rounded twice in half precision) rather than inside it (addmm: rounded once). It does where DeepSpeed ZeRO-3
    has replaced `torch.nn.functional.linear` with its wrapper (process-wide, from the first ZeRO-3 model built on),
    which adds the bias of an input of other than 2 dimensions after a matmul. Generation rounds as the training
    forward does, or a half-precision rollout's distribution parts from the one trained (Qwen2's q/k/v biases at
    ZeRO-3: a total-variation distance of ~1.5e-2 a token past position 500 in bf16)."""
    return x.dim() != 2 and getattr(torch.nn.functional.linear, "__module__", None) == "deepspeed.runtime.zero.linear"


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bias_after: bool) -> torch.Tensor:
    """x @ W.T (+ b), the bias added inside the product (one kernel, rounded once, as torch's own `F.linear` and
    GPT-2's `Conv1D` do) or, `bias_after`, after it (as DeepSpeed's replacement of `F.linear` does). Not a call of
    the replacement itself: an autograd function, slower per call."""
    if bias is None:
        return torch.matmul(x, weight.t())
    if bias_after:
        return torch.matmul(x, weight.t()) + bias
    flat = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t())
    return flat.view(*x.shape[:-1], weight.shape[0])


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ W.T for W [out, in], accumulated and returned in fp32, not rounded to the inputs' precision: on
    CUDA the half-precision GEMM itself with an fp32 output (`torch.mm`'s `out_dtype`), elsewhere the product of fp32
    copies (exact products of half-precision values, summed in fp32 as the GEMM sums them)."""
    if x.dtype == torch.float32:
        return torch.mm(x, weight.t())
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return torch.mm(x.float(), weight.t().float())


def reduced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reduce: Reduce,
                   lora: LoRATerm | None = None, product: Product = fp32_product) -> torch.Tensor:
    """A row-parallel shard's x_r @ W_r.T summed over its group by `reduce`, as x @ W.T (+ b) of the whole layer.

    The training forward rounds the whole product once, to the inputs' precision. Each rank's partial rounded to
    bf16 and the sum rounded again is another rounding of every output: rollouts of a bf16 Llama decoded by two
    tensor-parallel ranks were 7.6e-3 away from the trained distribution (total variation, past position 500),
    against 4e-6 undivided. Here the partials are summed in fp32 and rounded once. The bias, whole on every rank, is
    added after the sum as the layer adds it (`bias_added_after_product`). A LoRA term (its A split by columns as W
    is) has its x_r @ A_r.T summed in the same collective; its B, whole, is applied to the sum, as peft applies B to
    x @ A.T."""
    flat = x.reshape(-1, x.shape[-1])
    partial = product(flat, weight)
    rank = 0 if lora is None else lora.A.shape[0]
    if lora is not None:
        partial = torch.cat([partial, fp32_product(flat, lora.A)], dim=1)
    total, lora_down = reduce(partial).split([partial.shape[1] - rank, rank], dim=1)
    if bias is None:
        out = total.to(x.dtype)
    elif bias_added_after_product(x):
        out = total.to(x.dtype) + bias
    else:
        out = (total + bias).to(x.dtype)
    if lora is not None:
        out = out + torch.matmul(lora_down.to(x.dtype), lora.B.t())
    return out.view(*x.shape[:-1], out.shape[-1])


class LinearWeight:
    """A weight [out, in] (and optional bias [out]) applied as x @ W.T + b, oneDNN-packed where possible,
    summed across ranks by `reduce` when given (a row-parallel shard: `reduced_linear`). The bias is added as
    the layer it stands in for adds it: through `F.linear` (an `nn.Linear`; `bias_added_after_product` says how), or,
    not `functional_bias`, inside its own product (GPT-2's `Conv1D`, an addmm whatever `F.linear` is). A `lora` term
    (`lora_terms.py`) is added to the output after that, as peft adds an adapter's.

    The packed copy is a new tensor: the caller drops its own reference to `weight` to free the plain one, unless
    it asks to `keep_source` (a weight it will overwrite in place and `repack`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 reduce: Reduce | None = None, keep_source: bool = False, functional_bias: bool = True,
                 lora: LoRATerm | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.functional_bias = functional_bias
        self.lora = lora
        self.reduce = reduce
        self.packed = pack and not weight.requires_grad and _packable(weight, reduce is not None)
        self.source = weight if keep_source else None
        self.weight = self._packed(weight) if self.packed else weight

    @staticmethod
    def _packed(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKING_BATCH_HINT)

    def repack(self) -> None:
        """Take up new values written into the kept source weight (a plain weight is the source: nothing to do)."""
        if self.packed:
            if self.source is None:
                raise RuntimeError("repack needs a LinearWeight built with keep_source=True")
            self.weight = self._packed(self.source)

    @staticmethod
    def _packed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:
            return reduced_linear(x, self.weight, self.bias, self.reduce, self.lora,
                                  self._packed_product if self.packed else fp32_product)
        after = self.bias is not None and self.functional_bias and bias_added_after_product(x)
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, None if after else self.bias, "none", [], "")
            if after:
                out = out + self.bias
        else:
            out = _plain_linear(x, self.weight, self.bias, after)
        if self.lora is not None:
            out = out + self.lora(x)
        return out


class ReducedLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, same names) holding a row-parallel shard, summed over its group by `reduce`
    (`reduced_linear`, with its `lora` term when one is set)."""

    def __init__(self, in_features: int, out_features: int, reduce: Reduce, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.reduce = reduce
        self.lora: LoRATerm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduced_linear(x, self.weight, self.bias, self.reduce, self.lora)


class PackedLinear(torch.nn.Module):
    """Stands in for an inference copy's `nn.Linear` or `Conv1D`: same outputs, weight held as a `LinearWeight`.
    Given the replaced layer (`keep`), it holds that layer's parameters under their names too, for weights loaded in
    place and then `repack`ed."""

    def __init__(self, linear: LinearWeight, keep: torch.nn.Module | None = None):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if keep is not None:
            self.weight, self.bias = keep.weight, keep.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.linear.packed}"


def _weight_out_in(module: torch.nn.Module) -> torch.Tensor | None:
    """The layer's weight as [out, in], or None for a module that is not a plain linear layer."""
    if type(module) in (torch.nn.Linear, ReducedLinear):
        return module.weight
    if type(module) is Conv1D:  # GPT-2's transposed linear: x @ W + b
        return module.weight.t()
    return None


@torch.no_grad()
def pack_linear_layers(model: torch.nn.Module, keep_weights: bool = False) -> int:
    """Replace every plain linear layer whose weight oneDNN can pack by a `PackedLinear`; returns how many.
    With `keep_weights` the plain weights stay in the model (`repack_linear_layers` takes up new values written into
    them); without, they are freed.

    A layer whose weight another module shares (a tied output head) is packed as a copy; the other
    module keeps the plain weight."""
    replaced = 0
    for name, module in list(model.named_modules()):
        weight = _weight_out_in(module)
        if weight is None or not _packable(weight, isinstance(module, ReducedLinear)):
            continue
        bias = module.bias.detach() if module.bias is not None else None
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        reduce = module.reduce if isinstance(module, ReducedLinear) else None
        linear = LinearWeight(weight.detach(), bias, reduce=reduce, keep_source=keep_weights,
                              functional_bias=type(module) is not Conv1D)
        setattr(parent, child, PackedLinear(linear, module if keep_weights else None))
        replaced += 1
    return replaced


def repack_linear_layers(model: torch.nn.Module) -> None:
    """Pack again every `PackedLinear` weight of a model packed with `keep_weights`, after new values were written
    into its plain weights."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.linear.repack()
