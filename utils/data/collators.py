"""Batch collators: right padding for training sequences, left padding for generation prompts."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .tokenization import IGNORE_INDEX


def _padded_length(length: int, multiple: int | None) -> int:
    return length if not multiple else -(-length // multiple) * multiple


def pad_sequences(
    sequences: Sequence[torch.Tensor], value: int, left: bool = False, multiple: int | None = None
) -> torch.Tensor:
    """Stack 1-D tensors into [N, L], padding with `value` on the right (or the left)."""
    length = _padded_length(max((len(seq) for seq in sequences), default=0), multiple)
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            if left:
                out[row, length - len(seq) :] = seq
            else:
                out[row, : len(seq)] = seq
    return out


@dataclass
class SFTCollator:
    """Phase 1: right-pads `input_ids` (pad id), `attention_mask` (0) and `labels` (-100)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        multiple = self.pad_to_multiple_of
        return {
            "input_ids": pad_sequences([i["input_ids"] for i in items], self.pad_token_id, multiple=multiple),
            "attention_mask": pad_sequences([i["attention_mask"] for i in items], 0, multiple=multiple),
            "labels": pad_sequences([i["labels"] for i in items], IGNORE_INDEX, multiple=multiple),
        }


@dataclass
class PairwiseCollator:
    """Phase 2: right-pads and stacks the B chosen sequences, then the B rejected: `input_ids` [2B, L];
    `prompt_lengths` [B] says where each pair's answers start (both sides share the prompt)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        ids = [i["chosen_input_ids"] for i in items] + [i["rejected_input_ids"] for i in items]
        masks = [i["chosen_attention_mask"] for i in items] + [i["rejected_attention_mask"] for i in items]
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id, multiple=self.pad_to_multiple_of),
            "attention_mask": pad_sequences(masks, 0, multiple=self.pad_to_multiple_of),
            "prompt_lengths": torch.cat([i["prompt_length"] for i in items]),
        }


@dataclass
class PromptCollator:
    """Phase 3: LEFT-pads prompts so every row's last real token sits at the end, ready for generation.

    Items that carry metadata (a task's answers) add `"metadata"`: one dict per row, {} for a row without.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "input_ids": pad_sequences([i["input_ids"] for i in items], self.pad_token_id, True, self.pad_to_multiple_of),
            "attention_mask": pad_sequences([i["attention_mask"] for i in items], 0, True, self.pad_to_multiple_of),
        }
        if any("metadata" in i for i in items):
            batch["metadata"] = [dict(i.get("metadata") or {}) for i in items]
        return batch
