"""`FusedLlama` decode steps replayed as CUDA graphs, one graph per batch bucket.

An eager decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: SmolLM2's
30 layers issue several hundred kernels a step. A CUDA graph replays a recorded step's kernels with one launch,
on the same addresses every time, so everything a step reads or writes lives in buffers allocated once: the
token, position and attention-mask inputs (copied in before each replay), the column the new keys and values go
to (a one-element tensor, not a Python int), the KV buffers, and the logits the graph leaves behind.

Rows that finish leave the running batch as on every path (the decoder compacts their cache rows to the front),
so the batch shrinks while a graph's shape is fixed: the step runs on the smallest bucket (a power of two, or
the full row count) that holds the live rows; the rows past them are computed and discarded. A bucket's graph
is captured the first time it is needed and kept for this object's life. The graphs hold the addresses of the
inference copy's weights and of one KV allocation, so a new object is made for each (the hybrid engine makes the
inference copy afresh for each rollout).

On a CPU there are no graphs: the same bucketed static step runs eagerly (how the tests check it).
"""
from __future__ import annotations

from typing import Callable

import torch

from training.generation.fused_llama import FusedKVBuffers, FusedLlama


def bucket_sizes(rows: int) -> list[int]:
    """The batch sizes a graph is kept for: powers of two below `rows`, and `rows`."""
    sizes, size = [], 1
    while size < rows:
        sizes.append(size)
        size *= 2
    return sizes + [rows]


class BucketedDecodeSteps:
    """Single-token steps of `fused` over the KV buffers `buffers` (every row the cache holds, all T columns)."""

    def __init__(self, fused: FusedLlama, buffers: FusedKVBuffers, capture: bool):
        rows, length, device = buffers.rows, buffers.length, buffers.keys.device
        self.fused = fused
        self.buffers = buffers
        self.capture = capture
        self.buckets = bucket_sizes(rows)
        # every position a step can reach (positions never exceed their column); held here, so that the tables a
        # graph reads stay allocated even if the model later makes longer ones
        self.rope = fused.rope_tables(length)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.attend = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device)
        self.runners: dict[int, Callable[[], torch.Tensor]] = {}  # bucket -> the step over its rows, as logits

    def reset(self) -> None:
        """Forget the masks of the previous decode (a prompt of another length leaves other columns set); every
        row still sees its first column, so the rows past the live ones never attend to nothing (NaN)."""
        self.attend.zero_()
        self.attend[..., 0] = True

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        """Logits [n, V] for the n live rows: `tokens` [n], `positions` [n, 1], `mask` [n, W] (W ≤ T), the new
        tokens written at `column`. The result is the graph's own output: valid until the next step."""
        live = tokens.shape[0]
        bucket = next(size for size in self.buckets if size >= live)
        self.tokens[:live, 0].copy_(tokens)
        self.positions[:live].copy_(positions)
        self.attend[:live, 0, 0, :mask.shape[1]].copy_(mask.bool())
        self.column.fill_(column)
        if bucket not in self.runners:
            self.runners[bucket] = self._graphed(bucket) if self.capture else lambda: self._step(bucket)
        return self.runners[bucket]()[:live]

    def _step(self, bucket: int) -> torch.Tensor:
        rows = FusedKVBuffers(self.buffers.keys[:, :bucket], self.buffers.values[:, :bucket])
        return self.fused.forward(self.tokens[:bucket], self.positions[:bucket], rows, self.column,
                                  self.attend[:bucket])

    def _graphed(self, bucket: int) -> Callable[[], torch.Tensor]:
        """Capture the bucket's step (after one eager run on a side stream, which initialises the kernels' lazy
        state outside the capture; it writes the same keys and values the replay will) in its own memory pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._step(bucket)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
