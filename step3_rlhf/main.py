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

from transformers import set_seed

from step3_rlhf.plots import plot_reward_kl
from step3_rlhf.ppo_trainer import PPOTrainer
from step3_rlhf.placed import PlacedPPO, PlacedPPORun
from step3_rlhf.placement_setup import record_auto_plan, resolve_placement
from step3_rlhf.run_loop import ACTOR_SUBDIR, CRITIC_SUBDIR, EMA_SUBDIR, PLOT_FILE, PPORun
from step3_rlhf.rlhf_engine import RLHFEngine, build_rlhf_engine
from step3_rlhf.settings import Step3Settings, optimizer_steps_per_ppo_step, optimizer_steps_said
from training.core.args import (
    SettingsParser,
    flag_values,
    resume_fixed_flags,
    resume_override_flags,
    warn_long_warmup,
)
from training.core.model_loading import folder_stop_ids, load_config, load_tokenizer
from training.core.reward_model import MARKER_FILE, VALUE_HEAD_FILE, refuse_reward_model
from training.generation.hybrid_engine import build_generator
from training.loops.call_times import CallTimer
from training.placement.groups import PlacementGroups
from training.placement.spec import Placement
from training.loops.batch_stream import BatchStream
from training.loops.metrics import MetricsLogger, read_metrics
from training.reliability.checkpointing import CHECKPOINTS_SUBDIR, data_record
from training.reliability.run_lock import RunLock
from training.reliability.run_records import save_run_args, save_summary
from training.reliability.signals import GracefulInterrupt
from training.rewards import load_reward_fn
from training.reliability.validation import (
    check_input_run_shards,
    check_model_source,
    check_output_apart_from_inputs,
    check_output_dir,
    check_remote_code,
    check_reward_model_dir,
    check_sequence_lengths,
)
from utils.data import (
    PromptCollator,
    SFTCollator,
    build_unsupervised_dataset,
    write_split_record,
)
from utils.data.args import flags_another_step_reads
from utils.data.phases import PhaseData
from utils.data.shard_match import InputRunRecord
from utils.dist import get_world_size, init_distributed, is_main_process, run_as_program
from utils.errors import UserError, run_cli
from utils.log import setup_logging

logger = logging.getLogger(__name__)

def build_parser() -> SettingsParser:
    return SettingsParser(Step3Settings, description="Step 3: RLHF (PPO, GRPO, RLOO, REINFORCE++, ReMax) on the actor "
                                                     "with a reference, a reward model and/or a reward function")


def parse_args(argv: list[str] | None = None) -> Step3Settings:
    return build_parser().parse_args(argv)


def check_args(args: Step3Settings) -> list[InputRunRecord]:
    """Everything that can be checked before anything is loaded or written; returns what the runs that trained the
    input models recorded of their data (for the data build to compare: `check_input_run_shards`)."""
    args.check_flags(get_world_size())
    args.check_device()
    if args.rewards.reward_fn is not None:
        load_reward_fn(args.rewards.reward_fn)
    input_runs = []
    for flag, model in asdict(args.models).items():
        if model is None:
            continue
        check_model_source(model, f"--{flag}")
        check_remote_code(model, args.run.trust_remote_code, f"--{flag}")
        input_run = check_input_run_shards(model, args.data, 3, f"--{flag}")
        if input_run is not None:
            input_runs.append(input_run)
    check_output_apart_from_inputs(args.run.output_dir, {f"--{flag}": model for flag, model in asdict(args.models).items()},
                                   (ACTOR_SUBDIR, CRITIC_SUBDIR, EMA_SUBDIR, CHECKPOINTS_SUBDIR))
    refuse_reward_model(args.models.actor_model_name_or_path, "--actor_model_name_or_path")
    if args.models.critic_model_name_or_path is not None:
        check_reward_model_dir(args.models.critic_model_name_or_path, (MARKER_FILE, VALUE_HEAD_FILE))
    return input_runs


def experiences_per_step(args: Step3Settings) -> int:
    """Rows (answers) one PPO step trains on, per rank."""
    return args.loop.generation_batches * args.loop.per_device_generation_batch_size * args.ppo.n_samples_per_prompt


