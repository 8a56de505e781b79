"""PPO for language models with a small public API: `generate_experience` and `train_rlhf`.

A custom loop needs only these two calls (`train_rlhf(part, text_batch)` adds the pretraining mixture):

    trainer = PPOTrainer(rlhf_engine, generator, PPOConfig(...))
    for prompts in prompt_loader:
        experience = trainer.generate_experience(prompts)
        for _ in range(ppo_epochs):
            for part in experience.split(micro_batch_size):
                stats = trainer.train_rlhf(part)

As written, every micro-batch's token mean weighs alike (`micro_batch_token_mean`); step 3's loop passes
each one's `loss_weights` to `train_rlhf` so that an optimizer step takes the mean over all its tokens.

Layout of an experience: `sequences` [B, P+N] are left-padded prompts followed by right-padded
answers; every per-token tensor ([B, N]) is aligned with the answer tokens, so position j holds the
log-probability / value / reward of answer token j, and `action_mask` is 1 on the generated
tokens, the stop token that ended the answer included (ending the answer is an action the policy is rewarded or
penalised for). The stop tokens are those that end the actor's turn (`PromptFormatter.stop_token_ids`): its EOS,
and the chat template's end-of-turn token where that is another (Gemma's <end_of_turn>); and the other ids the
actor's generation config stops at (Qwen2.5-Instruct's <|endoftext|>).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, Sequence

import torch

from step3_rlhf.rlhf_engine import RLHFEngine
from step3_rlhf.scoring import RewardScorer, Scores, trained_end_id
from step3_rlhf.stage_fusion import StageFusion
from training.algorithms import (
    KL_ESTIMATORS,
    LOSS_ESTIMATOR,
    NO_GRADIENT_AS_LOSS,
    RL_ALGORITHMS,
    AdaptiveKLController,
    AdvantageEstimator,
    AdvantageInputs,
    FixedKLController,
    answer_mean_mask,
    compute_rewards,
    get_advantage_estimator,
    get_policy_loss,
    get_rl_algorithm,
    get_value_loss,
    kl_from_logits,
    kl_loss,
    masked_mean,
    sequence_rewards,
    whiten,
)
from training.core.answer_window import AnswerWindow, RowGroups
from training.core.model_loading import answer_stop_ids
from training.generation.generator import (
    FinishedRowsHook,
    GenerationConfig,
    GenerationOutput,
    Generator,
    eval_mode,
    is_stop_token,
    repeat_per_prompt,
)
from training.loops.accumulation import accumulation_weights
from training.loops.call_times import CallTimer
from training.reliability.guards import check_finite, step_engine
from utils.dist import current_device, sum_over_ranks
from training.rewards import RewardFunction
from utils.data.formatting import PromptFormatter
from utils.errors import UserError

logger = logging.getLogger(__name__)

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "micro_batch_token_mean")


@dataclass
class PPOConfig:
    """Every constant of the PPO update; each field is a step-3 flag (see its metadata and `training.core.args`)."""

    max_answer_seq_len: int = field(default=128, metadata={"help": "maximum generated tokens per answer"})
    kl_ctl: float = field(default=0.1, metadata={"help": "KL penalty coefficient (initial value if adaptive)"})
    target_kl: float | None = field(default=None, metadata={
        "help": "make the KL coefficient adaptive, steering the per-answer KL toward this value"})
    kl_horizon: float = field(default=10000.0, metadata={"help": "adaptation horizon (samples) of the adaptive KL"})
    clip_reward_value: float = field(default=5.0, metadata={
        "help": "clip the reward model's scores to +-this (--reward_fn_coef x --reward_fn is added after, unclipped)"})
    cliprange: float = field(default=0.2, metadata={"help": "PPO ratio clip range of the actor"})
    cliprange_value: float = field(default=0.2, metadata={"help": "value clip range of the critic"})
    gamma: float = field(default=1.0, metadata={"help": "discount factor"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda"})
    whiten_advantages: bool = field(default=True, metadata={
        "flag": "disable_advantage_whitening", "negated": True,
        "help": "use raw advantages (gae's and reinforce_pp's are otherwise whitened over the generation batch of "
                "every rank)"})
    no_eos_penalty: float = field(default=0.0, metadata={
        "help": "subtract this from the reward of answers cut off before emitting EOS or the chat template's "
                "end-of-turn token (after the reward model score's clip to +-clip_reward_value)"})
    # rollouts are drawn at it, and every log-prob (old, new, reference) is taken at it; step 3's --temperature
    temperature: float = field(default=1.0, metadata={"flag": None})
    unsup_coef: float = field(default=0.05, metadata={
        "help": "weight of the pretraining LM loss added to the actor's PPO loss, in one objective and one optimizer "
                "step (PPO-ptx; OpenRLHF's 0.05: DeepSpeed-Chat's 27.8 belongs to a step of its own, where Adam "
                "cancels the scale, and here would make the language-model gradient ~26x the policy's)"})
    algorithm: str = field(default="ppo", metadata={
        "choices": tuple(RL_ALGORITHMS.names()),
        "help": "the RL algorithm: its advantage estimator and the defaults of --n_samples_per_prompt, --kl_in_loss "
                "and --kl_estimator (see training/algorithms/rl.py)"})
    n_samples_per_prompt: int | None = field(default=None, metadata={
        "help": "answers sampled per prompt, sharing the prompt's prefill (default: the algorithm's; grpo/rloo 4)"})
    kl_in_loss: bool | None = field(default=None, metadata={
        "help": "add kl_ctl * KL(actor || reference) to the actor's loss instead of penalising it in the reward "
                "(default: the algorithm's; on for grpo)"})
    kl_estimator: str | None = field(default=None, metadata={
        "choices": tuple(KL_ESTIMATORS.names()),
        "help": "per-token KL estimator, in the reward or the loss (default: the algorithm's, k3 for grpo, else k1 "
                "in the reward and k2 in the loss; k1 is refused in the loss: its gradient is zero in expectation)"})
    group_std_eps: float = field(default=1e-6, metadata={
        "help": "grpo: added to the group's reward std before dividing"})
    advantage_estimator: str | None = field(default=None, metadata={
        "help": "override the algorithm's advantage estimator (training.algorithms registry); one that needs no critic "
                "trains none"})
    policy_loss: str = field(default="ppo", metadata={"help": "actor loss (training.algorithms registry)"})
    value_loss: str = field(default="clipped", metadata={
        "help": "critic loss (training.algorithms registry); unused without a critic"})
    loss_agg_mode: str = field(default="token_mean", metadata={
        "choices": LOSS_AGG_MODES,
        "help": "how an optimizer step averages the actor's and critic's per-token losses: token_mean, over all its "
                "answer tokens on every rank and accumulated micro-batch (verl's); seq_mean_token_mean, each "
                "answer's token mean, then the mean over all the step's answers alike (the GRPO paper's: a token "
                "of a short answer weighs more); micro_batch_token_mean, each micro-batch's token mean alike "
                "(DeepSpeed-Chat's: a token of a micro-batch of short answers weighs more)"})
    recompute_old_logprobs: bool = field(default=False, metadata={
        "help": "always take the old log-probs from a forward of the actor after generation, even when the "
                "generator's own log-probs are at parity with the training forward (fp32) and are reused"})

    # the settings that default to None on the command line, filled from `--algorithm`'s `RLAlgorithm`
    ALGORITHM_DEFAULTS: ClassVar[tuple[str, ...]] = (
        "advantage_estimator", "n_samples_per_prompt", "kl_in_loss", "kl_estimator")

    def __post_init__(self) -> None:
        """Fill the settings left unset from `--algorithm` (an unknown name fails here, naming the choices), and
        refuse k1 asked for in the loss: its gradient there is zero in expectation (`training.algorithms.kl`)."""
        for name, value in self.algorithm_defaults().items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.kl_in_loss and self.kl_estimator in NO_GRADIENT_AS_LOSS:
            raise UserError(f"--kl_in_loss with --kl_estimator {self.kl_estimator}: as a loss, its gradient is "
                            f"zero in expectation over the actor's samples, so it would not hold the actor near "
                            f"the reference; use {LOSS_ESTIMATOR} (the gradient of KL(actor || reference)) or "
                            f"k3 (GRPO's), or keep the KL in the reward")

    def algorithm_defaults(self) -> dict[str, Any]:
        """The value each of `ALGORITHM_DEFAULTS` takes when left unset: `--algorithm`'s, except that the KL moved
        into the loss (`--kl_in_loss`, as set) of an algorithm that estimates it with k1 in the reward takes
        `LOSS_ESTIMATOR` instead."""
        algorithm = get_rl_algorithm(self.algorithm)
        defaults = {name: getattr(algorithm, name) for name in self.ALGORITHM_DEFAULTS}
        kl_in_loss = defaults["kl_in_loss"] if self.kl_in_loss is None else self.kl_in_loss
        if kl_in_loss and defaults["kl_estimator"] in NO_GRADIENT_AS_LOSS:
            defaults["kl_estimator"] = LOSS_ESTIMATOR
        return defaults


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
    scores: torch.Tensor  # [B] reward model + any --reward_fn, before the model score's clip and the no-EOS penalty
    kl: torch.Tensor  # [B] summed log-ratio to the reference over each answer (a KL estimate if sampled)
    ended_with_eos: torch.Tensor  # [B] bool: the answer ended at a stop token (not cut off)
    exact_kl: torch.Tensor | None = None  # [B] sum over the answer of KL(actor || reference) per state (evaluation)
    group_index: torch.Tensor | None = None  # [B] long: rows answering the same prompt share it (group baselines)
    reward_fn_scores: torch.Tensor | None = None  # [B] the reward function's value (with --reward_fn)
    reward_clipped: torch.Tensor | None = None  # [B] bool: --clip_reward_value clipped the reward model's score

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


@dataclass
class Answers:
    """Generated rows: left-padded prompts followed by right-padded answers, and the answers' mask."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    action_mask: torch.Tensor

    @classmethod
    def of(cls, output: GenerationOutput, device: torch.device) -> "Answers":
        return cls(output.sequences, output.attention_mask, output.prompt_length, output.answer_mask.to(device))

    def ended_with_eos(self, stop_token_ids: Sequence[int]) -> torch.Tensor:
        """[B] bool: whether each answer ended at one of `stop_token_ids` (the EOS, an end-of-turn token) rather
        than being cut off at the length limit."""
        return (is_stop_token(self.sequences[:, self.prompt_length:], stop_token_ids) & self.action_mask.bool()).any(-1)


