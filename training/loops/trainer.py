"""The supervised training loop shared by step 1 (SFT) and step 2 (reward model).

Epochs over a `DistributedSampler`, gradient accumulation through the DeepSpeed engine (one
optimizer step every `gradient_accumulation_steps` micro-batches, counted across epoch ends),
a progress bar on rank 0, evaluation before training, after every epoch and every
`eval_interval` steps, and metrics through `MetricsLogger`. What a step trains is given as three
functions: `loss_fn(engine, batch) -> loss`, the mean over the batch's loss items (SFT: its predicted
tokens), `count_items(batch) -> int`, how many items that mean runs over, and
`eval_fn(engine, batches) -> {name: value}`.

An optimizer step's gradient is the mean over all the items of its micro-batches on all ranks: the
loop takes a step's micro-batches first, counts their items, and weighs each micro-batch's mean by its
share (`training.loops.accumulation`).

Reliability: with a `CheckpointManager` the loop saves every `--save_interval` optimizer steps
(engine, RNG, data position, evaluations so far) and resumes from the latest checkpoint, so a
resumed run ends exactly where an uninterrupted one would; with a `GracefulInterrupt` a
SIGTERM/SIGINT finishes the current step, saves and exits with a resume hint; a non-finite loss
stops the run before its gradients are applied, naming the step and the last good checkpoint.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset
from tqdm.auto import tqdm

from training.core.optim import LearningRateGroups
from training.loops.accumulation import accumulation_weights
from training.loops.metrics import MetricsLogger
from training.reliability.checkpointing import CheckpointManager
from training.reliability.guards import check_finite, step_engine
from training.reliability.signals import GracefulInterrupt
from utils.dist import (
    get_rank,
    get_world_size,
    is_main_process,
    sum_over_ranks,
)
from utils.errors import UserError

logger = logging.getLogger(__name__)

ENGINE_NAME = "model"  # the engine's name inside a checkpoint

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
ItemCount = Callable[[Batch], int]
EvalFn = Callable[[torch.nn.Module, Iterable[Batch]], Mapping[str, float]]


def batch_rows(batch: Batch) -> int:
    """The default `ItemCount`: a loss that averages over a batch's rows (pairs of rows count alike)."""
    return int(batch["input_ids"].shape[0])


@dataclass
class LoopConfig:
    num_train_epochs: int = 1
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_steps: int | None = None
    eval_interval: int = 0
    eval_iters: int | None = None
    log_interval: int = 10
    seed: int = 1234
    description: str = "train"


def examples_per_rank(num_examples: int, world_size: int) -> int:
    """The examples each rank's `DistributedSampler` yields per epoch: it repeats the first ones so that every rank
    gets as many."""
    return math.ceil(num_examples / world_size)


def micro_batches_per_epoch(num_examples: int, batch_size: int, world_size: int) -> int:
    """Micro-batches each rank sees per epoch."""
    return math.ceil(examples_per_rank(num_examples, world_size) / batch_size)


def micro_batch_examples(num_examples: int, batch_size: int, world_size: int, index: int) -> int:
    """The examples in micro-batch `index` of an epoch on each rank: `batch_size`, fewer in the epoch's last one."""
    return max(min(batch_size, examples_per_rank(num_examples, world_size) - index * batch_size), 0)


def count_optimizer_steps(num_examples: int, config: LoopConfig, world_size: int | None = None) -> int:
    """Optimizer steps the run will take: all epochs' micro-batches / accumulation, capped by `max_steps`."""
    world_size = world_size or get_world_size()
    micro_batches = micro_batches_per_epoch(num_examples, config.per_device_train_batch_size, world_size)
    steps = micro_batches * config.num_train_epochs // config.gradient_accumulation_steps
    if steps == 0:
        raise UserError(
            f"{num_examples} training examples make {micro_batches} micro-batches per rank, fewer than one "
            f"optimizer step of {config.gradient_accumulation_steps}; add data, lower "
            "--gradient_accumulation_steps or --per_device_train_batch_size"
        )
    return min(steps, config.max_steps) if config.max_steps else steps


def progress_postfix(step_loss: float, rates: Mapping[str, float]) -> dict[str, str]:
    """What the progress bar shows after a step: its loss and the learning `rates` as the metrics log them (the
    adapters' too, `LearningRateGroups.logged`: the first parameter group's rate alone hid theirs, or showed it as the
    model's)."""
    return {"loss": f"{step_loss:.4f}", **{name: f"{rate:.2e}" for name, rate in rates.items()}}