def count_ppo_steps(args: Step3Settings, prompts: BatchStream) -> int:
    per_epoch = prompts.batches_per_epoch // args.loop.generation_batches
    if per_epoch == 0:
        raise UserError(
            f"{len(prompts.dataset)} training prompts ({prompts.rows_per_rank} per rank over {get_world_size()}) give "
            f"fewer than --generation_batches {args.loop.generation_batches} "
            f"{'full ' if prompts.drop_last else ''}batches of {args.loop.per_device_generation_batch_size} per rank; "
            f"add prompts or lower those flags"
        )
    total = per_epoch * args.loop.num_train_epochs
    return min(total, args.schedule.max_steps) if args.schedule.max_steps else total


def _build_streams(args: Step3Settings, tokenizer,
                   phase_data: PhaseData) -> tuple[BatchStream, BatchStream | None, BatchStream | None]:
    data, loop, seed = args.data, args.loop, args.data.seed
    train_prompts, eval_prompts = phase_data.train, phase_data.eval
    collator = PromptCollator(tokenizer.pad_token_id)
    # with accumulation, every PPO step a full batch: a short one could not make whole optimizer steps
    prompts = BatchStream(train_prompts, loop.per_device_generation_batch_size, collator, seed,
                          drop_last=args.schedule.gradient_accumulation_steps > 1)
    held_out = None
    if len(eval_prompts) > 0:
        held_out = BatchStream(eval_prompts, loop.per_device_generation_batch_size, collator, seed, shuffle=False)
    unsupervised = None
    if args.unsupervised.unsupervised_dataset_name:
        blocks = build_unsupervised_dataset(
            args.unsupervised.unsupervised_dataset_name, tokenizer,
            data.max_prompt_seq_len + args.ppo.max_answer_seq_len, seed, data.data_output_path,
            rebuild_cache=data.rebuild_data_cache,
            config_name=args.unsupervised.unsupervised_dataset_config_name,
            text_column=args.unsupervised.unsupervised_text_column, shard=data.shard_settings(),
        )
        unsupervised = BatchStream(blocks, loop.per_device_training_batch_size, SFTCollator(tokenizer.pad_token_id),
                                   seed)
    return prompts, held_out, unsupervised


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
        "placement": run.placement_description,
        "wall_time_s": round(wall_time_s, 1),
    }


def call_timer(engine: RLHFEngine, generator: object | None, placement: Placement | None) -> CallTimer:
    """A timer wrapped around this rank's model calls (`--profile_calls`)."""
    timer = CallTimer()
    models = {"actor": engine.actor, "reference": engine.reference, "critic": engine.critic, "reward": engine.reward}
    role = placement.generation_role if placement is not None else "actor"
    timer.instrument(models, {"actor": engine.actor, "critic": engine.critic}, generator, role)
    return timer


def build_trainer(args: Step3Settings, engine: RLHFEngine, generator: object | None) -> PPOTrainer:
    """The run's PPO trainer. Its answers end where the actor's turn does under the data's --prompt_format (the
    format it was tuned in): at the EOS, or at the chat template's end-of-turn token where that is another; and at
    every other id the actor's generation config stops at, read from its folder (the same on every rank, also one
    that holds no copy of the actor)."""
    reward_fn = load_reward_fn(args.rewards.reward_fn) if args.rewards.reward_fn is not None else None
    fusion = args.placement.stage_fusion_micro_batch_size if args.placement.enable_stage_fusion else 0
    actor_stops = folder_stop_ids(args.models.actor_model_name_or_path, args.run.trust_remote_code)
    return PPOTrainer(engine, generator, args.ppo, reward_fn, args.rewards.reward_fn_coef, fusion,
                      args.data.prompt_format, actor_stops)


