"""An endless, resumable stream of batches over a dataset: epoch after epoch, each rank its own shard.

The position (epoch, batches taken in it) is all a checkpoint needs to continue the stream exactly
where it stopped: the shuffle is a function of the seed and the epoch, and the loader draws from a
private generator rather than the global RNG.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from training.loops.trainer import LoopPosition, SkipFirst, micro_batches_per_epoch
from utils.dist import get_rank, get_world_size


class BatchStream:
    """With `drop_last`, each epoch's last batch is left out when it would be short (every batch then has
    `batch_size` rows; the reshuffle leaves out different rows each epoch)."""

    def __init__(self, dataset: Dataset, batch_size: int, collator: Callable, seed: int, shuffle: bool = True,
                 drop_last: bool = False):
        self.dataset = dataset
        self.batch_size = batch_size
        self.collator = collator
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.position = LoopPosition()
        self._batches: Iterator | None = None

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.rows_per_rank // self.batch_size
        return micro_batches_per_epoch(len(self.dataset), self.batch_size, get_world_size())

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank draws from per epoch (`DistributedSampler` pads every rank to the same count)."""
        return -(-len(self.dataset) // get_world_size())

    @property
    def rows_left_out(self) -> int:
        """Rows per rank and epoch that `drop_last` leaves out."""
        return self.rows_per_rank % self.batch_size if self.drop_last else 0

    def _loader(self) -> DataLoader:
        sampler = DistributedSampler(self.dataset, num_replicas=get_world_size(), rank=get_rank(),
                                     shuffle=self.shuffle, seed=self.seed)
        sampler.set_epoch(self.position.epoch)
        return DataLoader(self.dataset, batch_size=self.batch_size,
                          sampler=SkipFirst(sampler, self.position.batches_done * self.batch_size),
                          collate_fn=self.collator, generator=torch.Generator(), drop_last=self.drop_last)

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch; a new epoch (reshuffled) starts when this one is used up."""
        if self.position.batches_done >= self.batches_per_epoch:
            self.position = LoopPosition(self.position.epoch + 1, 0)
            self._batches = None
        if self._batches is None:
            self._batches = iter(self._loader())
        batch = next(self._batches)
        self.position.batches_done += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return asdict(self.position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = LoopPosition(**state)
        self._batches = None
