"""Advantage estimators, registered by name (`--advantage_estimator`).

An estimator is one function
    (rewards [B, T], action_mask [B, T], values [B, T] or None, group_index [B] or None, config)
        -> (advantages [B, T], returns [B, T])
where `rewards` are the shaped per-token rewards (`kl.compute_rewards`), `values` the critic's
(None when the estimator needs no critic), `group_index` gives rows answering the same prompt the
same id (what group baselines such as GRPO or RLOO need), and `config` the trainer's settings (the
PPO config; each estimator reads the fields it uses). Each declares whether it needs a critic, so the
engine builds and the trainer trains one only then.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from training.algorithms.core import whiten
from training.algorithms.registry import Registry

EstimatorFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, Any], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: call it like its function; `needs_critic` says whether `values` must be given."""

    name: str
    fn: EstimatorFn
    needs_critic: bool

    def __call__(self, rewards: torch.Tensor, action_mask: torch.Tensor, values: torch.Tensor | None,
                 group_index: torch.Tensor | None, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(rewards, action_mask, values, group_index, config)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage_estimator(name: str, needs_critic: bool) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register an estimator function under `name` (the function itself is returned unchanged)."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name, fn, needs_critic))
        return fn

    return register


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; a `UserError` naming the choices otherwise."""
    return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages_and_returns(
    values: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the answer tokens.

    values/rewards/action_mask [B, T] -> (advantages [B, T], returns [B, T]), both 0 off the mask.
    The episode ends at each answer's last token: later positions contribute no value and no
    advantage, so padding after an early EOS never leaks into the answer.
    """
    mask = action_mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    rewards = torch.where(mask, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(mask[:, t], delta + gamma * lam * next_advantage, torch.zeros_like(delta))
        advantages[:, t] = advantage
        next_advantage = advantage
        next_value = values[:, t]
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages.detach(), returns.detach()


class GAEConfig(Protocol):
    gamma: float
    lam: float
    whiten_advantages: bool


@register_advantage_estimator("gae", needs_critic=True)
def gae(rewards: torch.Tensor, action_mask: torch.Tensor, values: torch.Tensor | None,
        group_index: torch.Tensor | None, config: GAEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) on the critic's values, then the advantages whitened over the batch's answer
    tokens unless `whiten_advantages` is off; the returns are the critic's targets."""
    advantages, returns = compute_advantages_and_returns(values, rewards, action_mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = whiten(advantages, action_mask)
    return advantages, returns
