"""A transformers forward run through `torch.compile` for decode steps, falling back to the eager forward when the
compiler fails.

`torch.compile` builds its kernels at a step's first call. Where it cannot (inductor's bf16 cast emulation has made
cast chains that crashed Triton 3.6's compiler, pytorch PR 173547), the error surfaces deep inside Triton in the
middle of a rollout. `CompiledStep` catches the compiler's own failures there and runs that step, and every later
one, through the model's eager forward: the same tokens and log-probs (the compiled step keeps eager's roundings),
without CUDA graphs. It logs once what failed and what to do, and remembers the failure for the process, so a
later inference copy decodes eagerly at once (`compile_failure`) instead of compiling and failing again. Nothing
else is caught: an error in the forward itself is raised as it is.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch._dynamo.exc import BackendCompilerFailed

logger = logging.getLogger(__name__)

# torch.compile's "reduce-overhead" mode (CUDA graphs), and eager's roundings: inductor fuses a chain of half-precision
# ops into one kernel that computes in fp32 and rounds once where eager rounds after each op (SiLU then the product
# with up_proj, the residual adds, ...). A bf16 Llama's compiled transformers-forward step sampled 1e-2 (total
# variation, past position 500) from the trained distribution so; with the casts emulated, 2e-5 (CPU inductor).
COMPILE_OPTIONS = {"triton.cudagraphs": True, "emulate_precision_casts": True}
COMPILER_FAILURES = (BackendCompilerFailed,)  # inductor's own errors (InductorError) derive from it

_failure: str | None = None  # why torch.compile failed in this process, once it has


def compile_failure() -> str | None:
    """Why `torch.compile` could not compile a decode step in this process; None while it never failed."""
    return _failure


def compile_model(model: torch.nn.Module) -> Any:
    """The model's forward through `torch.compile` (`COMPILE_OPTIONS`), one graph per static shape."""
    return torch.compile(model, dynamic=False, options=COMPILE_OPTIONS)


class CompiledStep:
    """`model`'s forward through `compile_model`, until the compiler fails; the eager forward from then on."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._compiled = compile_model(model)

    def __call__(self, **inputs: Any) -> Any:
        if _failure is not None:
            return self.model(**inputs)
        try:
            return self._compiled(**inputs)
        except COMPILER_FAILURES as error:
            _remember(error)
            return self.model(**inputs)


def _remember(error: Exception) -> None:
    """Record the compiler's failure for the process and tell the user once. The compiler fails before the step runs,
    so the eager forward that follows starts from the same cache."""
    global _failure
    cause = getattr(error, "inner_exception", None) or error
    first_line = (str(cause).strip().splitlines() or [""])[0][:300]
    _failure = f"{type(cause).__name__}: {first_line}"
    logger.warning(
        "hybrid engine: torch.compile could not compile the decode step (%s; torch %s, triton %s). Decoding through "
        "the model's eager forward from here on: the same tokens, without CUDA graphs, slower. Pass "
        "--disable_cuda_graph to skip compiling; another torch or Triton release may compile it.",
        _failure, torch.__version__, _triton_version())


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__
