"""Policy and value losses, registered by name (`--policy_loss`, `--value_loss`).

A policy loss is (logprobs, old_logprobs, advantages, mask, config) -> `ActorLoss`; a value loss is
(values, old_values, returns, mask, config) -> `CriticLoss`; every tensor [B, T], `config` the
trainer's settings (each loss reads the fields it uses). `actor_loss` and `critic_loss` are the
plain functions behind `ppo` and `clipped`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch

from training.algorithms.core import LOG_RATIO_MAX, masked_mean
from utils.registry import Registry


class ActorLoss(NamedTuple):
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


class CriticLoss(NamedTuple):
    loss: torch.Tensor
    clip_fraction: torch.Tensor


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], ActorLoss]
ValueLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], CriticLoss]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
VALUE_LOSSES: Registry[ValueLossFn] = Registry("value loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under `name`."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; a `UserError` naming the choices otherwise."""
    return POLICY_LOSSES.get(name)


def register_value_loss(name: str) -> Callable[[ValueLossFn], ValueLossFn]:
    """Decorator: register a value loss under `name`."""
    return VALUE_LOSSES.register(name)


def get_value_loss(name: str) -> ValueLossFn:
    """The value loss registered as `name`; a `UserError` naming the choices otherwise."""
    return VALUE_LOSSES.get(name)


def actor_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cliprange: float
) -> ActorLoss:
    """PPO clipped surrogate: mean over masked tokens of max(-A * r, -A * clip(r, 1-eps, 1+eps)), r = exp(logp - old_logp).

    All inputs [B, T]. `clip_fraction` is the share of tokens where the clipped term won;
    `approx_kl` is the mean of (r - 1) - log r (Schulman's k3 estimator of KL(old || new)). log r is clamped to
    +-`LOG_RATIO_MAX` (no gradient past it) so that r, the loss and its gradient stay finite: an infinite ratio gave a
    NaN gradient even where the clip picks the finite term (0 * inf in exp's backward), a NaN loss at a zero
    advantage and a NaN gradient from a masked-out token. Past the bound a token is clipped already (or, with A < 0,
    outweighs the rest of the batch anyway).
    """
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mask)
    return ActorLoss(loss, clip_fraction, approx_kl)


def critic_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange_value: float
) -> CriticLoss:
    """Clipped value loss: 0.5 * mean over masked tokens of max((v - R)^2, (v_clipped - R)^2),
    v_clipped = old_v + clip(v - old_v, -eps, eps). All inputs [B, T]."""
    values = values.float()
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped_error > unclipped_error).float(), mask)
    return CriticLoss(loss, clip_fraction)


class ClipConfig(Protocol):
    cliprange: float
    cliprange_value: float


@register_policy_loss("ppo")
def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, config: ClipConfig) -> ActorLoss:
    """`actor_loss` at `config.cliprange`."""
    return actor_loss(logprobs, old_logprobs, advantages, mask, config.cliprange)


@register_value_loss("clipped")
def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, config: ClipConfig) -> CriticLoss:
    """`critic_loss` at `config.cliprange_value`."""
    return critic_loss(values, old_values, returns, mask, config.cliprange_value)
