"""Run one supervised step (1: SFT, 2: reward model) end to end: start-up checks, the run lock,
data, model, DeepSpeed engine, the shared loop (with checkpoints and graceful stops), the final HF
folder. A step states only what differs in a `SupervisedStep`."""
from __future__ import annotations

import argparse
import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase, set_seed

from training.core.args import (
    add_lora_args,
    add_model_args,
    add_optimization_args,
    add_run_args,
    add_schedule_args,
    add_supervised_loop_args,
    add_zero_args,
    apply_model_options,
    check_positive,
    final_model_dir,
    optimization_settings,
)
from training.core.engine import create_train_engine
from training.core.model_loading import load_config, load_tokenizer, resolve_dtype
from training.core.save import save_hf_model
from training.core.zero import full_numel
from training.loops.metrics import MetricsLogger
from training.loops.trainer import (
    EvalFn,
    LoopConfig,
    LossFn,
    SupervisedTrainer,
    TrainResult,
    count_optimizer_steps,
)
from training.reliability.checkpointing import CheckpointManager, add_checkpoint_args
from training.reliability.run_lock import RunLock
from training.reliability.run_records import save_run_args
from training.reliability.signals import GracefulInterrupt
from training.reliability.validation import (
    check_disk_space,
    check_input_run_shards,
    check_model_source,
    check_output_dir,
    check_remote_code,
    check_sequence_lengths,
    estimate_output_bytes,
)
from utils.data import DataArguments, add_data_args
from utils.dist import init_distributed
from utils.log import setup_logging

logger = logging.getLogger(__name__)

ModelBuilder = Callable[[argparse.Namespace, PreTrainedTokenizerBase, dict, torch.dtype], torch.nn.Module]


@dataclass
class SupervisedStep:
    """What distinguishes step 1 from step 2."""

    phase: int
    name: str
    build_model: ModelBuilder  # (args, tokenizer, ds_config, dtype) -> model, ZeRO-3 aware
    make_collator: Callable[[int], Callable]  # pad token id -> collator
    loss_fn: LossFn
    eval_fn: EvalFn
    trainable_heads: tuple[str, ...] = ()  # parameters that train even under --only_optimize_lora


@dataclass
class SupervisedOutcome:
    result: TrainResult
    model_dir: Path
    train_items: int
    eval_items: int
    dtype: str


def supervised_step_parser(description: str, learning_rate: float, train_batch_size: int = 8) -> argparse.ArgumentParser:
    """The command line of a supervised step (steps 1 and 2 differ only in their defaults)."""
    parser = argparse.ArgumentParser(description=description)
    add_model_args(parser)
    add_run_args(parser)
    add_data_args(parser)
    add_supervised_loop_args(parser, train_batch_size=train_batch_size)
    add_optimization_args(parser, learning_rate=learning_rate)
    add_schedule_args(parser)
    add_zero_args(parser)
    add_lora_args(parser)
    add_checkpoint_args(parser)
    return parser


def run_supervised_step(args: argparse.Namespace, step: SupervisedStep) -> SupervisedOutcome:
    """Train `step` as `args` say and save the final model in `<output_dir>/model` (every rank calls it).

    The engine is destroyed and collected before returning, so a caller (train.py) can start the
    next step's engine in the same process.
    """
    outcome = _train_and_save(args, step)
    gc.collect()
    return outcome


def _train_and_save(args: argparse.Namespace, step: SupervisedStep) -> SupervisedOutcome:
    setup_logging()
    check_positive(args, "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                   "num_train_epochs", "max_steps", "log_interval", "max_seq_len")
    check_model_source(args.model_name_or_path)
    check_remote_code(args.model_name_or_path, args.trust_remote_code)
    check_input_run_shards(args.model_name_or_path, args)
    init_distributed()
    run_dir = check_output_dir(args.output_dir)
    with RunLock(run_dir):
        checkpoints = CheckpointManager.from_args(args)
        if not args.resume:
            checkpoints.restore({}, resume=False)  # refuses to start over an earlier run's checkpoints
        set_seed(args.seed)
        tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
        check_sequence_lengths(load_config(args.model_name_or_path, args.trust_remote_code),
                               max_seq_len=args.max_seq_len, model=args.model_name_or_path)
        train_data, eval_data = DataArguments.from_namespace(args).build(step.phase, tokenizer)
        loop = LoopConfig.from_args(args, description=step.name)
        num_steps = count_optimizer_steps(len(train_data), loop)
        settings = optimization_settings(args, num_steps, args.per_device_train_batch_size, job_name=step.name)
        dtype = resolve_dtype(args.dtype)
        model = step.build_model(args, tokenizer, settings.ds_config(), dtype)
        model = apply_model_options(model, args, trainable_heads=step.trainable_heads)
        check_disk_space(run_dir, _output_bytes(model, dtype, args.keep_last_checkpoints), step.name)
        save_run_args(run_dir, args)  # only now: a bad argument must leave an earlier run's files as they were
        engine = create_train_engine(model, settings)
        metrics = MetricsLogger(run_dir)
        logger.info("%s: %d train / %d eval items, %d optimizer steps, %s, ZeRO-%d", step.name, len(train_data),
                    len(eval_data), num_steps, settings.dtype, settings.zero_stage)
        try:
            with GracefulInterrupt() as interrupt:
                trainer = SupervisedTrainer(
                    engine, train_data, eval_data, step.make_collator(tokenizer.pad_token_id), step.loss_fn,
                    step.eval_fn, loop, metrics, num_training_steps=num_steps, checkpoints=checkpoints,
                    interrupt=interrupt, resume=args.resume,
                )
                result = trainer.fit()
            model_dir = final_model_dir(args)
            save_hf_model(engine, tokenizer, model_dir)
            logger.info("%s: saved the final model to %s", step.name, model_dir)
        finally:
            metrics.close()
            engine.destroy()
    return SupervisedOutcome(result, model_dir, len(train_data), len(eval_data), settings.dtype)


def _output_bytes(model: torch.nn.Module, dtype: torch.dtype, keep_last_checkpoints: int) -> int:
    """What the run will write: the final model and its resume checkpoints (ZeRO-3 aware parameter counts)."""
    params = list(model.parameters())
    count = sum(full_numel(p) for p in params)
    trainable = sum(full_numel(p) for p in params if p.requires_grad)
    return estimate_output_bytes(count, torch.finfo(dtype).bits // 8, trainable, keep_last_checkpoints)
