"""LoRA adapters applied beside the weights they adapt, the way the training forward applies them: the
half-precision inference copy's way.

Folding W + scale * B @ A into a bf16 weight rounds the sum to the weight's own precision, so every element the
adapter touches is rounded afresh: a new rounding of the whole adapted matrix, of the size of the model's own
bf16 rounding. The training forward (peft) adds the adapter's output to the projection's instead. A folded bf16 copy
therefore samples from another distribution than the one trained: a total-variation distance of ~1.5e-2 a token
past position 500 on the parity tests' tiny model after two LoRA steps, against 4e-6 without LoRA. Here each
adapted projection adds its `LoRATerm`, (x @ A.T) @ B.T with the scaling folded into B in fp32, to its output,
which is rounded as the training forward rounds it; only the term's own rounding, far below the output's, differs.
In fp32 folding is exact to 1e-4 and costs nothing per step, so an fp32 copy folds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from training.generation.cpu_linear import PackedLinear, ReducedLinear


@dataclass
class LoRATerm:
    """The active adapters of one projection: A [rank, in] (theirs stacked), B [out, rank] (each one's B times its
    scaling, side by side)."""

    A: torch.Tensor
    B: torch.Tensor

    @classmethod
    def empty(cls, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
              device: torch.device) -> "LoRATerm":
        return cls(torch.empty(rank, in_features, dtype=dtype, device=device),
                   torch.empty(out_features, rank, dtype=dtype, device=device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(torch.matmul(x, self.A.t()), self.B.t())


def fuse_lora_terms(terms: list[LoRATerm | None], out_features: list[int]) -> LoRATerm | None:
    """One term for projections fused by output rows (q/k/v, gate/up), or None when none is adapted: their A stacked,
    their B laid along the diagonal of a [sum of outputs, sum of ranks] B whose other blocks are zero (a projection
    without an adapter gets zero rows: adding 0 changes no bit). Each given term's A and B are rebound as views of the
    fused ones, so what is later loaded into them lands there."""
    present = [term for term in terms if term is not None]
    if not present:
        return None
    ranks = [term.A.shape[0] if term is not None else 0 for term in terms]
    fused_a = torch.cat([term.A for term in present])
    fused_b = present[0].B.new_zeros(sum(out_features), sum(ranks))
    rank_start = out_start = 0
    for term, rank, out in zip(terms, ranks, out_features):
        if term is not None:
            fused_b[out_start:out_start + out, rank_start:rank_start + rank] = term.B
            term.A = fused_a[rank_start:rank_start + rank]
            term.B = fused_b[out_start:out_start + out, rank_start:rank_start + rank]
        rank_start, out_start = rank_start + rank, out_start + out
    return LoRATerm(fused_a, fused_b)


def add_lora_terms(model: torch.nn.Module, terms: dict[str, LoRATerm]) -> None:
    """Make each named projection of `model` add its term to its output: the projection module there now (register
    after any swap of the modules, e.g. oneDNN packing) applies it itself where it is one of ours (`PackedLinear`,
    and `ReducedLinear`, whose term joins its cross-rank sum), a forward hook does elsewhere. The terms' tensors are
    marked static addresses: a step compiled with CUDA graphs then reads them where they are instead of copying them
    in at every replay."""
    for name, term in terms.items():
        torch._dynamo.mark_static_address(term.A)
        torch._dynamo.mark_static_address(term.B)
        module = model.get_submodule(name)
        if isinstance(module, PackedLinear):
            module.linear.lora = term
        elif isinstance(module, ReducedLinear):
            module.lora = term
        else:
            module.register_forward_hook(lambda module, args, output, term=term: output + term(args[0]))
