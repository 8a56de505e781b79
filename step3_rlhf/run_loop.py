"""The step-3 loop around a `PPOTrainer` (co-located: every model on every rank): rollouts, updates, metrics,
held-out evaluation, checkpoints and the saved models."""
from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from step3_rlhf.ema import save_ema_model
from step3_rlhf.ppo_trainer import Experience, PPOTrainer, experience_stats, weighted_stats
from step3_rlhf.rlhf_engine import RLHFEngine
from step3_rlhf.settings import Step3Settings
from training.core.optim import LearningRateGroups
from training.core.save import save_hf_model
from training.loops.batch_stream import BatchStream
from training.loops.call_times import CALL_TIMES_FILE, CallTimer
from training.loops.metrics import MetricsLogger, rewind_jsonl, sync_jsonl
from training.reliability.checkpointing import CheckpointManager
from training.reliability.guards import check_finite
from training.reliability.signals import GracefulInterrupt
from utils.dist import (
    all_gather_objects,
    get_world_size,
    is_main_process,
    max_over_ranks,
    mean_over_ranks,
    sum_over_ranks,
)

logger = logging.getLogger(__name__)

ACTOR_SUBDIR, CRITIC_SUBDIR, EMA_SUBDIR = "actor", "critic", "actor_ema"
PLOT_FILE = "reward_kl.png"
HELD_OUT_ROLLOUT_STATS = {"reward/score_mean": "score_mean", "rollout/response_length": "response_length",
                          "rollout/eos_fraction": "eos_fraction",
                          "reward/fn_mean": "reward_fn_mean"}  # experience_stats key: held-out name


def held_out_stats(experience: Experience) -> dict[str, float]:
    """Metrics of one batch of greedy held-out answers (this rank's rows): score, exact KL, length, EOS share."""
    stats = experience_stats(experience)
    return {**{name: stats[key] for key, name in HELD_OUT_ROLLOUT_STATS.items() if key in stats},
            "kl_exact": experience.exact_kl.mean().item()}


def first_rows(batch: Mapping, count: int) -> dict:
    """The first `count` rows of a collated batch (tensors and per-row lists alike)."""
    return {key: value[:count] for key, value in batch.items()}


def held_out_totals(prompts: BatchStream, num_prompts: int,
                    batch_stats: Callable[[dict], dict[str, float]]) -> dict[str, float]:
    """`batch_stats` of this rank's first `num_prompts` held-out prompts (whatever the batch size, so runs with
    other batch sizes score the same prompts), averaged over the prompts."""
    prompts.load_state_dict({"epoch": 0, "batches_done": 0})
    totals: dict[str, float] = {}
    remaining = num_prompts
    while remaining > 0:
        batch = first_rows(prompts.next(), remaining)
        rows = batch["input_ids"].shape[0]
        for key, value in batch_stats(batch).items():
            totals[key] = totals.get(key, 0.0) + value * rows / num_prompts
        remaining -= rows
    return totals


@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: BatchStream, num_prompts: int) -> dict[str, float]:
    """Greedy answers to the first `num_prompts` held-out prompts of every rank, scored: `held_out_stats`
    averaged over the prompts."""
    return mean_over_ranks(held_out_totals(prompts, num_prompts,
                                           lambda batch: held_out_stats(trainer.evaluate_prompts(batch))))


TOKEN_MEANS = frozenset({"rollout/value_mean"})  # `experience_stats` means over answer tokens; the others: answers


def rollout_means(batch_stats: Sequence[Mapping[str, float]], answers: Sequence[int],
                  tokens: Sequence[int]) -> dict[str, float]:
    """A step's rollout statistics from each generation batch's, each batch weighing by what its mean runs over: its
    `answers`, or for a mean over answer tokens (`TOKEN_MEANS`) its answer `tokens`. (Averaged batch by batch, an
    epoch's short last batch weighed as much as a full one, each of its answers more; weighed by answers, a batch of
    short answers weighed each of its tokens more in a token mean.)"""
    totals = {"answers": sum(answers) or 1, "tokens": sum(tokens) or 1}
    means: dict[str, float] = {}
    for stats, answer_count, token_count in zip(batch_stats, answers, tokens, strict=True):
        counts = {"answers": answer_count, "tokens": token_count}
        for key, value in stats.items():
            unit = "tokens" if key in TOKEN_MEANS else "answers"
            means[key] = means.get(key, 0.0) + value * (counts[unit] / totals[unit])
    return means


