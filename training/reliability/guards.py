"""Stop a run whose loss or reward stops being a finite number, and say where to resume from."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from utils.dist import any_rank
from utils.errors import UserError

if TYPE_CHECKING:
    from training.reliability.checkpointing import CheckpointManager


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
