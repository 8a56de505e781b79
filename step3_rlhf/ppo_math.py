"""The arithmetic of PPO for language models, as pure torch functions.

Shapes: B sequences, T positions aligned with the per-token log-probabilities (position t holds
the log-probability of token t+1 of the full prompt+answer sequence). `action_mask` [B, T] is 1 on
the answer tokens the actor generated (EOS included) and 0 on prompt and padding; answers are
contiguous runs of ones. Means over a mask are taken over every masked token of the batch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from training.core.sequences import last_token_index


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1 (over all elements, or along `dim`); NaN-safe for masked-out entries."""
    mask = mask.to(x.dtype)
    masked = torch.where(mask.bool(), x, torch.zeros_like(x))
    if dim is None:
        return masked.sum() / mask.sum().clamp(min=1.0)
    return masked.sum(dim) / mask.sum(dim).clamp(min=1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise `x` to unit variance (and zero mean if `shift_mean`) using only masked entries; masked-out entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the token distributions at masked positions: logits [B, T, V], mask [B, T] -> scalar."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    expected_logit = (F.softmax(logits, dim=-1) * logits).sum(-1)
    return masked_mean(log_z - expected_logit, mask)


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Exact KL(p || q) between the next-token distributions p = softmax(logits / T) and q = softmax(ref_logits / T),
    summed over each row's masked positions: logits/ref_logits [B, T, V], mask [B, T] -> [B] (fp32).

    One row at a time in fp32, so no [B, T, V] log-softmax tensor is ever built.
    """
    per_row = []
    for row_logits, row_ref_logits, row_mask in zip(logits, ref_logits, mask):
        log_p = torch.log_softmax(row_logits.float() / temperature, dim=-1)
        log_q = torch.log_softmax(row_ref_logits.float() / temperature, dim=-1)
        per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
        per_row.append(torch.where(row_mask.bool(), per_position, torch.zeros_like(per_position)).sum())
    return torch.stack(per_row)


def compute_rewards(
    reward_scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float,
    clip_reward_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * (logprob - ref_logprob) on every answer token, plus the reward
    model's score clipped to [-clip_reward_value, clip_reward_value] on the last answer token.

    reward_scores [B], logprobs/ref_logprobs/action_mask [B, T] -> (rewards [B, T], kl [B]) where
    kl is each sequence's summed log-ratio over its answer (the sample KL estimate).
    """
    mask = action_mask.bool()
    log_ratio = logprobs.float() - ref_logprobs.float()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    rewards = -kl_coef * log_ratio
    clipped = reward_scores.float().clamp(-clip_reward_value, clip_reward_value)
    has_answer = mask.any(-1)
    last = last_token_index(action_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += torch.where(has_answer, clipped, torch.zeros_like(clipped))
    return rewards, log_ratio.sum(-1)


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


class ActorLoss(NamedTuple):
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def actor_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cliprange: float
) -> ActorLoss:
    """PPO clipped surrogate: mean over masked tokens of max(-A * r, -A * clip(r, 1-eps, 1+eps)), r = exp(logp - old_logp).

    All inputs [B, T]. `clip_fraction` is the share of tokens where the clipped term won;
    `approx_kl` is the mean of (r - 1) - log r (Schulman's k3 estimator of KL(old || new)).
    """
    log_ratio = logprobs.float() - old_logprobs.float()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, mask)
    return ActorLoss(loss, clip_fraction, approx_kl)


class CriticLoss(NamedTuple):
    loss: torch.Tensor
    clip_fraction: torch.Tensor


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


def apply_no_eos_penalty(scores: torch.Tensor, ended_with_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract `penalty` from the reward-model score of every answer that never emitted EOS (cut off at the length limit)."""
    return torch.where(ended_with_eos.bool(), scores, scores - penalty)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019): steer the measured KL toward `target`.

    error = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon.
    `current_kl` is the mean per-sequence KL of the batch; `n_steps` the samples it was measured on.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("the adaptive KL controller needs a positive target and horizon")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
