"""Step 3: RLHF with PPO. The step-1 model is the actor (and, frozen, the reference); the step-2
reward model scores the answers (frozen) and initialises the critic (built only when the
`--advantage_estimator` needs one).

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

import argparse
import gc
import logging
import time
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm
from transformers import set_seed

from step3_rlhf.ema import save_ema_model
from step3_rlhf.plots import plot_reward_kl
from step3_rlhf.ppo_trainer import (
    Experience,
    PPOConfig,
    PPOTrainer,
    experience_stats,
)
from step3_rlhf.rlhf_engine import RLHFEngine, build_rlhf_engine
from training.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES
from training.core.args import (
    add_lora_args,
    add_optimization_args,
    add_run_args,
    add_schedule_args,
    add_zero_args,
    check_positive,
)
from training.core.model_loading import load_config, load_tokenizer
from training.core.reward_model import MARKER_FILE, VALUE_HEAD_FILE
from training.core.save import save_hf_model
from training.generation.hybrid_engine import (
    add_hybrid_engine_args,
    build_generator,
    generation_backend_from_args,
    hybrid_settings_from_args,
)
from training.loops.batch_stream import BatchStream
from training.loops.metrics import MetricsLogger, read_metrics
from training.reliability.checkpointing import CheckpointManager, add_checkpoint_args
from training.reliability.guards import check_finite
from training.reliability.run_lock import RunLock
from training.reliability.run_records import save_run_args, save_summary
from training.reliability.signals import GracefulInterrupt
from training.reliability.validation import (
    check_input_run_shards,
    check_model_source,
    check_output_dir,
    check_remote_code,
    check_reward_model_dir,
    check_sequence_lengths,
)
from utils.data import (
    DataArguments,
    PromptCollator,
    SFTCollator,
    add_data_args,
    add_unsupervised_data_args,
    build_unsupervised_dataset,
)
from utils.dist import init_distributed, is_main_process, mean_over_ranks
from utils.errors import UserError, run_cli
from utils.log import setup_logging

logger = logging.getLogger(__name__)

ACTOR_SUBDIR, CRITIC_SUBDIR, EMA_SUBDIR = "actor", "critic", "actor_ema"
PLOT_FILE = "reward_kl.png"
HELD_OUT_ROLLOUT_STATS = {"reward/score_mean": "score_mean", "rollout/response_length": "response_length",
                          "rollout/eos_fraction": "eos_fraction"}  # experience_stats key: held-out name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Step 3: RLHF with PPO (actor, critic, reference and reward model)")
    models = parser.add_argument_group("models")
    models.add_argument("--actor_model_name_or_path", required=True,
                        help="the step-1 run folder (or any causal LM): the actor and the frozen reference")
    models.add_argument("--critic_model_name_or_path", required=True,
                        help="the step-2 run folder: the frozen reward model and the critic's initialisation")
    models.add_argument("--actor_gradient_checkpointing", action="store_true")
    models.add_argument("--critic_gradient_checkpointing", action="store_true")
    add_run_args(parser)
    add_data_args(parser)
    add_unsupervised_data_args(parser)

    loop = parser.add_argument_group("PPO loop")
    loop.add_argument("--per_device_generation_batch_size", type=int, default=4, help="prompts per rollout batch per rank")
    loop.add_argument("--per_device_training_batch_size", type=int, default=4, help="PPO micro-batch size per rank")
    loop.add_argument("--generation_batches", type=int, default=1, help="rollout batches collected per PPO step")
    loop.add_argument("--ppo_epochs", type=int, default=1, help="passes over each PPO step's experiences")
    loop.add_argument("--num_train_epochs", type=int, default=1, help="passes over the prompt set")
    loop.add_argument("--max_answer_seq_len", type=int, default=128, help="maximum generated tokens per answer")
    loop.add_argument("--eval_interval", type=int, default=0,
                      help="score held-out prompts every N PPO steps (0: only before and after training)")
    loop.add_argument("--eval_samples", type=int, default=32, help="held-out prompts scored per evaluation (per rank)")

    ppo = parser.add_argument_group("PPO")
    ppo.add_argument("--kl_ctl", type=float, default=0.1, help="KL penalty coefficient (initial value if adaptive)")
    ppo.add_argument("--target_kl", type=float, default=None,
                     help="make the KL coefficient adaptive, steering the per-answer KL toward this value")
    ppo.add_argument("--kl_horizon", type=float, default=10000.0, help="adaptation horizon (samples) of the adaptive KL")
    ppo.add_argument("--clip_reward_value", type=float, default=5.0, help="clip reward-model scores to +-this")
    ppo.add_argument("--cliprange", type=float, default=0.2, help="PPO ratio clip range of the actor")
    ppo.add_argument("--cliprange_value", type=float, default=0.2, help="value clip range of the critic")
    ppo.add_argument("--gamma", type=float, default=1.0, help="discount factor")
    ppo.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    ppo.add_argument("--disable_advantage_whitening", action="store_true", help="use raw advantages")
    ppo.add_argument("--no_eos_penalty", type=float, default=0.0,
                     help="subtract this from the score of answers cut off before emitting EOS")
    ppo.add_argument("--temperature", type=float, default=1.0,
                     help="rollout sampling temperature; the policy PPO trains (old, new and reference log-probs, "
                          "KL, entropy) is softmax(logits / temperature), the distribution the answers are drawn from")
    ppo.add_argument("--top_p", type=float, default=1.0,
                     help="refused below 1: truncated sampling would train on other log-probs than drew the tokens")
    ppo.add_argument("--top_k", type=int, default=0,
                     help="refused above 0: truncated sampling would train on other log-probs than drew the tokens")
    ppo.add_argument("--unsup_coef", type=float, default=27.8,
                     help="weight of the pretraining LM loss added to the actor's PPO loss (PPO-ptx)")
    ppo.add_argument("--advantage_estimator", default="gae", choices=ADVANTAGE_ESTIMATORS.names(),
                     help="advantage estimator; one that needs no critic trains none (no critic folder is saved)")
    ppo.add_argument("--policy_loss", default="ppo", choices=POLICY_LOSSES.names(), help="actor loss")
    ppo.add_argument("--value_loss", default="clipped", choices=VALUE_LOSSES.names(), help="critic loss")
    ppo.add_argument("--enable_ema", action="store_true", help="keep an EMA of the actor, saved as actor_ema/")
    ppo.add_argument("--ema_beta", type=float, default=0.992, help="EMA decay per actor optimizer step")

    add_optimization_args(parser, prefix="actor_", learning_rate=1e-5)
    add_optimization_args(parser, prefix="critic_", learning_rate=1e-5)
    add_schedule_args(parser)
    add_zero_args(parser, prefix="actor_")
    add_zero_args(parser, prefix="critic_")
    frozen = parser.add_argument_group("frozen models")
    frozen.add_argument("--offload_reference_model", action="store_true", help="keep the reference model in CPU memory")
    frozen.add_argument("--offload_reward_model", action="store_true", help="keep the reward model in CPU memory")
    add_lora_args(parser, prefix="actor_")
    add_lora_args(parser, prefix="critic_")
    add_hybrid_engine_args(parser)
    add_checkpoint_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def ppo_config(args: argparse.Namespace) -> PPOConfig:
    return PPOConfig(
        max_answer_seq_len=args.max_answer_seq_len,
        kl_ctl=args.kl_ctl,
        target_kl=args.target_kl,
        kl_horizon=args.kl_horizon,
        clip_reward_value=args.clip_reward_value,
        cliprange=args.cliprange,
        cliprange_value=args.cliprange_value,
        gamma=args.gamma,
        lam=args.lam,
        whiten_advantages=not args.disable_advantage_whitening,
        no_eos_penalty=args.no_eos_penalty,
        temperature=args.temperature,
        unsup_coef=args.unsup_coef,
        advantage_estimator=args.advantage_estimator,
        policy_loss=args.policy_loss,
        value_loss=args.value_loss,
    )


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before anything is loaded or written."""
    check_positive(args, "per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches",
                   "ppo_epochs", "num_train_epochs", "gradient_accumulation_steps", "max_steps", "eval_samples")
    if args.eval_interval < 0:
        raise UserError(f"--eval_interval must be 0 or positive, got {args.eval_interval}")
    if not 0.0 <= args.ema_beta < 1.0:
        raise UserError(f"--ema_beta must lie in [0, 1), got {args.ema_beta}")
    if args.temperature <= 0:
        raise UserError(f"--temperature must be positive, got {args.temperature}")
    if args.top_p != 1.0 or args.top_k != 0:
        raise UserError(
            f"--top_p {args.top_p} / --top_k {args.top_k}: step 3 samples rollouts from the full distribution at "
            "--temperature, because PPO's ratios and KL must use the log-probabilities of the distribution that drew "
            "each token, and top-p/top-k truncation changes it; drop --top_p/--top_k (lower --temperature to sharpen "
            "sampling); truncated sampling stays available in inference/chatbot.py"
        )
    for flag in ("actor_model_name_or_path", "critic_model_name_or_path"):
        check_model_source(getattr(args, flag), f"--{flag}")
        check_remote_code(getattr(args, flag), args.trust_remote_code, f"--{flag}")
        check_input_run_shards(getattr(args, flag), args, f"--{flag}")
    check_reward_model_dir(args.critic_model_name_or_path, (MARKER_FILE, VALUE_HEAD_FILE))


