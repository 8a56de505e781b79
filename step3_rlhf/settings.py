"""Step 3's command line: one typed group per concern (see `training.core.args`)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from step3_rlhf.placement_setup import check_placement_flags
from step3_rlhf.ppo_trainer import PPOConfig, check_samples_per_prompt
from step3_rlhf.stage_fusion import check_stage_fusion
from step3_rlhf.unused_flags import check_unused_flags
from training.algorithms import get_advantage_estimator, get_policy_loss, get_value_loss
from training.core.args import (
    ModelTrainingConfig,
    RunArguments,
    ScheduleSettings,
    check_finite,
    check_lora_flags,
    check_non_negative,
    check_offload_stage,
    check_optimizer_flags,
    check_positive,
    check_warmup,
    flag_values,
    group,
)
from training.generation.generator import SamplingSettings
from training.generation.hybrid_engine import HybridEngineSettings
from training.placement.settings import PlacementSettings
from training.placement.workload import offloaded_models, ppo_micro_batches
from training.reliability.checkpointing import CheckpointSettings
from training.rewards.functions import is_builtin
from utils.data import DataArguments, UnsupervisedDataArguments
from utils.errors import UserError, refuse_all, refuse_messages


@dataclass
class Step3Models:
    actor_model_name_or_path: str = field(metadata={
        "help": "the step-1 run folder (or any causal LM): the actor and the frozen reference"})
    critic_model_name_or_path: str | None = field(default=None, metadata={
        "help": "the step-2 run folder: the frozen reward model and the critic's initialisation (optional with "
                "--reward_fn: without it a reward function alone scores the answers, and a critic starts from the "
                "actor's model with a new value head)"})


@dataclass
class RewardFunctionSettings:
    """A program that scores answers, alone or added to the reward model's score."""

    reward_fn: str | None = field(default=None, metadata={
        "help": "score answers with a Python function (prompt, answer, row metadata) -> float: 'builtin:math' (the "
                "final number equals the row's answer), 'builtin:format', 'module:function' or 'file.py:function'"})
    reward_fn_coef: float = field(default=1.0, metadata={
        "help": "weight of --reward_fn in the score (added to the reward model's score when there is one)"})


