"""The algorithm layer of RL fine-tuning: pure tensor functions, no engines (depends on
`training.core` and `utils` only).

- `core`: masked mean, whitening, entropy from logits;
- `kl`: KL-penalty reward shaping, the no-EOS penalty, exact KL from logits, KL coefficient controllers;
- `advantages`: advantage estimators by name (`gae`), each declaring whether it needs a critic;
- `losses`: policy losses (`ppo`) and value losses (`clipped`) by name;
- `preference`: preference-pair losses against a frozen reference (`sigmoid` DPO, `ipo`, `hinge`) by name.
A new algorithm is one registered function: `@register_advantage_estimator("name", needs_critic=False)`,
`@register_policy_loss("name")`, `@register_value_loss("name")` or `@register_preference_loss("name")`.
"""
from training.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages_and_returns,
    gae,
    get_advantage_estimator,
    register_advantage_estimator,
)
from training.algorithms.core import entropy_from_logits, masked_mean, whiten
from training.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_no_eos_penalty,
    compute_rewards,
    kl_from_logits,
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
from training.algorithms.registry import Registry
