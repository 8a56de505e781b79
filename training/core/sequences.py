"""Tensor helpers over token sequences that every model call shares: positions from the attention
mask, the last real token, and the log-probabilities of chosen tokens (the one definition that
generation, the PPO trainer and the parity tests all use)."""
from __future__ import annotations

import torch


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [B, T] mask (0 for an all-zero row); right or left padding alike."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row; pads get 0 (their outputs are never used)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] in fp32: logits [..., V], tokens [...] -> [...].

    Computed as logit[token] - logsumexp(logits), so no [..., V] log-softmax tensor is kept."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def answer_logits(
    module: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """The train-mode forward's logits that predict the answer tokens: [B, N, V] (module dtype, raw).

    One forward over prompt + answer with positions from the mask; logits at position t predict t+1.
    """
    logits = module(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention_mask(attention_mask),
        use_cache=False,
    ).logits
    return logits[:, prompt_length - 1:-1]


def answer_logprobs(
    module: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The train-mode log-probabilities of the answer tokens at `temperature`: [B, N] (not masked)."""
    logits = answer_logits(module, sequences, attention_mask, prompt_length)
    return token_logprobs(logits, sequences[:, prompt_length:], temperature)
