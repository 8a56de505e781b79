"""The SFT objective: next-token cross-entropy on the tokens whose label is not -100, and held-out perplexity."""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from utils.dist import is_initialized

IGNORE_INDEX = -100


def sft_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over the labelled tokens of a right-padded SFT batch."""
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"], use_cache=False
    ).loss


def predicted_token_count(labels: torch.Tensor) -> int:
    """Tokens that carry loss: a label other than -100 at positions 1.. (position 0 is never predicted)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum().item())


def sft_loss_items(batch: Mapping[str, torch.Tensor]) -> int:
    """What `sft_loss` averages over: the batch's predicted tokens (an optimizer step averages over all of its)."""
    return predicted_token_count(batch["labels"])


@torch.no_grad()
def evaluate_perplexity(model: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """Token-weighted held-out loss and its perplexity, summed over ranks (every rank must call it)."""
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        loss = sft_loss(model, batch)  # every batch's forward, counted or not: ZeRO-3 gathers in each
        tokens = predicted_token_count(batch["labels"])
        if tokens == 0:
            continue
        totals[0] += loss.double().item() * tokens
        totals[1] += tokens
    if is_initialized():
        from utils.dist import current_device

        totals = totals.to(current_device())
        torch.distributed.all_reduce(totals)
    loss = totals[0].item() / max(totals[1].item(), 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": totals[1].item()}
