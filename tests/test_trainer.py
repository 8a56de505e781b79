"""The shared supervised loop: step counting, accumulation, evaluation cadence, metrics, and the
reliability wiring (periodic checkpoints, exact resume, stop on a signal, stop on a non-finite loss)."""
import logging
import os
import signal
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from conftest import recorded_step_gradients, run_on_two_ranks
from tiny_models import make_tiny_model

from step1_sft.objective import evaluate_perplexity, sft_loss, sft_loss_items
from training.core.args import ModelTrainingConfig, ScheduleSettings, group
from training.core.engine import OptimizationSettings, create_train_engine
from training.core.lora import apply_lora
from training.loops.metrics import MetricsLogger, read_metrics
from training.loops.trainer import (
    LoopConfig,
    SkipFirst,
    SupervisedTrainer,
    count_optimizer_steps,
    micro_batch_examples,
    micro_batches_per_epoch,
)
from training.reliability.checkpointing import CLIENT_STATE_FILE, CheckpointManager
from training.reliability.guards import NonFiniteError
from training.reliability.signals import EXIT_INTERRUPTED, GracefulInterrupt
from utils.errors import UserError

TEXTS = [
    "Human: What is the capital of France? Assistant: The capital of France is Paris.",
    "Human: Tell me a joke. Assistant: Why did the chicken cross the road?",
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a reward model and a policy.",
]


def _items(tokenizer, count):
    items = []
    for index in range(count):
        ids = torch.tensor(tokenizer(TEXTS[index % len(TEXTS)])["input_ids"] + [tokenizer.eos_token_id])
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return items


def _collate(items):
    length = max(len(i["input_ids"]) for i in items)
    out = {"input_ids": torch.zeros(len(items), length, dtype=torch.long),
           "attention_mask": torch.zeros(len(items), length, dtype=torch.long),
           "labels": torch.full((len(items), length), -100, dtype=torch.long)}
    for row, item in enumerate(items):
        for key in out:
            out[key][row, : len(item[key])] = item[key]
    return out


def _trainer(tmp_path, config, train_count=8, lr=3e-3, seed=0, arch="llama", loss_fn=sft_loss, zero_stage=0,
             eval_count=4, dtype="fp32", train_items=None, lora_learning_rate=None, **options):
    """A trainer of a tiny model (with LoRA adapters on its layers, trained with the rest, given
    `lora_learning_rate`)."""
    model, tokenizer = make_tiny_model(arch, seed=seed)
    if lora_learning_rate is not None:
        model = apply_lora(model, 4)
    train_items = train_items(tokenizer) if train_items else _items(tokenizer, train_count)
    steps = count_optimizer_steps(len(train_items), config, world_size=1)
    settings = OptimizationSettings(
        learning_rate=lr, num_training_steps=steps, micro_batch_size=config.per_device_train_batch_size,
        zero_stage=zero_stage, dtype=dtype,
        gradient_accumulation_steps=config.gradient_accumulation_steps, lr_scheduler_type="constant_with_warmup",
        lora_learning_rate=lora_learning_rate,
    )
    engine = create_train_engine(model, settings)
    metrics = MetricsLogger(tmp_path, enable_tensorboard=False)
    trainer = SupervisedTrainer(
        engine, train_items, _items(tokenizer, eval_count), _collate, loss_fn, evaluate_perplexity,
        config, metrics, num_training_steps=steps, **options,
    )
    return trainer