def run_step3(args: Step3Settings) -> dict:
    started = time.perf_counter()
    setup_logging()
    input_runs = check_args(args)
    given = flag_values(args)  # args.json records the flags as given: train.py compares a rerun's with them
    init_distributed()
    placement, auto_plan = resolve_placement(args)
    if auto_plan is not None:
        check_args(args)  # the settings the plan chose
    run_dir = check_output_dir(args.run.output_dir)
    with RunLock(run_dir):
        fixed_flags = resume_fixed_flags(args, flags_another_step_reads(3))
        checkpoints = args.checkpoints.manager(args.run.output_dir, fixed_flags, resume_override_flags(args))
        checkpoints.check_start(args.checkpoints.resume)  # before anything loads or args.json is written
        if auto_plan is not None:
            record_auto_plan(run_dir, auto_plan)
        set_seed(args.data.seed)
        actor_path = args.models.actor_model_name_or_path
        tokenizer = load_tokenizer(actor_path, args.run.trust_remote_code)
        # the reward model and critic read whole rollouts too: one of fewer positions failed in its embedding
        for path in filter(None, (actor_path, args.models.critic_model_name_or_path)):
            check_sequence_lengths(load_config(path, args.run.trust_remote_code),
                                   max_prompt_seq_len=args.data.max_prompt_seq_len,
                                   max_answer_seq_len=args.ppo.max_answer_seq_len, model=path)
        phase_data = args.data.build(3, tokenizer, input_runs)
        prompts, eval_prompts, unsupervised = _build_streams(args, tokenizer, phase_data)
        streams = {"train": prompts, "eval": eval_prompts, "pretraining": unsupervised}
        checkpoints.check_data({name: data_record(stream.dataset) for name, stream in streams.items()
                                if stream is not None}, args.checkpoints.resume)
        checkpoints.check_inputs({"actor_model_name_or_path": actor_path,
                                  "critic_model_name_or_path": args.models.critic_model_name_or_path},
                                 args.checkpoints.resume)
        total_steps = count_ppo_steps(args, prompts)
        optimizer_steps = total_steps * optimizer_steps_per_ppo_step(args)
        warn_long_warmup(args.schedule.num_warmup_steps, optimizer_steps, optimizer_steps_said(total_steps, args))
        groups = PlacementGroups(placement) if placement is not None else None
        engine = build_rlhf_engine(args, tokenizer, optimizer_steps, optimizer_steps, groups)
        generating = engine.shadow_actor if engine.shadow_actor is not None else engine.actor
        generator = build_generator(args.hybrid.backend, generating, tokenizer, args.hybrid) \
            if generating is not None else None
        trainer = build_trainer(args, engine, generator)
        # after every check (the models' LoRA and vocabulary ones included), so a refused run never overwrites an
        # earlier one's
        save_run_args(run_dir, given)  # what --placement auto changed is in its AUTO_PLAN_FILE
        write_split_record(run_dir, phase_data.records, 3)
        metrics = MetricsLogger(run_dir)
        logger.info("step3_rlhf: %d prompts, %d PPO steps of %d rollouts per rank, generation backend %s%s",
                    len(prompts.dataset), total_steps, experiences_per_step(args), type(generator).__name__,
                    f", placement {placement.describe()}" if placement is not None else "")
        if prompts.rows_left_out:
            logger.info("step3_rlhf: each epoch leaves out %d of the %d prompts per rank (not a full batch of %d; "
                        "the reshuffle leaves out others each epoch)", prompts.rows_left_out, prompts.rows_per_rank,
                        prompts.batch_size)
        run_args = (args, engine, trainer, prompts, eval_prompts, unsupervised, total_steps, checkpoints, metrics)
        timer = call_timer(engine, generator, placement) if args.placement.profile_calls else None
        if placement is None:
            run = PPORun(*run_args, call_timer=timer)
        else:
            placed = PlacedPPO(trainer, placement, groups.rank, args.models.critic_model_name_or_path is not None,
                               timer)
            run = PlacedPPORun(*run_args, placed=placed, call_timer=timer)
        try:
            with GracefulInterrupt() as interrupt:
                run.fit(interrupt)
                interrupt.finishing("the final models' save")
                saved = run.save_models()
                plot = plot_reward_kl(read_metrics(run_dir), run_dir / PLOT_FILE) if is_main_process() else None
                # last, and within the lock and the signal guard: summary.json marks the run finished
                summary = save_summary(run_dir, _summary(run, saved, plot, time.perf_counter() - started))
        finally:
            metrics.close()
            engine.destroy()
    gc.collect()
    return summary


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 3 and return its summary (also written to `<output_dir>/summary.json`)."""
    return run_step3(parse_args(argv))


if __name__ == "__main__":
    run_as_program(main)
