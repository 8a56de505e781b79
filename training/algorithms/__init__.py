"""The algorithm layer of RL fine-tuning: pure tensor functions, no engines (depends on
`training.core` and `utils` only).

- `core`: masked mean, whitening;
- `kl`: KL estimators by name (`k1`, `k2`, `k3`), the KL penalty in the reward or as a loss, the no-EOS
  penalty, exact KL from logits, KL coefficient controllers;
- `advantages`: advantage estimators by name (`gae`, `group_normalized`, `leave_one_out`, `reinforce_pp`,
  `greedy_baseline`), each declaring what it needs (a critic, groups of answers, a greedy baseline);
- `rl`: the step-3 algorithms by name (`ppo`, `grpo`, `rloo`, `reinforce_pp`, `remax`): an estimator and defaults;
- `losses`: policy losses (`ppo`) and value losses (`clipped`) by name;
- `preference`: preference-pair losses against a frozen reference (`sigmoid` DPO, `ipo`, `hinge`) by name.
A new algorithm is one registered function: `@register_advantage_estimator("name", needs_critic=False)`
(`whitened=True` to have the trainer whiten its advantages over every rank's generation batch, `reads=("gamma",)`
to name the settings it reads),
`@register_policy_loss("name")`, `@register_value_loss("name")` or `@register_preference_loss("name")`, and,
to give a step-3 algorithm an `--algorithm` name with its defaults, one `register_rl_algorithm(RLAlgorithm(...))`.
"""
from training.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    compute_advantages_and_returns,
    gae,
    get_advantage_estimator,
    register_advantage_estimator,
)
from training.algorithms.core import answer_mean_mask, masked_mean, whiten
from training.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KL_ESTIMATORS,
    LOSS_ESTIMATOR,
    NO_GRADIENT_AS_LOSS,
    compute_rewards,
    kl_from_logits,
    kl_loss,
    sequence_rewards,
)
from training.algorithms.losses import (
    POLICY_LOSSES,
    VALUE_LOSSES,
    ActorLoss,
    CriticLoss,
    actor_loss,
    clipped_value_loss,
    critic_loss,
    get_policy_loss,
    get_value_loss,
    ppo_policy_loss,
    register_policy_loss,
    register_value_loss,
)
from training.algorithms.preference import (
    PREFERENCE_LOSSES,
    PairLoss,
    PreferenceLoss,
    get_preference_loss,
    hinge_loss,
    implicit_rewards,
    ipo_loss,
    register_preference_loss,
    sigmoid_loss,
)
from utils.registry import Registry
from training.algorithms.rl import RL_ALGORITHMS, RLAlgorithm, get_rl_algorithm, register_rl_algorithm
