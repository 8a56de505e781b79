"""A compact, torch-serialisable dataset of variable-length token sequences.

Each column is stored as one flat LongTensor plus offsets, so a phase's data saves and loads with
`torch.save` / `torch.load(weights_only=True)` in one piece. Items are dicts of 1-D LongTensors;
every `...input_ids` column gets a matching all-ones `...attention_mask` (unpadded items).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Dataset


class TokenizedDataset(Dataset):
    def __init__(self, columns: dict[str, tuple[torch.Tensor, torch.Tensor]], stats: dict[str, int] | None = None):
        self.columns = columns
        self.stats = dict(stats or {})
        lengths = {len(offsets) - 1 for _, offsets in columns.values()}
        if len(lengths) > 1:
            raise ValueError("all columns must hold the same number of items")
        self._length = lengths.pop() if lengths else 0

    @classmethod
    def from_lists(cls, columns: dict[str, Sequence[Sequence[int]]], stats: dict[str, int] | None = None) -> "TokenizedDataset":
        packed = {}
        for name, sequences in columns.items():
            lengths = torch.tensor([0] + [len(seq) for seq in sequences], dtype=torch.long)
            flat = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)
            packed[name] = (flat, torch.cumsum(lengths, 0))
        return cls(packed, stats)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._length <= index < self._length:
            raise IndexError(index)
        index %= max(self._length, 1)
        item = {}
        for name, (flat, offsets) in self.columns.items():
            item[name] = flat[offsets[index] : offsets[index + 1]]
            if name.endswith("input_ids"):
                item[name[: -len("input_ids")] + "attention_mask"] = torch.ones_like(item[name])
        return item

    def head(self, count: int | None) -> "TokenizedDataset":
        """The first `count` items (all when None); the data is already in seeded order."""
        if count is None or count >= self._length:
            return self
        columns = {}
        for name, (flat, offsets) in self.columns.items():
            columns[name] = (flat[: offsets[count]].clone(), offsets[: count + 1].clone())
        return TokenizedDataset(columns, self.stats)

    def state(self) -> dict:
        return {"columns": {name: list(pair) for name, pair in self.columns.items()}, "stats": self.stats}

    @classmethod
    def from_state(cls, state: dict) -> "TokenizedDataset":
        return cls({name: (pair[0], pair[1]) for name, pair in state["columns"].items()}, state["stats"])
