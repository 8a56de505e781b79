"""Seeded phase shards (`--data_split 2,4,4`) and held-out eval splits, at the raw-record level.

Each source's records are permuted with the seed and cut into three contiguous, disjoint shards in
the split's proportions: step N trains only on shard N. Within a shard the first `eval_fraction`
of records are held out for evaluation. Splitting records (not samples) keeps every sample of one
conversation inside one shard and one side of the eval split.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from utils.errors import UserError

NUM_PHASES = 3
SEEDS = 2**32  # numpy's RandomState, which cuts the shards, takes a seed in [0, 2**32)


def check_seed(seed: int) -> None:
    """Refuse a --seed the shards cannot be cut with (numpy raised a bare ValueError when the data was built)."""
    if not 0 <= seed < SEEDS:
        raise UserError(f"--seed must be between 0 and {SEEDS - 1}, not {seed}")


def held_out_seed(seed: int) -> int:
    """The seed of the held-out part's random choices (the embedded pairs' rejected replies): another stream than
    the training part's, within the seeds numpy takes."""
    return (seed + 1) % SEEDS


def parse_data_split(data_split: str) -> list[float]:
    """'2,4,4' -> [2.0, 4.0, 4.0]; three non-negative, finite weights with a positive, finite sum (an infinite weight,
    or a sum past the largest float, cuts no shard: inf / inf)."""
    try:
        weights = [float(part) for part in str(data_split).split(",")]
    except ValueError:
        weights = []
    if len(weights) != NUM_PHASES or not all(w >= 0 for w in weights) or not sum(weights) > 0:  # nan fails both
        raise UserError(
            f"--data_split '{data_split}' must be three non-negative numbers with a positive sum, one per step, "
            "e.g. 2,4,4"
        )
    if not all(math.isfinite(w) for w in weights):
        raise UserError(f"--data_split '{data_split}' must be three finite numbers (only their proportions count), "
                        "e.g. 2,4,4")
    if not math.isfinite(sum(weights)):
        raise UserError(f"--data_split '{data_split}': its weights are finite, but their sum is past the largest "
                        f"float ({sys.float_info.max:.4g}); scale them down (only their proportions count), e.g. 2,4,4")
    return weights


def _exact_weight(part: str) -> Fraction:
    """A weight as the number written ('0.2' is 1/5, not the float nearest it); a form `Fraction` does not read, as
    the float `parse_data_split` read."""
    try:
        return Fraction(part.strip())
    except ValueError:
        return Fraction(float(part))


def shard_bounds(data_split: str) -> tuple[Fraction, ...]:
    """Where the shards start and end, as exact fractions of a source: '2,4,4', '1,2,2' and '0.2,0.4,0.4' cut alike."""
    parse_data_split(data_split)
    weights = [_exact_weight(part) for part in str(data_split).split(",")]
    total, bounds = sum(weights), [Fraction(0)]
    for weight in weights:
        bounds.append(bounds[-1] + weight)
    return tuple(bound / total for bound in bounds)


def shard_fractions(data_split: str) -> np.ndarray:
    """`shard_bounds` as floats: equal proportions give the same floats, whichever numbers write them."""
    return np.array([float(bound) for bound in shard_bounds(data_split)])


def same_shards(seed: int, data_split: str, other_seed: int, other_data_split: str) -> bool:
    """Whether both settings put every record of any source in the same shard."""
    return seed == other_seed and shard_bounds(data_split) == shard_bounds(other_data_split)


def phase_shard(num_records: int, data_split: str, phase: int, seed: int) -> np.ndarray:
    """Indices (in seeded shuffled order) of the records that belong to `phase` (1, 2 or 3)."""
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, not {phase}")
    bounds = np.round(shard_fractions(data_split) * num_records).astype(int)
    order = np.random.RandomState(seed).permutation(num_records)
    return order[bounds[phase - 1] : bounds[phase]]


def check_eval_fraction(eval_fraction: float) -> None:
    if not 0 <= eval_fraction < 1:
        raise UserError(f"--eval_fraction must be in [0, 1), not {eval_fraction}")


def holdout(indices: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval): eval is the first `eval_fraction` (at least one record when there are two or more)."""
    check_eval_fraction(eval_fraction)
    num_eval = int(round(len(indices) * eval_fraction))
    if eval_fraction > 0 and len(indices) >= 2:
        num_eval = max(num_eval, 1)
    return indices[num_eval:], indices[:num_eval]


def seeded_order(num_items: int, seed: int) -> np.ndarray:
    """The blend order: several sources are concatenated, then shuffled with this permutation."""
    return np.random.RandomState(seed).permutation(num_items)


@dataclass(frozen=True)
class ShardSettings:
    """The settings that cut every source: `--data_split` shards by `--seed`, `--eval_fraction` of each held out."""

    data_split: str
    seed: int
    eval_fraction: float

    def records(self, num_records: int, phase: int) -> tuple[np.ndarray, np.ndarray]:
        """(train, eval) indices of the records of `phase`'s shard."""
        return holdout(phase_shard(num_records, self.data_split, phase, self.seed), self.eval_fraction)

    def key(self) -> dict:
        """What decides `records` (for a cache key)."""
        return {"fractions": shard_fractions(self.data_split).tolist(), "seed": self.seed, "eval_fraction": self.eval_fraction}
