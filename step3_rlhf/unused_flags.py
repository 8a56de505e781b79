"""Step-3 flags that do nothing in the combination given, refused before anything loads (`Step3Settings.check_flags`).

Each rule names flags and says, from the settings, why they do nothing and what would make them work (None: they
take effect). Only flags changed from their defaults are refused (`non_default_flags`; for the flags `--algorithm`
fills, from the algorithm's values: `PPOConfig.algorithm_defaults`), so the defaults, and every plan train.py makes,
pass: a flag given its default value changes nothing anyway.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.algorithms import ADVANTAGE_ESTIMATORS, AdvantageEstimator, get_advantage_estimator
from training.core.args import non_default_flags
from training.placement.spec import AUTO
from utils.errors import UserError

if TYPE_CHECKING:  # step3_rlhf.settings calls `check_unused_flags` from `Step3Settings.check_flags`
    from step3_rlhf.settings import Step3Settings

CRITIC_FLAGS = ("critic_learning_rate", "critic_weight_decay", "critic_lora_dim", "critic_lora_module_name",
                "critic_only_optimize_lora", "critic_lora_learning_rate", "critic_offload",
                "critic_gradient_checkpointing", "cliprange_value", "value_loss")
HYBRID_ENGINE_FLAGS = ("inference_tp_size", "tp_gather_partition_size", "release_inference_cache",
                       "keep_inference_copy", "unpin_actor_parameters", "disable_fused_decode", "disable_cuda_graph",
                       "disable_onednn_packing", "generation_dtype")
INFERENCE_COPY_FLAGS = ("tp_gather_partition_size", "disable_fused_decode", "disable_cuda_graph", "disable_onednn_packing",
                        "generation_dtype")
PRETRAINING_FLAGS = ("unsup_coef", "unsupervised_dataset_config_name", "unsupervised_text_column")


@dataclass(frozen=True)
class UnusedFlags:
    """`flags` do nothing where `unused(args)` gives the reason and the remedy, "why; what to do" (None: they work)."""

    flags: tuple[str, ...]
    unused: Callable[[Step3Settings], str | None]


def _estimator(args: Step3Settings) -> AdvantageEstimator:
    return get_advantage_estimator(args.ppo.advantage_estimator)


def _runs(args: Step3Settings) -> str:
    """The estimator the run uses, as the user chose it."""
    return f"advantage estimator {args.ppo.advantage_estimator!r} (--algorithm {args.ppo.algorithm})"


def _no_critic(args: Step3Settings) -> str | None:
    if _estimator(args).needs_critic:
        return None
    return f"{_runs(args)} trains no critic; use an algorithm with one (--algorithm ppo)"


def _neither_critic_nor_reward_model(args: Step3Settings) -> str | None:
    """--critic_zero_stage builds the critic and, as DeepSpeed-Chat's, the frozen reward model (ZeRO-3 at 3)."""
    if _estimator(args).needs_critic or args.models.critic_model_name_or_path is not None:
        return None
    return (f"it sets the ZeRO stage of the critic and the reward model, and the run has neither ({_runs(args)} trains "
            "no critic; no --critic_model_name_or_path); use --algorithm ppo or give a reward model")


def _no_reward_model(args: Step3Settings) -> str | None:
    if args.models.critic_model_name_or_path is not None:
        return None
    return ("no reward model scores the answers (--reward_fn alone); give one with --critic_model_name_or_path "
            "(a step-2 run folder)")


def _no_reward_fn(args: Step3Settings) -> str | None:
    return None if args.rewards.reward_fn is not None else "it weighs --reward_fn, which is not given; add --reward_fn"


def _estimators_that(has: Callable[[AdvantageEstimator], bool]) -> str:
    return ", ".join(sorted(name for name, estimator in ADVANTAGE_ESTIMATORS.entries.items() if has(estimator)))


def _not_read_by_the_estimator(setting: str) -> Callable[[Step3Settings], str | None]:
    def unused(args: Step3Settings) -> str | None:
        if setting in _estimator(args).reads:
            return None
        readers = _estimators_that(lambda estimator: setting in estimator.reads)
        return f"{_runs(args)} does not read it; the estimators that do: {readers}"

    return unused


def _not_whitened(args: Step3Settings) -> str | None:
    if _estimator(args).whitened:
        return None
    whitened = _estimators_that(lambda estimator: estimator.whitened)
    return f"{_runs(args)} does not whiten its advantages; the estimators that do: {whitened}"


def _fixed_kl_coefficient(args: Step3Settings) -> str | None:
    if args.ppo.target_kl is not None:
        return None
    return "it paces the adaptive KL coefficient, and without --target_kl the coefficient stays --kl_ctl; add --target_kl"


def _no_kl_penalty(args: Step3Settings) -> str | None:
    if args.ppo.kl_ctl > 0:
        return None
    return ("with --kl_ctl 0 the KL to the reference weighs nothing, in the reward or in the loss (only the logged "
            "kl_loss would change); give --kl_ctl > 0 (e.g. 0.1)")


