"""Stop a run whose loss or reward stops being a finite number, and say where to resume from; say when an
optimizer step was skipped for non-finite gradients behind a finite loss."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from utils.dist import any_rank
from utils.errors import UserError

if TYPE_CHECKING:
    import deepspeed

    from training.reliability.checkpointing import CheckpointManager

logger = logging.getLogger(__name__)


class NonFiniteError(UserError):
    """A loss, reward or other monitored value became NaN or infinite."""


def _is_finite(value: float | torch.Tensor) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all().item())
    return math.isfinite(float(value))


def _describe(value: float | torch.Tensor) -> str:
    if isinstance(value, torch.Tensor):
        value = value.detach().float()
        if value.numel() != 1:
            bad = (~torch.isfinite(value)).sum().item()
            return f"{bad} of {value.numel()} values non-finite"
    return f"{float(value)}"


def check_finite(
    name: str,
    value: float | torch.Tensor,
    step: int,
    checkpoint_manager: "CheckpointManager | None" = None,
    group=None,
) -> None:
    """Raise `NonFiniteError` on every rank (of `group`, default all) if `value` is NaN/inf on any of them.

    Collective: every rank of the group calls it at the same point. Do not save a checkpoint after it raised:
    the weights may already be damaged, and the last good checkpoint is the one to resume from.
    """
    if not any_rank(not _is_finite(value), group):
        return
    shown = _describe(value) if not _is_finite(value) else "non-finite on another rank"
    latest = checkpoint_manager.latest() if checkpoint_manager is not None else None
    if latest is None:
        where = "no checkpoint was saved before it (set --save_interval to keep resume points); start again"
    else:
        where = (f"the last good checkpoint is {latest.path} (step {latest.step}): continue from it with --resume "
                 "(a resumed run takes a new --learning_rate and --gradient_clipping), or start again")
    raise NonFiniteError(
        f"{name} is not finite ({shown}) at step {step}; stopping. {where}, e.g. with a lower --learning_rate, "
        "a smaller --gradient_clipping or --dtype fp32"
    )


def step_engine(engine: "deepspeed.DeepSpeedEngine", name: str) -> bool:
    """`engine.step()`; False, with a warning, when the optimizer step was skipped because the gradients were not
    finite. In bf16 and fp32 DeepSpeed skips such a step without a word (ZeRO-0's bf16 optimizer) or with a loss
    scaler's line ("OVERFLOW!") that names neither the model nor the step, and the loss, which `check_finite`
    watches, can be finite: a NaN at positions the loss masks out passes into the gradients only. At ZeRO-0 in
    fp32 DeepSpeed hands the gradients to the optimizer unchecked, which would write the NaN into every weight:
    there this function has the step skipped (`_skipped_if_non_finite_fp32`). fp16 skips are its loss scaler's
    calibration and stay DeepSpeed's to report."""
    skipped_before = engine.skipped_steps
    with _skipped_if_non_finite_fp32(engine):
        engine.step()
    skipped = engine.skipped_steps > skipped_before
    if skipped and not engine.fp16_enabled():
        logger.warning(
            "%s: optimizer step %d skipped, its gradients were not finite though the loss was (%d skipped so far). A "
            "NaN at masked-out positions does this (an attention kernel's backward, a value that overflows where the "
            "loss ignores it); if it repeats, try --dtype fp32 to tell precision from a bug, and report it.",
            name, engine.global_steps, engine.skipped_steps)
    return not skipped


@contextmanager
def _skipped_if_non_finite_fp32(engine: "deepspeed.DeepSpeedEngine") -> Iterator[None]:
    """Around an fp32 ZeRO-0 engine's optimizer step whose gradients are not all finite: the optimizer's step a no-op
    that reports an overflow, which DeepSpeed's engine counts as a skipped step (no update, no learning-rate step,
    the gradients cleared), as it counts its mixed-precision optimizers' (they set `overflow`; a torch optimizer
    has none). ZeRO-0 has all-reduced the gradients by now, so every rank decides alike. A bf16 engine of
    `MasterWeightAdamW` (fp32 mode to DeepSpeed) passes through: its weights hold no gradient here (their fp32 sums
    are the optimizer's), and that optimizer sets `overflow` itself from the all-reduced sums' norm."""
    if (engine.zero_optimization_stage() != 0 or engine.fp16_enabled() or engine.bfloat16_enabled()
            or not engine.is_gradient_accumulation_boundary() or _gradients_finite(engine.module)):
        yield
        return
    optimizer = engine.optimizer
    own = {name: optimizer.__dict__[name] for name in ("step", "overflow") if name in optimizer.__dict__}
    optimizer.step, optimizer.overflow = (lambda *args, **kwargs: None), True
    try:
        yield
    finally:
        del optimizer.step, optimizer.overflow
        optimizer.__dict__.update(own)


def _gradients_finite(module: torch.nn.Module) -> bool:
    gradients = [p.grad for p in module.parameters() if p.grad is not None]
    return not gradients or bool(torch.stack([torch.isfinite(g).all() for g in gradients]).all())