def test_step_count_spans_epochs_and_is_capped():
    config = LoopConfig(num_train_epochs=3, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    # 10 examples on 2 ranks: 5 per rank -> 3 micro-batches per epoch, 9 in all -> 2 optimizer steps
    assert count_optimizer_steps(10, config, world_size=2) == 2
    config.max_steps = 1
    assert count_optimizer_steps(10, config, world_size=2) == 1
    with pytest.raises(UserError, match="gradient_accumulation_steps"):
        count_optimizer_steps(3, LoopConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4), world_size=1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_micro_batch_counts_are_the_distributed_samplers_batches(world_size):
    """Each rank's loader over a `DistributedSampler` (which repeats the first examples so every rank gets as many)
    makes as many micro-batches as `micro_batches_per_epoch` says, of the sizes `micro_batch_examples` says."""
    from torch.utils.data import DataLoader, DistributedSampler

    for num_examples in (1, 2, 5, 7, 8, 13):
        for batch_size in (1, 3, 4):
            expected = [micro_batch_examples(num_examples, batch_size, world_size, index)
                        for index in range(micro_batches_per_epoch(num_examples, batch_size, world_size))]
            for rank in range(world_size):
                sampler = DistributedSampler(range(num_examples), num_replicas=world_size, rank=rank, shuffle=False)
                loader = DataLoader(range(num_examples), batch_size=batch_size, sampler=sampler)
                assert [len(batch) for batch in loader] == expected, (num_examples, batch_size, rank)


def test_skip_first_resumes_mid_epoch():
    assert list(SkipFirst(range(7), 3)) == [3, 4, 5, 6]
    assert len(SkipFirst(range(7), 3)) == 4
    assert list(SkipFirst(range(2), 5)) == []


def test_fit_accumulates_evaluates_each_epoch_and_logs(distributed, tmp_path):
    config = LoopConfig(num_train_epochs=2, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                        gradient_accumulation_steps=2, log_interval=1)
    trainer = _trainer(tmp_path, config)
    result = trainer.fit()
    # 8 examples / batch 2 = 4 micro-batches per epoch, 2 per optimizer step, 2 epochs -> 4 steps
    assert result.steps == 4 and trainer.engine.global_steps == 4
    assert result.epochs_completed == 2
    assert [e["step"] for e in result.evaluations] == [0, 2, 4]
    assert result.final_eval["perplexity"] < result.first_eval["perplexity"]
    records = read_metrics(tmp_path)
    train_losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(train_losses) == 4 and train_losses[-1] < train_losses[0]
    assert sum("eval/perplexity" in r for r in records) == 3
    _trainer(tmp_path, config).fit()  # a fresh run into the same folder: its metrics alone, not appended
    assert len(read_metrics(tmp_path)) == len(records)


@pytest.mark.parametrize("epochs, steps", [(1, 1), (3, 4)])
def test_the_last_epoch_ends_when_fewer_micro_batches_than_a_step_are_left(distributed, tmp_path, epochs, steps):
    """12 items / batch 2 = 6 micro-batches an epoch, 4 a step: the last epoch's leftover 2 make no step, and the
    summary said one epoch fewer than the run trained, its final evaluation filed under the epoch before."""
    config = LoopConfig(num_train_epochs=epochs, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                        gradient_accumulation_steps=4, log_interval=1)
    result = _trainer(tmp_path, config, train_count=12).fit()
    assert result.steps == steps and result.epochs_completed == epochs
    assert result.evaluations[-1]["step"] == steps and result.evaluations[-1]["epoch"] == epochs


def test_max_steps_stops_mid_epoch_with_a_final_evaluation(distributed, tmp_path):
    config = LoopConfig(num_train_epochs=5, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                        max_steps=3, eval_interval=2, log_interval=10)
    trainer = _trainer(tmp_path, config)
    result = trainer.fit()
    assert result.steps == 3 and result.epochs_completed == 0
    assert [e["step"] for e in result.evaluations] == [0, 2, 3]
    # the last step is always logged even when it is not a multiple of log_interval
    assert [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r] == [3]


def test_the_logged_samples_per_second_count_an_epochs_short_last_micro_batch_as_it_is(distributed, tmp_path,
                                                                                      monkeypatch):
    """5 items / batch 2: each epoch's third micro-batch holds 1 example, and was counted as 2. The clock stands
    still, so each step's rate is its examples over the 1e-9 s floor."""
    import training.loops.trainer as trainer_module

    config = LoopConfig(num_train_epochs=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, log_interval=1)
    trainer = _trainer(tmp_path, config, train_count=5)
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    trainer.fit()
    rates = [record["train/samples_per_s"] for record in read_metrics(tmp_path) if "train/loss" in record]
    assert rates == pytest.approx([2e9, 2e9, 1e9, 2e9, 2e9, 1e9])


def test_the_progress_bar_shows_the_adapters_learning_rate_beside_the_models(distributed, tmp_path, monkeypatch):
    """With --lora_learning_rate the bar showed the first parameter group's rate alone, as the logs did before
    train/lora_lr: here the model's, 3e-3, hiding the adapters' 1e-4."""
    import training.loops.trainer as trainer_module

    shown = []

    class RecordedBar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix(self, values=None, **kwargs):
            shown.append({**(values or {}), **kwargs})

        def update(self, count):
            pass

    monkeypatch.setattr(trainer_module, "tqdm", RecordedBar)
    config = LoopConfig(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=1)
    _trainer(tmp_path, config, lora_learning_rate=1e-4).fit()
    assert shown and shown[-1]["lr"] == "3.00e-03" and shown[-1]["lora_lr"] == "1.00e-04", shown


def test_accumulation_weights_make_each_steps_loss_the_mean_over_its_items():
    from training.loops.accumulation import accumulation_weights

    weights = accumulation_weights([2, 12, 5, 5], accumulation=2)  # two steps on one rank
    assert weights == pytest.approx([4 / 14, 24 / 14, 1.0, 1.0])
    assert accumulation_weights([7, 7, 7], accumulation=1) == [1.0, 1.0, 1.0]  # exactly: a run's numbers stay as they were
    with pytest.raises(ValueError, match="whole optimizer steps"):
        accumulation_weights([1, 2, 3], accumulation=2)


def test_accumulation_weights_count_every_ranks_micro_batches(monkeypatch):
    """Two ranks: this one's micro-batches of 2 and 12 items, the other's 10 in all. DeepSpeed averages the four
    micro-batches' gradients, so each mean weighs items x 4 / 24 (a rank factor left out passed on one rank)."""
    from training.loops import accumulation

    monkeypatch.setattr(accumulation, "is_initialized", lambda: True)
    monkeypatch.setattr(accumulation.torch_dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(accumulation, "sum_over_ranks", lambda values, group=None: [value + 10 for value in values])
    assert accumulation.accumulation_weights([2, 12], accumulation=2) == pytest.approx([2 * 4 / 24, 12 * 4 / 24])


def _uneven_answers(tokenizer):
    """Two SFT items whose answers differ sixfold in predicted tokens (the rest of each is prompt, labelled -100)."""
    items = []
    for text, answer in ((TEXTS[3], 2), (TEXTS[0], 12)):
        ids = torch.tensor(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
        labels = torch.full_like(ids, -100)
        labels[-answer:] = ids[-answer:]
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return items


def _one_step(tmp_path, monkeypatch, batch, accumulation, dtype="fp32", zero_stage=0):
    """One optimizer step on `_uneven_answers` as `accumulation` micro-batches of `batch`: the gradient DeepSpeed
    applies (ZeRO-0 fp32: the whole vector; always its norm) and the logged train/loss."""
    from training.loops import trainer as loop

    gradients = recorded_step_gradients(monkeypatch, loop)
    config = LoopConfig(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, log_interval=1)
    trainer = _trainer(tmp_path, config, train_items=_uneven_answers, eval_count=1, dtype=dtype, zero_stage=zero_stage,
                       count_items=sft_loss_items)
    trainer.fit()
    assert trainer.engine.global_steps == 1
    return {"gradient": gradients.get(config.description),
            "norm": trainer.engine.get_global_grad_norm(),  # None at ZeRO-0 fp32
            "loss": [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]}


def test_an_accumulated_step_averages_over_all_its_tokens_as_one_micro_batch_does(distributed, tmp_path,
                                                                                  monkeypatch):
    """SFT, two answers of 2 and 12 tokens: one micro-batch of both or two accumulated micro-batches of one give one
    gradient and one logged loss, the mean over the 14 tokens (the mean of the micro-batches' means weighed each
    token of the short answer six times as much as one of the long)."""
    whole = _one_step(tmp_path / "whole", monkeypatch, batch=2, accumulation=1)
    split = _one_step(tmp_path / "split", monkeypatch, batch=1, accumulation=2)
    difference = (split["gradient"] - whole["gradient"]).norm() / whole["gradient"].norm()
    assert difference < 1e-5, difference.item()
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-6)


@pytest.mark.parametrize("dtype,zero_stage", [("bf16", 0), ("bf16", 3), ("fp32", 3)])
def test_an_accumulated_steps_gradient_norm_is_one_micro_batches_in_every_dtype_and_stage(distributed, tmp_path,
                                                                                          monkeypatch, dtype,
                                                                                          zero_stage):
    """The same two-answer step, seen through the gradient norm DeepSpeed clips with, where the gradient itself sits
    in the optimizer's own (fp32, partitioned) buffers."""
    whole = _one_step(tmp_path / "whole", monkeypatch, 2, 1, dtype, zero_stage)
    split = _one_step(tmp_path / "split", monkeypatch, 1, 2, dtype, zero_stage)
    assert float(split["norm"]) == pytest.approx(float(whole["norm"]), rel=2e-2 if dtype == "bf16" else 1e-5)
    assert split["loss"] == pytest.approx(whole["loss"], rel=2e-2 if dtype == "bf16" else 1e-6)


@dataclass
class _TwoModelsCLI:
    actor: ModelTrainingConfig = group("actor_")
    critic: ModelTrainingConfig = group("critic_")
    schedule: ScheduleSettings


def test_flag_groups_compose_per_model_with_prefixes():
    from types import SimpleNamespace

    from training.core.args import SettingsParser, flag_values, optimization_settings

    settings = SettingsParser(_TwoModelsCLI).parse_args(
        ["--actor_zero_stage", "3", "--critic_learning_rate", "5e-6", "--critic_offload", "--actor_lora_dim", "8",
         "--gradient_accumulation_steps", "2"])
    actor = optimization_settings(settings.actor, settings.schedule, "fp32", 10, micro_batch_size=2)
    critic = optimization_settings(settings.critic, settings.schedule, "fp32", 10, micro_batch_size=2)
    args = SimpleNamespace(**flag_values(settings))
    assert (actor.zero_stage, actor.offload, critic.zero_stage, critic.offload) == (3, False, 0, True)
    assert critic.learning_rate == 5e-6 and actor.gradient_accumulation_steps == critic.gradient_accumulation_steps == 2
    assert args.actor_lora_dim == 8 and args.critic_lora_dim == 0


def test_only_optimize_lora_keeps_named_heads_trainable(tiny_model_dir):
    from training.core.args import apply_model_options
    from training.core.reward_model import RewardModel

    path = tiny_model_dir("llama")
    flags = ModelTrainingConfig(gradient_checkpointing=True, lora_dim=4, lora_module_name="layers.",
                                only_optimize_lora=True)
    model = apply_model_options(RewardModel.from_causal_lm(path), flags, trainable_heads=("v_head",))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name or "v_head" in name for name in trainable)
    assert any("v_head" in name for name in trainable)
    flags.lora_dim = 0
    with pytest.raises(UserError, match="only_optimize_lora needs"):
        apply_model_options(RewardModel.from_causal_lm(path), flags)


RESUME_CONFIG = dict(num_train_epochs=3, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                     gradient_accumulation_steps=2, eval_interval=3, log_interval=1)  # 2 steps per epoch, 6 in all


def _weights(trainer):
    return {name: param.detach().clone() for name, param in trainer.engine.module.named_parameters()}


@pytest.mark.parametrize("train_count,steps,epochs,evaluated_at", [
    (8, 6, 3, [0, 2, 3, 4, 6]),  # 4 micro-batches an epoch: every optimizer step within one epoch
    (6, 4, 3, [0, 1, 3, 4]),  # 3 an epoch: steps 2 and 4 span an epoch's end (evaluated between their batches);
    # step 3 is an --eval_interval step and ends epoch 1: evaluated once; step 4 ends the run, and with it epoch 2
    # (its one micro-batch left makes no step)
])
def test_a_run_stopped_by_sigterm_resumes_to_the_same_end(distributed, tmp_path, train_count, steps, epochs,
                                                         evaluated_at):
    """GPT-2's dropout is on, so the resumed run matches only if RNG, data position and optimizer all come back."""
    torch.manual_seed(7)
    straight = _trainer(tmp_path / "straight", LoopConfig(**RESUME_CONFIG), arch="gpt2", train_count=train_count)
    expected = straight.fit()

    micro_batches = []

    def signalled_during_step_3(model, batch):
        micro_batches.append(1)
        if len(micro_batches) == 5:  # first micro-batch of optimizer step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return sft_loss(model, batch)

    run_dir = tmp_path / "stopped"
    torch.manual_seed(7)
    with GracefulInterrupt() as interrupt:
        stopped = _trainer(run_dir, LoopConfig(**RESUME_CONFIG), arch="gpt2", loss_fn=signalled_during_step_3,
                           checkpoints=CheckpointManager(run_dir), interrupt=interrupt, train_count=train_count)
        with pytest.raises(SystemExit) as exit_info:
            stopped.fit()
    assert exit_info.value.code == EXIT_INTERRUPTED
    assert stopped.engine.global_steps == 3 and len(micro_batches) == 6  # the step under way was finished
    assert [c.step for c in CheckpointManager(run_dir).complete_checkpoints()] == [3]

    torch.manual_seed(12345)  # the checkpoint's RNG state must win over whatever the new process has
    resumed = _trainer(run_dir, LoopConfig(**RESUME_CONFIG), arch="gpt2", seed=99,
                       checkpoints=CheckpointManager(run_dir), resume=True, train_count=train_count)
    result = resumed.fit()
    assert result.steps == expected.steps == steps and result.epochs_completed == expected.epochs_completed == epochs
    for name, value in _weights(straight).items():
        assert torch.equal(value, _weights(resumed)[name]), name
    assert [e["step"] for e in result.evaluations] == [e["step"] for e in expected.evaluations] == evaluated_at
    for got, want in zip(result.evaluations, expected.evaluations):
        assert got == pytest.approx(want, rel=1e-6)
    assert result.train_loss == pytest.approx(expected.train_loss, rel=1e-6)


def test_a_resume_from_a_loop_state_without_the_position_names_the_checkpoint(distributed, tmp_path):
    """A client state another version wrote (or altered) without the data position ended the resume in a bare
    KeyError: 'position'."""
    manager = CheckpointManager(tmp_path, save_interval=2)
    _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), checkpoints=manager).fit()
    saved = manager.latest().path / CLIENT_STATE_FILE
    state = torch.load(saved, weights_only=True)
    del state["position"]
    torch.save(state, saved)
    with pytest.raises(UserError, match=rf"checkpoint {saved.parent} holds a loop state .*KeyError: 'position'.* "
                                        "delete that folder"):
        _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), checkpoints=manager, resume=True).fit()