def experiences_per_step(args: argparse.Namespace) -> int:
    """Rows one PPO step trains on, per rank."""
    return args.generation_batches * args.per_device_generation_batch_size


def optimizer_steps_per_ppo_step(args: argparse.Namespace) -> int:
    """Optimizer steps the actor and the critic each take per PPO step (the pretraining mixture adds none)."""
    micro_batches = args.ppo_epochs * -(-experiences_per_step(args) // args.per_device_training_batch_size)
    return max(1, micro_batches // args.gradient_accumulation_steps)


def count_ppo_steps(args: argparse.Namespace, prompts: BatchStream) -> int:
    per_epoch = prompts.batches_per_epoch // args.generation_batches
    if per_epoch == 0:
        raise UserError(
            f"{len(prompts.dataset)} training prompts give fewer than --generation_batches {args.generation_batches} "
            f"batches of {args.per_device_generation_batch_size}; add prompts or lower those flags"
        )
    total = per_epoch * args.num_train_epochs
    return min(total, args.max_steps) if args.max_steps else total


def held_out_stats(experience: Experience) -> dict[str, float]:
    """Metrics of one batch of greedy held-out answers (this rank's rows): score, exact KL, length, EOS share."""
    stats = experience_stats(experience)
    return {**{name: stats[key] for key, name in HELD_OUT_ROLLOUT_STATS.items()},
            "kl_exact": experience.exact_kl.mean().item()}


@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: BatchStream, num_batches: int) -> dict[str, float]:
    """Greedy answers to the first held-out prompts, scored by the reward model: `held_out_stats` averaged."""
    prompts.load_state_dict({"epoch": 0, "batches_done": 0})
    totals: dict[str, float] = {}
    for _ in range(num_batches):
        for key, value in held_out_stats(trainer.evaluate_prompts(prompts.next())).items():
            totals[key] = totals.get(key, 0.0) + value / num_batches
    return mean_over_ranks(totals)


class PPORun:
    """The step-3 loop around a `PPOTrainer`: rollouts, updates, metrics, evaluation, checkpoints."""

    def __init__(self, args: argparse.Namespace, engine: RLHFEngine, trainer: PPOTrainer, prompts: BatchStream,
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
        state = self.checkpoints.restore(self.engines, self.args.resume)
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
        num_batches = max(1, min(self.eval_prompts.batches_per_epoch,
                                 -(-self.args.eval_samples // self.eval_prompts.batch_size)))
        values = evaluate(self.trainer, self.eval_prompts, num_batches)
        record = {"step": self.step, **values}
        self.evaluations.append(record)
        self.metrics.log(self.step, {f"eval/{key}": value for key, value in values.items()})
        logger.info("held-out at PPO step %d: score %.4f, exact KL %.4f, length %.1f", self.step,
                    values["score_mean"], values["kl_exact"], values["response_length"])
        return record

    def ppo_step(self) -> dict[str, float]:
        """Collect `generation_batches` rollouts, then train on them for `ppo_epochs`."""
        args, trainer = self.args, self.trainer
        timing = {"generation_s": 0.0, "scoring_s": 0.0, "generated_tokens": 0.0}
        experiences, rollout = [], {}
        for _ in range(args.generation_batches):
            experience = trainer.generate_experience(self.prompts.next())
            experiences.append(experience)
            for key, value in trainer.last_timing.items():
                timing[key] += value
            for key, value in experience_stats(experience).items():
                rollout[key] = rollout.get(key, 0.0) + value / args.generation_batches
        check_finite("reward", torch.cat([e.scores for e in experiences]), self.step + 1, self.checkpoints)
        started = time.perf_counter()
        updates: dict[str, float] = {}
        count = 0
        for _ in range(args.ppo_epochs):
            for experience in experiences:
                for part in experience.split(args.per_device_training_batch_size):
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

    def fit(self, interrupt: GracefulInterrupt) -> None:
        self.restore()
        if not self.evaluations:
            self.evaluate()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="step3_ppo", unit="step",
                   disable=not is_main_process(), dynamic_ncols=True)
        while self.step < self.total_steps:
            stats = self.ppo_step()
            self.step += 1
            self.last_stats = stats
            self.metrics.log(self.step, stats)
            bar.set_postfix(score=f"{stats['reward/score_mean']:.3f}", kl=f"{stats['reward/kl']:.3f}",
                            len=f"{stats['rollout/response_length']:.0f}")
            bar.update(1)
            if self.args.eval_interval and self.step % self.args.eval_interval == 0 and self.step < self.total_steps:
                self.evaluate()
            saved = self.checkpoints.save(self.step, self.engines, self.client_state()) \
                if self.checkpoints.should_save(self.step) else None
            if interrupt.should_stop():
                interrupt.exit_for_resume(self.step, saved or self.checkpoints.save(self.step, self.engines,
                                                                                     self.client_state()))
        bar.close()
        if not self.evaluations or self.evaluations[-1]["step"] != self.step:
            self.evaluate()


def _build_streams(args: argparse.Namespace, tokenizer) -> tuple[BatchStream, BatchStream | None, BatchStream | None]:
    data = DataArguments.from_namespace(args)
    train_prompts, eval_prompts = data.build(3, tokenizer)
    collator = PromptCollator(tokenizer.pad_token_id)
    prompts = BatchStream(train_prompts, args.per_device_generation_batch_size, collator, args.seed)
    held_out = None
    if len(eval_prompts) > 0:
        held_out = BatchStream(eval_prompts, args.per_device_generation_batch_size, collator, args.seed, shuffle=False)
    unsupervised = None
    if args.unsupervised_dataset_name:
        blocks = build_unsupervised_dataset(
            args.unsupervised_dataset_name, tokenizer, args.max_prompt_seq_len + args.max_answer_seq_len, args.seed,
            args.data_output_path, rebuild_cache=args.rebuild_data_cache,
            config_name=args.unsupervised_dataset_config_name, shard=data.shard_settings(),
        )
        unsupervised = BatchStream(blocks, args.per_device_training_batch_size, SFTCollator(tokenizer.pad_token_id),
                                   args.seed)
    return prompts, held_out, unsupervised


def _save_models(args: argparse.Namespace, engine: RLHFEngine) -> dict[str, str | None]:
    run_dir = Path(args.output_dir)
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
        **saved,
        "ppo_steps": run.step,
        "reward_first": first.get("score_mean"),
        "reward_last": last.get("score_mean"),
        "kl_exact_last": last.get("kl_exact"),
        "response_length_last": last.get("response_length"),
        "rollout_reward_last": run.last_stats.get("reward/score_mean"),
        "rollout_kl_last": run.last_stats.get("reward/kl"),
        "evaluations": run.evaluations,
        "plot": str(plot) if plot is not None else None,
        "wall_time_s": round(wall_time_s, 1),
    }


def run_step3(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    setup_logging()
    check_args(args)
    init_distributed()
    run_dir = check_output_dir(args.output_dir)
    with RunLock(run_dir):
        checkpoints = CheckpointManager.from_args(args)
        if not args.resume:
            checkpoints.restore({}, resume=False)
        set_seed(args.seed)
        tokenizer = load_tokenizer(args.actor_model_name_or_path, args.trust_remote_code)
        check_sequence_lengths(load_config(args.actor_model_name_or_path, args.trust_remote_code),
                               max_prompt_seq_len=args.max_prompt_seq_len, max_answer_seq_len=args.max_answer_seq_len,
                               model=args.actor_model_name_or_path)
        prompts, eval_prompts, unsupervised = _build_streams(args, tokenizer)
        total_steps = count_ppo_steps(args, prompts)
        save_run_args(run_dir, args)  # after every check, so a refused run never overwrites an earlier one's
        optimizer_steps = total_steps * optimizer_steps_per_ppo_step(args)
        engine = build_rlhf_engine(args, tokenizer, optimizer_steps, optimizer_steps)
        generator = build_generator(generation_backend_from_args(args), engine.actor, tokenizer,
                                    hybrid_settings_from_args(args))
        trainer = PPOTrainer(engine, generator, ppo_config(args))
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