@dataclass
class Rollout(Answers):
    """One prompt batch's answers before any scoring: what the scoring models read (see `PPOTrainer`)."""

    group_index: torch.Tensor | None  # [B] rows answering the same prompt share it
    row_metadata: list | None  # one entry per row (the prompt's)
    samples_per_prompt: int
    do_sample: bool
    generation_s: float
    greedy: Answers | None = None  # ReMax: one greedy answer per prompt, its baseline
    prompt_metadata: list | None = None  # one entry per prompt
    logprobs: torch.Tensor | None = None  # [B, N] the generator's, when at parity with the training forward


def kl_in_groups(actor_logits: list[torch.Tensor], ref_logits: list[torch.Tensor], groups: RowGroups,
                 temperature: float, tokenizer_size: int | None) -> torch.Tensor:
    """The exact KL per answer [B] over the tokenizer's ids from both models' window logits of the same `groups`."""
    return groups.merge([kl_from_logits(actor, ref, window.answer_mask(), temperature,
                                        tokenizer_size=tokenizer_size)
                         for actor, ref, window in zip(actor_logits, ref_logits, groups.windows, strict=True)])


@dataclass
class GroupedLogits:
    """One model's window logits of a rollout's rows, one [b_g, W_g, V] tensor per `RowGroups` group, with each
    group's row indices: two ranks may group the same rows differently (where a ZeRO-3 forward runs, its ranks
    agree on a group count; elsewhere each rank takes its rows' best one)."""

    rows: list[torch.Tensor]
    logits: list[torch.Tensor]

    def groups(self, answers: Answers) -> RowGroups:
        """The groups (and their windows) these logits were computed on."""
        return RowGroups(self.rows, [AnswerWindow.of(answers.sequences[rows], answers.attention_mask[rows],
                                                     answers.prompt_length) for rows in self.rows],
                         answers.sequences)

    def grouped_like(self, other: "GroupedLogits") -> bool:
        return len(self.rows) == len(other.rows) and all(
            torch.equal(mine, theirs.to(mine.device)) for mine, theirs in zip(self.rows, other.rows))

    def answer_logits(self, answers: Answers) -> list[torch.Tensor]:
        """Each row's logits predicting its answer tokens [n_i, V], in the rollout's row order (a row's answer
        takes the last n_i columns of its group's window)."""
        lengths = answers.attention_mask[:, answers.prompt_length:].sum(-1).tolist()
        per_row = {}
        for rows, logits in zip(self.rows, self.logits, strict=True):
            for index, row in enumerate(rows.tolist()):
                per_row[row] = logits[index, logits.shape[1] - lengths[row]:]
        return [per_row[row] for row in range(len(lengths))]

    def exact_kl(self, reference: "GroupedLogits", answers: Answers, temperature: float,
                 tokenizer_size: int | None) -> torch.Tensor:
        """KL(this model || `reference`) per answer [B] over the tokenizer's ids: in the shared groups' windows where
        both grouped the rows alike (the co-located arithmetic), otherwise row by row on each row's answer logits."""
        if self.grouped_like(reference):
            return kl_in_groups(self.logits, reference.logits, self.groups(answers), temperature, tokenizer_size)
        return torch.cat([kl_from_logits(mine[None], theirs[None], torch.ones(1, len(mine), device=mine.device),
                                         temperature, tokenizer_size=tokenizer_size)
                          for mine, theirs in zip(self.answer_logits(answers), reference.answer_logits(answers))])


