"""Run one supervised step (1: SFT, 2: reward model or DPO) end to end: start-up checks, the run lock,
data, model, DeepSpeed engine, the shared loop (with checkpoints and graceful stops), the final HF
folder. A step states only what differs in a `SupervisedStep`."""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedTokenizerBase, set_seed

from training.core.args import (
    ModelSource,
    ModelTrainingConfig,
    RunArguments,
    ScheduleSettings,
    SettingsParser,
    apply_model_options,
    check_lora_flags,
    check_non_negative,
    check_offload_stage,
    check_optimizer_flags,
    check_positive,
    check_warmup,
    flag_values,
    optimization_settings,
    resume_fixed_flags,
    resume_override_flags,
    warn_long_warmup,
)
from training.core.engine import create_train_engine
from training.core.model_loading import FINAL_MODEL_SUBDIR, load_causal_lm, load_config, load_tokenizer, resolve_dtype
from training.core.save import save_hf_model
from training.core.zero import full_numel
from training.loops.metrics import MetricsLogger
from training.loops.trainer import (
    EvalFn,
    ItemCount,
    LoopConfig,
    LossFn,
    SupervisedTrainer,
    TrainResult,
    batch_rows,
    count_optimizer_steps,
)
from training.reliability.checkpointing import CHECKPOINTS_SUBDIR, CheckpointSettings, data_record
from training.reliability.run_lock import RunLock
from training.reliability.run_records import save_run_args, save_summary
from training.reliability.signals import GracefulInterrupt
from training.reliability.validation import (
    check_disk_space,
    check_input_run_shards,
    check_model_source,
    check_output_apart_from_inputs,
    check_output_dir,
    check_remote_code,
    check_sequence_lengths,
    estimate_output_bytes,
)
from utils.data import DataArguments, PromptFormatter, write_split_record
from utils.data.args import flags_another_step_reads
from utils.data.phases import no_eval_items_note
from utils.dist import get_world_size, init_distributed
from utils.errors import refuse_all
from utils.log import setup_logging

logger = logging.getLogger(__name__)


@dataclass
class SupervisedLoopArguments:
    """Epochs, batch sizes and evaluation cadence of the supervised loop."""

    per_device_train_batch_size: int = field(default=8, metadata={"help": "micro-batch size per rank"})
    per_device_eval_batch_size: int = field(default=8, metadata={
        "resume_override": True, "help": "held-out batch size per rank"})
    num_train_epochs: int = field(default=1, metadata={
        "help": "passes over the training items (--max_steps stops sooner)"})
    eval_interval: int = field(default=0, metadata={
        "resume_override": True,
        "help": "also evaluate every N optimizer steps (0: only before training and after each epoch)"})
    eval_iters: int | None = field(default=None, metadata={
        "resume_override": True, "help": "evaluate on at most this many held-out batches per rank (default: all)"})
    log_interval: int = field(default=10, metadata={
        "same_result": True, "help": "log the training loss every N optimizer steps"})