def test_a_checkpoint_is_saved_after_the_metrics_lines_it_counts_are_on_disk(distributed, tmp_path, fsynced_paths):
    """The checkpoint is fsynced but metrics.jsonl was not: after a power loss the checkpoint could outlive the lines
    it counts (`metrics_lines`)."""
    manager = CheckpointManager(tmp_path, save_interval=3)
    last_synced_before_saves = []
    save = manager.save
    manager.save = lambda *args: (last_synced_before_saves.append(fsynced_paths[-1:]), save(*args))[-1]
    _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), checkpoints=manager).fit()
    assert last_synced_before_saves == [[str(tmp_path / "metrics.jsonl")]] * 2


def test_checkpoints_are_saved_every_save_interval_steps(distributed, tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, save_interval=2)
    _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), checkpoints=manager).fit()
    assert [c.step for c in manager.complete_checkpoints()] == [4, 6]  # step 2's was pruned
    with pytest.raises(UserError, match="--resume"):  # a fresh run must not overwrite them
        _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), checkpoints=manager).fit()


def test_a_non_finite_loss_stops_before_its_update_and_names_the_checkpoint(distributed, tmp_path):
    calls = []

    def nan_at_step_3(model, batch):
        calls.append(1)
        loss = sft_loss(model, batch)
        return loss * float("nan") if len(calls) == 5 else loss

    manager = CheckpointManager(tmp_path, save_interval=2)
    trainer = _trainer(tmp_path, LoopConfig(**RESUME_CONFIG), loss_fn=nan_at_step_3, checkpoints=manager)
    with pytest.raises(NonFiniteError, match=r"at step 3.*step2"):
        trainer.fit()
    assert all(torch.isfinite(p).all() for p in _weights(trainer).values())


