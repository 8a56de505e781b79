"""The step-3 algorithms by name (`--algorithm`): each is an advantage estimator plus the defaults
it is known by. Every one trains the actor with the same clipped policy loss (`--policy_loss`) on
its advantages; they differ in the baseline, hence in what they need besides the actor:

| name | advantage | critic | answers per prompt | KL to the reference |
|---|---|---|---|---|
| `ppo` | GAE on a learned critic | yes | 1 | in the reward, k1 |
| `grpo` | group-normalised outcome | no | 4 | loss term, k3 |
| `rloo` | leave-one-out baseline | no | 4 | in the reward, k1 |
| `reinforce_pp` | batch-whitened returns-to-go | no | 1 | in the reward, k1 (per token) |
| `remax` | greedy answer's reward as baseline | no | 1 (+1 greedy) | in the reward, k1 |

A new algorithm is one `register_rl_algorithm(RLAlgorithm(...))` naming a registered estimator.
"""
from __future__ import annotations

from dataclasses import dataclass

from utils.registry import Registry


@dataclass(frozen=True)
class RLAlgorithm:
    """A named recipe: the estimator and the defaults of the flags left unset."""

    name: str
    advantage_estimator: str
    n_samples_per_prompt: int
    kl_in_loss: bool
    kl_estimator: str
    summary: str


RL_ALGORITHMS: Registry[RLAlgorithm] = Registry("algorithm")


def register_rl_algorithm(algorithm: RLAlgorithm) -> RLAlgorithm:
    return RL_ALGORITHMS.add(algorithm.name, algorithm)


def get_rl_algorithm(name: str) -> RLAlgorithm:
    """The algorithm registered as `name`; a `UserError` naming the choices otherwise."""
    return RL_ALGORITHMS.get(name)


for _algorithm in (
    RLAlgorithm("ppo", "gae", 1, False, "k1", "PPO with a learned critic (GAE), KL penalty in the reward"),
    RLAlgorithm("grpo", "group_normalized", 4, True, "k3",
                "GRPO: K answers per prompt, advantage normalised within the group, KL as a loss term"),
    RLAlgorithm("rloo", "leave_one_out", 4, False, "k1",
                "RLOO: K answers per prompt, the mean reward of the other K-1 as baseline"),
    RLAlgorithm("reinforce_pp", "reinforce_pp", 1, False, "k1",
                "REINFORCE++: token-level KL in the reward, returns-to-go whitened over the batch"),
    RLAlgorithm("remax", "greedy_baseline", 1, False, "k1",
                "ReMax: the reward of the prompt's greedy answer as baseline (one extra greedy rollout)"),
):
    register_rl_algorithm(_algorithm)