@dataclass
class SupervisedSettings:
    """The command line of a supervised step: step 1's; a step on the preference pairs extends it
    (`PreferenceSettings`)."""

    phase: ClassVar[int] = 1  # the shard of --data_path it trains on (`DataArguments.build`)

    model: ModelSource
    run: RunArguments
    data: DataArguments
    loop: SupervisedLoopArguments
    training: ModelTrainingConfig
    schedule: ScheduleSettings
    checkpoints: CheckpointSettings

    def check_flags(self, world_size: int) -> None:
        """Refuse, with a `UserError` naming the flag, what the flags alone make wrong, every refusal at once
        (`refuse_all`): checked before anything is loaded or written, by the step itself and by train.py before its
        first step. `world_size` (the ranks the step runs on) changes nothing here; step 3's rules depend on it."""
        refuse_all(*self.flag_checks())

    def flag_checks(self) -> list[Callable[[], object]]:
        """The independent checks of `check_flags`; a step with flags of its own adds its own."""
        flags = flag_values(self)
        return [
            partial(check_positive, flags, "per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "num_train_epochs", "max_steps", "log_interval", "eval_iters"),
            partial(check_non_negative, flags, "eval_interval", "num_warmup_steps", "lora_dim"),
            partial(check_offload_stage, flags, ""),
            partial(check_lora_flags, flags, ""),
            partial(check_optimizer_flags, flags, ""),
            self._check_warmup,
            self.checkpoints.check_flags,
            partial(self.data.check_flags, self.phase),
        ]

    def _check_warmup(self) -> None:
        """A --max_steps (optimizer steps here) the warm-up outlasts; the data, not yet read, may end the run sooner
        (`warn_long_warmup`)."""
        max_steps = self.schedule.max_steps
        if max_steps is not None and max_steps > 0:
            check_warmup(self.schedule.num_warmup_steps, max_steps, f"--max_steps {max_steps} optimizer steps")

    def check_device(self) -> None:
        """Refuse, before anything loads, a --dtype this device cannot compute in (fp16 on a CPU): checked by the step
        itself, and by train.py where the steps run on devices like its own."""
        self.run.check_device()

    def loop_config(self, description: str) -> LoopConfig:
        return LoopConfig(**asdict(self.loop), gradient_accumulation_steps=self.schedule.gradient_accumulation_steps,
                          max_steps=self.schedule.max_steps, seed=self.data.seed, description=description)


@dataclass
class PreferenceSettings(SupervisedSettings):
    """The command line of a supervised step on the preference pairs of shard 2 (step 2; DPO extends it)."""

    phase: ClassVar[int] = 2


ModelBuilder = Callable[[SupervisedSettings, PreTrainedTokenizerBase, dict, torch.dtype], torch.nn.Module]
FrozenModels = Callable[[SupervisedSettings, PreTrainedTokenizerBase], AbstractContextManager[None]]


def build_causal_lm(args: SupervisedSettings, tokenizer: PreTrainedTokenizerBase, ds_config: dict,
                    dtype: torch.dtype, *, disable_dropout: bool = False) -> torch.nn.Module:
    """The `ModelBuilder` of a step that trains `--model_name_or_path` as a causal LM (SFT, DPO's policy), its
    dropout off with `--disable_dropout` or `disable_dropout`."""
    return load_causal_lm(args.model.model_name_or_path, tokenizer, dtype=dtype, ds_config=ds_config,
                          disable_dropout_layers=args.model.disable_dropout or disable_dropout,
                          trust_remote_code=args.run.trust_remote_code,
                          stop_token_ids=PromptFormatter(tokenizer, args.data.prompt_format).stop_token_ids)


@dataclass
class SupervisedStep:
    """What distinguishes one supervised step from another."""

    name: str
    build_model: ModelBuilder  # (args, tokenizer, ds_config, dtype) -> model, ZeRO-3 aware
    make_collator: Callable[[int], Callable]  # pad token id -> collator
    loss_fn: LossFn
    eval_fn: EvalFn
    summarize: Callable[[SupervisedOutcome], dict[str, Any]]  # the step's summary.json (`SupervisedOutcome.summary`)
    count_items: ItemCount = batch_rows  # what loss_fn's mean runs over: an optimizer step averages over them all
    trainable_heads: tuple[str, ...] = ()  # parameters that train even under --only_optimize_lora
    # (args, tokenizer) -> a context during which the models that loss_fn and eval_fn read but never
    # train exist (DPO's reference); entered once the trained engine exists, left before the final save
    frozen_models: FrozenModels | None = None


@dataclass
class SupervisedOutcome:
    result: TrainResult
    model_dir: Path
    train_items: int
    eval_items: int
    dtype: str
    train_answers_cut: int  # of the items the step uses (`TokenizedDataset.answers_cut`)
    eval_answers_cut: int

    def summary(self, step_name: str, counts: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, Any]:
        """A supervised step's `summary.json`: what and how long it trained, its item `counts` and own `metrics`."""
        result = self.result
        return {"step": step_name, "model_dir": str(self.model_dir), "optimizer_steps": result.steps,
                "epochs_completed": result.epochs_completed, **counts, "train_answer_truncated": self.train_answers_cut,
                "eval_answer_truncated": self.eval_answers_cut, "dtype": self.dtype,
                "final_train_loss": result.train_loss, **metrics, "wall_time_s": round(result.wall_time_s, 1)}


def supervised_step_parser(description: str, learning_rate: float,
                           settings: type[SupervisedSettings] = SupervisedSettings) -> SettingsParser:
    """The command line of a supervised step: `settings` (a step with flags of its own extends
    `SupervisedSettings` by a group) with the step's default learning rate."""
    parser = SettingsParser(settings, description=description)
    parser.set_defaults(learning_rate=learning_rate)
    return parser


def run_supervised_step(args: SupervisedSettings, step: SupervisedStep) -> dict[str, Any]:
    """Train `step` as `args` say, save the final model in `<output_dir>/model` and then `summary.json` (every
    rank calls it); returns the summary.

    The engine is destroyed and collected before returning, so a caller (train.py) can start the
    next step's engine in the same process.
    """
    summary = _train_and_save(args, step)
    gc.collect()
    return summary


def _train_and_save(args: SupervisedSettings, step: SupervisedStep) -> dict[str, Any]:
    setup_logging()
    args.check_flags(get_world_size())
    args.check_device()
    model_name = args.model.model_name_or_path
    check_model_source(model_name)
    check_remote_code(model_name, args.run.trust_remote_code)
    input_run = check_input_run_shards(model_name, args.data, args.phase)
    check_output_apart_from_inputs(args.run.output_dir, {"--model_name_or_path": model_name},
                                   (FINAL_MODEL_SUBDIR, CHECKPOINTS_SUBDIR))
    init_distributed()
    run_dir = check_output_dir(args.run.output_dir)
    with RunLock(run_dir):
        fixed_flags = resume_fixed_flags(args, flags_another_step_reads(args.phase))
        checkpoints = args.checkpoints.manager(args.run.output_dir, fixed_flags, resume_override_flags(args))
        checkpoints.check_start(args.checkpoints.resume)  # before anything loads or args.json is written
        set_seed(args.data.seed)
        tokenizer = load_tokenizer(model_name, args.run.trust_remote_code)
        check_sequence_lengths(load_config(model_name, args.run.trust_remote_code),
                               max_seq_len=args.data.max_seq_len, model=model_name)
        train_data, eval_data, cut_records = args.data.build(args.phase, tokenizer,
                                                             [input_run] if input_run is not None else [])
        checkpoints.check_data({"train": data_record(train_data), "eval": data_record(eval_data)},
                               args.checkpoints.resume)
        checkpoints.check_inputs({"model_name_or_path": model_name}, args.checkpoints.resume)
        loop = args.loop_config(step.name)
        num_steps = count_optimizer_steps(len(train_data), loop)
        warn_long_warmup(args.schedule.num_warmup_steps, num_steps, f"{num_steps} optimizer steps of its data")
        settings = optimization_settings(args.training, args.schedule, args.run.dtype_name, num_steps,
                                         args.loop.per_device_train_batch_size)
        dtype = resolve_dtype(args.run.dtype)
        model = step.build_model(args, tokenizer, settings.ds_config(), dtype)
        model = apply_model_options(model, args.training, trainable_heads=step.trainable_heads)
        check_disk_space(run_dir, _output_bytes(model, dtype, args.checkpoints.keep_last_checkpoints,
                                                len(checkpoints.complete_checkpoints())), step.name)
        save_run_args(run_dir, flag_values(args))  # only now: a bad argument must leave an earlier run's files as they were
        write_split_record(run_dir, cut_records, args.phase)
        engine = create_train_engine(model, settings)
        metrics = MetricsLogger(run_dir)
        logger.info("%s: %d train / %d eval items, %d optimizer steps, %s, ZeRO-%d", step.name, len(train_data),
                    len(eval_data), num_steps, settings.dtype, settings.zero_stage)
        if not len(eval_data) and args.data.eval_fraction > 0 and args.data.max_eval_samples != 0:
            logger.warning("%s: %s", step.name, no_eval_items_note(args.phase, args.data.eval_fraction,
                                                                   eval_data.stats))
        frozen = step.frozen_models(args, tokenizer) if step.frozen_models else nullcontext()
        try:
            with GracefulInterrupt() as interrupt:
                with frozen:
                    trainer = SupervisedTrainer(
                        engine, train_data, eval_data, step.make_collator(tokenizer.pad_token_id), step.loss_fn,
                        step.eval_fn, loop, metrics, num_training_steps=num_steps, checkpoints=checkpoints,
                        interrupt=interrupt, resume=args.checkpoints.resume, count_items=step.count_items,
                    )
                    result = trainer.fit()
                interrupt.finishing("the final model's save")
                model_dir = args.run.final_model_dir
                save_hf_model(engine, tokenizer, model_dir)
                logger.info("%s: saved the final model to %s", step.name, model_dir)
                # last, and within the lock and the signal guard: summary.json marks the run finished
                outcome = SupervisedOutcome(result, model_dir, len(train_data), len(eval_data), settings.dtype,
                                            train_data.answers_cut, eval_data.answers_cut)
                summary = save_summary(run_dir, step.summarize(outcome))
        finally:
            metrics.close()
            engine.destroy()
    return summary


def _output_bytes(model: torch.nn.Module, dtype: torch.dtype, keep_last_checkpoints: int,
                  checkpoints_on_disk: int) -> int:
    """What the run will write: the final model and the resume checkpoints not yet on disk (ZeRO-3 aware parameter
    counts)."""
    params = list(model.parameters())
    count = sum(full_numel(p) for p in params)
    trainable = sum(full_numel(p) for p in params if p.requires_grad)
    return estimate_output_bytes(count, torch.finfo(dtype).bits // 8, trainable, keep_last_checkpoints,
                                 checkpoints_on_disk=checkpoints_on_disk)
