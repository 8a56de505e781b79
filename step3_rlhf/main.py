"""Step 3: RLHF with PPO, GRPO, RLOO, REINFORCE++ or ReMax (`--algorithm`). The step-1 model is the actor
(and, frozen, the reference); the step-2 reward model scores the answers (frozen) and initialises the
critic (built only when the algorithm's advantage estimator needs one); `--reward_fn` scores them with a
program instead of, or added to, the reward model. The critic-free algorithms sample
`--n_samples_per_prompt` answers per prompt (one prefill each) and compare them.

One PPO step = `--generation_batches` prompt batches answered and scored, then `--ppo_epochs`
passes of actor and critic updates over those experiences (with `--unsupervised_dataset_name`, each
actor update minimises the PPO loss plus `--unsup_coef` times the language-model loss of a batch of
pretraining text: one objective, one optimizer step).
Held-out prompts are answered greedily and scored before training, every `--eval_interval` steps
and at the end: the mean reward-model score and the exact KL to the reference along the answers
(`kl_exact`, see `PPOTrainer.evaluate_prompts`) are the run's headline.
Example (CPU quick run on the outputs of steps 1 and 2):

    python step3_rlhf/main.py --actor_model_name_or_path runs/step1 --critic_model_name_or_path runs/step2 \\
        --output_dir runs/step3 --max_steps 30 --enable_hybrid_engine
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm
from transformers import set_seed

from step3_rlhf.ema import save_ema_model
from step3_rlhf.plots import plot_reward_kl
from step3_rlhf.ppo_trainer import (
    Experience,
    PPOTrainer,
    check_samples_per_prompt,
    experience_stats,
)
from step3_rlhf.rlhf_engine import RLHFEngine, build_rlhf_engine
from step3_rlhf.settings import Step3Settings
from training.algorithms import get_advantage_estimator, get_policy_loss, get_value_loss
from training.core.args import SettingsParser, check_positive, flag_values
from training.core.model_loading import load_config, load_tokenizer
from training.core.reward_model import MARKER_FILE, VALUE_HEAD_FILE
from training.core.save import save_hf_model
from training.generation.hybrid_engine import build_generator
from training.loops.batch_stream import BatchStream
from training.loops.metrics import MetricsLogger, read_metrics
from training.reliability.checkpointing import CheckpointManager
from training.reliability.guards import check_finite
from training.reliability.run_lock import RunLock
from training.reliability.run_records import save_run_args, save_summary
from training.reliability.signals import GracefulInterrupt
from training.rewards import load_reward_fn
from training.reliability.validation import (
    check_input_run_shards,
    check_model_source,
    check_output_dir,
    check_remote_code,
    check_reward_model_dir,
    check_sequence_lengths,
)
from utils.data import (
    PromptCollator,
    SFTCollator,
    build_unsupervised_dataset,
)
from utils.dist import get_world_size, init_distributed, is_main_process, mean_over_ranks, sum_over_ranks
from utils.errors import UserError, run_cli
from utils.log import setup_logging

logger = logging.getLogger(__name__)

ACTOR_SUBDIR, CRITIC_SUBDIR, EMA_SUBDIR = "actor", "critic", "actor_ema"
PLOT_FILE = "reward_kl.png"
HELD_OUT_ROLLOUT_STATS = {"reward/score_mean": "score_mean", "rollout/response_length": "response_length",
                          "rollout/eos_fraction": "eos_fraction",
                          "reward/fn_mean": "reward_fn_mean"}  # experience_stats key: held-out name


def build_parser() -> SettingsParser:
    return SettingsParser(Step3Settings, description="Step 3: RLHF (PPO, GRPO, RLOO, REINFORCE++, ReMax) on the actor "
                                                     "with a reference, a reward model and/or a reward function")


def parse_args(argv: list[str] | None = None) -> Step3Settings:
    return build_parser().parse_args(argv)


def check_args(args: Step3Settings) -> None:
    """Everything that can be checked before anything is loaded or written."""
    check_positive(flag_values(args), "per_device_generation_batch_size", "per_device_training_batch_size",
                   "generation_batches", "ppo_epochs", "num_train_epochs", "gradient_accumulation_steps", "max_steps",
                   "eval_samples")
    if args.loop.max_train_minutes is not None and args.loop.max_train_minutes <= 0:
        raise UserError(f"--max_train_minutes must be positive, got {args.loop.max_train_minutes}")
    if args.loop.eval_interval < 0:
        raise UserError(f"--eval_interval must be 0 or positive, got {args.loop.eval_interval}")
    if not 0.0 <= args.ema.ema_beta < 1.0:
        raise UserError(f"--ema_beta must lie in [0, 1), got {args.ema.ema_beta}")
    if args.sampling.temperature <= 0:
        raise UserError(f"--temperature must be positive, got {args.sampling.temperature}")
    if args.sampling.top_p != 1.0 or args.sampling.top_k != 0:
        raise UserError(
            f"--top_p {args.sampling.top_p} / --top_k {args.sampling.top_k}: step 3 samples rollouts from the full "
            "distribution at --temperature, because PPO's ratios and KL must use the log-probabilities of the "
            "distribution that drew each token, and top-p/top-k truncation changes it; drop --top_p/--top_k (lower "
            "--temperature to sharpen sampling); truncated sampling stays available in inference/chatbot.py"
        )
    check_positive(flag_values(args), "n_samples_per_prompt")
    estimator = get_advantage_estimator(args.ppo.advantage_estimator)  # an unknown name fails, listing the known
    get_policy_loss(args.ppo.policy_loss)
    get_value_loss(args.ppo.value_loss)
    check_samples_per_prompt(estimator, args.ppo.n_samples_per_prompt)
    if args.models.critic_model_name_or_path is None and args.rewards.reward_fn is None:
        raise UserError("step 3 needs something to score the answers: --critic_model_name_or_path (a step-2 reward "
                        "model), --reward_fn (e.g. builtin:math), or both")
    if args.rewards.reward_fn is not None:
        load_reward_fn(args.rewards.reward_fn)
    for flag, model in asdict(args.models).items():
        if model is None:
            continue
        check_model_source(model, f"--{flag}")
        check_remote_code(model, args.run.trust_remote_code, f"--{flag}")
        check_input_run_shards(model, args.data, f"--{flag}")
    if args.models.critic_model_name_or_path is not None:
        check_reward_model_dir(args.models.critic_model_name_or_path, (MARKER_FILE, VALUE_HEAD_FILE))


def experiences_per_step(args: Step3Settings) -> int:
    """Rows (answers) one PPO step trains on, per rank."""
    return args.loop.generation_batches * args.loop.per_device_generation_batch_size * args.ppo.n_samples_per_prompt


def optimizer_steps_per_ppo_step(args: Step3Settings) -> int:
    """Optimizer steps the actor and the critic each take per PPO step (the pretraining mixture adds none)."""
    micro_batches = args.loop.ppo_epochs * -(-experiences_per_step(args) // args.loop.per_device_training_batch_size)
    return max(1, micro_batches // args.schedule.gradient_accumulation_steps)


def count_ppo_steps(args: Step3Settings, prompts: BatchStream) -> int:
    per_epoch = prompts.batches_per_epoch // args.loop.generation_batches
    if per_epoch == 0:
        raise UserError(
            f"{len(prompts.dataset)} training prompts give fewer than --generation_batches "
            f"{args.loop.generation_batches} "
            f"batches of {args.loop.per_device_generation_batch_size}; add prompts or lower those flags"
        )
    total = per_epoch * args.loop.num_train_epochs
    return min(total, args.schedule.max_steps) if args.schedule.max_steps else total


def held_out_stats(experience: Experience) -> dict[str, float]:
    """Metrics of one batch of greedy held-out answers (this rank's rows): score, exact KL, length, EOS share."""
    stats = experience_stats(experience)
    return {**{name: stats[key] for key, name in HELD_OUT_ROLLOUT_STATS.items() if key in stats},
            "kl_exact": experience.exact_kl.mean().item()}


def first_rows(batch: Mapping, count: int) -> dict:
    """The first `count` rows of a collated batch (tensors and per-row lists alike)."""
    return {key: value[:count] for key, value in batch.items()}


@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: BatchStream, num_prompts: int) -> dict[str, float]:
    """Greedy answers to this rank's first `num_prompts` held-out prompts (whatever the batch size, so runs
    with other batch sizes score the same prompts), scored: `held_out_stats` averaged over the prompts."""
    prompts.load_state_dict({"epoch": 0, "batches_done": 0})
    totals: dict[str, float] = {}
    remaining = num_prompts
    while remaining > 0:
        batch = first_rows(prompts.next(), remaining)
        rows = batch["input_ids"].shape[0]
        for key, value in held_out_stats(trainer.evaluate_prompts(batch)).items():
            totals[key] = totals.get(key, 0.0) + value * rows / num_prompts
        remaining -= rows
    return mean_over_ranks(totals)


