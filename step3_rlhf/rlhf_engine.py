"""The models of PPO as DeepSpeed engines: actor and critic train, reference and reward are frozen.

- actor: the step-1 model, trained by PPO (its own ZeRO stage, offload and LoRA);
- reference: a frozen copy of the step-1 model, the anchor of the KL penalty;
- critic: initialised from the step-2 reward model (backbone + value head), or without one from the
  actor's model with a new value head, trained on the returns; built only when the advantage estimator
  needs one (`--algorithm`/`--advantage_estimator`), None otherwise;
- reward: the step-2 reward model, frozen, scores each finished answer; None when the answers are scored
  by a reward function alone (`--reward_fn` without `--critic_model_name_or_path`);
- optionally an EMA of the actor's weights (`--enable_ema`).
Every model is built ZeRO-3 aware, and dropout is switched off in all of them: PPO compares
log-probabilities and values of the same tokens across forward passes, which dropout would blur.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from step3_rlhf.ema import ModelEMA
from training.algorithms import get_advantage_estimator
from training.core.args import apply_model_options, optimization_settings
from training.core.ds_config import get_eval_ds_config
from training.core.engine import create_frozen_engine, create_reference_engine, create_train_engine
from training.core.model_loading import load_causal_lm, load_tokenizer, resolve_dtype
from training.core.reward_model import RewardModel
from training.placement.groups import PlacementGroups
from training.placement.spec import Placement
from training.reliability.layouts import check_same_vocabulary, scored_layout_warning, warn_tuned_on_other_layout
from training.reliability.run_records import trained_prompt_format
from utils.data import PromptFormatter
from utils.dist import current_device, is_main_process

if TYPE_CHECKING:  # settings.py imports ppo_trainer, which imports this module
    from step3_rlhf.settings import Step3Settings

logger = logging.getLogger(__name__)


@dataclass
class RLHFEngine:
    """The models this rank holds: under a placement other than `colocate` a rank holds only its models' engines
    (the others are None) and the rollout ranks a `shadow_actor`."""

    actor: torch.nn.Module | None
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None  # None when the advantage estimator needs no critic (or not on this rank)
    reward: torch.nn.Module | None  # None when a reward function alone scores the answers (or not on this rank)
    tokenizer: PreTrainedTokenizerBase
    actor_ema: ModelEMA | None = None
    placement: Placement | None = None  # None: every model on every rank
    groups: PlacementGroups | None = None
    shadow_actor: torch.nn.Module | None = None  # the rollout ranks' generating copy of the actor

    @property
    def has_critic(self) -> bool:
        """Whether the run trains a critic (on some rank)."""
        return self.critic is not None or (self.placement is not None and self.placement.has("critic"))

    def destroy(self) -> None:
        """Release the engines' DeepSpeed state (so a caller can start another step in this process)."""
        for engine in (self.actor, self.reference, self.critic, self.reward):
            destroy = getattr(engine, "destroy", None)
            if destroy is not None:
                destroy()


def warn_other_layout(actor_tokenizer: PreTrainedTokenizerBase, reward_tokenizer: PreTrainedTokenizerBase,
                      prompt_format: str, reward_path: str) -> None:
    """Warn where the reward model was trained on conversations laid out otherwise than step 3 gives them to it: it
    scores the actor's tokens, prompts rendered by the actor's tokenizer under --prompt_format and answers ending where
    the actor's turn does, and step 2 rendered its pairs with the reward model's own tokenizer (another chat template,
    or none) under the --prompt_format its run recorded."""
    warning = scored_layout_warning(actor_tokenizer, prompt_format, reward_tokenizer,
                                    trained_prompt_format(reward_path), reward_path)
    if warning is not None:
        logger.warning("%s", warning)


