"""KL to the reference policy: per-token KL estimators, the KL penalty in the reward or as a loss
term, the exact KL between two models' next-token distributions, and the controllers of the
penalty's coefficient (shapes as in `core`).

The estimators (Schulman, "Approximating KL divergence") estimate KL(actor || reference) from tokens the
actor sampled, with log r = ref_logprob - logprob:
- `k1`: -log r (unbiased, can be negative per token);
- `k2`: (log r)^2 / 2 (biased, low variance, its gradient is that of the reverse KL);
- `k3`: (r - 1) - log r (unbiased and never negative; GRPO's KL loss), at most `K3_MAX`: it grows as r, so one
  token the reference likes and the actor now finds unlikely (log r = 10: k3 = 22,015) would otherwise outweigh
  every other term of the loss or the reward (verl and OpenRLHF clamp it likewise; a clamped token has no gradient).

As a loss term the estimators differ in their gradient, not their value: over the actor's own samples, k2's expected
gradient is that of KL(actor || reference) and k3's that of KL(reference || actor) (DeepSeekMath's choice), while
k1's is E[grad log pi] = 0: it pulls the actor nowhere, so it is refused there (`NO_GRADIENT_AS_LOSS`) and
`LOSS_ESTIMATOR` takes its place by default.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from training.algorithms.core import LOG_RATIO_MAX, masked_mean
from utils.registry import Registry
from training.core.sequences import last_token_index, tokenizer_columns

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
NO_GRADIENT_AS_LOSS = ("k1",)  # estimators whose loss has zero expected gradient (see the module doc)
LOSS_ESTIMATOR = "k2"  # the loss estimator in their place: its expected gradient is KL(actor || reference)'s
K3_MAX = 10.0  # k3's clamp (see the module doc); exp(log r) is taken with log r clamped to +-LOG_RATIO_MAX


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs.float() - ref_logprobs.float()


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs.float() - ref_logprobs.float()) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = (ref_logprobs.float() - logprobs.float()).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(max=K3_MAX)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """The KL as a loss term: the mean over masked tokens of the named estimator (differentiable in `logprobs`)."""
    return masked_mean(KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs), mask)


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0, *, tokenizer_size: int | None) -> torch.Tensor:
    """Exact KL(p || q) between the next-token distributions p = softmax(logits / T) and q = softmax(ref_logits / T)
    over the tokenizer's ids (the first `tokenizer_size` columns, those generation draws from; no default: None, all,
    is said outright), summed over each row's masked positions: logits/ref_logits [B, T, V], mask [B, T] -> [B] (fp32).

    One row at a time in fp32, so no [B, T, V] log-softmax tensor is ever built.
    """
    columns = tokenizer_columns(logits, tokenizer_size)
    per_row = []
    for row_logits, row_ref_logits, row_mask in zip(logits, ref_logits, mask):
        log_p = torch.log_softmax(row_logits[:, :columns].float() / temperature, dim=-1)
        log_q = torch.log_softmax(row_ref_logits[:, :columns].float() / temperature, dim=-1)
        p = log_p.exp()
        per_position = torch.where(p > 0, p * (log_p - log_q), 0).sum(-1)  # 0 * log 0 is 0 (a -inf logit)
        per_row.append(torch.where(row_mask.bool(), per_position, torch.zeros_like(per_position)).sum())
    return torch.stack(per_row)


def compute_rewards(
    reward_scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float,
    clip_reward_value: float,
    kl_estimator: str = "k1",
    ended_with_eos: torch.Tensor | None = None,
    no_eos_penalty: float = 0.0,
    unclipped_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * the `kl_estimator` estimate on every answer token (pass kl_coef 0 when
    the KL is a loss term instead), plus the answer's `sequence_rewards` (its score clipped, plus its unclipped
    score, less the no-EOS penalty) on the last answer token.

    reward_scores [B], logprobs/ref_logprobs/action_mask [B, T] -> (rewards [B, T], kl [B]) where
    kl is each sequence's summed log-ratio over its answer (the k1 sample KL estimate, whatever the penalty).
    """
    mask = action_mask.bool()
    log_ratio = logprobs.float() - ref_logprobs.float()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    penalty = log_ratio if kl_estimator == "k1" else torch.where(
        mask, KL_ESTIMATORS.get(kl_estimator)(logprobs, ref_logprobs), torch.zeros_like(log_ratio))
    rewards = -kl_coef * penalty
    clipped = sequence_rewards(reward_scores, clip_reward_value, ended_with_eos, no_eos_penalty, unclipped_scores)
    has_answer = mask.any(-1)
    last = last_token_index(action_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += torch.where(has_answer, clipped, torch.zeros_like(clipped))
    return rewards, log_ratio.sum(-1)


def sequence_rewards(scores: torch.Tensor, clip_reward_value: float, ended_with_eos: torch.Tensor | None = None,
                     no_eos_penalty: float = 0.0, unclipped_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Each answer's reward: its score clipped to [-clip_reward_value, clip_reward_value], plus `unclipped_scores`
    (step 3's weighted reward function: the clip guards against a reward model's outliers, and would cap the
    function's weight), less `no_eos_penalty` where it never emitted EOS (cut off at the length limit). The penalty
    comes after the clip: before it, a score at or beyond the clip range lost it in part or whole, and a cut-off
    answer was rewarded as a finished one."""
    clipped = scores.float().clamp(-clip_reward_value, clip_reward_value)
    if unclipped_scores is not None:
        clipped = clipped + unclipped_scores.float()
    if ended_with_eos is None or not no_eos_penalty:
        return clipped
    return torch.where(ended_with_eos.bool(), clipped, clipped - no_eos_penalty)


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