def ppo_step_stats(rollout: Mapping[str, float], updates: Mapping[str, float], timing: Mapping[str, float],
                   training_s: float, kl_coef: float, learning_rates: Mapping[str, float],
                   phases: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """One PPO step's logged statistics: rollout means, update means, KL coefficient, phase times (and each model
    call's, `PPOTrainer.PHASES`: 0 for a call this rank did not make), rates (`timing["generated_tokens"]`: every
    rank's)."""
    return {**rollout, **{f"train/{key}": value for key, value in updates.items()},
            "reward/kl_coef": kl_coef,
            "time/generation_s": timing["generation_s"], "time/scoring_s": timing["scoring_s"],
            "time/training_s": training_s,
            **{f"time/{name}_s": phases[name]["s"] if name in phases else 0.0 for name in PPOTrainer.PHASES},
            "rollout/generated_tokens_per_s": timing["generated_tokens"] / max(timing["generation_s"], 1e-9),
            **learning_rates}


class PPORun:
    """The step-3 loop around a `PPOTrainer`: rollouts, updates, metrics, evaluation, checkpoints."""

    def __init__(self, args: Step3Settings, engine: RLHFEngine, trainer: PPOTrainer, prompts: BatchStream,
                 eval_prompts: BatchStream | None, unsupervised: BatchStream | None, total_steps: int,
                 checkpoints: CheckpointManager, metrics: MetricsLogger, call_timer: CallTimer | None = None):
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
        self.call_timer = call_timer
        self.learning_rate_groups = {role: LearningRateGroups.of(model) for role, model in self.engines.items()}

    @property
    def placement_description(self) -> str:
        return "colocate"

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
            "metrics_lines": self.metrics.lines_written,
        }

    def rank_state(self) -> dict | None:
        """What this rank alone holds that a resume needs beyond its RNG: its share of the EMA (None without)."""
        return self.trainer.rank_state() or None

    def save_checkpoint(self) -> Path:
        """The checkpoint of this PPO step, the logs it counts synced to disk first (`MetricsLogger.sync`)."""
        self.metrics.sync()
        if is_main_process():
            sync_jsonl(self.call_times_path)
        return self.checkpoints.save(self.step, self.engines, self.client_state(), self.rank_state())

    @property
    def call_times_path(self) -> Path:
        return Path(self.args.run.output_dir) / CALL_TIMES_FILE

    def restore(self) -> dict | None:
        """Load the latest checkpoint with --resume (collective); returns its client state (None: a fresh run)."""
        state = self.checkpoints.restore(self.engines, self.args.checkpoints.resume)
        start = None if state is None else state["step"]  # the PPO step, as every checkpoint records it
        self.metrics.rewind(start, None if state is None else state.get("metrics_lines"))
        if is_main_process():  # also where this run does not profile: the file is the run folder's
            rewind_jsonl(self.call_times_path, start)
        if state is None:
            return None
        with self.checkpoints.reading_loaded_state():
            self.step = state["ppo_step"]
            self.prompts.load_state_dict(state["prompts"])
            if self.unsupervised is not None and state["unsupervised"] is not None:
                self.unsupervised.load_state_dict(state["unsupervised"])
            self.trainer.load_state_dict(state["trainer"], state.get("rank_state"))
            self.evaluations = list(state["evaluations"])
            self.last_stats = dict(state["last_stats"])
        logger.info("resuming step 3 after PPO step %d", self.step)
        return state

    def evaluate(self) -> dict:
        if self.eval_prompts is None:
            return {}
        per_rank = -(-len(self.eval_prompts.dataset) // get_world_size())
        return self.record_evaluation(evaluate(self.trainer, self.eval_prompts, min(self.args.loop.eval_samples,
                                                                                    per_rank)))

    def record_evaluation(self, values: dict[str, float]) -> dict:
        """Keep, log and print one held-out evaluation's `values`."""
        record = {"step": self.step, **values}
        self.evaluations.append(record)
        self.metrics.log(self.step, {f"eval/{key}": value for key, value in values.items()})
        logger.info("held-out at PPO step %d: score %.4f, exact KL %.4f, length %.1f%s", self.step,
                    values["score_mean"], values["kl_exact"], values["response_length"],
                    f", reward function {values['reward_fn_mean']:.4f}" if "reward_fn_mean" in values else "")
        return record

    def ppo_step(self) -> dict[str, float]:
        """One PPO step's statistics, with its wall time and the peak memory of the busiest rank."""
        if self.call_timer is not None:
            self.call_timer.take()  # drop what ran between steps (the held-out evaluation)
        started = time.perf_counter()
        stats = self._ppo_step()
        stats["time/step_s"] = time.perf_counter() - started
        stats["memory/peak_rss_gb"] = max_over_ranks(peak_rss_gb())
        if self.call_timer is not None:
            self.log_call_times(stats["time/step_s"])
        return stats

    def log_call_times(self, step_s: float) -> None:
        """Every rank's call times of this step and its peak memory so far, one line of call_times.jsonl
        (collective; outside time/step_s)."""
        per_rank = all_gather_objects({"calls": self.call_timer.take(), "peak_rss_gb": peak_rss_gb()})
        if is_main_process():
            record = {"step": self.step + 1, "step_s": step_s, "ranks": per_rank}
            with open(self.call_times_path, "a") as out:
                out.write(json.dumps(record) + "\n")

    def _ppo_step(self) -> dict[str, float]:
        """Collect `generation_batches` rollouts, then train on them for `ppo_epochs`."""
        args = self.args
        self.trainer.clock.take()  # what the held-out evaluation spent is not this step's
        timing = {"generation_s": 0.0, "scoring_s": 0.0, "generated_tokens": 0.0}
        batches, batch_stats = [], []
        for _ in range(args.loop.generation_batches):
            batch, batch_timing, stats = self.rollout_batch(self.prompts.next())
            batches.append(batch)
            batch_stats.append(stats)
            for key, value in batch_timing.items():
                timing[key] += value
        timing["generated_tokens"] = self.run_generated_tokens(timing["generated_tokens"])
        answers = [len(self.scores([batch])) for batch in batches]
        tokens = [self.answer_tokens([batch]) for batch in batches]
        rollout = self.rollout_over_ranks(rollout_means(batch_stats, answers, tokens), sum(answers), sum(tokens))
        # a mean of each batch's std would leave out the spread between batches (and ranks)
        rollout["reward/score_std"] = self.step_scores(batches).std(unbiased=False).item()
        check_finite("reward", self.scores(batches), self.step + 1, self.checkpoints)
        started = time.perf_counter()
        updates = self.train_on(batches)
        training_s = time.perf_counter() - started
        # the rollout's keys first, as `ppo_step_stats` orders them
        return {**rollout, **self.over_ranks(ppo_step_stats({}, updates, timing, training_s,
                                                            self.trainer.kl_controller.value, self.learning_rates(),
                                                            self.trainer.clock.take()))}

    def rollout_batch(self, prompt_batch: dict) -> tuple[Experience, dict[str, float], dict[str, float]]:
        """One prompt batch's experience, the rollout's phase times and its statistics."""
        experience = self.trainer.generate_experience(prompt_batch)
        return experience, self.trainer.last_timing, experience_stats(experience)

    def scores(self, batches: list[Experience]) -> torch.Tensor:
        return torch.cat([experience.scores for experience in batches])

    def run_generated_tokens(self, tokens: float) -> float:
        """The answer tokens every rank generated, from this rank's `tokens` (collective): the rate a step logs is
        the run's, the same under every placement."""
        return sum_over_ranks([tokens])[0]

    def answer_tokens(self, batches: list[Experience]) -> int:
        """The answer tokens of this rank's `batches` (what a token mean of their statistics runs over)."""
        return sum(int(experience.action_mask.sum().item()) for experience in batches)

    def step_scores(self, batches: list[Experience]) -> torch.Tensor:
        """The scores of the step's answers on every rank (collective)."""
        return torch.cat(all_gather_objects(self.scores(batches).cpu()))

    def train_on(self, batches: list[Experience]) -> dict[str, float]:
        """`ppo_epochs` passes of micro-batch updates (with the pretraining mixture); the mean statistics, and the
        run's skipped optimizer steps so far."""
        args, trainer = self.args, self.trainer
        parts = [part for _ in range(args.loop.ppo_epochs) for experience in batches
                 for part in experience.split(args.loop.per_device_training_batch_size)]
        actor_weights = trainer.loss_weights(parts, "actor")
        critic_weights = trainer.loss_weights(parts, "critic") if self.engine.critic is not None else actor_weights
        updates: dict[str, float] = {}
        for part, actor_weight, critic_weight in zip(parts, actor_weights, critic_weights):
            pretraining = self.unsupervised.next() if self.unsupervised is not None else None
            stats = trainer.train_rlhf(part, pretraining, actor_weight, critic_weight)
            for key, value in weighted_stats(stats, actor_weight, critic_weight).items():
                updates[key] = updates.get(key, 0.0) + value
        return {**{key: value / len(parts) for key, value in updates.items()}, **trainer.skipped_steps()}

    def learning_rates(self) -> dict[str, float]:
        """The actor's (and critic's) learning rates (`LearningRateGroups.logged`: their LoRA adapters' too)."""
        return trained_learning_rates(self.engines, self.learning_rate_groups)

    def rollout_over_ranks(self, rollout: dict[str, float], answers: int, tokens: int) -> dict[str, float]:
        """This rank's rollout means (over its `answers` and their answer `tokens`) made the run's, each rank
        weighing by what its means run over (`rollout_means`; collective): a plain mean over ranks weighed each
        answer token of a rank with shorter answers more in a token mean."""
        return rollout_means(*zip(*all_gather_objects((rollout, answers, tokens)), strict=True))

    def over_ranks(self, stats: dict[str, float]) -> dict[str, float]:
        """This rank's other statistics made the run's: the mean over ranks of their own batches (the updates' are
        already weighed for it, `weighted_stats`)."""
        return mean_over_ranks(stats)

    def _out_of_time(self, started: float) -> bool:
        """Whether the time budget is spent (decided on rank 0 and shared, so every rank stops at the same step)."""
        budget = self.args.loop.max_train_minutes
        if budget is None:
            return False
        spent = float(time.perf_counter() - started >= budget * 60) if is_main_process() else 0.0
        return sum_over_ranks([spent])[0] > 0

    def stop_for_resume(self, interrupt: GracefulInterrupt, saved: Path | None) -> None:
        interrupt.exit_for_resume(self.step, saved or self.save_checkpoint())

    def save_models(self) -> dict[str, str | None]:
        return save_step3_models(self.args, self.engine)

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
            saved = self.save_checkpoint() if self.checkpoints.should_save(self.step) else None
            if interrupt.should_stop():
                self.stop_for_resume(interrupt, saved)
        bar.close()
        if not self.evaluations or self.evaluations[-1]["step"] != self.step:
            self.evaluate()


def trained_learning_rates(engines: Mapping[str, torch.nn.Module],
                           groups: Mapping[str, LearningRateGroups]) -> dict[str, float]:
    """`train/{role}_lr` (and `train/{role}_lora_lr`) of each trained engine by role, read through its `groups`."""
    rates: dict[str, float] = {}
    for role, engine in engines.items():
        rates.update(groups[role].logged(engine, f"train/{role}_"))
    return rates


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (10^9 bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def save_step3_models(args: Step3Settings, engine: RLHFEngine) -> dict[str, str | None]:
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