@dataclass
class PPOLoopArguments:
    """Rollout and update batches, passes and held-out evaluation."""

    per_device_generation_batch_size: int = field(default=4, metadata={"help": "prompts per rollout batch per rank"})
    per_device_training_batch_size: int = field(default=4, metadata={"help": "PPO micro-batch size per rank"})
    generation_batches: int = field(default=1, metadata={"help": "rollout batches collected per PPO step"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each PPO step's experiences"})
    num_train_epochs: int = field(default=1, metadata={"help": "passes over the prompt set"})
    eval_interval: int = field(default=0, metadata={
        "help": "score held-out prompts every N PPO steps (0: only before and after training)"})
    eval_samples: int = field(default=32, metadata={"help": "held-out prompts scored per evaluation (per rank)"})
    max_train_minutes: float | None = field(default=None, metadata={
        "resume_override": True,
        "help": "start no PPO step after this many minutes of training in this process (then evaluate and save "
                "as usual): a time budget instead of, or besides, --max_steps"})


@dataclass
class RolloutSampling(SamplingSettings):
    """Rollouts are drawn from the full distribution at `temperature` (top-p/top-k are refused)."""

    temperature: float = field(default=1.0, metadata={
        "help": "rollout sampling temperature; the policy PPO trains (old, new and reference log-probs, KL, entropy) "
                "is softmax(logits / temperature), the distribution the answers are drawn from"})
    top_p: float = field(default=1.0, metadata={
        "help": "refused below 1: truncated sampling would train on other log-probs than drew the tokens"})
    top_k: int = field(default=0, metadata={
        "help": "refused above 0: truncated sampling would train on other log-probs than drew the tokens"})


@dataclass
class EMASettings:
    enable_ema: bool = field(default=False, metadata={"help": "keep an EMA of the actor, saved as actor_ema/"})
    ema_beta: float = field(default=0.992, metadata={
        "help": "EMA decay per actor optimizer step, in [0, 1): ema = beta * ema + (1 - beta) * actor; 0 keeps no "
                "average, only the actor's weights after its last step (actor_ema/ then equals actor/)"})


@dataclass
class FrozenModels:
    offload_reference_model: bool = field(default=False, metadata={"help": "keep the reference model in CPU memory"})
    offload_reward_model: bool = field(default=False, metadata={"help": "keep the reward model in CPU memory"})


@dataclass
class Step3Settings:
    """Everything step 3 is told; `ppo.temperature` follows `--temperature`."""

    models: Step3Models
    rewards: RewardFunctionSettings
    run: RunArguments
    data: DataArguments
    unsupervised: UnsupervisedDataArguments
    loop: PPOLoopArguments
    ppo: PPOConfig
    sampling: RolloutSampling
    ema: EMASettings
    actor: ModelTrainingConfig = group("actor_")
    critic: ModelTrainingConfig = group("critic_")
    schedule: ScheduleSettings
    frozen: FrozenModels
    hybrid: HybridEngineSettings
    placement: PlacementSettings
    checkpoints: CheckpointSettings

    def __post_init__(self) -> None:
        self.ppo.temperature = self.sampling.temperature

    def check_flags(self, world_size: int) -> None:
        """Refuse, with a `UserError` naming the flag, what the flags alone make wrong (the refusals of the
        independent checks all at once: `refuse_all`): checked before anything is loaded or written, by step 3 itself
        and by train.py before its first step. `world_size`: the ranks step 3 runs on (stage fusion's rule depends on
        it)."""
        flags = flag_values(self)
        refuse_all(partial(_check_loop, self, flags), partial(_check_sampling, self.sampling),
                   partial(_check_ppo_constants, self, flags), self.checkpoints.check_flags,
                   partial(self.data.check_flags, phase=3), partial(check_positive, flags, "inference_tp_size"),
                   self.hybrid.check_flags)
        # the checks below combine flags those above passed (a PPO step's micro-batches divide by
        # --per_device_training_batch_size): the first refusal ends them
        _check_accumulation(self)
        _check_warmup(self)
        _check_algorithm(self.ppo)
        _check_stage_fusion(self, world_size)
        check_placement_flags(self, world_size)
        _check_scoring(self, flags)
        check_unused_flags(self)  # --inference_tp_size without the hybrid engine among them

    def check_device(self) -> None:
        """Refuse, before anything loads, a --dtype or --generation_dtype this device cannot compute in (fp16 on a
        CPU): checked by step 3 itself, and by train.py where the steps run on devices like its own."""
        self.run.check_device()
        self.hybrid.generation_dtype_here()


def micro_batches_per_ppo_step(args: Step3Settings) -> int:
    """Training micro-batches of one PPO step, per rank (`ppo_micro_batches` of the run's flags)."""
    answers = args.loop.per_device_generation_batch_size * args.ppo.n_samples_per_prompt
    return ppo_micro_batches(args.loop.ppo_epochs, args.loop.generation_batches, answers,
                             args.loop.per_device_training_batch_size)


def _check_loop(args: Step3Settings, flags: Mapping[str, Any]) -> None:
    """Batch sizes, passes, evaluation cadence, the models' training options and the EMA, every refusal at once."""
    refuse_all(
        partial(check_positive, flags, "per_device_generation_batch_size", "per_device_training_batch_size",
                "generation_batches", "ppo_epochs", "num_train_epochs", "gradient_accumulation_steps", "max_steps",
                "eval_samples", "max_train_minutes"),
        partial(check_non_negative, flags, "eval_interval", "num_warmup_steps", "actor_lora_dim", "critic_lora_dim"),
        partial(check_offload_stage, flags, "actor_", "critic_"),
        partial(check_lora_flags, flags, "actor_", "critic_"),
        partial(check_optimizer_flags, flags, "actor_", "critic_"),
        partial(_check_ema_beta, args.ema.ema_beta))


def _check_ema_beta(ema_beta: float) -> None:
    if not 0.0 <= ema_beta < 1.0:
        raise UserError(f"--ema_beta must lie in [0, 1), got {ema_beta}")


def _check_sampling(sampling: RolloutSampling) -> None:
    if sampling.top_p != 1.0 or sampling.top_k != 0:
        raise UserError(
            f"--top_p {sampling.top_p} / --top_k {sampling.top_k}: step 3 samples rollouts from the full "
            "distribution at --temperature, because PPO's ratios and KL must use the log-probabilities of the "
            "distribution that drew each token, and top-p/top-k truncation changes it; drop --top_p/--top_k (lower "
            "--temperature to sharpen sampling); truncated sampling stays available in inference/chatbot.py"
        )


def _check_ppo_constants(args: Step3Settings, flags: Mapping[str, Any]) -> None:
    """The PPO constants, every refusal at once (--max_prompt_seq_len is the data's to check:
    `DataArguments.check_flags`)."""
    refuse_all(
        partial(_check_reward_clip, flags),
        partial(check_positive, flags, "n_samples_per_prompt", "cliprange", "cliprange_value", "target_kl",
                "kl_horizon", "group_std_eps", "max_answer_seq_len", "temperature"),
        # each would turn a term around (reward the KL, the cut-off answer, the pretraining loss) or divide by ~0
        partial(check_non_negative, flags, "kl_ctl", "unsup_coef", "no_eos_penalty"),
        partial(_check_unit_interval, flags, "gamma", "lam"),
        partial(_check_kl_target, args.ppo),
        partial(_check_unsupervised_mix, args))


def _check_reward_clip(flags: Mapping[str, Any]) -> None:
    """An infinite clip is refused as every infinite flag is, saying how to clip nothing (it once meant that)."""
    if flags["clip_reward_value"] == math.inf:
        raise UserError("--clip_reward_value must be a finite number, got inf; to leave the reward model's scores "
                        "unclipped give a bound above any score it gives (e.g. --clip_reward_value 1e6)")
    check_positive(flags, "clip_reward_value")


def _check_unit_interval(flags: Mapping[str, Any], *names: str) -> None:
    refuse_messages([f"--{name} must lie in [0, 1], got {flags[name]}" for name in names
                     if not 0.0 <= flags[name] <= 1.0])


def _check_kl_target(ppo: PPOConfig) -> None:
    """A target the controller could hold (a bad --target_kl is refused by its own check, not said again here)."""
    if ppo.target_kl is not None and 0 < ppo.target_kl < math.inf and ppo.kl_ctl == 0:
        raise UserError(f"--target_kl {ppo.target_kl} adapts the KL coefficient by multiplying it, so from "
                        "--kl_ctl 0 it stays 0 and the KL is never held; start from --kl_ctl > 0 (e.g. 0.1), or drop "
                        "--target_kl")


def _check_unsupervised_mix(args: Step3Settings) -> None:
    if args.unsupervised.unsupervised_dataset_name and args.ppo.unsup_coef == 0:
        raise UserError(f"--unsupervised_dataset_name {args.unsupervised.unsupervised_dataset_name} with --unsup_coef 0 "
                        "mixes nothing in, though every actor update would still compute a pretraining batch's "
                        "language-model loss; give --unsup_coef > 0 (e.g. 0.05), or drop --unsupervised_dataset_name")


def _check_scoring(args: Step3Settings, flags: Mapping[str, Any]) -> None:
    """Something scores the answers, and --reward_fn_coef gives --reward_fn's score a weight that trains: 0 leaves it
    measured only (the evaluation reports it), so a reward model must score; a negative one suits a function of your
    own that scores what is unwanted (a penalty), never a built-in, which scores the answer wanted 1."""
    reward_model, reward_fn = args.models.critic_model_name_or_path, args.rewards.reward_fn
    if reward_model is None and reward_fn is None:
        raise UserError("step 3 needs something to score the answers: --critic_model_name_or_path (a step-2 reward "
                        "model), --reward_fn (e.g. builtin:math), or both")
    check_finite(flags, "reward_fn_coef")
    coef = args.rewards.reward_fn_coef
    if reward_fn is None:
        return  # a weight without --reward_fn is refused as unused (`check_unused_flags`)
    if coef == 0 and reward_model is None:
        raise UserError(f"--reward_fn_coef 0 with --reward_fn {reward_fn} alone scores every answer 0, so nothing is "
                        "learned; give a positive weight (e.g. 1), or a reward model to train on with "
                        "--critic_model_name_or_path (--reward_fn then only measures the answers)")
    if coef < 0 and is_builtin(reward_fn):
        raise UserError(f"--reward_fn_coef {coef} with --reward_fn {reward_fn}: a built-in reward function scores the "
                        "answer wanted 1, and a negative weight trains the actor away from it; give a positive weight "
                        "(e.g. 1)")


def _check_accumulation(args: Step3Settings) -> None:
    micro_batches = micro_batches_per_ppo_step(args)
    if micro_batches % args.schedule.gradient_accumulation_steps:
        raise UserError(
            f"--gradient_accumulation_steps {args.schedule.gradient_accumulation_steps} does not divide the "
            f"{micro_batches} training micro-batches of a PPO step (--ppo_epochs x --generation_batches x the "
            f"micro-batches of --per_device_generation_batch_size x --n_samples_per_prompt answers at "
            f"--per_device_training_batch_size): an optimizer step would span two PPO steps, and a checkpoint "
            f"between them would lose its accumulated gradients; use a divisor of {micro_batches}")


def optimizer_steps_per_ppo_step(args: Step3Settings) -> int:
    """Optimizer steps the actor and the critic each take per PPO step (the pretraining mixture adds none;
    `_check_accumulation` makes the accumulation divide the micro-batches)."""
    return micro_batches_per_ppo_step(args) // args.schedule.gradient_accumulation_steps


def optimizer_steps_said(ppo_steps: int, args: Step3Settings) -> str:
    """How `ppo_steps` PPO steps make the trained models' optimizer steps, as a message says it."""
    per_step = optimizer_steps_per_ppo_step(args)
    return f"{ppo_steps} PPO steps of {per_step} optimizer steps each: {ppo_steps * per_step}"


def _check_warmup(args: Step3Settings) -> None:
    """A --max_steps (PPO steps) whose optimizer steps the warm-up outlasts; the prompts, not yet read, may end the
    run sooner (main's `warn_long_warmup`)."""
    max_steps = args.schedule.max_steps
    if max_steps is not None:
        check_warmup(args.schedule.num_warmup_steps, max_steps * optimizer_steps_per_ppo_step(args),
                     f"--max_steps {optimizer_steps_said(max_steps, args)}")


def _check_algorithm(ppo: PPOConfig) -> None:
    """The registry names (an unknown one fails, listing the known) and the answers per prompt they need."""
    estimator = get_advantage_estimator(ppo.advantage_estimator)
    get_policy_loss(ppo.policy_loss)
    get_value_loss(ppo.value_loss)
    check_samples_per_prompt(estimator, ppo.n_samples_per_prompt)


def _check_stage_fusion(args: Step3Settings, world_size: int) -> None:
    check_stage_fusion(args.placement.enable_stage_fusion, args.placement.stage_fusion_micro_batch_size,
                       args.hybrid.backend, args.hybrid.inference_tp_size, args.actor.zero_stage,
                       args.critic.zero_stage, offloaded_models(args), world_size)