def _no_ema(args: Step3Settings) -> str | None:
    return None if args.ema.enable_ema else "no EMA of the actor is kept without --enable_ema; add --enable_ema"


def _not_the_hybrid_engine(args: Step3Settings) -> str | None:
    if args.hybrid.backend == "hybrid":
        return None
    remedy = "drop --generation_backend hf" if args.hybrid.generation_backend == "hf" else "add --enable_hybrid_engine"
    return ("it configures the hybrid engine's generation, but the rollouts would be generated by the 'hf' backend "
            f"(transformers' generate on each rank's whole model), which ignores it; {remedy}")


def _no_inference_copy(args: Step3Settings) -> str | None:
    if not args.hybrid.unpin_actor_parameters:
        return None
    return ("it configures the hybrid engine's inference copy, and with --unpin_actor_parameters none is built (the "
            "actor's own module generates through its ZeRO-3 hooks); drop --unpin_actor_parameters")


def _nothing_gathered(args: Step3Settings) -> str | None:
    if args.actor.zero_stage == 3 or args.placement.placement == AUTO:  # the planner may choose ZeRO-3
        return None
    return (f"it bounds the decoder layers gathered at once from a ZeRO-3 actor, and at --actor_zero_stage "
            f"{args.actor.zero_stage} every rank holds the whole actor (nothing is gathered); use --actor_zero_stage 3")


def _no_pretraining_source(args: Step3Settings) -> str | None:
    if args.unsupervised.unsupervised_dataset_name:
        return None
    return ("no pretraining text is mixed in without --unsupervised_dataset_name; add it (e.g. "
            "--unsupervised_dataset_name embedded)")


def _no_stage_fusion(args: Step3Settings) -> str | None:
    if args.placement.enable_stage_fusion or args.placement.placement == AUTO:  # the planner may turn fusion on
        return None
    return "no answers are scored while others decode without --enable_stage_fusion; add --enable_stage_fusion"


def _no_planner(args: Step3Settings) -> str | None:
    if args.placement.placement == AUTO:
        return None
    return (f"only --placement auto plans with the machine's constants, and --placement {args.placement.placement} "
            "places the models as named; use --placement auto")


def rules() -> list[UnusedFlags]:
    """Every rule; the estimators' settings are read from the registry as it stands."""
    estimator_settings = sorted({setting for estimator in ADVANTAGE_ESTIMATORS.entries.values()
                                 for setting in estimator.reads})
    return [
        UnusedFlags(CRITIC_FLAGS, _no_critic),
        UnusedFlags(("critic_zero_stage",), _neither_critic_nor_reward_model),
        UnusedFlags(("offload_reward_model", "clip_reward_value"), _no_reward_model),
        UnusedFlags(("reward_fn_coef",), _no_reward_fn),
        *(UnusedFlags((setting,), _not_read_by_the_estimator(setting)) for setting in estimator_settings),
        UnusedFlags(("disable_advantage_whitening",), _not_whitened),
        UnusedFlags(("kl_horizon",), _fixed_kl_coefficient),
        UnusedFlags(("kl_in_loss", "kl_estimator"), _no_kl_penalty),
        UnusedFlags(("ema_beta",), _no_ema),
        UnusedFlags(HYBRID_ENGINE_FLAGS, _not_the_hybrid_engine),
        UnusedFlags(INFERENCE_COPY_FLAGS, _no_inference_copy),
        UnusedFlags(("tp_gather_partition_size",), _nothing_gathered),
        UnusedFlags(PRETRAINING_FLAGS, _no_pretraining_source),
        UnusedFlags(("stage_fusion_micro_batch_size",), _no_stage_fusion),
        UnusedFlags(("hardware_file", "calibrate"), _no_planner),
    ]


def _as_given(name: str, value: object) -> str:
    """The flag as a command line gives it (`--kl_in_loss false`, not Python's `False`)."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--{name} false"
    return f"--{name} {value}"


def _changed_flags(args: Step3Settings) -> dict[str, object]:
    """`non_default_flags`, less the flags `--algorithm` fills that hold the algorithm's value."""
    algorithm_values = args.ppo.algorithm_defaults()
    return {name: value for name, value in non_default_flags(args).items()
            if name not in algorithm_values or value != algorithm_values[name]}


def check_unused_flags(args: Step3Settings) -> None:
    """Refuse the first rule whose flags were changed from their defaults and do nothing in this run, naming them, why
    and what to do."""
    changed = _changed_flags(args)
    for rule in rules():
        given = [name for name in rule.flags if name in changed]
        if not given:
            continue
        reason = rule.unused(args)
        if reason is not None:
            flags = " and ".join(_as_given(name, changed[name]) for name in given)
            does, them = ("does", "it") if len(given) == 1 else ("do", "them")
            raise UserError(f"{flags} {does} nothing here: {reason}, or drop {them}")