class PPORun:
    """The step-3 loop around a `PPOTrainer`: rollouts, updates, metrics, evaluation, checkpoints."""

    def __init__(self, args: Step3Settings, engine: RLHFEngine, trainer: PPOTrainer, prompts: BatchStream,
                 eval_prompts: BatchStream | None, unsupervised: BatchStream | None, total_steps: int,
                 checkpoints: CheckpointManager, metrics: MetricsLogger):
        self.args = args
        self.engine = engine
        self.trainer = trainer
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.unsupervised = unsupervised
        self.total_steps = total_steps
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.step = 0
        self.evaluations: list[dict] = []
        self.last_stats: dict[str, float] = {}

    @property
    def engines(self) -> dict[str, torch.nn.Module]:
        """The trained engines a checkpoint holds (no critic without one)."""
        engines = {"actor": self.engine.actor, "critic": self.engine.critic}
        return {name: engine for name, engine in engines.items() if engine is not None}

    def client_state(self) -> dict:
        return {
            "ppo_step": self.step,
            "prompts": self.prompts.state_dict(),
            "unsupervised": self.unsupervised.state_dict() if self.unsupervised is not None else None,
            "trainer": self.trainer.state_dict(),
            "evaluations": self.evaluations,
            "last_stats": self.last_stats,
        }

    def restore(self) -> None:
        state = self.checkpoints.restore(self.engines, self.args.checkpoints.resume)
        if state is None:
            return
        self.step = state["ppo_step"]
        self.prompts.load_state_dict(state["prompts"])
        if self.unsupervised is not None and state["unsupervised"] is not None:
            self.unsupervised.load_state_dict(state["unsupervised"])
        self.trainer.load_state_dict(state["trainer"])
        self.evaluations = list(state["evaluations"])
        self.last_stats = dict(state["last_stats"])
        logger.info("resuming step 3 after PPO step %d", self.step)

    def evaluate(self) -> dict:
        if self.eval_prompts is None:
            return {}
        per_rank = -(-len(self.eval_prompts.dataset) // get_world_size())
        values = evaluate(self.trainer, self.eval_prompts, min(self.args.loop.eval_samples, per_rank))
        record = {"step": self.step, **values}
        self.evaluations.append(record)
        self.metrics.log(self.step, {f"eval/{key}": value for key, value in values.items()})
        logger.info("held-out at PPO step %d: score %.4f, exact KL %.4f, length %.1f%s", self.step,
                    values["score_mean"], values["kl_exact"], values["response_length"],
                    f", reward function {values['reward_fn_mean']:.4f}" if "reward_fn_mean" in values else "")
        return record

    def ppo_step(self) -> dict[str, float]:
        """Collect `generation_batches` rollouts, then train on them for `ppo_epochs`."""
        args, trainer = self.args, self.trainer
        timing = {"generation_s": 0.0, "scoring_s": 0.0, "generated_tokens": 0.0}
        experiences, rollout = [], {}
        for _ in range(args.loop.generation_batches):
            experience = trainer.generate_experience(self.prompts.next())
            experiences.append(experience)
            for key, value in trainer.last_timing.items():
                timing[key] += value
            for key, value in experience_stats(experience).items():
                rollout[key] = rollout.get(key, 0.0) + value / args.loop.generation_batches
        check_finite("reward", torch.cat([e.scores for e in experiences]), self.step + 1, self.checkpoints)
        started = time.perf_counter()
        updates: dict[str, float] = {}
        count = 0
        for _ in range(args.loop.ppo_epochs):
            for experience in experiences:
                for part in experience.split(args.loop.per_device_training_batch_size):
                    pretraining = self.unsupervised.next() if self.unsupervised is not None else None
                    for key, value in trainer.train_rlhf(part, pretraining).items():
                        updates[key] = updates.get(key, 0.0) + value
                    count += 1
        training_s = time.perf_counter() - started
        stats = {**rollout, **{f"train/{key}": value / count for key, value in updates.items()},
                 "reward/kl_coef": trainer.kl_controller.value,
                 "time/generation_s": timing["generation_s"], "time/scoring_s": timing["scoring_s"],
                 "time/training_s": training_s,
                 "rollout/generated_tokens_per_s": timing["generated_tokens"] / max(timing["generation_s"], 1e-9),
                 "train/actor_lr": self.engine.actor.get_lr()[0]}
        if self.engine.critic is not None:
            stats["train/critic_lr"] = self.engine.critic.get_lr()[0]
        return mean_over_ranks(stats)

    def _out_of_time(self, started: float) -> bool:
        """Whether the time budget is spent (decided on rank 0 and shared, so every rank stops at the same step)."""
        budget = self.args.loop.max_train_minutes
        if budget is None:
            return False
        spent = float(time.perf_counter() - started >= budget * 60) if is_main_process() else 0.0
        return sum_over_ranks([spent])[0] > 0

    def fit(self, interrupt: GracefulInterrupt) -> None:
        self.restore()
        if not self.evaluations:
            self.evaluate()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="step3_ppo", unit="step",
                   disable=not is_main_process(), dynamic_ncols=True)
        started = time.perf_counter()
        while self.step < self.total_steps:
            if self._out_of_time(started):
                logger.info("--max_train_minutes %s reached after PPO step %d", self.args.loop.max_train_minutes,
                            self.step)
                break
            stats = self.ppo_step()
            self.step += 1
            self.last_stats = stats
            self.metrics.log(self.step, stats)
            bar.set_postfix(score=f"{stats['reward/score_mean']:.3f}", kl=f"{stats['reward/kl']:.3f}",
                            len=f"{stats['rollout/response_length']:.0f}")
            bar.update(1)
            eval_interval = self.args.loop.eval_interval
            if eval_interval and self.step % eval_interval == 0 and self.step < self.total_steps:
                self.evaluate()
            saved = self.checkpoints.save(self.step, self.engines, self.client_state()) \
                if self.checkpoints.should_save(self.step) else None
            if interrupt.should_stop():
                interrupt.exit_for_resume(self.step, saved or self.checkpoints.save(self.step, self.engines,
                                                                                     self.client_state()))
        bar.close()
        if not self.evaluations or self.evaluations[-1]["step"] != self.step:
            self.evaluate()


