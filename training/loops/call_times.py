"""Per-call wall times: the PPO trainer's phases (`PPOTrainer.clock`), and with `--profile_calls` one rank's every
model call, what the placement cost model's calls are checked against.

`CallTimer.instrument` wraps, on the objects themselves (no class is changed), the calls of the models this rank
holds: every model's forward (`forward` without gradients: scoring; `train forward` with them), the trained
engines' backward, gradient all-reduce, master-gradient accumulation, optimizer step (the inner torch optimizer's
and the wrapper's weight copy-back / all-gather), and the generator's `generate`. Times are exclusive: a call
nested in another (the all-reduce inside the backward) is subtracted from its parent, so a rank's times add up.
Code that is no model call (the experience exchange, the weight broadcast) is timed with `timer.time(name)`.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

CALL_TIMES_FILE = "call_times.jsonl"  # in the run folder: one line per PPO step, every rank's call times
# (attribute path on a trained DeepSpeed engine, the call's name); under mixed precision the engine's optimizer is
# DeepSpeed's wrapper around the torch optimizer (the inner step)
ENGINE_CALLS = (("backward", "backward"), ("allreduce_gradients", "gradient all-reduce"),
                ("optimizer.backward_epilogue", "master-gradient accumulation"), ("step", "engine step"),
                ("optimizer.step", "optimizer step"), ("optimizer.optimizer.step", "inner optimizer step"),
                ("optimizer.update_lp_params", "weight copy-back"))


class CallTimer:
    """Exclusive wall time and count per call name, since the last `take`. On CUDA each timed call ends with a
    synchronize, so its time is the device's work, not its launch."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._nested: list[float] = []  # per open call: the time of the calls nested in it so far

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as call `name` (also a `torch.profiler` range of that name, for profiles by phase)."""
        started = time.perf_counter()
        self._nested.append(0.0)
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            self.seconds[name] += elapsed - self._nested.pop()
            self.counts[name] += 1
            if self._nested:
                self._nested[-1] += elapsed

    def wrap(self, owner: Any, attribute: str, name: str | Callable[[], str]) -> bool:
        """Time every call of `owner.attribute` (a dotted path; False when it does not exist). A call this timer
        already wraps is left as it is: the kept inference copy hands back the same decoder at every entry."""
        *path, method = attribute.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        original = getattr(owner, method, None) if owner is not None else None
        if not callable(original):
            return False
        if getattr(original, "timed_by", None) is self:
            return True

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with self.time(name() if callable(name) else name):
                return original(*args, **kwargs)

        timed.timed_by = self
        setattr(owner, method, timed)
        return True

    def instrument(self, models: dict[str, torch.nn.Module | None], trained: dict[str, torch.nn.Module | None],
                   generator: object | None, generating_role: str) -> None:
        """Wrap the calls of `models` (role -> engine or module; None: not on this rank), of the trained engines'
        update path, and of the generator."""
        for role, model in models.items():
            if model is not None:
                module = getattr(model, "module", model)
                self.wrap(module, "forward",
                          lambda role=role: f"{role}/{'train forward' if torch.is_grad_enabled() else 'forward'}")
        for role, engine in trained.items():
            if engine is not None:
                for attribute, name in ENGINE_CALLS:
                    self.wrap(engine, attribute, f"{role}/{name}")
        if generator is not None:
            self.wrap(generator, "generate", f"{generating_role}/generate")
            self._wrap_decoder_entry(generator, generating_role)

    def _wrap_decoder_entry(self, generator: object, role: str) -> None:
        """The hybrid engine's entry into generate mode (the inference copy's gather, copy and packing), and the
        prefill and decode steps of the decoder each entry builds."""
        enter = getattr(generator, "_enter", None)
        if enter is None:
            return

        @functools.wraps(enter)
        def timed_enter(*args, **kwargs):
            with self.time(f"{role}/enter generate mode"):
                decoder = enter(*args, **kwargs)
            self.wrap(decoder.model, "prefill", f"{role}/prefill")
            self.wrap(decoder.model, "step", f"{role}/decode step")
            return decoder

        generator._enter = timed_enter

    def take(self) -> dict[str, dict[str, float]]:
        """{name: {"s": seconds, "n": calls}} since the last take, and start again."""
        taken = {name: {"s": self.seconds[name], "n": self.counts[name]} for name in sorted(self.seconds)}
        self.seconds.clear()
        self.counts.clear()
        return taken


class NoTimer:
    """The timer of a run that does not profile its calls."""

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        yield
