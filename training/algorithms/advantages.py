"""Advantage estimators, registered by name (`--advantage_estimator`, or through `--algorithm`).

An estimator is one function `(inputs: AdvantageInputs, config) -> (advantages [B, T], returns [B, T])`,
both 0 off the answer tokens. `inputs.rewards` are the shaped per-token rewards (`kl.compute_rewards`:
the score on each answer's last token, plus the KL penalty on every token when the KL is in the reward),
`config` the trainer's settings (each estimator reads the fields it uses, and names them in `reads`: step 3 refuses
such a flag, changed, where the estimator it runs does not read it). Each declares what it needs:
a critic (`values`), groups of answers to one prompt (`group_index`, `min_group_size` rows each), or the
reward of the prompt's greedy answer (`baseline_rewards`); the trainer and engine provide exactly that. An
estimator registered `whitened` returns its advantages as they are, and the trainer whitens them over the
answer tokens of the whole generation batch, every rank's rows together (unless --disable_advantage_whitening):
one rank's few rows would give each rank its own scale.

The critic-free estimators use each answer's return R = the sum of its per-token rewards (its outcome)
and put one advantage on all of its tokens, except REINFORCE++, which keeps token-level returns-to-go:
- `group_normalized` (GRPO): (R - mean of the group) / (std of the group + eps), the sample std;
- `leave_one_out` (RLOO): R - mean of the OTHER answers of the group;
- `reinforce_pp` (REINFORCE++): returns-to-go sum_{t'>=t} gamma^(t'-t) r_t', whitened;
- `greedy_baseline` (ReMax): R - the reward of the prompt's greedy answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from utils.registry import Registry


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read; the fields an estimator does not declare a need for may be None."""

    rewards: torch.Tensor  # [B, T] shaped per-token rewards
    action_mask: torch.Tensor  # [B, T] 1 on answer tokens
    values: torch.Tensor | None = None  # [B, T] the critic's values (`needs_critic`)
    group_index: torch.Tensor | None = None  # [B] long, rows answering the same prompt share it
    baseline_rewards: torch.Tensor | None = None  # [B] the reward of the row's prompt's greedy answer

    @property
    def sequence_returns(self) -> torch.Tensor:
        """Each answer's undiscounted total reward R: [B] fp32."""
        mask = self.action_mask.bool()
        return torch.where(mask, self.rewards.float(), torch.zeros_like(self.rewards, dtype=torch.float32)).sum(-1)

    def on_answer_tokens(self, per_row: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, T]: the row's value on each of its answer tokens, 0 elsewhere."""
        return per_row[:, None] * self.action_mask.float()


EstimatorFn = Callable[[AdvantageInputs, Any], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: call it like its function; the flags say what its inputs must hold."""

    name: str
    fn: EstimatorFn
    needs_critic: bool
    min_group_size: int = 1  # answers per prompt it needs (--n_samples_per_prompt)
    needs_greedy_baseline: bool = False
    whitened: bool = False  # its advantages are whitened over the generation batch (by the trainer)
    reads: tuple[str, ...] = ()  # the fields of `config` it reads (step-3 flags: "gamma", "lam")

    def __call__(self, inputs: AdvantageInputs, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(inputs, config)


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage_estimator(name: str, needs_critic: bool, min_group_size: int = 1,
                                 needs_greedy_baseline: bool = False, whitened: bool = False,
                                 reads: tuple[str, ...] = ()) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register an estimator function under `name` (the function itself is returned unchanged)."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        entry = AdvantageEstimator(name, fn, needs_critic, min_group_size, needs_greedy_baseline, whitened, reads)
        ADVANTAGE_ESTIMATORS.add(name, entry)
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
    advantage, so padding after an early EOS never leaks into the answer. With `values` all 0 and
    `lam` 1 the advantages are the discounted returns-to-go.
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


def group_sums(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (the sum of `values` over its group, its group's size), both [B] fp64. A group of equal fp32 values
    sums exactly in fp64, so its mean is the value itself: an fp32 mean of 0.3s is off by an ulp, which GRPO's
    division by a ~1e-7 std turned into advantages of up to 0.3 for groups that carry no signal."""
    same = (group_index[:, None] == group_index[None, :]).double()
    return same @ values.double(), same.sum(-1)


class GAEConfig(Protocol):
    gamma: float
    lam: float


class GroupConfig(Protocol):
    group_std_eps: float


@register_advantage_estimator("gae", needs_critic=True, whitened=True, reads=("gamma", "lam"))
def gae(inputs: AdvantageInputs, config: GAEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) on the critic's values (whitened by the trainer); the returns are the critic's targets."""
    return compute_advantages_and_returns(inputs.values, inputs.rewards, inputs.action_mask, config.gamma, config.lam)


@register_advantage_estimator("group_normalized", needs_critic=False, min_group_size=2, reads=("group_std_eps",))
def group_normalized(inputs: AdvantageInputs, config: GroupConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's outcome advantage: (R - group mean) / (group sample std + `group_std_eps`); a group whose
    answers all earned the same reward gets advantage 0 (it carries no signal)."""
    returns = inputs.sequence_returns
    total, size = group_sums(returns, inputs.group_index)
    deviation = returns.double() - total / size
    squares, _ = group_sums(deviation * deviation, inputs.group_index)
    advantages = deviation / ((squares / (size - 1).clamp(min=1.0)).sqrt() + config.group_std_eps)
    return inputs.on_answer_tokens(advantages.float()), inputs.on_answer_tokens(returns)


@register_advantage_estimator("leave_one_out", needs_critic=False, min_group_size=2)
def leave_one_out(inputs: AdvantageInputs, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: R minus the mean return of the other answers to the same prompt."""
    returns = inputs.sequence_returns
    total, size = group_sums(returns, inputs.group_index)
    advantages = returns.double() - (total - returns.double()) / (size - 1).clamp(min=1.0)
    return inputs.on_answer_tokens(advantages.float()), inputs.on_answer_tokens(returns)


@register_advantage_estimator("reinforce_pp", needs_critic=False, whitened=True, reads=("gamma",))
def reinforce_pp(inputs: AdvantageInputs, config: GAEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: each token's discounted return-to-go (no critic), as advantage (whitened by the trainer)."""
    zeros = torch.zeros_like(inputs.rewards, dtype=torch.float32)
    returns, _ = compute_advantages_and_returns(zeros, inputs.rewards, inputs.action_mask, config.gamma, 1.0)
    return returns.clone(), returns


@register_advantage_estimator("greedy_baseline", needs_critic=False, needs_greedy_baseline=True)
def greedy_baseline(inputs: AdvantageInputs, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: R minus the reward of the greedy answer to the same prompt."""
    returns = inputs.sequence_returns
    advantages = returns - inputs.baseline_rewards.float()
    return inputs.on_answer_tokens(advantages), inputs.on_answer_tokens(returns)