def _build_streams(args: Step3Settings, tokenizer) -> tuple[BatchStream, BatchStream | None, BatchStream | None]:
    data, loop, seed = args.data, args.loop, args.data.seed
    train_prompts, eval_prompts = data.build(3, tokenizer)
    collator = PromptCollator(tokenizer.pad_token_id)
    prompts = BatchStream(train_prompts, loop.per_device_generation_batch_size, collator, seed)
    held_out = None
    if len(eval_prompts) > 0:
        held_out = BatchStream(eval_prompts, loop.per_device_generation_batch_size, collator, seed, shuffle=False)
    unsupervised = None
    if args.unsupervised.unsupervised_dataset_name:
        blocks = build_unsupervised_dataset(
            args.unsupervised.unsupervised_dataset_name, tokenizer,
            data.max_prompt_seq_len + args.ppo.max_answer_seq_len, seed, data.data_output_path,
            rebuild_cache=data.rebuild_data_cache,
            config_name=args.unsupervised.unsupervised_dataset_config_name, shard=data.shard_settings(),
        )
        unsupervised = BatchStream(blocks, loop.per_device_training_batch_size, SFTCollator(tokenizer.pad_token_id),
                                   seed)
    return prompts, held_out, unsupervised


def _save_models(args: Step3Settings, engine: RLHFEngine) -> dict[str, str | None]:
    run_dir = Path(args.run.output_dir)
    save_hf_model(engine.actor, engine.tokenizer, run_dir / ACTOR_SUBDIR)
    critic_dir = None
    if engine.critic is not None:
        critic_dir = run_dir / CRITIC_SUBDIR
        save_hf_model(engine.critic, engine.tokenizer, critic_dir)
    ema_dir = None
    if engine.actor_ema is not None:
        ema_dir = run_dir / EMA_SUBDIR
        save_ema_model(engine.actor_ema, engine.actor, engine.tokenizer, ema_dir)
    return {"actor_dir": str(run_dir / ACTOR_SUBDIR), "critic_dir": str(critic_dir) if critic_dir is not None else None,
            "ema_dir": str(ema_dir) if ema_dir is not None else None}