@pytest.mark.parametrize("dtype,zero_stage", [("bf16", 0), ("bf16", 3), ("fp32", 0), ("fp32", 2)])
def test_a_step_whose_gradients_are_nan_behind_a_finite_loss_is_skipped_and_named(distributed, tmp_path, caplog,
                                                                                   dtype, zero_stage):
    """At optimizer step 2 the loss is finite but a term it masks out has a NaN gradient (as a left-padded row's
    attention had through cuDNN's backward): the update is skipped, the log names the step, the run goes on. At
    fp32 ZeRO-0, where DeepSpeed applies such gradients unchecked, the NaN reached every weight and the next loss
    stopped the run."""
    calls, before_step = [], {}

    def nan_gradients_at_step_2(model, batch):
        calls.append(1)
        before_step[len(calls)] = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        if len(calls) != 2:
            return sft_loss(model, batch)
        out = model(**batch)
        logits = out.logits.float()
        masked_out = torch.where(torch.zeros_like(logits, dtype=torch.bool), torch.sqrt(-1 - logits.abs()), 0)
        return out.loss + masked_out.sum()

    config = LoopConfig(num_train_epochs=1, per_device_train_batch_size=2, per_device_eval_batch_size=4)
    trainer = _trainer(tmp_path, config, loss_fn=nan_gradients_at_step_2, zero_stage=zero_stage, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="training.reliability.guards"):
        trainer.fit()
    assert trainer.engine.global_steps == 4 and trainer.engine.skipped_steps == 1
    ours = [record.message.split(",")[0] for record in caplog.records if record.name == "training.reliability.guards"]
    assert ours == [f"{config.description}: optimizer step 2 skipped"]
    assert all(torch.isfinite(p).all() for p in _weights(trainer).values())
    if zero_stage != 3:  # (ZeRO-3's module holds no weights between forwards)
        for name, value in before_step[3].items():
            assert torch.equal(value, before_step[2][name]), f"step 2 moved {name}"
        assert any(not torch.equal(value, before_step[3][name]) for name, value in _weights(trainer).items()), \
            "steps 3 and 4 did not train"


