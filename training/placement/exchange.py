"""Moving step 3's data between the ranks of a placement: per-chunk results, random streams, actor weights, and
finished rows sent to the scoring ranks while generation goes on (stage fusion).

Experience rows are small next to the models (token ids and a few numbers per token), so after each phase
every rank's per-chunk results are all-gathered to every rank: one collective per phase, and every rank can
then run whichever call it owns next. Tensors travel on the CPU and return to the compute device for use.

Stage fusion sends rows point to point instead (`post`, `Inbox`) over a gloo group of its own: a send never
waits for its receiver, and each receiving rank takes its messages on a background thread, so a rank can decode
its own answers while the rows of another's arrive, and score them between its decode steps. Each receive, and a
sender's wait at the end of a phase for its messages to be taken, waits at most DeepSpeed's process-group timeout
(`DEEPSPEED_TIMEOUT` minutes, the bound of every collective of the run): a rank at the other end that died or hangs
ends the run with an error naming it, where a wait without a bound went on forever.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pickle
import queue
import threading
from datetime import timedelta
from typing import Any, Collection, Iterator, Mapping

import torch
import torch.distributed as torch_dist
from deepspeed.constants import default_pg_timeout

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

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {str(chunk): dict(state) for chunk, state in self.states.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        if {int(chunk) for chunk in state} != set(self.states):
            raise ValueError(f"random streams of chunks {sorted(state)} for a rank that generates {sorted(self.states)}")
        self.states = {int(chunk): dict(chunk_state) for chunk, chunk_state in state.items()}

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


_HEADER_TAG, _BODY_TAG = 1, 2


def _stall_advice(slow: str) -> str:
    """What a stage-fusion transfer that did not end in time tells to check; `slow`: when a live run takes as long."""
    return (f"a rank that died or hangs; look for its error in its log or the launcher's output. If {slow}, raise "
            "DEEPSPEED_TIMEOUT (minutes), which bounds every collective of the run too")


class Outbox:
    """Messages (picklable values, tensors moved to the CPU) sent to other ranks of `group` without waiting for
    them to be received; `wait` before the buffers may go (the end of a phase). Each message starts with a header of
    the sending rank and the body's size, so the receiver learns who sent it from the message itself."""

    def __init__(self, group: Any, timeout: timedelta = default_pg_timeout):
        self.group = group
        self.timeout = timeout
        self.in_flight: list[tuple[Any, ...]] = []

    def post(self, destination: int, value: Any) -> None:
        self._send(destination, ("value", moved(value, "cpu")))

    def close(self, destination: int) -> None:
        """Tell `destination` it gets nothing more from this rank in the phase."""
        self._send(destination, ("close", None))

    def _send(self, destination: int, message: tuple[str, Any]) -> None:
        body = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        header = torch.tensor([torch_dist.get_rank(), body.numel()], dtype=torch.long)
        sends = [torch_dist.isend(header, destination, group=self.group, tag=_HEADER_TAG),
                 torch_dist.isend(body, destination, group=self.group, tag=_BODY_TAG)]
        self.in_flight.append((destination, sends, (header, body)))  # the buffers live until sent

    def wait(self) -> None:
        """Wait until every message sent is taken, each within the timeout: a gloo send ends once its receiver asks
        for it, which one that died or hangs never does."""
        for destination, sends, _ in self.in_flight:
            try:
                for sent in sends:
                    sent.wait(self.timeout)
            except RuntimeError as error:
                raise RuntimeError(self._untaken(destination, error)) from error
        self.in_flight = []

    def _untaken(self, destination: int, error: RuntimeError) -> str:
        """What a send that its receiver did not take in time says: to whom, how long, what to check."""
        return (f"stage fusion: rank {torch_dist.get_rank()} could not hand its finished rows to rank {destination} "
                f"within {self.timeout.total_seconds():g} s ({error}): "
                + _stall_advice("the scoring rank truly starts the phase that much later than this one"))


class Inbox:
    """Receives the values `Outbox.post` sends from the ranks `senders` of `group`, on a background thread, until each
    has closed; the caller takes them as they arrive (`ready`) or waits for the rest (`remaining`). A wait of more than
    `timeout` for the next message (by default the one of DeepSpeed's process groups) ends it with an error naming the
    senders still open, raised in the caller's thread."""

    def __init__(self, group: Any, senders: Collection[int], timeout: timedelta = default_pg_timeout):
        self.group = group
        self.timeout = timeout
        self.arrived: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._receive, args=(set(senders),), daemon=True)
        self.thread.start()

    def _receive(self, open_senders: set[int]) -> None:
        try:
            while open_senders:
                header = torch.zeros(2, dtype=torch.long)
                self._received(header, None, _HEADER_TAG, open_senders)
                source, size = header.tolist()
                body = torch.empty(size, dtype=torch.uint8)
                self._received(body, source, _BODY_TAG, open_senders)
                kind, value = pickle.loads(body.numpy().tobytes())
                if kind == "close":
                    open_senders.discard(source)
                else:
                    self.arrived.put(("message", value))
        except BaseException as error:  # handed to the caller's thread, which raises it
            self.arrived.put(("error", error))
        self.arrived.put(("closed", None))

    def _received(self, tensor: torch.Tensor, source: int | None, tag: int, open_senders: set[int]) -> None:
        """Fill `tensor` from `source` (None: whichever rank sends first) within the timeout."""
        try:
            torch_dist.irecv(tensor, src=source, group=self.group, tag=tag).wait(self.timeout)
        except RuntimeError as error:
            raise RuntimeError(self._silence(open_senders, error)) from error

    def _silence(self, open_senders: set[int], error: RuntimeError) -> str:
        """What a receive that ended without its message says: who was waited for, how long, what to check."""
        ranks = ", ".join(str(rank) for rank in sorted(open_senders))
        peers = f"rank{'s' if len(open_senders) > 1 else ''} {ranks}"
        return (f"stage fusion: rank {torch_dist.get_rank()} got nothing from {peers} within "
                f"{self.timeout.total_seconds():g} s, whose finished rows it still waits for ({error}): "
                + _stall_advice("generation truly takes longer than that between finished rows"))

    def _next(self, block: bool) -> tuple[str, Any] | None:
        try:
            kind, value = self.arrived.get(block=block)
        except queue.Empty:
            return None
        if kind == "error":
            raise value
        return kind, value

    def ready(self) -> Iterator[Any]:
        """The messages that have arrived so far (without waiting)."""
        while (item := self._next(block=False)) is not None and item[0] == "message":
            yield item[1]
        if item is not None:  # closed: every sender is done
            self.arrived.put(item)

    def remaining(self) -> Iterator[Any]:
        """Every message still to come, waiting for each, until every sender has closed."""
        while (item := self._next(block=True))[0] == "message":
            yield item[1]
        self.thread.join()
