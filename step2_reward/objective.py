"""Step 2's objective: the pairwise (Bradley-Terry) loss and the held-out pair accuracy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.dist import current_device


def pairwise_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry preference loss: mean of -log sigmoid(chosen - rejected), computed in fp32."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float()).mean()


def split_chosen_rejected(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of a [2B] pairwise batch (chosen stacked before rejected, as `PairwiseCollator` builds it)."""
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


@dataclass
class PairwiseEvaluation:
    accuracy: float
    chosen_mean: float
    rejected_mean: float
    margin_mean: float
    num_pairs: int


@torch.no_grad()
def evaluate_pairs(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> PairwiseEvaluation:
    """Accuracy (chosen scored strictly above rejected), mean scores and mean margin over pairwise batches.

    `model` is a `RewardModel` or a DeepSpeed engine around one. Under torch.distributed the totals
    are summed over ranks, so every rank returns the same numbers (every rank must call it).
    """
    was_training = model.training
    model.eval()
    device = current_device()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # correct, sum chosen, sum rejected, pairs
    for batch in batches:
        scores = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        chosen, rejected = split_chosen_rejected(scores["end_scores"].double())
        totals[0] += (chosen > rejected).sum()
        totals[1] += chosen.sum()
        totals[2] += rejected.sum()
        totals[3] += chosen.numel()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    pairs = max(int(totals[3].item()), 1)
    chosen_mean, rejected_mean = totals[1].item() / pairs, totals[2].item() / pairs
    return PairwiseEvaluation(
        accuracy=totals[0].item() / pairs,
        chosen_mean=chosen_mean,
        rejected_mean=rejected_mean,
        margin_mean=chosen_mean - rejected_mean,
        num_pairs=int(totals[3].item()),
    )