TWO_RANKS_LOSS_WINDOW = """
import shutil, sys
from pathlib import Path
from utils.dist import barrier, init_distributed, is_main_process
init_distributed()
from test_trainer import _trainer
from training.loops.metrics import read_metrics
from training.loops.trainer import LoopConfig
from training.reliability.checkpointing import CheckpointManager

root = Path(sys.argv[1])
config = LoopConfig(num_train_epochs=1, per_device_train_batch_size=2, log_interval=2)
whole = _trainer(root / "whole", config, train_count=16, checkpoints=CheckpointManager(root / "whole", save_interval=3))
whole.fit()  # 4 steps on each rank's 8 items; checkpoints at step 3, whose losses are logged with step 4's
if is_main_process():
    shutil.copytree(root / "whole", root / "resumed")
    (root / "resumed" / "checkpoints" / "latest").write_text("step3")
barrier()
resumed = _trainer(root / "resumed", config, train_count=16, checkpoints=CheckpointManager(root / "resumed"),
                   resume=True)
resumed.fit()
if is_main_process():
    for run in ("whole", "resumed"):
        print(run, [(row["step"], row["train/loss"]) for row in read_metrics(root / run) if "train/loss" in row])
"""


@pytest.mark.slow
def test_the_loss_logged_first_after_a_resume_on_two_ranks_is_the_uninterrupted_runs(tmp_path):
    """The checkpoint holds the losses of steps not yet logged, of every rank: a resume on 2 ranks logs the same
    train/loss at its first log step as the uninterrupted run (each rank used to take rank 0's share)."""
    stdout = run_on_two_ranks(TWO_RANKS_LOSS_WINDOW, tmp_path, str(tmp_path))
    logged = dict(line.split(" ", 1) for line in stdout.splitlines() if line.startswith(("whole ", "resumed ")))
    assert logged["whole"] == logged["resumed"], logged
    assert "(4, " in logged["whole"]