def reward_clipped(scores: Scores, clip_reward_value: float) -> torch.Tensor | None:
    """[B] bool: whether each answer's reward-model score lay beyond +-`clip_reward_value`, so the clip changed it
    (None without a reward model: nothing is clipped)."""
    return None if scores.model is None else scores.model.abs() > clip_reward_value


def row_metadata(prompt_batch: Mapping[str, Any], samples: int) -> list | None:
    """One metadata entry per answer row (the prompt's), prompt-major; None when the batch carries none."""
    metadata = prompt_batch.get("metadata")
    return [entry for entry in metadata for _ in range(samples)] if metadata is not None else None


def update_kl_controller(controller: AdaptiveKLController | FixedKLController, kl: torch.Tensor) -> None:
    """One update from the global batch: the mean per-answer KL over every rank's answers, with the
    global answer count as the step count, so every rank holds the same coefficient (collective)."""
    total, count = sum_over_ranks([kl.sum().item(), kl.numel()])
    controller.update(total / max(count, 1.0), int(count))


def check_samples_per_prompt(estimator: AdvantageEstimator, samples_per_prompt: int) -> None:
    """An estimator that compares answers to one prompt needs at least `min_group_size` of them."""
    if samples_per_prompt < estimator.min_group_size:
        raise UserError(
            f"advantage estimator {estimator.name!r} compares answers to the same prompt and needs "
            f"--n_samples_per_prompt of at least {estimator.min_group_size}, got {samples_per_prompt}"
        )


