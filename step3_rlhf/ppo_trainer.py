"""PPO for language models with a small public API: `generate_experience` and `train_rlhf`.

A custom loop needs only these two calls (`train_rlhf(part, text_batch)` adds the pretraining mixture):

    trainer = PPOTrainer(rlhf_engine, generator, PPOConfig(...))
    for prompts in prompt_loader:
        experience = trainer.generate_experience(prompts)
        for _ in range(ppo_epochs):
            for part in experience.split(micro_batch_size):
                stats = trainer.train_rlhf(part)

Layout of an experience: `sequences` [B, P+N] are left-padded prompts followed by right-padded
answers; every per-token tensor ([B, N]) is aligned with the answer tokens, so position j holds the
log-probability / value / reward of answer token j, and `action_mask` is 1 on the generated
tokens, the EOS included (the EOS is an action the policy is rewarded or penalised for).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Mapping

import torch

from step3_rlhf.rlhf_engine import RLHFEngine
from training.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_no_eos_penalty,
    compute_rewards,
    entropy_from_logits,
    get_advantage_estimator,
    get_policy_loss,
    get_value_loss,
    kl_from_logits,
    masked_mean,
)
from training.core.sequences import answer_logits, token_logprobs
from training.generation.generator import GenerationConfig, Generator, eval_mode
from training.reliability.guards import check_finite
from utils.dist import sum_over_ranks
from utils.errors import UserError


@dataclass
class PPOConfig:
    """Every constant of the PPO update; each field is a step-3 flag (see its metadata and `training.core.args`)."""

    max_answer_seq_len: int = field(default=128, metadata={"help": "maximum generated tokens per answer"})
    kl_ctl: float = field(default=0.1, metadata={"help": "KL penalty coefficient (initial value if adaptive)"})
    target_kl: float | None = field(default=None, metadata={
        "help": "make the KL coefficient adaptive, steering the per-answer KL toward this value"})
    kl_horizon: float = field(default=10000.0, metadata={"help": "adaptation horizon (samples) of the adaptive KL"})
    clip_reward_value: float = field(default=5.0, metadata={"help": "clip reward-model scores to +-this"})
    cliprange: float = field(default=0.2, metadata={"help": "PPO ratio clip range of the actor"})
    cliprange_value: float = field(default=0.2, metadata={"help": "value clip range of the critic"})
    gamma: float = field(default=1.0, metadata={"help": "discount factor"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda"})
    whiten_advantages: bool = field(default=True, metadata={
        "flag": "disable_advantage_whitening", "negated": True, "help": "use raw advantages"})
    no_eos_penalty: float = field(default=0.0, metadata={
        "help": "subtract this from the score of answers cut off before emitting EOS"})
    # rollouts are drawn at it, and every log-prob (old, new, reference) is taken at it; step 3's --temperature
    temperature: float = field(default=1.0, metadata={"flag": None})
    unsup_coef: float = field(default=27.8, metadata={
        "help": "weight of the pretraining LM loss added to the actor's PPO loss (PPO-ptx)"})
    advantage_estimator: str = field(default="gae", metadata={
        "help": "advantage estimator (training.algorithms registry); one that needs no critic trains none"})
    policy_loss: str = field(default="ppo", metadata={"help": "actor loss (training.algorithms registry)"})
    value_loss: str = field(default="clipped", metadata={
        "help": "critic loss (training.algorithms registry); unused without a critic"})


@dataclass
class Experience:
    """One rollout batch with everything the PPO update needs (see the module docstring for the layout)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor | None  # None without a critic
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor  # [B] reward-model score (after the no-EOS penalty, before clipping)
    kl: torch.Tensor  # [B] summed log-ratio to the reference over each answer (a KL estimate if sampled)
    ended_with_eos: torch.Tensor  # [B] bool
    exact_kl: torch.Tensor | None = None  # [B] sum over the answer of KL(actor || reference) per state (evaluation)
    group_index: torch.Tensor | None = None  # [B] long: rows answering the same prompt share it (group baselines)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def split(self, micro_batch_size: int) -> list["Experience"]:
        """Consecutive row slices of at most `micro_batch_size` rows."""
        parts = []
        for start in range(0, self.batch_size, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            parts.append(Experience(**{
                f.name: value if not isinstance(value := getattr(self, f.name), torch.Tensor) else value[rows]
                for f in fields(self)
            }))
        return parts


def update_kl_controller(controller: AdaptiveKLController | FixedKLController, kl: torch.Tensor) -> None:
    """One update from the global batch: the mean per-answer KL over every rank's answers, with the
    global answer count as the step count, so every rank holds the same coefficient (collective)."""
    total, count = sum_over_ranks([kl.sum().item(), kl.numel()])
    controller.update(total / max(count, 1.0), int(count))


def _answer_values(critic: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_length: int) -> torch.Tensor:
    """The critic's value of the state before each answer token: [B, N] (read at the preceding position)."""
    values = critic(input_ids=sequences, attention_mask=attention_mask)["values"]
    return values[:, prompt_length - 1:-1].float()


class PPOTrainer:
    """Rollouts and PPO updates for the actor (and the critic, when the advantage estimator needs one)
    of an `RLHFEngine`; the estimator and losses are looked up by name in `training.algorithms`."""

    def __init__(self, engine: RLHFEngine, generator: Generator, config: PPOConfig):
        self.engine = engine
        self.generator = generator
        self.config = config
        self.advantage_estimator = get_advantage_estimator(config.advantage_estimator)
        self.policy_loss = get_policy_loss(config.policy_loss)
        self.value_loss = get_value_loss(config.value_loss)
        if self.advantage_estimator.needs_critic != (engine.critic is not None):
            raise UserError(
                f"advantage estimator {config.advantage_estimator!r} "
                f"{'needs a critic' if self.advantage_estimator.needs_critic else 'trains no critic'}, but the engine "
                f"{'has none' if engine.critic is None else 'has one'}; build the engine for the same estimator"
            )
        tokenizer = engine.tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.kl_controller = (
            AdaptiveKLController(config.kl_ctl, config.target_kl, config.kl_horizon)
            if config.target_kl is not None else FixedKLController(config.kl_ctl)
        )

    def generation_config(self, do_sample: bool = True) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.config.max_answer_seq_len,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            do_sample=do_sample,
            temperature=self.config.temperature,
        )

    # rollouts -----------------------------------------------------------------------------------

    def generate_experience(self, prompt_batch: Mapping[str, torch.Tensor]) -> Experience:
        """Sample answers to a left-padded prompt batch and score them: log-probs of actor and reference,
        critic values (with a critic), reward-model scores, per-token rewards, advantages and returns
        (a `group_index` entry of the batch, [B], rows answering the same prompt sharing it, is passed to
        the estimator and kept). The adaptive KL coefficient then moves toward its target, from every
        rank's answers together (collective).

        Everything after generation runs in eval mode (dropout is off anyway), so the old log-probs
        and values are exactly what the first PPO epoch's train-mode forward starts from.
        """
        experience = self._rollout(prompt_batch, do_sample=True)
        update_kl_controller(self.kl_controller, experience.kl)
        return experience

    def evaluate_prompts(self, prompt_batch: Mapping[str, torch.Tensor]) -> Experience:
        """Greedy answers to a prompt batch, scored like a rollout; changes no training state.

        Greedy tokens are not samples of the actor, so their summed log-ratio (`kl`) estimates no KL;
        `exact_kl` is the real one along each answer: at every answer position, the KL between the
        actor's and the reference's full next-token distributions, summed over the answer.
        """
        return self._rollout(prompt_batch, do_sample=False, with_exact_kl=True)

    @torch.no_grad()
    def _rollout(self, prompt_batch: Mapping[str, torch.Tensor], do_sample: bool,
                 with_exact_kl: bool = False) -> Experience:
        engine, config = self.engine, self.config
        device = engine.actor.device
        input_ids = prompt_batch["input_ids"].to(device)
        prompt_mask = prompt_batch["attention_mask"].to(device)
        started = time.perf_counter()
        output = self.generator.generate(input_ids, prompt_mask, self.generation_config(do_sample))
        generated = time.perf_counter()
        # clones: a backend may return inference-mode tensors, which autograd refuses to train on
        sequences, attention_mask = output.sequences.clone(), output.attention_mask.clone()
        prompt_length = output.prompt_length
        action_mask = output.answer_mask.clone().to(device)
        answers = sequences[:, prompt_length:]
        group_index = prompt_batch.get("group_index")
        if group_index is not None:
            group_index = group_index.to(device)
        critic = engine.critic
        with eval_mode(engine.actor.module), eval_mode(critic.module) if critic is not None else nullcontext():
            logits = answer_logits(engine.actor, sequences, attention_mask, prompt_length)
            old_logprobs = token_logprobs(logits, answers, config.temperature)
            actor_logits = logits if with_exact_kl else None
            del logits
            ref_logits = answer_logits(engine.reference, sequences, attention_mask, prompt_length)
            ref_logprobs = token_logprobs(ref_logits, answers, config.temperature)
            exact_kl = (kl_from_logits(actor_logits, ref_logits, action_mask, config.temperature)
                        if with_exact_kl else None)
            del ref_logits, actor_logits
            old_values = (_answer_values(critic, sequences, attention_mask, prompt_length)
                          if critic is not None else None)
            scores = engine.reward(input_ids=sequences, attention_mask=attention_mask)["end_scores"].float()
        ended_with_eos = ((answers == self.eos_token_id) & action_mask.bool()).any(-1)
        if config.no_eos_penalty:
            scores = apply_no_eos_penalty(scores, ended_with_eos, config.no_eos_penalty)
        rewards, kl = compute_rewards(scores, old_logprobs, ref_logprobs, action_mask, self.kl_controller.value,
                                      config.clip_reward_value)
        advantages, returns = self.advantage_estimator(rewards, action_mask, old_values, group_index, config)
        scored = time.perf_counter()
        self.last_timing = {"generation_s": generated - started, "scoring_s": scored - generated,
                            "generated_tokens": float(action_mask.sum().item())}
        return Experience(sequences, attention_mask, prompt_length, action_mask, old_logprobs, ref_logprobs,
                          old_values, rewards, advantages, returns, scores, kl, ended_with_eos, exact_kl, group_index)

    # updates ------------------------------------------------------------------------------------

    def train_rlhf(self, experience: Experience,
                   unsupervised_batch: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One PPO update on `experience` of the actor (the policy loss) and, if there is one, the critic
        (the value loss).

        With `unsupervised_batch` (pretraining text: the PPO-ptx mixture), the actor minimises InstructGPT's
        single objective, policy loss + unsup_coef * language-model loss, in one backward and ONE optimizer
        step: separate steps would let Adam normalise the coefficient away. Both forward graphs are alive
        until that backward.
        """
        engine, config = self.engine, self.config
        actor, critic = engine.actor, engine.critic
        mask = experience.action_mask
        prompt_length = experience.prompt_length
        step = actor.global_steps + 1

        logits = answer_logits(actor, experience.sequences, experience.attention_mask, prompt_length)
        logprobs = token_logprobs(logits, experience.sequences[:, prompt_length:], config.temperature)
        policy = self.policy_loss(logprobs, experience.old_logprobs, experience.advantages, mask, config)
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach() / config.temperature, mask)
        del logits
        check_finite("actor loss", policy.loss, step)
        objective, mixture_stats = policy.loss, {}
        if unsupervised_batch is not None:
            lm_loss = self._language_model_loss(unsupervised_batch)
            check_finite("unsupervised loss", lm_loss, step)
            objective = objective + config.unsup_coef * lm_loss
            mixture_stats["unsup_loss"] = lm_loss.item()
        self._step_actor(objective)
        stats = {"actor_loss": policy.loss.item(), "clip_fraction": policy.clip_fraction.item(),
                 "approx_kl": policy.approx_kl.item(), "entropy": entropy.item(), **mixture_stats}
        if critic is None:
            return stats

        values = _answer_values(critic, experience.sequences, experience.attention_mask, prompt_length)
        value = self.value_loss(values, experience.old_values, experience.returns, mask, config)
        check_finite("critic loss", value.loss, step)
        critic.backward(value.loss)
        critic.step()
        return {**stats, "critic_loss": value.loss.item(), "value_clip_fraction": value.clip_fraction.item()}

    def _language_model_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The actor's next-token loss on pretraining text (the term that keeps its general language ability)."""
        actor = self.engine.actor
        batch = {key: value.to(actor.device) for key, value in batch.items()}
        return actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"], use_cache=False).loss

    def _step_actor(self, loss: torch.Tensor) -> None:
        """Backward and (micro-)step the actor; the EMA follows every optimizer step actually taken."""
        actor = self.engine.actor
        steps_before = actor.global_steps
        actor.backward(loss)
        actor.step()
        if self.engine.actor_ema is not None and actor.global_steps > steps_before:
            self.engine.actor_ema.update(actor)

    # checkpoint state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a resumed run needs besides the engines: the KL coefficient (and the EMA weights)."""
        state = {"kl_controller": self.kl_controller.state_dict()}
        if self.engine.actor_ema is not None:
            state["actor_ema"] = self.engine.actor_ema.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.engine.actor_ema is not None:
            self.engine.actor_ema.load_state_dict(state["actor_ema"])


def experience_stats(experience: Experience) -> dict[str, float]:
    """Rollout metrics of one experience batch (this rank's rows)."""
    mask = experience.action_mask.float()
    lengths = mask.sum(-1)
    stats = {
        "reward/score_mean": experience.scores.mean().item(),
        "reward/score_std": experience.scores.std(unbiased=False).item(),
        "reward/kl": experience.kl.mean().item(),
        "reward/total_mean": (experience.rewards * mask).sum(-1).mean().item(),
        "rollout/response_length": lengths.mean().item(),
        "rollout/eos_fraction": experience.ended_with_eos.float().mean().item(),
    }
    if experience.old_values is not None:
        stats["rollout/value_mean"] = masked_mean(experience.old_values, experience.action_mask).item()
    return stats