TWO_RANKS_EVALUATION = """
import sys
from pathlib import Path
import torch
from utils.dist import init_distributed
init_distributed()
from step1_sft.objective import predicted_token_count, sft_loss
from test_trainer import _collate, _trainer
from training.loops.trainer import LoopConfig

config = LoopConfig(per_device_train_batch_size=2, per_device_eval_batch_size=int(sys.argv[3]))
trainer = _trainer(Path(sys.argv[1]), config, zero_stage=int(sys.argv[2]), eval_count=5)
values = trainer.evaluate(0)
whole = _collate(trainer.eval_dataset)
say = lambda *words: sys.stdout.write(" ".join(map(str, words)) + "\\n") or sys.stdout.flush()  # one write a line
say("tokens", values["tokens"], predicted_token_count(whole["labels"]))
if int(sys.argv[2]) == 0:  # every rank holds the whole model: the whole set in one forward, no collective
    trainer.engine.eval()
    with torch.no_grad():
        say("loss", values["loss"], sft_loss(trainer.engine, whole).item())
"""


TWO_RANKS_ONE_STEP = """
import sys
from pathlib import Path
import pytest
from utils.dist import init_distributed, is_main_process
init_distributed()
from test_trainer import _one_step
seen = _one_step(Path(sys.argv[1]), pytest.MonkeyPatch(), 1, 1, "fp32", 3)
if is_main_process():
    print("step", float(seen["norm"]), seen["loss"][0])
"""