TOKEN_MEAN_STATS = {"actor": ("actor_loss", "clip_fraction", "approx_kl", "entropy", "kl_loss"),
                    "critic": ("critic_loss", "value_clip_fraction")}


def weighted_stats(stats: Mapping[str, float], actor_weight: float, critic_weight: float) -> dict[str, float]:
    """A micro-batch's statistics with the token means of each model multiplied by the weight its loss took
    (`PPOTrainer.loss_weights`), so that their mean over an optimizer step's micro-batches on all ranks is the
    step's mean over its tokens, the quantity it minimised. The pretraining loss, its own batch's mean, stays."""
    weights = {key: weight for role, weight in (("actor", actor_weight), ("critic", critic_weight))
               for key in TOKEN_MEAN_STATS[role]}
    return {key: value * weights.get(key, 1.0) for key, value in stats.items()}


class PPOTrainer:
    """Rollouts and clipped policy-gradient updates for the actor (and the critic, when the advantage
    estimator needs one) of an `RLHFEngine`, for every `--algorithm`: the estimator and the losses are
    looked up by name in `training.algorithms`.

    Answers are scored by the engine's reward model, the `reward_fn`, or both (`RewardScorer`). An answer ends at
    any of the tokens that end the actor's turn under `prompt_format` (`PromptFormatter.stop_token_ids`; step 3
    passes its data's --prompt_format, under which the actor was tuned), and at any other of `actor_stop_token_ids`,
    the ids the actor's generation config stops at (as transformers' `generate` and the chatbot stop there; step 3
    passes them: `folder_stop_ids`).

    Every scoring and training forward runs on rows grouped by length and laid flush right (`RowGroups`): little
    padding, the LM head only where answer tokens are predicted. The old log-probs are the generator's own when
    they are at parity with the training forward (`Generator.logprobs_match_training`: fp32), and a forward of
    the actor otherwise. `clock` holds the seconds of each phase (generation, each scoring call, each update)."""

    # the phases `clock` times: generation, each model's scoring forward, each model's update
    PHASES: ClassVar[tuple[str, ...]] = ("generation", "score_actor", "score_reference", "score_critic",
                                         "score_reward", "train_actor", "train_critic")

    def __init__(self, engine: RLHFEngine, generator: Generator, config: PPOConfig,
                 reward_fn: RewardFunction | None = None, reward_fn_coef: float = 1.0,
                 stage_fusion_micro_batch_size: int = 0, prompt_format: str = "auto",
                 actor_stop_token_ids: Sequence[int] = ()):
        self.engine = engine
        # > 0: finished answers are scored in micro-batches of this many rows while generation goes on
        self.stage_fusion_micro_batch_size = stage_fusion_micro_batch_size
        self.generator = generator
        self.config = config
        self.advantage_estimator = get_advantage_estimator(config.advantage_estimator)
        self.policy_loss = get_policy_loss(config.policy_loss)
        self.value_loss = get_value_loss(config.value_loss)
        if self.advantage_estimator.needs_critic != engine.has_critic:
            raise UserError(
                f"advantage estimator {config.advantage_estimator!r} "
                f"{'needs a critic' if self.advantage_estimator.needs_critic else 'trains no critic'}, but the engine "
                f"{'has one' if engine.has_critic else 'has none'}; build the engine for the same estimator"
            )
        check_samples_per_prompt(self.advantage_estimator, config.n_samples_per_prompt)
        tokenizer = engine.tokenizer
        formatter = PromptFormatter(tokenizer, prompt_format)
        self.stop_token_ids = answer_stop_ids(formatter.stop_token_ids, actor_stop_token_ids)
        # None on a rank of a placement that scores no answers
        self.scorer = RewardScorer(engine.reward, reward_fn, reward_fn_coef, tokenizer, self.stop_token_ids,
                                   trained_end_id(formatter)) \
            if engine.reward is not None or reward_fn is not None else None
        self.pad_token_id = tokenizer.pad_token_id
        self.tokenizer_size = len(tokenizer)
        self.kl_controller = (
            AdaptiveKLController(config.kl_ctl, config.target_kl, config.kl_horizon)
            if config.target_kl is not None else FixedKLController(config.kl_ctl)
        )
        self.clock = CallTimer()
        # a generator that does not say its log-probs are at parity gets them recomputed
        self.reuse_rollout_logprobs = (generator is not None and not config.recompute_old_logprobs
                                       and getattr(generator, "logprobs_match_training", False))
        if generator is not None:
            logger.info("old log-probs: %s", "the generator's own (at parity with the training forward in fp32)"
                        if self.reuse_rollout_logprobs else
                        "recomputed by a forward of the actor" + (" (--recompute_old_logprobs)"
                                                                   if config.recompute_old_logprobs else
                                                                   " (the generator's are not at fp32 parity)"))

    def generation_config(self, do_sample: bool = True, num_return_sequences: int = 1) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.config.max_answer_seq_len,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            do_sample=do_sample,
            temperature=self.config.temperature,
            num_return_sequences=num_return_sequences,
            tokenizer_size=self.tokenizer_size,
        )

    # rollouts -----------------------------------------------------------------------------------

    def generate_experience(self, prompt_batch: Mapping[str, Any]) -> Experience:
        """Sample `n_samples_per_prompt` answers to each prompt of a left-padded prompt batch (one prefill per
        prompt) and score them: log-probs of actor and reference, critic values (with a critic), scores,
        per-token rewards, advantages and returns. Rows are prompt-major and carry a `group_index` (the
        prompt's row in the batch; with one answer per prompt, the batch's own `group_index` entry if it has
        one). The adaptive KL coefficient then moves toward its target, from every rank's answers together
        (collective).

        Everything after generation runs in eval mode (dropout is off anyway), so the old log-probs
        and values are exactly what the first PPO epoch's train-mode forward starts from.
        """
        experience = self._rollout(prompt_batch, do_sample=True)
        self.whiten_advantages([experience], over_ranks=True)
        update_kl_controller(self.kl_controller, experience.kl)
        return experience

    def whiten_advantages(self, experiences: Sequence[Experience], over_ranks: bool) -> None:
        """Whiten the advantages of one generation batch's `experiences` together, over all their answer tokens and,
        with `over_ranks` (collective), every rank's, where the estimator's are whitened
        (`AdvantageEstimator.whitened`) and --disable_advantage_whitening is off."""
        if not (self.advantage_estimator.whitened and self.config.whiten_advantages):
            return
        whitened = whiten([experience.advantages for experience in experiences],
                          [experience.action_mask for experience in experiences], over_ranks)
        for experience, advantages in zip(experiences, whitened):
            experience.advantages = advantages

    def evaluate_prompts(self, prompt_batch: Mapping[str, Any]) -> Experience:
        """Greedy answers to a prompt batch (one each), scored like a rollout, with no advantages (zeros);
        changes no training state.

        Greedy tokens are not samples of the actor, so their summed log-ratio (`kl`) estimates no KL;
        `exact_kl` is the real one along each answer: at every answer position, the KL between the
        actor's and the reference's full next-token distributions, summed over the answer.
        """
        return self._rollout(prompt_batch, do_sample=False, with_exact_kl=True)

    def generate_rollout(self, prompt_batch: Mapping[str, Any], do_sample: bool,
                         on_finished: FinishedRowsHook | None = None) -> Rollout:
        """Answer a left-padded prompt batch (`n_samples_per_prompt` samples each, or one greedy answer), plus
        ReMax's greedy answers for its baseline when sampling for it. `on_finished` receives the answers' rows as
        they end (stage fusion; the generator must stream them)."""
        device = self.engine_device
        input_ids = prompt_batch["input_ids"].to(device)
        prompt_mask = prompt_batch["attention_mask"].to(device)
        samples = self.samples_per_prompt(do_sample)
        streaming = {"on_finished": on_finished} if on_finished is not None else {}
        started = time.perf_counter()
        # one generate mode for both calls (the hybrid engine's): ReMax's greedy answers reuse the gathered weights
        one_gather = getattr(self.generator, "generate_mode", contextlib.nullcontext)
        with self.clock.time("generation"), one_gather():
            output = self.generator.generate(input_ids, prompt_mask, self.generation_config(do_sample, samples),
                                             **streaming)
            greedy = None
            if do_sample and self.advantage_estimator.needs_greedy_baseline:
                greedy = self.generator.generate(input_ids, prompt_mask, self.generation_config(do_sample=False))
        generation_s = time.perf_counter() - started
        group_index = prompt_batch.get("group_index")
        if samples > 1:
            group_index = repeat_per_prompt(torch.arange(input_ids.shape[0]), samples)
        metadata = prompt_batch.get("metadata")
        # clones: a backend may return inference-mode tensors, which autograd refuses to train on
        return Rollout(output.sequences.clone(), output.attention_mask.clone(), output.prompt_length,
                       output.answer_mask.clone().to(device),
                       group_index.to(device) if group_index is not None else None,
                       row_metadata(prompt_batch, samples), samples, do_sample, generation_s,
                       Answers.of(greedy, device) if greedy is not None else None,
                       list(metadata) if metadata is not None else None,
                       output.logprobs.clone().to(device) if do_sample and self.reuse_rollout_logprobs else None)

    def samples_per_prompt(self, do_sample: bool) -> int:
        return self.config.n_samples_per_prompt if do_sample else 1

    def fuses_stages(self) -> bool:
        """Whether rollouts are scored while they generate (`step3_rlhf.stage_fusion`)."""
        return self.stage_fusion_micro_batch_size > 0 and getattr(self.generator, "streams_finished_rows", False)

    def rollout_and_scores(self, prompt_batch: Mapping[str, Any], do_sample: bool, roles: Sequence[str],
                           with_exact_kl: bool = False) -> tuple[Rollout, dict[str, Any]]:
        """`generate_rollout` and `score_rollout` of `roles`; with stage fusion, the answers are scored in
        micro-batches as they finish, and only ReMax's baseline waits for the whole batch."""
        if not self.fuses_stages():
            rollout = self.generate_rollout(prompt_batch, do_sample)
            return rollout, self.score_rollout(rollout, roles, with_exact_kl)
        fusion = StageFusion(self.stage_fusion_micro_batch_size,
                             lambda rows, output: self.score_rollout(
                                 self.rows_rollout(prompt_batch, do_sample, rows, output), roles, with_exact_kl),
                             self.pad_token_id)
        rollout = self.generate_rollout(prompt_batch, do_sample, on_finished=fusion)
        parts = fusion.results(*rollout.action_mask.shape)
        if "reward" in roles and rollout.greedy is not None:
            parts["baseline"] = self.baseline_scores(rollout)
        return rollout, parts

    def rows_rollout(self, prompt_batch: Mapping[str, Any], do_sample: bool, rows: torch.Tensor,
                     output: GenerationOutput) -> Rollout:
        """The rollout of some finished rows of `prompt_batch`'s answers (`rows`: their indices), for scoring."""
        samples = self.samples_per_prompt(do_sample)
        metadata = prompt_batch.get("metadata")  # row r answers prompt r // samples (prompt-major)
        device = self.engine_device
        return Rollout(output.sequences.to(device), output.attention_mask.to(device), output.prompt_length,
                       output.answer_mask.to(device), None,
                       [metadata[row // samples] for row in rows.tolist()] if metadata is not None else None,
                       samples, do_sample,
                       0.0, logprobs=output.logprobs.to(device) if do_sample and self.reuse_rollout_logprobs else None)

    @property
    def engine_device(self) -> torch.device:
        """Where rollouts live: the actor's device (or, on a rank without the actor, this rank's)."""
        actor = self.engine.actor
        return actor.device if actor is not None else current_device()

    @torch.no_grad()
    def score_rollout(self, rollout: Rollout, roles: Sequence[str], with_exact_kl: bool = False) -> dict[str, Any]:
        """The scoring calls of `roles` on one rollout: `actor` (old log-probs), `reference` (its log-probs),
        `critic` (values), `reward` (scores, and ReMax's baseline scores). With `with_exact_kl` (evaluation), the
        exact KL when both the actor and the reference are in `roles`, otherwise their `GroupedLogits`
        (`actor_logits`, `reference_logits`; to be combined where both arrive, `GroupedLogits.exact_kl`).
        A rollout that carries the generator's log-probs needs no actor forward for its old log-probs."""
        engine, config, clock = self.engine, self.config, self.clock
        sequences, attention_mask, prompt_length = rollout.sequences, rollout.attention_mask, rollout.prompt_length
        reuse_logprobs = rollout.logprobs is not None and not with_exact_kl
        forwards = {"actor": engine.actor if not reuse_logprobs else None, "reference": engine.reference,
                    "critic": engine.critic}
        groups = RowGroups.of(sequences, attention_mask, prompt_length,
                              models=tuple(model for role, model in forwards.items() if role in roles))
        parts: dict[str, Any] = {}
        actor_module = engine.actor.module if engine.actor is not None else None
        critic_module = engine.critic.module if engine.critic is not None else None
        with eval_mode(actor_module), eval_mode(critic_module):
            for role, model, name in (("actor", engine.actor, "old"), ("reference", engine.reference, "ref")):
                if role not in roles:
                    continue
                if role == "actor" and reuse_logprobs:
                    parts["old_logprobs"] = rollout.logprobs
                    continue
                with clock.time(f"score_{role}"):
                    parts[f"{name}_logprobs"], logits = groups.answer_logprobs(model, config.temperature,
                                                                                self.tokenizer_size)
                if with_exact_kl:
                    parts[f"{role}_logits"] = GroupedLogits(groups.rows, logits)
                del logits
            if with_exact_kl and "actor_logits" in parts and "reference_logits" in parts:
                parts["exact_kl"] = self.exact_kl(parts.pop("actor_logits"), parts.pop("reference_logits"), rollout)
            if "critic" in roles:
                with clock.time("score_critic"):
                    parts["old_values"] = groups.answer_values(engine.critic)
            if "reward" in roles:
                with clock.time("score_reward"):
                    parts["scores"] = self.scorer(sequences, attention_mask, prompt_length, rollout.row_metadata)
                if rollout.greedy is not None:
                    parts["baseline"] = self.baseline_scores(rollout)
        return parts

    def exact_kl(self, actor_logits: GroupedLogits, reference_logits: GroupedLogits, answers: Answers) -> torch.Tensor:
        """KL(actor || reference) per answer [B] of the distributions rollouts are drawn from (this trainer's
        temperature, over the tokenizer's ids), from the two models' window logits scored on one rank or apart."""
        return actor_logits.exact_kl(reference_logits, answers, self.config.temperature, self.tokenizer_size)

    @torch.no_grad()
    def baseline_scores(self, rollout: Rollout) -> torch.Tensor:
        """ReMax's baseline: each prompt's greedy answer's reward (`sequence_rewards`: its reward-model score clipped,
        plus the weighted reward function, less the no-EOS penalty), repeated for its sampled rows."""
        greedy = rollout.greedy
        scores = self.scorer(greedy.sequences, greedy.attention_mask, greedy.prompt_length, rollout.prompt_metadata)
        rewards = sequence_rewards(scores.clipped_part, self.config.clip_reward_value,
                                   greedy.ended_with_eos(self.stop_token_ids), self.config.no_eos_penalty,
                                   scores.weighted_function)
        return repeat_per_prompt(rewards, rollout.samples_per_prompt)

    def assemble_experience(self, rollout: Rollout, parts: Mapping[str, Any]) -> Experience:
        """Rewards, KL, advantages and returns from one rollout's scoring outputs (no model call)."""
        config = self.config
        action_mask = rollout.action_mask
        scores: Scores = parts["scores"]
        old_logprobs, ref_logprobs = parts["old_logprobs"], parts["ref_logprobs"]
        reward_kl_coef = 0.0 if config.kl_in_loss else self.kl_controller.value
        ended_with_eos = rollout.ended_with_eos(self.stop_token_ids)
        rewards, kl = compute_rewards(scores.clipped_part, old_logprobs, ref_logprobs, action_mask, reward_kl_coef,
                                      config.clip_reward_value, config.kl_estimator, ended_with_eos,
                                      config.no_eos_penalty, scores.weighted_function)
        if rollout.do_sample:
            inputs = AdvantageInputs(rewards, action_mask, parts.get("old_values"), rollout.group_index,
                                     parts.get("baseline"))
            advantages, returns = self.advantage_estimator(inputs, config)
        else:
            advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
        return Experience(rollout.sequences, rollout.attention_mask, rollout.prompt_length, action_mask, old_logprobs,
                          ref_logprobs, parts.get("old_values"), rewards, advantages, returns, scores.total, kl,
                          ended_with_eos, parts.get("exact_kl"), rollout.group_index,
                          scores.function, reward_clipped(scores, config.clip_reward_value))

    @torch.no_grad()
    def _rollout(self, prompt_batch: Mapping[str, Any], do_sample: bool,
                 with_exact_kl: bool = False) -> Experience:
        """Generation and scoring; `last_timing`'s generation time includes the scoring done during it (stage
        fusion) and its scoring time is what follows generation."""
        started = time.perf_counter()
        roles = ["actor", "reference", "critic", "reward"] if self.engine.critic is not None else \
            ["actor", "reference", "reward"]
        rollout, parts = self.rollout_and_scores(prompt_batch, do_sample, roles, with_exact_kl)
        generated = started + rollout.generation_s
        experience = self.assemble_experience(rollout, parts)
        self.last_timing = {"generation_s": rollout.generation_s, "scoring_s": time.perf_counter() - generated,
                            "generated_tokens": float(rollout.action_mask.sum().item())}
        return experience

    # updates ------------------------------------------------------------------------------------

    def loss_weights(self, parts: Sequence[Experience], role: str) -> list[float]:
        """The weight of each micro-batch's token-mean losses for `role` ("actor" or "critic"), `parts` being this
        rank's micro-batches in training order (every PPO epoch's). Under `token_mean` each optimizer step's loss
        is the mean over all its answer tokens on all the role's ranks (collective over them:
        `accumulation_weights`); under `micro_batch_token_mean` every micro-batch weighs 1."""
        if self.config.loss_agg_mode == "micro_batch_token_mean":
            return [1.0] * len(parts)
        model = self.engine.actor if role == "actor" else self.engine.critic
        # what a micro-batch's loss mask weighs in all: its answer tokens, or its answers under seq_mean_token_mean
        items = [round(self.loss_mask(part.action_mask).sum().item()) for part in parts]
        return accumulation_weights(items, model.gradient_accumulation_steps(), self._group(role))

    def loss_mask(self, action_mask: torch.Tensor) -> torch.Tensor:
        """The mask a micro-batch's losses and their statistics are averaged over: its answer tokens, or under
        `seq_mean_token_mean` each answer's tokens weighing 1 / its length (`answer_mean_mask`)."""
        return answer_mean_mask(action_mask) if self.config.loss_agg_mode == "seq_mean_token_mean" else action_mask

    def train_rlhf(self, experience: Experience, unsupervised_batch: Mapping[str, torch.Tensor] | None = None,
                   actor_weight: float = 1.0, critic_weight: float = 1.0) -> dict[str, float]:
        """One PPO update on `experience` of the actor (the policy loss) and, if there is one, the critic
        (the value loss), their token means multiplied by their `loss_weights`; returns the micro-batch's
        statistics (`weighted_stats` weighs them as the losses were for a step's mean)."""
        stats = self.train_actor(experience, unsupervised_batch, weight=actor_weight)
        if self.engine.critic is None:
            return stats
        return {**stats, **self.train_critic(experience, weight=critic_weight)}

    def train_actor(self, experience: Experience, unsupervised_batch: Mapping[str, torch.Tensor] | None = None,
                    weight: float = 1.0) -> dict[str, float]:
        """One update of the actor on `experience`, its token-mean losses (policy, and KL in the loss) multiplied
        by `weight` (`loss_weights`).

        With `unsupervised_batch` (pretraining text: the PPO-ptx mixture), the actor minimises InstructGPT's
        single objective, policy loss + unsup_coef * language-model loss, in one backward and ONE optimizer
        step: separate steps would let Adam normalise the coefficient away. Both forward graphs are alive
        until that backward.
        """
        with self.clock.time("train_actor"):
            return self._train_actor(experience, unsupervised_batch, weight)

    def _train_actor(self, experience: Experience, unsupervised_batch: Mapping[str, torch.Tensor] | None,
                     weight: float) -> dict[str, float]:
        config = self.config
        actor = self.engine.actor
        mask = self.loss_mask(experience.action_mask)
        step = actor.global_steps + 1

        groups = RowGroups.of(experience.sequences, experience.attention_mask, experience.prompt_length, (actor,))
        logprobs, logits = groups.answer_logprobs(actor, config.temperature, self.tokenizer_size)
        policy = self.policy_loss(logprobs, experience.old_logprobs, experience.advantages, mask, config)
        entropy = masked_mean(groups.answer_entropies([part.detach() for part in logits], config.temperature,
                                                      self.tokenizer_size), mask)
        del logits
        check_finite("actor loss", policy.loss, step, group=self._group("actor"))
        objective, extra_stats = policy.loss, {}
        if config.kl_in_loss:
            kl_term = kl_loss(logprobs, experience.ref_logprobs, mask, config.kl_estimator)
            objective = objective + self.kl_controller.value * kl_term
            extra_stats["kl_loss"] = kl_term.item()
        objective = objective * weight
        if unsupervised_batch is not None:
            lm_loss = self._language_model_loss(unsupervised_batch)
            check_finite("unsupervised loss", lm_loss, step, group=self._group("actor"))
            objective = objective + config.unsup_coef * lm_loss
            extra_stats["unsup_loss"] = lm_loss.item()
        self._step_actor(objective)
        return {"actor_loss": policy.loss.item(), "clip_fraction": policy.clip_fraction.item(),
                "approx_kl": policy.approx_kl.item(), "entropy": entropy.item(), **extra_stats}

    def train_critic(self, experience: Experience, weight: float = 1.0) -> dict[str, float]:
        """One update of the critic on `experience` (the value loss, a token mean, multiplied by `weight`:
        `loss_weights`)."""
        critic = self.engine.critic
        with self.clock.time("train_critic"):
            groups = RowGroups.of(experience.sequences, experience.attention_mask, experience.prompt_length, (critic,))
            value = self.value_loss(groups.answer_values(critic), experience.old_values, experience.returns,
                                    self.loss_mask(experience.action_mask), self.config)
            check_finite("critic loss", value.loss, critic.global_steps + 1, group=self._group("critic"))
            critic.backward(value.loss * weight)
            step_engine(critic, "critic")
        return {"critic_loss": value.loss.item(), "value_clip_fraction": value.clip_fraction.item()}

    def skipped_steps(self) -> dict[str, float]:
        """The optimizer steps of the run so far that DeepSpeed skipped for non-finite gradients, per trained model
        (`step_engine` says each as it happens)."""
        models = {"actor": self.engine.actor, "critic": self.engine.critic}
        return {f"{role}_skipped_steps": float(model.skipped_steps)
                for role, model in models.items() if model is not None}

    def _group(self, role: str):
        """Where a model's checks are collective: its ranks under a placement, else every rank."""
        groups = self.engine.groups
        return groups.process_group(role) if groups is not None else None

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
        taken = step_engine(actor, "actor")  # False where DeepSpeed skipped it, though global_steps counts it
        if self.engine.actor_ema is not None and taken and actor.global_steps > steps_before:
            self.engine.actor_ema.update(actor)

    # checkpoint state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a resumed run needs besides the engines, rank 0's handed to every rank: the KL coefficient (and the
        EMA's small fields; its weights are in `rank_state`)."""
        state = {"kl_controller": self.kl_controller.state_dict()}
        if self.engine.actor_ema is not None:
            state["actor_ema"] = self.engine.actor_ema.state_dict()
        return state

    def rank_state(self) -> dict:
        """What this rank alone holds for a resume: its share of the EMA weights (empty without an EMA here)."""
        ema = self.engine.actor_ema
        return {} if ema is None else {"actor_ema": ema.local_state_dict()}

    def load_state_dict(self, state: Mapping, rank_state: Mapping | None = None) -> None:
        """Restore `state_dict()` and this rank's `rank_state()` (collective over the actor's ranks with an EMA)."""
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.engine.actor_ema is not None:
            self.engine.actor_ema.load_state_dict(state["actor_ema"], (rank_state or {}).get("actor_ema"))


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
    if experience.reward_fn_scores is not None:
        stats["reward/fn_mean"] = experience.reward_fn_scores.float().mean().item()
    if experience.old_values is not None:
        stats["rollout/value_mean"] = masked_mean(experience.old_values, experience.action_mask).item()
    if experience.reward_clipped is not None:
        stats["reward/clip_fraction"] = experience.reward_clipped.float().mean().item()
    return stats
