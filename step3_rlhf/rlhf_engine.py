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

import logging
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
from utils.errors import UserError

if TYPE_CHECKING:  # settings.py imports ppo_trainer, which imports this module
    from step3_rlhf.settings import Step3Settings

logger = logging.getLogger(__name__)


@dataclass
class RLHFEngine:
    actor: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None  # None when the advantage estimator needs no critic
    reward: torch.nn.Module | None  # None when a reward function alone scores the answers
    tokenizer: PreTrainedTokenizerBase
    actor_ema: ModelEMA | None = None

    def destroy(self) -> None:
        """Release the engines' DeepSpeed state (so a caller can start another step in this process)."""
        for engine in (self.actor, self.reference, self.critic, self.reward):
            destroy = getattr(engine, "destroy", None)
            if destroy is not None:
                destroy()


def check_same_vocabulary(actor_tokenizer: PreTrainedTokenizerBase, critic_tokenizer: PreTrainedTokenizerBase,
                          critic_path: str) -> None:
    """The critic scores the actor's tokens one by one, so both must read token ids the same way."""
    if actor_tokenizer.get_vocab() != critic_tokenizer.get_vocab():
        raise UserError(
            f"the reward/critic model {critic_path} uses a different tokenizer from the actor; train the "
            "reward model (step 2) from the same base model family as the actor"
        )


def build_rlhf_engine(
    args: Step3Settings, tokenizer: PreTrainedTokenizerBase, num_actor_steps: int, num_critic_steps: int
) -> RLHFEngine:
    """Build the engines (and the EMA) from the step-3 settings: the critic (and its optimizer) only if the
    advantage estimator needs one, the reward model only if `--critic_model_name_or_path` names one."""
    dtype = resolve_dtype(args.run.dtype)
    dtype_name, trust_remote_code = args.run.dtype_name, args.run.trust_remote_code
    actor_path, reward_path = args.models.actor_model_name_or_path, args.models.critic_model_name_or_path
    micro_batch = args.loop.per_device_training_batch_size
    if reward_path is not None:
        check_same_vocabulary(tokenizer, load_tokenizer(reward_path, trust_remote_code), reward_path)

    actor_settings = optimization_settings(args.actor, args.schedule, dtype_name, num_actor_steps, micro_batch,
                                           job_name="actor")
    actor_model = load_causal_lm(actor_path, tokenizer, dtype=dtype, ds_config=actor_settings.ds_config(),
                                 disable_dropout_layers=True, trust_remote_code=trust_remote_code)
    actor_model = apply_model_options(actor_model, args.actor, flag_prefix="actor_")
    actor = create_train_engine(actor_model, actor_settings)

    reference = create_reference_engine(actor_path, tokenizer, dtype_name, args.actor.zero_stage,
                                        args.frozen.offload_reference_model, trust_remote_code)

    critic = None
    if get_advantage_estimator(args.ppo.advantage_estimator).needs_critic:
        critic_settings = optimization_settings(args.critic, args.schedule, dtype_name, num_critic_steps, micro_batch,
                                                job_name="critic")
        ds_config = critic_settings.ds_config()
        if reward_path is not None:
            critic_model = RewardModel.from_pretrained(reward_path, dtype=dtype, ds_config=ds_config,
                                                       disable_dropout_layers=True, trust_remote_code=trust_remote_code)
        else:
            critic_model = RewardModel.from_causal_lm(actor_path, tokenizer, dtype=dtype, ds_config=ds_config,
                                                      disable_dropout_layers=True, trust_remote_code=trust_remote_code)
        critic_model = apply_model_options(critic_model, args.critic, trainable_heads=("v_head",),
                                           flag_prefix="critic_")
        critic = create_train_engine(critic_model, critic_settings)

    reward = None
    reward_stage = 3 if args.critic.zero_stage == 3 else 0
    if reward_path is not None:
        reward_config = get_eval_ds_config(reward_stage, args.frozen.offload_reward_model, dtype_name)
        reward_model = RewardModel.from_pretrained(reward_path, dtype=dtype, ds_config=reward_config,
                                                   disable_dropout_layers=True, trust_remote_code=trust_remote_code)
        reward = create_frozen_engine(reward_model, reward_stage, args.frozen.offload_reward_model, dtype_name)

    ema = ModelEMA(actor, beta=args.ema.ema_beta, offload=args.actor.offload) if args.ema.enable_ema else None
    critic_desc = "no critic" if critic is None else (
        f"critic ZeRO-{args.critic.zero_stage}" + (f" LoRA r={args.critic.lora_dim}" if args.critic.lora_dim else "")
        + ("" if reward_path is not None else " (new value head on the actor's model)"))
    reward_desc = f"reward ZeRO-{reward_stage}" if reward is not None else "no reward model"
    logger.info("RLHF engine: actor ZeRO-%d%s, %s, reference ZeRO-%d, %s, %s%s",
                args.actor.zero_stage, f" LoRA r={args.actor.lora_dim}" if args.actor.lora_dim else "",
                critic_desc, reference.zero_optimization_stage(), reward_desc, dtype_name,
                ", EMA" if ema is not None else "")
    return RLHFEngine(actor, reference, critic, reward, tokenizer, ema)
