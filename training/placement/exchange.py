"""Moving step 3's data between the ranks of a placement: per-chunk results, random streams, actor weights.

Experience rows are small next to the models (token ids and a few numbers per token), so after each phase
every rank's per-chunk results are all-gathered to every rank: one collective per phase, and every rank can
then run whichever call it owns next. Tensors travel on the CPU and return to the compute device for use.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as torch_dist

from utils.dist import all_gather_objects


def moved(value: Any, device: torch.device | str) -> Any:
    """`value` with every tensor inside (dicts, lists, tuples, dataclasses) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: moved(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(moved(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def gather_chunks(local: Mapping[int, Any]) -> dict[int, Any]:
    """Every rank's {chunk: result} merged, on every rank (collective); a chunk's dict results from several
    ranks (one per model call) are merged into one dict."""
    merged: dict[int, Any] = {}
    for results in all_gather_objects(moved(dict(local), "cpu")):
        for chunk, result in results.items():
            if isinstance(result, dict) and isinstance(merged.get(chunk), dict):
                merged[chunk].update(result)
            else:
                merged[chunk] = result
    return dict(sorted(merged.items()))


class ChunkRandomStreams:
    """One random stream per chunk, so the rank that generates a chunk samples exactly what the chunk's own rank
    would sample alone, whichever rank that is: each stream starts from the same state (every rank's state
    after seeding) and only that chunk's generation draws from it."""

    def __init__(self, chunks: list[int]):
        start = self._capture()
        self.states: dict[int, dict[str, Any]] = {chunk: start for chunk in chunks}

    @staticmethod
    def _capture() -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore(state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])

    @contextlib.contextmanager
    def use(self, chunk: int) -> Iterator[None]:
        """Draw from `chunk`'s stream for the duration; the global stream is left as it was."""
        outer = self._capture()
        self._restore(self.states[chunk])
        try:
            yield
        finally:
            self.states[chunk] = self._capture()
            self._restore(outer)


@torch.no_grad()
def broadcast_trainable_weights(module: torch.nn.Module, names: list[str], source: int, group: Any) -> None:
    """Copy the parameters `names` (those the actor trains: all of them, or the LoRA adapters) from `source` to
    every rank of `group` (collective over the group), through the CPU under gloo."""
    parameters = dict(module.named_parameters())
    backend_cpu = torch_dist.get_backend(group) == "gloo"
    for name in names:
        parameter = parameters[name]
        buffer = parameter.data.cpu() if backend_cpu else parameter.data
        torch_dist.broadcast(buffer, src=source, group=group)
        if buffer is not parameter.data:
            parameter.data.copy_(buffer)
