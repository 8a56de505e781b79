"""`FusedLlama` decode steps replayed as CUDA graphs, one graph per batch bucket.

An eager decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: SmolLM2's
30 layers issue several hundred kernels a step. A CUDA graph replays a recorded step's kernels with one launch,
on the same addresses every time, so everything a step reads or writes lives in buffers allocated once: the
token, position and attention-mask inputs (copied in before each replay), the column the new keys and values go
to (a one-element tensor, not a Python int), the uniform numbers a draw reads, the KV buffers, and the tokens and
log-probs the graph leaves behind. The step's token choice (`TokenChoice`: temperature, top-k/top-p filtering, the
inverse-CDF draw and the drawn token's log-prob, some fifteen kernels more) is captured with the forward, so a
step is one replay; only the uniform numbers are drawn outside (one kernel, from the decode's own generator, the
same numbers the eager path draws). A graph is kept per bucket and choice.

Rows that finish leave the running batch as on every path (the decoder compacts their cache rows to the front),
so the batch shrinks while a graph's shape is fixed: the step runs on the smallest bucket (a power of two, or
the full row count) that holds the live rows; the rows past them are computed and discarded. A bucket's graph
is captured the first time it is needed and kept for this object's life. The graphs hold the addresses of the
inference copy's weights and of one KV allocation, so a new object is made for each (the hybrid engine makes the
inference copy afresh for each rollout).

On a CPU there are no graphs: the same bucketed static step runs eagerly (how the tests check it).
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

from training.generation.fused_llama import FusedKVBuffers, FusedLlama
from training.generation.generator import TokenChoice

Choice = tuple[torch.Tensor, torch.Tensor]  # tokens [n] and their log-probs [n]
Outputs = TypeVar("Outputs")


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
        self.uniforms = torch.zeros(rows, 1, dtype=torch.float64, device=device)
        self.runners: dict[tuple[int, TokenChoice], Callable[[], Choice]] = {}  # the step over a bucket's rows

    @property
    def buckets_used(self) -> list[int]:
        return sorted({bucket for bucket, _ in self.runners})

    def reset(self) -> None:
        """Forget the masks of the previous decode (a prompt of another length leaves other columns set); every
        row still sees its first column, so the rows past the live ones never attend to nothing (NaN)."""
        self.attend.zero_()
        self.attend[..., 0] = True

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int,
                 choose: TokenChoice, uniforms: torch.Tensor | None) -> Choice:
        """The next tokens and their log-probs for the n live rows: `tokens` [n], `positions` [n, 1], `mask`
        [n, W] (W ≤ T), the new tokens written at `column`, chosen by `choose` at `uniforms` [n, 1]. The results
        are the graph's own outputs: valid until the next step."""
        live = tokens.shape[0]
        bucket = next(size for size in self.buckets if size >= live)
        self.tokens[:live, 0].copy_(tokens)
        self.positions[:live].copy_(positions)
        self.attend[:live, 0, 0, :mask.shape[1]].copy_(mask.bool())
        self.column.fill_(column)
        if uniforms is not None:
            self.uniforms[:live].copy_(uniforms)
        key = (bucket, choose)
        if key not in self.runners:
            step = functools.partial(self._step, bucket, choose)
            self.runners[key] = captured(step) if self.capture else step
        chosen, logprobs = self.runners[key]()
        return chosen[:live], logprobs[:live]

    def _step(self, bucket: int, choose: TokenChoice) -> Choice:
        rows = FusedKVBuffers(self.buffers.keys[:, :bucket], self.buffers.values[:, :bucket])
        logits = self.fused.forward(self.tokens[:bucket], self.positions[:bucket], rows, self.column,
                                    self.attend[:bucket])
        return choose(logits, self.uniforms[:bucket] if choose.do_sample else None)


def captured(run: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """`run` (CUDA work only, no host synchronisation) recorded as a CUDA graph, in its own memory pool: returns a
    function that replays it and returns the tensors the capture produced (rewritten by each replay). One eager run
    on a side stream comes first: it initialises the kernels' lazy state (cuBLAS workspaces, kernel choices) outside
    the capture, and whatever it writes, the replays write again.

    The capture runs on that side stream through `capture_begin`/`capture_end` rather than `torch.cuda.graph`,
    whose entry also synchronises the device and empties PyTorch's cache of freed GPU memory: graphs are captured
    afresh in every generate mode, and an emptied cache makes the next inference copy (13 GB at 7B) and the
    training after it allocate from the driver again. The capture is thread-local, as torch.compile's own captures
    are: in the default global mode, a call that capture forbids (an allocation from the driver, say) made by any
    other thread of the process meanwhile ends the capture with an error."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        run()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)

    def replay() -> Outputs:
        graph.replay()
        return outputs

    return replay
