"""Masked reductions and per-token statistics shared by every algorithm.

Shapes: B sequences, T positions aligned with the per-token log-probabilities (position t holds
the log-probability of token t+1 of the full prompt+answer sequence). `action_mask` [B, T] is 1 on
the answer tokens the actor generated (EOS included) and 0 on prompt and padding; answers are
contiguous runs of ones. Means over a mask are taken over every masked token of the batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as torch_dist

from utils.dist import get_world_size, is_initialized

# |log r| bound before r = exp(log r) (PPO's ratio, k3): exp(20) is finite in fp32, past 88 inf makes NaN gradients
LOG_RATIO_MAX = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` where `mask` is non-zero, each entry weighed by its mask value (a 0/1 mask: the plain mean of the
    masked entries), over all elements, in fp32; NaN-safe for masked-out entries."""
    total, count = _masked_totals(x, mask)
    return total / torch.where(count > 0, count, 1.0)


def answer_mean_mask(mask: torch.Tensor) -> torch.Tensor:
    """A weight mask that makes `masked_mean` the mean over answers of each answer's token mean: each of a row's
    masked tokens weighs 1 / its row's count (a row with none weighs nothing)."""
    counts = mask.float().sum(-1, keepdim=True)
    return mask.float() / counts.clamp(min=1.0)


def _masked_totals(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of `x` weighed by `mask` where it is non-zero, and the sum of the weights, in fp32: a bf16 count
    stops at 256 exact steps (2056 tokens counted as 2048)."""
    weight = mask.float()
    masked = torch.where(weight != 0, x.float(), 0.0) * weight
    return masked.sum(), weight.sum()


def whiten(xs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], over_ranks: bool = False,
           eps: float = 1e-8) -> list[torch.Tensor]:
    """Normalise the tensors `xs` together to zero mean and unit variance over their masked entries only, and over
    every rank's with `over_ranks` (collective: every rank calls it), in fp32; masked-out entries become 0. One
    tensor on one rank gets exactly the numbers of its own `masked_mean`s."""
    mean = _pooled_mean(xs, masks, over_ranks)
    var = _pooled_mean([(x.float() - mean) ** 2 for x in xs], masks, over_ranks)
    scale = torch.rsqrt(var + eps)
    out = []
    for x, mask in zip(xs, masks):
        normalised = (x.float() - mean) * scale
        out.append(torch.where(mask.bool(), normalised, torch.zeros_like(normalised)))
    return out


def _pooled_mean(xs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], over_ranks: bool) -> torch.Tensor:
    """The mean of the masked entries of all `xs` (and every rank's with `over_ranks`), as `masked_mean` takes it."""
    totals = torch.stack([torch.stack(_masked_totals(x, mask)) for x, mask in zip(xs, masks)]).sum(0)
    if over_ranks and is_initialized() and get_world_size() > 1:
        torch_dist.all_reduce(totals)
    return totals[0] / totals[1].clamp(min=1.0)
