"""Preference losses over (chosen, rejected) answer pairs against a frozen reference, registered by
name (`--dpo_loss`).

A loss is (policy_chosen, policy_rejected, reference_chosen, reference_rejected, config) -> `PairLoss`:
each input is one log-probability per answer, [B] in fp32, and `config` the step's settings (each
loss reads the fields it uses: `beta`, and `label_smoothing` for `sigmoid`). With the log-ratio of
each answer, policy minus reference, and h = log-ratio(chosen) - log-ratio(rejected):
- `sigmoid` (DPO): -log sigmoid(beta * h); with label smoothing e (conservative DPO, for pairs whose
  label is wrong with probability e) -(1 - e) log sigmoid(beta * h) - e log sigmoid(-beta * h);
- `ipo` (IPO): (h - 1 / (2 beta))^2, which pulls h to a finite target instead of pushing it to infinity;
- `hinge` (SLiC / RSO): relu(1 - beta * h).
The loss is the mean over pairs; the implicit rewards beta * log-ratio, detached, come with it.

How an answer's token log-probabilities make its log-probability is part of the entry
(`PreferenceLoss.per_token_mean`): `sigmoid` and `hinge` take the sum over the answer tokens (the
sequence's log-likelihood, as in the DPO paper); `ipo` takes the mean over the answer tokens, since its
fixed target 1 / (2 beta) would otherwise mean a different per-token margin for every answer length
(the IPO authors' recommendation, followed by TRL). Prompt tokens and padding never count.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from utils.registry import Registry


class PairLoss(NamedTuple):
    loss: torch.Tensor  # scalar, mean over the pairs
    chosen_rewards: torch.Tensor  # [B] beta * (policy - reference) log-prob of the chosen answer, detached
    rejected_rewards: torch.Tensor  # [B] the same for the rejected answer


PreferenceLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], PairLoss]


@dataclass(frozen=True)
class PreferenceLoss:
    """A registered preference loss: call it like its function; `per_token_mean` says whether its
    log-probabilities are the mean over answer tokens (else the sum)."""

    name: str
    fn: PreferenceLossFn
    per_token_mean: bool

    def __call__(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                 reference_rejected: torch.Tensor, config: Any) -> PairLoss:
        return self.fn(policy_chosen, policy_rejected, reference_chosen, reference_rejected, config)


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")


def register_preference_loss(name: str, per_token_mean: bool = False) -> Callable[[PreferenceLossFn], PreferenceLossFn]:
    """Decorator: register a preference loss function under `name` (the function is returned unchanged)."""

    def register(fn: PreferenceLossFn) -> PreferenceLossFn:
        PREFERENCE_LOSSES.add(name, PreferenceLoss(name, fn, per_token_mean))
        return fn

    return register


def get_preference_loss(name: str) -> PreferenceLoss:
    """The preference loss registered as `name`; a `UserError` naming the choices otherwise."""
    return PREFERENCE_LOSSES.get(name)


def implicit_rewards(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor, beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """beta * (policy - reference) log-prob of each chosen and each rejected answer, [B] each, with gradients."""
    return (beta * (policy_chosen.float() - reference_chosen.float()),
            beta * (policy_rejected.float() - reference_rejected.float()))


def _pair_loss(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> PairLoss:
    return PairLoss(losses.mean(), chosen.detach(), rejected.detach())


@register_preference_loss("sigmoid")
def sigmoid_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                 reference_rejected: torch.Tensor, config: Any) -> PairLoss:
    """DPO: -log sigmoid(beta * h), label-smoothed by `config.label_smoothing` (0: the original DPO)."""
    chosen, rejected = implicit_rewards(policy_chosen, policy_rejected, reference_chosen, reference_rejected,
                                        config.beta)
    logits = chosen - rejected  # beta * h
    smoothing = config.label_smoothing
    losses = -(1.0 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
    return _pair_loss(losses, chosen, rejected)


@register_preference_loss("ipo", per_token_mean=True)
def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, config: Any) -> PairLoss:
    """IPO: (h - 1 / (2 beta))^2, on per-token mean log-probabilities."""
    chosen, rejected = implicit_rewards(policy_chosen, policy_rejected, reference_chosen, reference_rejected,
                                        config.beta)
    h = (policy_chosen.float() - reference_chosen.float()) - (policy_rejected.float() - reference_rejected.float())
    return _pair_loss((h - 1.0 / (2.0 * config.beta)) ** 2, chosen, rejected)


@register_preference_loss("hinge")
def hinge_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
               reference_rejected: torch.Tensor, config: Any) -> PairLoss:
    """SLiC / RSO hinge: relu(1 - beta * h)."""
    chosen, rejected = implicit_rewards(policy_chosen, policy_rejected, reference_chosen, reference_rejected,
                                        config.beta)
    return _pair_loss(torch.relu(1.0 - (chosen - rejected)), chosen, rejected)