class SkipFirst(Sampler):
    """The indices of `sampler` after its first `count` (resuming part-way through an epoch)."""

    def __init__(self, sampler: Sampler, count: int):
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[int]:
        for position, index in enumerate(self.sampler):
            if position >= self.count:
                yield index

    def __len__(self) -> int:
        return max(len(self.sampler) - self.count, 0)


def to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


@dataclass
class LoopPosition:
    """Where the loop stands in the data: the epoch and how many of its micro-batches are done."""

    epoch: int = 0
    batches_done: int = 0


@dataclass
class AccumulationWindow:
    """The micro-batches of one optimizer step on this rank, with each one's loss items and the weight of its mean
    loss (`accumulation_weights`)."""

    batches: list[Batch]
    items: list[int]
    weights: list[float]
    examples: int  # the examples of its micro-batches (an epoch's last micro-batch may hold fewer than its size)


@dataclass
class TrainResult:
    steps: int
    epochs_completed: int
    train_loss: float
    wall_time_s: float
    evaluations: list[dict] = field(default_factory=list)

    @property
    def first_eval(self) -> dict:
        return self.evaluations[0] if self.evaluations else {}

    @property
    def final_eval(self) -> dict:
        return self.evaluations[-1] if self.evaluations else {}


class SupervisedTrainer:
    def __init__(
        self,
        engine: torch.nn.Module,
        train_dataset: Dataset,
        eval_dataset: Dataset | None,
        collator: Callable,
        loss_fn: LossFn,
        eval_fn: EvalFn | None,
        config: LoopConfig,
        metrics: MetricsLogger,
        num_training_steps: int | None = None,
        checkpoints: CheckpointManager | None = None,
        interrupt: GracefulInterrupt | None = None,
        resume: bool = False,
        count_items: ItemCount = batch_rows,
    ):
        self.engine = engine
        self.learning_rate_groups = LearningRateGroups.of(engine)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.collator = collator
        self.loss_fn = loss_fn
        self.count_items = count_items
        self.eval_fn = eval_fn
        self.config = config
        self.metrics = metrics
        self.num_training_steps = num_training_steps or count_optimizer_steps(len(train_dataset), config)
        self.checkpoints = checkpoints
        self.interrupt = interrupt
        self.resume = resume
        self.position = LoopPosition()
        self.evaluations: list[dict] = []
        self._loss_sum = 0.0
        self._loss_items = 0
        self._last_train_loss = float("nan")

    # data ---------------------------------------------------------------------------------------

    def train_loader(self, epoch: int, skip_batches: int = 0) -> DataLoader:
        sampler = DistributedSampler(
            self.train_dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=True, seed=self.config.seed
        )
        sampler.set_epoch(epoch)
        skipped = SkipFirst(sampler, skip_batches * self.config.per_device_train_batch_size)
        # a private generator keeps the loader from drawing on the global RNG, so that a resumed run
        # (which creates its loader at a different moment) sees the same dropout masks
        return DataLoader(
            self.train_dataset,
            batch_size=self.config.per_device_train_batch_size,
            sampler=skipped,
            collate_fn=self.collator,
            generator=torch.Generator(),
        )

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of the held-out set, every item once over the ranks (a `DistributedSampler` repeats
        the first items to give each rank as many, and they were counted twice). A rank with fewer batches than
        another then runs as many uncounted forwards of the training loss on the set's first item, so that every rank
        runs the same number of forwards (ZeRO-3 gathers each layer's weights from all ranks in each)."""
        world, size = get_world_size(), self.config.per_device_eval_batch_size
        mine = Subset(self.eval_dataset, range(get_rank(), len(self.eval_dataset), world))
        # its own generator: iterating a loader without one draws on the global RNG (the dropout masks after it)
        loader = DataLoader(mine, batch_size=size, shuffle=False, collate_fn=self.collator, generator=torch.Generator())
        forwards = -(-len(range(0, len(self.eval_dataset), world)) // size)  # the busiest rank's batches
        if self.config.eval_iters is not None:
            forwards = min(forwards, self.config.eval_iters)
        device = self.engine.device
        done = 0
        for batch in itertools.islice(loader, forwards):
            yield to_device(batch, device)
            done += 1
        if done < forwards:
            filler = to_device(self.collator([self.eval_dataset[0]]), device)
            for _ in range(forwards - done):
                self.loss_fn(self.engine, filler)

    # evaluation ---------------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict:
        """Run `eval_fn` on the held-out set, log it under `eval/`, and remember it. The weights change only at
        optimizer steps, so a step already evaluated (an `eval_interval` step that also ends an epoch) is not
        evaluated again: its record takes the new epoch."""
        if self.eval_fn is None or self.eval_dataset is None or len(self.eval_dataset) == 0:
            return {}
        if self.evaluations and self.evaluations[-1]["step"] == step:
            self.evaluations[-1]["epoch"] = self.position.epoch
            return self.evaluations[-1]
        self.engine.eval()
        with torch.no_grad():
            values = dict(self.eval_fn(self.engine, self.eval_batches()))
        self.engine.train()
        record = {"step": step, "epoch": self.position.epoch, **values}
        self.evaluations.append(record)
        self.metrics.log(step, {f"eval/{key}": value for key, value in values.items()})
        summary = ", ".join(f"{key} {value:.4g}" for key, value in values.items() if isinstance(value, (int, float)))
        logger.info("eval at step %d (epoch %d): %s", step, self.position.epoch, summary)
        return record

    # checkpoints --------------------------------------------------------------------------------

    def _client_state(self) -> dict:
        """What a resume needs besides the engine (collective: the loss window not yet logged is every rank's)."""
        return {
            "position": asdict(self.position),
            "evaluations": self.evaluations,
            "loss_window": sum_over_ranks([self._loss_sum, self._loss_items]),
            "last_train_loss": self._last_train_loss,
            "metrics_lines": self.metrics.lines_written,
        }

    def _restore(self) -> None:
        """Continue from the latest checkpoint under `--resume` (and refuse to overwrite one without it)."""
        state = self.checkpoints.restore({ENGINE_NAME: self.engine}, self.resume) \
            if self.checkpoints is not None else None
        if state is None:
            self.metrics.rewind(None)
            return
        self.metrics.rewind(state["step"], state.get("metrics_lines"))
        with self.checkpoints.reading_loaded_state():
            self.position = LoopPosition(**state["position"])
            self.evaluations = list(state["evaluations"])
            # the ranks' window together, on rank 0 alone: `_log_training` sums it over ranks again
            self._loss_sum, self._loss_items = state["loss_window"] if is_main_process() else (0.0, 0)
            self._last_train_loss = state["last_train_loss"]
        logger.info("resuming at step %d (epoch %d, micro-batch %d)", self.engine.global_steps,
                    self.position.epoch, self.position.batches_done)

    def _save(self, step: int) -> Path:
        self.metrics.sync()  # the checkpoint counts its lines
        return self.checkpoints.save(step, {ENGINE_NAME: self.engine}, self._client_state())

    def _after_step(self, step: int) -> None:
        """Periodic checkpoint, then a requested stop: save (unless just saved) and exit with a resume hint."""
        saved = None
        if self.checkpoints is not None and self.checkpoints.should_save(step):
            saved = self._save(step)
        if self.interrupt is not None and self.interrupt.should_stop():
            if self.checkpoints is None:
                raise UserError(f"stopped on a signal after step {step}; no checkpoint manager, nothing was saved")
            self.interrupt.exit_for_resume(step, saved or self._save(step))

    # training -----------------------------------------------------------------------------------

    def _log_training(self, step: int, window_start: float, samples: int) -> None:
        total, items = sum_over_ranks([self._loss_sum, self._loss_items])
        loss = total / max(items, 1.0)
        self._last_train_loss = loss
        elapsed = max(time.perf_counter() - window_start, 1e-9)
        self.metrics.log(
            step,
            {
                "train/loss": loss,
                **self.learning_rate_groups.logged(self.engine, "train/"),
                "train/samples_per_s": samples * get_world_size() / elapsed,
                "train/epoch": self.position.epoch + self.position.batches_done / max(self._batches_per_epoch, 1),
            },
        )
        self._loss_sum, self._loss_items = 0.0, 0

    def _end_epoch_if_done(self) -> None:
        """Once every micro-batch of the epoch has run, the position moves to the next epoch, and the model is
        evaluated. The last epoch is done too once every step of all epochs has been taken: the fewer than
        `gradient_accumulation_steps` micro-batches it has left make no step (`_windows`)."""
        last_epoch_trained = (self.position.epoch == self.config.num_train_epochs - 1
                              and self.engine.global_steps >= self._steps_in_all_epochs)
        if self.position.batches_done >= self._batches_per_epoch or last_epoch_trained:
            self.position = LoopPosition(epoch=self.position.epoch + 1)
            self.evaluate(self.engine.global_steps)

    @property
    def _steps_in_all_epochs(self) -> int:
        return self._batches_per_epoch * self.config.num_train_epochs // self.config.gradient_accumulation_steps

    @property
    def _batches_per_epoch(self) -> int:
        return micro_batches_per_epoch(len(self.train_dataset), self.config.per_device_train_batch_size, get_world_size())

    def _micro_batches(self) -> Iterator[tuple[Batch, int]]:
        """The run's remaining micro-batches in order, across epoch ends, each with its examples. The position counts
        each one as it is taken; an epoch whose last one was taken ends (and is evaluated) when the next one is asked
        for."""
        while self.position.epoch < self.config.num_train_epochs:
            for batch in self.train_loader(self.position.epoch, self.position.batches_done):
                examples = micro_batch_examples(len(self.train_dataset), self.config.per_device_train_batch_size,
                                                get_world_size(), self.position.batches_done)
                self.position.batches_done += 1
                yield to_device(batch, self.engine.device), examples
            self._end_epoch_if_done()

    def _windows(self) -> Iterator[AccumulationWindow]:
        """Each optimizer step's micro-batches, with their items summed over the ranks (a collective per step).
        Data too short for a whole step at the end of the last epoch is left untrained (it made no step
        before either)."""
        micro_batches = self._micro_batches()
        while taken := list(itertools.islice(micro_batches, self.config.gradient_accumulation_steps)):
            if len(taken) < self.config.gradient_accumulation_steps:
                return
            batches = [batch for batch, _ in taken]
            items = [self.count_items(batch) for batch in batches]
            yield AccumulationWindow(batches, items, accumulation_weights(items, len(batches)),
                                     sum(examples for _, examples in taken))

    def _train_window(self, window: AccumulationWindow) -> float:
        """Forward, backward and (at the window's end) the optimizer step of one window; returns this rank's
        item-weighted mean loss over it."""
        engine = self.engine
        loss_sum = 0.0
        for batch, items, weight in zip(window.batches, window.items, window.weights):
            loss = self.loss_fn(engine, batch)
            check_finite("training loss", loss, engine.global_steps + 1, self.checkpoints)
            engine.backward(loss * weight)
            step_engine(engine, self.config.description)
            loss_sum += loss.detach().float().item() * items
        self._loss_sum += loss_sum
        self._loss_items += sum(window.items)
        return loss_sum / max(sum(window.items), 1)

    def fit(self) -> TrainResult:
        """Train for `num_training_steps` optimizer steps; returns the losses and every evaluation."""
        config, engine = self.config, self.engine
        started = time.perf_counter()
        total = self.num_training_steps
        self._restore()
        if not self.evaluations:
            self.evaluate(step=0)
        engine.train()
        with tqdm(
            total=total, initial=engine.global_steps, desc=config.description, unit="step",
            disable=not is_main_process(), dynamic_ncols=True,
        ) as bar:  # closed on an error too, so a stop message starts on its own line
            window_start, window_samples = time.perf_counter(), 0
            windows = self._windows()
            while engine.global_steps < total and (window := next(windows, None)) is not None:
                step_loss = self._train_window(window)
                window_samples += window.examples
                step = engine.global_steps
                bar.set_postfix(progress_postfix(step_loss, self.learning_rate_groups.logged(engine, "")))
                bar.update(1)
                if step % config.log_interval == 0 or step == total:
                    self._log_training(step, window_start, window_samples)
                    window_start, window_samples = time.perf_counter(), 0
                if config.eval_interval and step % config.eval_interval == 0 and step < total:
                    self.evaluate(step)
                self._after_step(step)
        self._end_epoch_if_done()  # a run resumed from the checkpoint at its last step, which ended an epoch
        if not self.evaluations or self.evaluations[-1]["step"] != engine.global_steps:
            self.evaluate(engine.global_steps)
        return TrainResult(
            steps=engine.global_steps,
            epochs_completed=self.position.epoch,
            train_loss=self._last_train_loss,
            wall_time_s=time.perf_counter() - started,
            evaluations=list(self.evaluations),
        )
