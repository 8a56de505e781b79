"""A compact, torch-serialisable dataset of variable-length token sequences.

Each column is stored as one flat LongTensor plus offsets, so a phase's data saves and loads with
`torch.save` / `torch.load(weights_only=True)` in one piece. Items are dicts of 1-D LongTensors;
every `...input_ids` column gets a matching all-ones `...attention_mask` (unpadded items).
An optional per-item `metadata` list (plain JSON-like dicts, which `weights_only` loading accepts)
comes with each item under the key "metadata".
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

ANSWER_TRUNCATED = "answer_truncated"  # the stats key of items whose answer --max_seq_len cut


class TokenizedDataset(Dataset):
    def __init__(
        self,
        columns: dict[str, tuple[torch.Tensor, torch.Tensor]],
        stats: dict[str, int] | None = None,
        metadata: list[dict[str, Any]] | None = None,
        answer_cut_items: Sequence[int] = (),
    ):
        self.columns = columns
        self.stats = dict(stats or {})
        self.metadata = metadata
        self.answer_cut_items = tuple(answer_cut_items)  # the indices of the items whose answer --max_seq_len cut
        lengths = {len(offsets) - 1 for _, offsets in columns.values()} | ({len(metadata)} if metadata is not None else set())
        if len(lengths) > 1:
            raise ValueError("all columns (and the metadata) must hold the same number of items")
        self._length = lengths.pop() if lengths else 0

    @classmethod
    def from_lists(
        cls,
        columns: dict[str, Sequence[Sequence[int]]],
        stats: dict[str, int] | None = None,
        metadata: list[dict[str, Any]] | None = None,
        answer_cut_items: Sequence[int] = (),
    ) -> TokenizedDataset:
        packed = {}
        for name, sequences in columns.items():
            lengths = torch.tensor([0] + [len(seq) for seq in sequences], dtype=torch.long)
            flat = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)
            packed[name] = (flat, torch.cumsum(lengths, 0))
        return cls(packed, stats, metadata, answer_cut_items)

    def __len__(self) -> int:
        return self._length

    @property
    def answers_cut(self) -> int:
        """How many of these items hold their answer only in part, cut at --max_seq_len (`stats` counts them among
        the items built, before `head`)."""
        return len(self.answer_cut_items)

    def digest(self) -> str:
        """A hash of every item's tokens (and metadata): equal exactly when two datasets hold the same items."""
        hasher = hashlib.sha256()
        for name in sorted(self.columns):
            flat, offsets = self.columns[name]
            hasher.update(name.encode())
            hasher.update(offsets.numpy().tobytes())
            hasher.update(flat.numpy().tobytes())
        if self.metadata is not None:
            hasher.update(json.dumps(self.metadata, sort_keys=True, default=str).encode())
        return hasher.hexdigest()

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self._length <= index < self._length:
            raise IndexError(index)
        index %= max(self._length, 1)
        item = {}
        for name, (flat, offsets) in self.columns.items():
            item[name] = flat[offsets[index] : offsets[index + 1]]
            if name.endswith("input_ids"):
                item[name[: -len("input_ids")] + "attention_mask"] = torch.ones_like(item[name])
        if self.metadata is not None:
            item["metadata"] = self.metadata[index]
        return item

    def head(self, count: int | None) -> TokenizedDataset:
        """The first `count` items (all when None); the data is already in seeded order."""
        if count is None or count >= self._length:
            return self
        columns = {}
        for name, (flat, offsets) in self.columns.items():
            columns[name] = (flat[: offsets[count]].clone(), offsets[: count + 1].clone())
        return TokenizedDataset(columns, self.stats, None if self.metadata is None else self.metadata[:count],
                                [index for index in self.answer_cut_items if index < count])

    def state(self) -> dict:
        state = {"columns": {name: list(pair) for name, pair in self.columns.items()}, "stats": self.stats}
        if self.metadata is not None:
            state["metadata"] = self.metadata
        if self.answer_cut_items:
            state["answer_cut_items"] = list(self.answer_cut_items)
        return state

    @classmethod
    def from_state(cls, state: dict) -> TokenizedDataset:
        columns = {name: (pair[0], pair[1]) for name, pair in state["columns"].items()}
        return cls(columns, state["stats"], state.get("metadata"), state.get("answer_cut_items", ()))