def _summary(run: PPORun, saved: Mapping[str, str | None], plot: Path | None, wall_time_s: float) -> dict:
    first = run.evaluations[0] if run.evaluations else {}
    last = run.evaluations[-1] if run.evaluations else {}
    return {
        "step": "step3_rlhf",
        "algorithm": run.args.ppo.algorithm,
        **saved,
        "ppo_steps": run.step,
        "reward_first": first.get("score_mean"),
        "reward_last": last.get("score_mean"),
        "kl_exact_last": last.get("kl_exact"),
        "response_length_last": last.get("response_length"),
        "reward_fn_first": first.get("reward_fn_mean"),
        "reward_fn_last": last.get("reward_fn_mean"),
        "rollout_reward_last": run.last_stats.get("reward/score_mean"),
        "rollout_kl_last": run.last_stats.get("reward/kl"),
        "evaluations": run.evaluations,
        "plot": str(plot) if plot is not None else None,
        "wall_time_s": round(wall_time_s, 1),
    }


def run_step3(args: Step3Settings) -> dict:
    started = time.perf_counter()
    setup_logging()
    check_args(args)
    init_distributed()
    run_dir = check_output_dir(args.run.output_dir)
    with RunLock(run_dir):
        checkpoints = args.checkpoints.manager(args.run.output_dir)
        if not args.checkpoints.resume:
            checkpoints.restore({}, resume=False)
        set_seed(args.data.seed)
        actor_path = args.models.actor_model_name_or_path
        tokenizer = load_tokenizer(actor_path, args.run.trust_remote_code)
        check_sequence_lengths(load_config(actor_path, args.run.trust_remote_code),
                               max_prompt_seq_len=args.data.max_prompt_seq_len,
                               max_answer_seq_len=args.ppo.max_answer_seq_len, model=actor_path)
        prompts, eval_prompts, unsupervised = _build_streams(args, tokenizer)
        total_steps = count_ppo_steps(args, prompts)
        # after every check, so a refused run never overwrites an earlier one's
        save_run_args(run_dir, flag_values(args))
        optimizer_steps = total_steps * optimizer_steps_per_ppo_step(args)
        engine = build_rlhf_engine(args, tokenizer, optimizer_steps, optimizer_steps)
        generator = build_generator(args.hybrid.backend, engine.actor, tokenizer, args.hybrid)
        reward_fn = load_reward_fn(args.rewards.reward_fn) if args.rewards.reward_fn is not None else None
        trainer = PPOTrainer(engine, generator, args.ppo, reward_fn, args.rewards.reward_fn_coef)
        metrics = MetricsLogger(run_dir)
        logger.info("step3_rlhf: %d prompts, %d PPO steps of %d rollouts per rank, generation backend %s",
                    len(prompts.dataset), total_steps, experiences_per_step(args), type(generator).__name__)
        run = PPORun(args, engine, trainer, prompts, eval_prompts, unsupervised, total_steps, checkpoints, metrics)
        try:
            with GracefulInterrupt() as interrupt:
                run.fit(interrupt)
            saved = _save_models(args, engine)
            plot = plot_reward_kl(read_metrics(run_dir), run_dir / PLOT_FILE) if is_main_process() else None
        finally:
            metrics.close()
            engine.destroy()
    summary = _summary(run, saved, plot, time.perf_counter() - started)
    save_summary(run_dir, summary)
    gc.collect()
    return summary


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 3 and return its summary (also written to `<output_dir>/summary.json`)."""
    return run_step3(parse_args(argv))


if __name__ == "__main__":
    main()