@contextlib.contextmanager
def model_random_stream(seed: int) -> Iterator[None]:
    """Build a model from `seed`'s stream and leave the global one untouched: what a rank builds (and in what
    order) then changes neither another model's initialisation (LoRA, a new value head) nor the rollouts'
    samples, so every placement builds and samples the same."""
    devices = [torch.device(current_device()).index or 0] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def build_rlhf_engine(
    args: Step3Settings, tokenizer: PreTrainedTokenizerBase, num_actor_steps: int, num_critic_steps: int,
    groups: PlacementGroups | None = None,
) -> RLHFEngine:
    """Build the engines (and the EMA) from the step-3 settings: the critic (and its optimizer) only if the
    advantage estimator needs one, the reward model only if `--critic_model_name_or_path` names one. Under a
    placement (`groups`), only the models this rank holds, each on its ranks' group; a model on fewer ranks
    accumulates gradients over the batches of the ranks it serves, so its optimizer steps are the co-located
    run's."""
    dtype = resolve_dtype(args.run.dtype)
    dtype_name, trust_remote_code = args.run.dtype_name, args.run.trust_remote_code
    actor_path, reward_path = args.models.actor_model_name_or_path, args.models.critic_model_name_or_path
    micro_batch = args.loop.per_device_training_batch_size
    seed = args.data.seed
    placement = groups.placement if groups is not None else None
    rank = groups.rank if groups is not None else 0

    def holds(role: str) -> bool:
        return placement is None or placement.holds(role, rank)

    def settings_for(role: str, model_args, steps: int):
        settings = optimization_settings(model_args, args.schedule, dtype_name, steps, micro_batch)
        if placement is not None:
            settings.gradient_accumulation_steps *= placement.chunks_per_member(role)
            settings.data_parallel_size = groups.group_size(role)
        return settings

    def unit(role: str):
        return groups.unit(role) if groups is not None else None

    def bind(role: str, engine):
        return groups.bind(role, engine) if groups is not None else engine

    if is_main_process():  # the same on every rank
        warn_tuned_on_other_layout(tokenizer, args.data.prompt_format, actor_path, "step 3")
    if reward_path is not None:
        reward_tokenizer = load_tokenizer(reward_path, trust_remote_code)
        check_same_vocabulary(tokenizer, reward_tokenizer, reward_path)
        if is_main_process():  # the same on every rank
            warn_other_layout(tokenizer, reward_tokenizer, args.data.prompt_format, reward_path)

    actor = reference = critic = reward = shadow = None
    if holds("actor"):
        actor_settings = settings_for("actor", args.actor, num_actor_steps)
        with model_random_stream(seed):
            stop_token_ids = PromptFormatter(tokenizer, args.data.prompt_format).stop_token_ids  # saved with it
            actor_model = load_causal_lm(actor_path, tokenizer, dtype=dtype, ds_config=actor_settings.ds_config(),
                                         disable_dropout_layers=True, trust_remote_code=trust_remote_code,
                                         stop_token_ids=stop_token_ids)
            actor_model = apply_model_options(actor_model, args.actor, flag_prefix="actor_")
            actor = bind("actor", create_train_engine(actor_model, actor_settings, unit("actor")))

    if holds("reference"):
        with model_random_stream(seed):
            reference = bind("reference", create_reference_engine(
                actor_path, tokenizer, dtype_name, args.actor.zero_stage, args.frozen.offload_reference_model,
                trust_remote_code, unit("reference")))

    needs_critic = get_advantage_estimator(args.ppo.advantage_estimator).needs_critic
    if needs_critic and holds("critic"):
        critic_settings = settings_for("critic", args.critic, num_critic_steps)
        ds_config = critic_settings.ds_config()
        with model_random_stream(seed):
            if reward_path is not None:
                critic_model = RewardModel.from_pretrained(reward_path, dtype=dtype, ds_config=ds_config,
                                                           disable_dropout_layers=True,
                                                           trust_remote_code=trust_remote_code)
            else:
                critic_model = RewardModel.from_causal_lm(actor_path, tokenizer, dtype=dtype, ds_config=ds_config,
                                                          disable_dropout_layers=True,
                                                          trust_remote_code=trust_remote_code)
            critic_model = apply_model_options(critic_model, args.critic, trainable_heads=("v_head",),
                                               flag_prefix="critic_")
            critic = bind("critic", create_train_engine(critic_model, critic_settings, unit("critic")))

    reward_stage = 3 if args.critic.zero_stage == 3 else 0
    if reward_path is not None and holds("reward"):
        reward_config = get_eval_ds_config(reward_stage, args.frozen.offload_reward_model, dtype_name)
        with model_random_stream(seed):
            reward_model = RewardModel.from_pretrained(reward_path, dtype=dtype, ds_config=reward_config,
                                                       disable_dropout_layers=True,
                                                       trust_remote_code=trust_remote_code)
            reward = bind("reward", create_frozen_engine(reward_model, reward_stage,
                                                         args.frozen.offload_reward_model, dtype_name, unit("reward")))

    if placement is not None and placement.holds("rollout", rank):
        with model_random_stream(seed):
            shadow = load_causal_lm(actor_path, tokenizer, dtype=dtype, disable_dropout_layers=True,
                                    trust_remote_code=trust_remote_code)
            shadow = apply_model_options(shadow, args.actor, flag_prefix="actor_").to(current_device())
        shadow.eval()

    ema = ModelEMA(actor, beta=args.ema.ema_beta, offload=args.actor.offload) \
        if args.ema.enable_ema and actor is not None else None
    critic_desc = "no critic" if not needs_critic else (
        f"critic ZeRO-{args.critic.zero_stage}" + (f" LoRA r={args.critic.lora_dim}" if args.critic.lora_dim else "")
        + ("" if reward_path is not None else " (new value head on the actor's model)"))
    reward_desc = f"reward ZeRO-{reward_stage}" if reward_path is not None else "no reward model"
    logger.info("RLHF engine: actor ZeRO-%d%s, %s, reference ZeRO-%d, %s, %s%s%s",
                args.actor.zero_stage, f" LoRA r={args.actor.lora_dim}" if args.actor.lora_dim else "",
                critic_desc, 3 if args.actor.zero_stage == 3 else 0, reward_desc, dtype_name,
                ", EMA" if ema is not None else "",
                f"; placement {placement.name}: {placement.describe()}" if placement is not None else "")
    return RLHFEngine(actor, reference, critic, reward, tokenizer, ema, placement, groups, shadow)