@pytest.mark.slow
def test_a_step_over_two_ranks_averages_over_all_their_tokens_as_one_rank_does(distributed, tmp_path, monkeypatch):
    """The two answers of 2 and 12 tokens on two ranks, one each, at ZeRO-3: the gradient norm and the logged loss of
    the step are those of one rank's micro-batch of both (the ranks' token counts are summed before the step)."""
    stdout = run_on_two_ranks(TWO_RANKS_ONE_STEP, tmp_path, str(tmp_path / "ranks"))
    norm, loss = next(line.split()[1:] for line in stdout.splitlines() if line.startswith("step "))
    whole = _one_step(tmp_path / "whole", monkeypatch, 2, 1, "fp32", 3)
    assert float(norm) == pytest.approx(float(whole["norm"]), rel=1e-5)
    assert float(loss) == pytest.approx(whole["loss"][0], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage,batch", [(0, 2), (3, 1)])  # at batch 1, rank 1 has 2 batches to rank 0's 3
def test_a_held_out_set_split_over_two_ranks_counts_each_item_once(tmp_path, stage, batch):
    """5 held-out items on 2 ranks: the totals are the whole set's (a padding sampler counted the first item
    twice), at ZeRO-3 too, where the rank with fewer batches runs as many forwards."""
    stdout = run_on_two_ranks(TWO_RANKS_EVALUATION, tmp_path, str(tmp_path), str(stage), str(batch))
    for line in stdout.splitlines():
        if line.startswith(("tokens ", "loss ")):
            name, reported, expected = line.split()
            assert float(reported) == pytest.approx(float(expected), rel=1e-5), line
    assert stdout.count("tokens ") == 2 and stdout.count("loss ") == (2 if stage == 0 else 0)
