"""Masked reductions and per-token statistics shared by every algorithm.

Shapes: B sequences, T positions aligned with the per-token log-probabilities (position t holds
the log-probability of token t+1 of the full prompt+answer sequence). `action_mask` [B, T] is 1 on
the answer tokens the actor generated (EOS included) and 0 on prompt and padding; answers are
contiguous runs of ones. Means over a mask are taken over every masked token of the batch.
"""
from __future__ import annotations

import torch

from training.core.sequences import token_entropies


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1 (over all elements, or along `dim`); NaN-safe for masked-out entries."""
    mask = mask.to(x.dtype)
    masked = torch.where(mask.bool(), x, torch.zeros_like(x))
    if dim is None:
        return masked.sum() / mask.sum().clamp(min=1.0)
    return masked.sum(dim) / mask.sum(dim).clamp(min=1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise `x` to unit variance (and zero mean if `shift_mean`) using only masked entries; masked-out entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean entropy (nats) of softmax(logits / temperature) at masked positions: logits [B, T, V], mask [B, T] ->
    scalar (chunked, no gradient: `token_entropies`)."""
    return masked_mean(token_entropies(logits, temperature), mask)
