"""What each micro-batch's mean loss weighs in its optimizer step.

A loss is a mean over a micro-batch's items (answer tokens, preference pairs), and DeepSpeed averages
the gradients of an optimizer step's micro-batches (`gradient_accumulation_steps` on each of its data
ranks) with equal weights, so an item of a micro-batch with few items counts more than one of a
micro-batch with many: with answers of 2 and 12 tokens in two micro-batches, each token of the short
answer six times as much. Multiplying micro-batch i's mean by

    items_i x accumulation x ranks / items of the whole step (over every rank)

makes the step's gradient the mean over all its items, the one a single micro-batch of all of them
would give (transformers' Trainer and verl's `token-mean` take the same mean). The weights are 1.0
exactly where every micro-batch holds as many items.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as torch_dist

from utils.dist import is_initialized, sum_over_ranks


def accumulation_weights(items: Sequence[int], accumulation: int, group=None) -> list[float]:
    """The weight of each micro-batch's mean loss, in training order: `items` holds each micro-batch's count on this
    rank, `accumulation` micro-batches make one optimizer step, and the ranks of `group` (default all) take theirs
    together (collective over `group`: one all-reduce for all the steps). `items` must hold whole steps."""
    if len(items) % accumulation:
        raise ValueError(f"{len(items)} micro-batches do not make whole optimizer steps of {accumulation}")
    starts = range(0, len(items), accumulation)
    step_items = sum_over_ranks([sum(items[start:start + accumulation]) for start in starts], group)
    micro_batches = accumulation * (torch_dist.get_world_size(group) if is_initialized() else 1)
    return [count * micro_batches / max(step_items[index // accumulation], 1.0) for index, count in enumerate(items)]
