"""Tensor helpers over token sequences that every model call shares: positions from the attention
mask, the last real token, and the log-probabilities of chosen tokens (the one definition that
generation, the PPO trainer and the parity tests all use).

A model's embedding may hold rows beyond its tokenizer (Qwen2.5's 151,936 for 151,665 tokens), ids that generation
never draws (training/generation/generator.py). Given `tokenizer_size`, log-probs and entropies are those of the
distribution over the tokenizer's ids only, the one tokens are drawn from: the logits' columns from it on are left
out, a chunk of rows at a time (no copy of the logits without them is made)."""
from __future__ import annotations

import torch


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [B, T] mask (0 for an all-zero row); right or left padding alike."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row; pads get 0 (their outputs are never used)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# rows of [N, V] logits handled at once by the chunked log-prob and entropy: about 16 MB of fp32 per chunk
_CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))


def tokenizer_columns(logits: torch.Tensor, tokenizer_size: int | None) -> int:
    """How many leading columns of `logits` [..., V] hold the tokenizer's ids: `tokenizer_size`, or all V where it
    is None or not smaller (a model whose rows are its tokenizer's)."""
    vocab = logits.shape[-1]
    return vocab if tokenizer_size is None else min(tokenizer_size, vocab)


class _ChosenTokenLogprob(torch.autograd.Function):
    """log_softmax(logits[:, :C] / T)[token] without a full-vocab log-softmax (C: `tokenizer_columns`): the chosen
    logit minus a logsumexp taken a chunk of rows at a time in fp32, and a backward that rebuilds each chunk's
    softmax from the saved logits and per-row logsumexp (the columns from C on get no gradient). Only the logits
    (model dtype) and one fp32 number per row are kept for the backward, instead of an fp32 copy of every logit."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                tokenizer_size: int | None) -> torch.Tensor:
        flat, chosen = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        columns = tokenizer_columns(logits, tokenizer_size)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        log_z = torch.empty_like(out)
        step = _chunk_rows(flat.shape[-1])
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            scaled = flat[rows, :columns].float() / temperature
            log_z[rows] = torch.logsumexp(scaled, dim=-1)
            out[rows] = scaled.gather(-1, chosen[rows]).squeeze(-1) - log_z[rows]
        ctx.save_for_backward(logits, tokens, log_z)
        ctx.temperature, ctx.columns = temperature, columns
        return out.reshape(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens, log_z = ctx.saved_tensors
        temperature, columns = ctx.temperature, ctx.columns
        flat, chosen = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        grad_rows = grad_out.reshape(-1, 1).float() / temperature
        grad = torch.empty_like(flat)
        grad[:, columns:] = 0
        step = _chunk_rows(flat.shape[-1])
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            # d/dx [x_c / T - logsumexp(x / T)] = (onehot(c) - softmax(x / T)) / T
            probs = (flat[rows, :columns].float() / temperature - log_z[rows, None]).exp_().neg_()
            probs.scatter_add_(-1, chosen[rows], torch.ones_like(chosen[rows], dtype=probs.dtype))
            grad[rows, :columns] = probs.mul_(grad_rows[rows])
        return grad.reshape(logits.shape), None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   tokenizer_size: int | None) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] in fp32 over the tokenizer's ids (the first `tokenizer_size`
    columns; no default: None, every column, is said outright): logits [..., V], tokens [...] -> [...].

    Computed as logit[token] - logsumexp(logits), a chunk of rows at a time, so no [..., V] log-softmax or
    fp32 copy of the logits is ever built (in the forward or the backward)."""
    return _ChosenTokenLogprob.apply(logits, tokens, float(temperature), tokenizer_size)


@torch.no_grad()
def token_entropies(logits: torch.Tensor, temperature: float = 1.0, *, tokenizer_size: int | None) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) over the tokenizer's ids (as `token_logprobs`) at every
    position: [..., V] -> [...] fp32, chunked like `token_logprobs` (no gradient: a statistic)."""
    flat = logits.reshape(-1, logits.shape[-1])
    columns = tokenizer_columns(logits, tokenizer_size)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = _chunk_rows(flat.shape[-1])
    for start in range(0, flat.shape[0], step):
        scaled = flat[start:start + step, :columns].float() / temperature
        log_z = torch.logsumexp(scaled, dim=-1)
        probs = (scaled - log_z[:, None]).exp_()
        # 0 * log 0 is 0: a -inf logit (a masked token) would make the product nan
        impossible = probs == 0
        out[start:start + step] = log_z - probs.mul_(scaled).masked_fill_(impossible, 0).sum(-1)
    return out.reshape(logits.shape[:-1])


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
    temperature: float = 1.0, *, tokenizer_size: int | None,
) -> torch.Tensor:
    """The train-mode log-probabilities of the answer tokens at `temperature` over the tokenizer's ids
    (`token_logprobs`): [B, N] (not masked)."""
    logits = answer_logits(module, sequences, attention_mask, prompt_length)
    return token_logprobs(logits, sequences[:, prompt_length:], temperature, tokenizer_size=tokenizer_size)
