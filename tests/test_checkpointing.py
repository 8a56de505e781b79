"""Resume checkpoints: exact continuation, crash-safe saves, the `latest` pointer, pruning, atomic folders."""
import argparse
import enum
import json
import random
from collections import defaultdict, namedtuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model

from training.core.args import RunArguments, SettingsParser
from training.core.engine import OptimizationSettings, create_train_engine
from training.reliability.checkpointing import (
    LATEST_FILE,
    MARKER_FILE,
    CheckpointManager,
    CheckpointSettings,
    capture_rng_state,
    check_weights_only_safe,
    cut_short_files,
    folder_fingerprint,
    restore_rng_state,
)
from utils.atomic import atomic_directory, shared_atomic_directory
from utils.errors import UserError, UserErrors

NUM_SEQUENCES, BATCH, SEQ_LEN = 10, 2, 12
BATCHES_PER_EPOCH = NUM_SEQUENCES // BATCH
TOTAL_STEPS = 6


def build_engine(stage: int, seed: int = 0, arch: str = "gpt2", learning_rate: float = 5e-3):
    # gpt2's default dropout (0.1) makes the result depend on the torch RNG, so resume must restore it
    model, _ = make_tiny_model(arch, seed=seed)
    settings = OptimizationSettings(
        learning_rate=learning_rate, num_training_steps=TOTAL_STEPS, zero_stage=stage, micro_batch_size=BATCH,
        num_warmup_steps=3, optimizer="torch_adamw", lr_scheduler_type="cosine",
    )
    engine = create_train_engine(model, settings)
    engine.train()
    return engine


def dataset(vocab_size: int = 200) -> torch.Tensor:
    return torch.randint(0, vocab_size, (NUM_SEQUENCES, SEQ_LEN), generator=torch.Generator().manual_seed(7))


def epoch_batches(data: torch.Tensor, epoch: int, skip: int):
    """A seeded sampler's batches of `epoch`, after the `skip` already consumed."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(100 + epoch))
    for index in range(skip, BATCHES_PER_EPOCH):
        yield data[order[index * BATCH:(index + 1) * BATCH]]


def train(engines: dict, data, position: dict, until: int, manager=None, save_at=()) -> dict:
    """Train every engine on the same batches up to optimizer step `until`; saves at the steps in `save_at`."""
    lead = next(iter(engines.values()))
    while lead.global_steps < until:
        for batch in epoch_batches(data, position["epoch"], position["batches_done"]):
            for engine in engines.values():
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
            position["batches_done"] += 1
            step = lead.global_steps
            if step in save_at:
                extra = {"ema": {"shadow": lead.module.lm_head.weight.detach().clone()}, "kl_coef": 0.1 * step}
                manager.save(step, engines, {**position, **extra})
            if step >= until:
                break
        if position["batches_done"] >= BATCHES_PER_EPOCH:
            position.update(epoch=position["epoch"] + 1, batches_done=0)
    return position


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in engine.module.named_parameters()}


@pytest.mark.parametrize("stage,names", [(0, ("actor", "critic")), (2, ("actor",))])
def test_resume_reproduces_the_uninterrupted_run(distributed, tmp_path, stage, names):
    data = dataset()
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    engines = {name: build_engine(stage, seed=seed) for seed, name in enumerate(names)}
    torch.manual_seed(1)
    train(engines, data, {"epoch": 0, "batches_done": 0}, TOTAL_STEPS, manager, save_at={2, 4})
    expected = {name: weights(engine) for name, engine in engines.items()}
    assert [info.step for info in manager.complete_checkpoints()] == [2, 4]

    # resume from step 2, the older of the two: point `latest` at it
    (manager.checkpoints_dir / LATEST_FILE).write_text("step2")
    resumed = {name: build_engine(stage, seed=10 + seed) for seed, name in enumerate(names)}
    torch.manual_seed(999)
    random.seed(999)
    state = manager.load_latest(resumed)
    assert state["step"] == 2 and state["kl_coef"] == pytest.approx(0.2)
    assert (state["epoch"], state["batches_done"]) == (0, 2)
    assert isinstance(state["ema"]["shadow"], torch.Tensor)
    assert all(engine.global_steps == 2 for engine in resumed.values())
    train(resumed, data, {"epoch": state["epoch"], "batches_done": state["batches_done"]}, TOTAL_STEPS)
    for name, engine in resumed.items():
        for key, value in weights(engine).items():
            assert torch.allclose(value, expected[name][key], atol=1e-6, rtol=0), (name, key)
        assert engine.get_lr() == engines[name].get_lr()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_resumed_run_takes_its_new_peak_learning_rate_at_the_schedules_step(distributed, tmp_path, stage):
    """The checkpoint brings back its optimizer's and schedule's rates; a run resumed with another --learning_rate
    (lowered after a divergence) goes on at the same point of the schedule (warm-up, then cosine) with its own
    peak, and its optimizer steps at that rate."""
    data = dataset()
    manager = CheckpointManager(tmp_path / "run")
    original = {"actor": build_engine(stage)}
    train(original, data, {"epoch": 0, "batches_done": 0}, 2, manager, save_at={2})
    lowered = {"actor": build_engine(stage, seed=10, learning_rate=5e-4)}
    state = manager.load_latest(lowered)
    engine = lowered["actor"]
    assert engine.lr_scheduler.base_lrs == [5e-4] * len(engine.lr_scheduler.base_lrs)
    position = {"epoch": state["epoch"], "batches_done": state["batches_done"]}
    train(original, data, dict(position), 4)
    train(lowered, data, position, 4)
    assert engine.get_lr() == pytest.approx([rate / 10 for rate in original["actor"].get_lr()], rel=1e-12)
    assert [group["lr"] for group in engine.lr_scheduler.optimizer.param_groups] == engine.get_lr()


def test_interrupted_save_keeps_previous_checkpoint(distributed, tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    engines = {"actor": build_engine(0), "critic": build_engine(0, seed=1)}
    first = manager.save(1, engines, {"epoch": 0, "batches_done": 1})

    critic = engines["critic"]

    def crash(save_dir, tag, **kwargs):
        (tmp_path / "crashed_in").write_text(save_dir)
        raise RuntimeError("disk full")

    monkeypatch.setattr(critic, "save_checkpoint", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        manager.save(2, engines, {"epoch": 0, "batches_done": 2})
    monkeypatch.undo()
    staged = (tmp_path / "crashed_in").read_text()
    assert ".tmp-" in staged and not (tmp_path / "run" / "checkpoints" / "step2").exists()
    assert (manager.checkpoints_dir / LATEST_FILE).read_text() == "step1"
    assert not any(path.name.startswith(".") for path in manager.checkpoints_dir.iterdir())

    # a killed save can also leave a folder without marker and a pointer to it: both are skipped
    (manager.checkpoints_dir / "step5" / "actor").mkdir(parents=True)
    (manager.checkpoints_dir / LATEST_FILE).write_text("step5")
    (manager.checkpoints_dir / ".step6.tmp-deadbeef").mkdir()
    assert manager.latest().path == first
    state = manager.load_latest({"actor": build_engine(0), "critic": build_engine(0, seed=1)})
    assert state["step"] == 1 and state["batches_done"] == 1

    # the next save sweeps the staging folder and prunes the incomplete one
    manager.save(2, engines, {"epoch": 0, "batches_done": 2})
    names = sorted(path.name for path in manager.checkpoints_dir.iterdir())
    assert names == ["latest", "step1", "step2"]


def test_prune_keeps_latest_and_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        folder = manager.checkpoints_dir / f"step{step}"
        folder.mkdir(parents=True)
        (folder / MARKER_FILE).write_text(json.dumps({"step": step, "engines": ["actor"]}))
    (manager.checkpoints_dir / LATEST_FILE).write_text("step1")
    removed = manager.prune()
    assert sorted(path.name for path in removed) == ["step2"]
    assert [info.step for info in manager.complete_checkpoints()] == [1, 3, 4]
    assert manager.latest().step == 1


def test_a_prune_cut_short_leaves_no_folder_taken_for_complete(tmp_path, monkeypatch):
    """A kill while an old checkpoint is deleted leaves part of it: never one that still looks complete."""
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        folder = manager.checkpoints_dir / f"step{step}"
        (folder / "actor").mkdir(parents=True)
        (folder / MARKER_FILE).write_text(json.dumps({"step": step, "engines": ["actor"]}))
    (manager.checkpoints_dir / LATEST_FILE).write_text("step2")
    monkeypatch.setattr("shutil.rmtree", lambda path, ignore_errors=False: (Path(path) / "actor").rmdir())
    manager.prune()  # killed part-way: the engine files gone, the folder still there
    assert (manager.checkpoints_dir / "step1").is_dir()
    assert [info.step for info in manager.complete_checkpoints()] == [2]


def test_a_resume_with_another_number_of_processes_is_refused(distributed, tmp_path):
    manager = CheckpointManager(tmp_path / "run", fixed_flags={"seed": 1})
    manager.save(2, {"actor": build_engine(0)}, {})
    manager.check_start(resume=True)
    marker = manager.checkpoints_dir / "step2" / MARKER_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 4}))
    with pytest.raises(UserError, match="written by 4 processes and this run has 1; resume with 4"):
        manager.check_start(resume=True)


def test_a_resume_from_an_input_run_made_again_is_refused_and_an_older_checkpoint_is_not(distributed, tmp_path,
                                                                                          caplog):
    """An input run folder of this project is told by its run_id: made again (a new summary.json) at the same path,
    the resume is refused, naming the flag, the path and both run_ids. A checkpoint written before inputs were
    recorded resumes unchecked, saying so."""
    from training.reliability.run_records import save_run_args, save_summary

    step1 = tmp_path / "step1"
    save_run_args(step1, {"seed": 1})
    first_id = save_summary(step1, {})["run_id"]
    manager = CheckpointManager(tmp_path / "run")
    manager.check_inputs({"model_name_or_path": str(step1), "critic_model_name_or_path": None}, resume=False)
    manager.save(2, {"actor": build_engine(0)}, {})
    manager.check_inputs({"model_name_or_path": str(step1)}, resume=True)  # the same input resumes
    again_id = save_summary(step1, {})["run_id"]
    with pytest.raises(UserError, match=f"--model_name_or_path {step1}: another run made it "
                                        f"\\(run_id {first_id} -> {again_id}\\)"):
        manager.check_inputs({"model_name_or_path": str(step1)}, resume=True)
    marker = manager.checkpoints_dir / "step2" / MARKER_FILE
    marker.write_text(json.dumps({key: value for key, value in json.loads(marker.read_text()).items()
                                  if key != "inputs"}))
    with caplog.at_level("INFO"):
        manager.check_inputs({"model_name_or_path": str(step1)}, resume=True)
    assert "records no input models (an older version wrote it): the inputs are not compared" in caplog.text


@pytest.mark.parametrize("step, required, allowed, absent", [
    ("step1_sft.main", [], ["--eval_interval", "--learning_rate", "--lora_learning_rate"], ["--max_train_minutes"]),
    ("step3_rlhf.main", ["--actor_model_name_or_path", "actor"],
     ["--actor_learning_rate", "--critic_lora_learning_rate", "--max_train_minutes"], ["--eval_interval"]),
])
def test_a_refused_resume_names_the_flags_that_step_lets_change(distributed, tmp_path, step, required, allowed,
                                                                absent):
    """The refusal of a changed flag says what a resume of that step may change: its own "resume_override" flags
    (step 1 has no --max_train_minutes, which the message used to offer; its --eval_interval may change)."""
    from importlib import import_module

    from training.core.args import resume_fixed_flags, resume_override_flags

    parser = import_module(step).build_parser()

    def manager_for(seed: str) -> CheckpointManager:
        settings = parser.parse_args(["--output_dir", str(tmp_path / "run"), "--seed", seed, *required])
        return CheckpointManager(tmp_path / "run", fixed_flags=resume_fixed_flags(settings),
                                 overridable=resume_override_flags(settings))

    manager_for("1").save(2, {"actor": build_engine(0)}, {})
    with pytest.raises(UserError, match="--seed 1 -> 2") as refused:
        manager_for("2").check_start(resume=True)
    assert all(flag in str(refused.value) for flag in allowed), str(refused.value)
    assert not any(flag in str(refused.value) for flag in absent), str(refused.value)


def test_restore_follows_resume_flag(distributed, tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    engines = {"actor": build_engine(0)}
    assert manager.restore(engines, resume=False) is None
    with pytest.raises(UserError, match="no complete checkpoint .* run without --resume"):
        manager.restore(engines, resume=True)
    manager.save(4, engines, {"epoch": 1})
    with pytest.raises(UserError, match="earlier run \\(latest: step 4\\); pass --resume"):
        manager.restore(engines, resume=False)
    with pytest.raises(UserError, match="holds the models \\['actor'\\].*\\['actor', 'critic'\\]"):
        manager.restore({"actor": engines["actor"], "critic": engines["actor"]}, resume=True)
    assert manager.restore({"actor": build_engine(0)}, resume=True)["epoch"] == 1


def test_a_ranks_own_state_comes_back_to_it(distributed, tmp_path):
    """A placement's per-rank state (its chunks' random streams) round-trips on one process; before, only the
    slow two-rank placement resumes reached it."""
    manager = CheckpointManager(tmp_path / "run")
    manager.save(2, {"actor": build_engine(0)}, {"epoch": 1}, rank_state={"chunks": [3, 5]})
    state = manager.restore({"actor": build_engine(0)}, resume=True)
    assert state["epoch"] == 1 and state["rank_state"] == {"chunks": [3, 5]}
    manager.save(4, {"actor": build_engine(0)}, {"epoch": 2})
    assert "rank_state" not in manager.restore({"actor": build_engine(0)}, resume=True)


def test_a_checkpoint_missing_a_ranks_own_state_is_damaged(distributed, tmp_path):
    """A placed run's rank read its chunks' random streams from a state that was not there: a KeyError on that rank
    alone, while the others waited for it."""
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(2, {"actor": build_engine(0)}, {"epoch": 1}, rank_state={"chunks": [3, 5]})
    (path / "rank_state" / "rank0.pt").unlink()
    with pytest.raises(UserError, match=r"is damaged: rank 0's own state \(rank_state/rank0.pt is missing\)"):
        manager.restore({"actor": build_engine(0)}, resume=True)


@pytest.mark.parametrize("damaged", ["model_states", "client_state", "rank0"])
def test_a_checkpoint_file_cut_short_is_named_as_a_damaged_checkpoint(distributed, tmp_path, damaged):
    """A file cut short (at 200 bytes, at half its size) is found before anything loads and named. One whole in
    length whose bytes are overwritten passes that check: torch's reader raises (a RuntimeError, for some
    damage an OSError or an unpickling error), said as the same damaged checkpoint."""
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(2, {"actor": build_engine(0)}, {"epoch": 1})
    target = next(path.rglob(f"*{damaged}*.pt"))
    whole = target.read_bytes()
    for length in (200, len(whole) // 2):
        target.write_bytes(whole[:length])
        with pytest.raises(UserError, match=rf"checkpoint {path} is damaged: .*{damaged}.*\(cut short\).* delete "
                                            "that folder"):
            manager.restore({"actor": build_engine(0)}, resume=True)
    target.write_bytes(whole[:100] + bytes(len(whole) - 400) + whole[-300:])  # the zip's directory kept
    assert not cut_short_files(path)
    with pytest.raises(UserError, match=f"checkpoint {path} is damaged: .* delete that folder"):
        manager.restore({"actor": build_engine(0)}, resume=True)


@pytest.mark.parametrize("victim,content,named", [
    ("rng/rank0.pt", {"python": 1}, r"a random-number state \(rng/rank0.pt\) .*\(TypeError: "),
    ("rng/rank0.pt", {"torch": torch.zeros(2)}, r"a random-number state \(rng/rank0.pt\) .*\(KeyError: 'python'\)"),
    ("client_state.pt", [1, 2], r"a loop state \(client_state.pt\) .*\(a list where a dict was written\)"),
    ("client_state.pt", {"epoch": 1}, r"a loop state \(client_state.pt\) .*\(step None where checkpoint.json says 2\)"),
    ("rank_state/rank0.pt", [3, 5], r"a rank's own state \(rank_state/rank0.pt\) .*\(a list where a dict"),
    ("actor/mp_rank_00_model_states.pt", {"step": 2}, r"the 'actor' model's state \(actor/\) .*\(KeyError: 'module'\)"),
])
def test_a_checkpoint_file_of_another_structure_is_named_with_the_way_out(distributed, tmp_path, victim, content,
                                                                         named):
    """A file whole and safe to load that holds other data than this version writes (another version's, or altered)
    ended the resume in a bare TypeError or KeyError from the code taking it back (DeepSpeed's, for its own files)."""
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(2, {"actor": build_engine(0)}, {"epoch": 1}, rank_state={"chunks": [3, 5]})
    torch.save(content, path / victim)
    with pytest.raises(UserError, match=rf"checkpoint {path} holds {named}.* delete that folder .* without --resume"):
        manager.restore({"actor": build_engine(0)}, resume=True)


def test_a_loop_state_missing_what_its_caller_reads_is_named_with_the_way_out(distributed, tmp_path):
    """The keys of the client state are its caller's (the trainer's position, step 3's prompt stream): read within
    `reading_loaded_state`, one that is missing names the checkpoint rather than ending in a bare KeyError."""
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(2, {"actor": build_engine(0)}, {"epoch": 1})
    state = manager.restore({"actor": build_engine(0)}, resume=True)
    with pytest.raises(UserError, match=rf"checkpoint {path} holds a loop state .*\(KeyError: 'position'\)"), \
            manager.reading_loaded_state():
        state["position"]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_resume_reads_each_checkpoint_file_once(distributed, tmp_path, monkeypatch, stage):
    """DeepSpeed's loader read the model-states file (below ZeRO, the weights and the Adam moments) twice: whole, to
    check one entry of it, then again to load it."""
    manager = CheckpointManager(tmp_path / "run")
    saved = build_engine(stage)
    path = manager.save(2, {"actor": saved}, {"epoch": 1})
    resumed = build_engine(stage, seed=3)
    reads, load = [], torch.load

    def counted_load(file, *args, **kwargs):
        reads.append(Path(file).relative_to(path).as_posix())
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    manager.restore({"actor": resumed}, resume=True)
    assert "actor/mp_rank_00_model_states.pt" in reads and len(reads) == len(set(reads)), reads
    for name, value in weights(saved).items():
        assert torch.equal(value, weights(resumed)[name]), name


def test_saving_the_same_step_twice_keeps_the_first(distributed, tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    engines = {"actor": build_engine(0)}
    path = manager.save(2, engines, {"tag": "first"})
    assert manager.save(2, engines, {"tag": "second"}) == path
    assert torch.load(path / "client_state.pt", weights_only=True)["tag"] == "first"


def test_a_resume_discards_a_checkpoint_saved_past_the_one_latest_names(distributed, tmp_path):
    """A save cut short between its folder's rename and `latest` (SIGKILL, a second Ctrl-C) left step 4 complete
    with `latest` at step 2. The resumed run's save of step 4 kept that old folder and `latest` stayed at 2: the
    next resume went back to step 2, and step 4 held the abandoned run's state."""
    manager = CheckpointManager(tmp_path / "run", keep_last=3)
    engines = {"actor": build_engine(0)}
    manager.save(2, engines, {"run": "first"})
    manager.save(4, engines, {"run": "first"})
    (manager.checkpoints_dir / LATEST_FILE).write_text("step2")  # as the cut-short save of step 4 left it
    client_state = manager.checkpoints_dir / "step2" / "client_state.pt"
    whole = client_state.read_bytes()
    client_state.write_bytes(whole[:200])
    with pytest.raises(UserError, match="is damaged"):  # nothing is removed before the checkpoint has loaded
        manager.restore({"actor": build_engine(0)}, resume=True)
    assert [info.step for info in manager.complete_checkpoints()] == [2, 4]
    client_state.write_bytes(whole)
    assert manager.restore({"actor": build_engine(0)}, resume=True)["run"] == "first"
    assert [info.step for info in manager.complete_checkpoints()] == [2]
    saved = manager.save(4, engines, {"run": "resumed"})
    assert manager.latest().path == saved
    assert torch.load(saved / "client_state.pt", weights_only=True)["run"] == "resumed"


Position = namedtuple("Position", "epoch batch")


class Stage(enum.IntEnum):
    TRAIN = 1


def test_client_state_must_be_plain_data(distributed, tmp_path):
    with pytest.raises(TypeError, match=r"client_state\['position'\] is a Namespace"):
        check_weights_only_safe({"position": argparse.Namespace(epoch=1)})
    with pytest.raises(TypeError, match=r"client_state\[.bad.\]\[.x.\] is a ndarray"):
        check_weights_only_safe({"ok": [1, 2.0, "x", None, torch.zeros(2)], "bad": {"x": np.zeros(2)}})
    with pytest.raises(ValueError, match="client_state\\['step'\\] is 3"):
        CheckpointManager(tmp_path).save(4, {}, {"step": 3})


@pytest.mark.parametrize("value", [np.float64(0.5), np.str_("a"), Position(1, 2), defaultdict(int, a=1), Stage.TRAIN],
                         ids=["numpy float", "numpy str", "namedtuple", "defaultdict", "IntEnum"])
def test_a_subclass_of_plain_data_that_a_resume_could_not_load_is_refused_at_the_save(distributed, tmp_path, value):
    """A float, str, tuple, dict or int of a subclass (a numpy float, a namedtuple, ...) passed the save's check as
    plain data, then the resume's safe load refused the checkpoint as 'written by another version or altered'."""
    with pytest.raises(TypeError, match=rf"client_state\['loop'\]\[0\] is a {type(value).__name__};"):
        CheckpointManager(tmp_path).save(1, {}, {"loop": [value]})
    assert CheckpointManager(tmp_path).latest() is None
    if isinstance(value, (int, str)):  # as a key too
        with pytest.raises(TypeError, match=rf"client_state\['loop'\] has a key of type {type(value).__name__};"):
            CheckpointManager(tmp_path).save(1, {}, {"loop": {value: 1}})


def test_rng_state_round_trip_through_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.randn(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.randn()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


CUDA_GENERATOR_STATE = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state: its seed and offset


def test_a_gpu_runs_rng_file_resumed_on_cpu_restores_all_but_the_accelerator_stream(tmp_path, caplog):
    torch.manual_seed(3)
    state = {**capture_rng_state(), "accelerator": CUDA_GENERATOR_STATE}  # as a single-GPU run writes it
    torch.save(state, tmp_path / "rank0.pt")
    expected = torch.rand(3)
    torch.manual_seed(0)
    restore_rng_state(torch.load(tmp_path / "rank0.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected)
    assert "saved on an accelerator and resumes on CPU" in caplog.text


class _FakeGpu:
    def __init__(self) -> None:
        self.restored: list[torch.Tensor] = []

    def device_name(self) -> str:
        return "cuda"

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.restored.append(state)


def test_the_accelerator_stream_is_restored_on_a_gpu_and_a_cpu_runs_file_says_it_starts_anew(monkeypatch, caplog):
    import deepspeed.accelerator

    cpu_saved = capture_rng_state()
    gpu = _FakeGpu()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: gpu)
    restore_rng_state({**cpu_saved, "accelerator": CUDA_GENERATOR_STATE})
    assert gpu.restored == [CUDA_GENERATOR_STATE] and not caplog.text
    restore_rng_state(cpu_saved)
    assert len(gpu.restored) == 1 and "saved on CPU and resumes on cuda" in caplog.text


@dataclass
class _CheckpointCLI:
    run: RunArguments
    checkpoints: CheckpointSettings


def test_checkpoint_args_and_interval():
    settings = SettingsParser(_CheckpointCLI).parse_args(["--output_dir", "x", "--save_interval", "5", "--resume"])
    args = settings.checkpoints
    manager = args.manager(settings.run.output_dir)
    assert args.resume and manager.keep_last == 2
    assert [step for step in range(1, 16) if manager.should_save(step)] == [5, 10, 15]
    with pytest.raises(UserError, match="--keep_last_checkpoints must be at least 1"):
        CheckpointManager("x", keep_last=0)


def test_both_bad_checkpoint_flags_are_reported_at_once():
    """--keep_last_checkpoints 0 with --save_interval -1: the second was told only once the first was fixed."""
    settings = SettingsParser(_CheckpointCLI).parse_args(["--output_dir", "x", "--keep_last_checkpoints", "0",
                                                          "--save_interval", "-1"])
    with pytest.raises(UserErrors) as refused:
        settings.checkpoints.check_flags()
    assert refused.value.messages == ["--keep_last_checkpoints must be at least 1, got 0",
                                      "--save_interval must be 0 (off) or a positive number of steps, got -1"]


def test_atomic_directory_replaces_or_leaves_untouched(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (final / "old.txt").read_text() == "old"
    with atomic_directory(final) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (final / "new.txt").exists()
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_shared_atomic_directory_single_rank(distributed, tmp_path):
    final = tmp_path / "ckpt"
    with shared_atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".ckpt.tmp-")
        (tmp / "rank0.pt").write_text("x")
    assert (final / "rank0.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class _RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize("victim", ["actor/mp_rank_00_model_states.pt", "client_state.pt"])
def test_tampered_checkpoint_is_refused_without_running_code(distributed, tmp_path, capsys, victim):
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(1, {"actor": build_engine(0)}, {"epoch": 0})
    torch.save({"module": _RunsCode()}, path / victim)
    with pytest.raises(UserError, match="safe load refuses .*GLOBAL print was not an allowed global"):
        manager.load_latest({"actor": build_engine(0)})
    assert "this must never run" not in capsys.readouterr().out


TWO_RANKS = """
import argparse, math, os, signal, sys
import torch
from utils.dist import barrier, get_rank, init_distributed
init_distributed()
import test_checkpointing as t
from training.reliability.checkpointing import CheckpointManager
from utils.errors import UserError
from training.reliability.guards import NonFiniteError, check_finite
from training.reliability.run_lock import RunLock
from training.reliability.signals import GracefulInterrupt

output_dir, rank = sys.argv[1], get_rank()


def say(*words):  # one write per line, so the two ranks' lines do not interleave
    sys.stdout.write(" ".join(map(str, (rank, *words))) + "\\n")
    sys.stdout.flush()


with RunLock(output_dir):
    try:
        RunLock(output_dir).acquire()
    except UserError:
        say("lock refused")
    manager = CheckpointManager(output_dir, keep_last=1)
    engines = {"actor": t.build_engine(2)}
    torch.manual_seed(rank)
    t.train(engines, t.dataset(), {"epoch": 0, "batches_done": 0}, t.TOTAL_STEPS, manager, save_at={2})
    resumed = {"actor": t.build_engine(2, seed=3)}
    state = manager.load_latest(resumed)
    t.train(resumed, t.dataset(), {"epoch": state["epoch"], "batches_done": state["batches_done"]}, t.TOTAL_STEPS)
    diff = max((a - b).abs().max().item() for a, b in zip(t.weights(engines["actor"]).values(), t.weights(resumed["actor"]).values()))
    say("diff", diff)
    try:
        check_finite("loss", math.nan if rank == 1 else 1.0, step=5, checkpoint_manager=manager)
    except NonFiniteError:
        say("non-finite agreed")
    with GracefulInterrupt() as stop:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        barrier()
        say("stop", stop.should_stop())
    # one rank's file refused (a class a safe load refuses), then one cut short: both ranks refuse (rank 0 went on
    # without rank 1 and waited for it, after its own state's load or in DeepSpeed's collectives of the engine's)
    for damage, named in (("rng/rank1.pt", "rank1.pt holds objects a safe load refuses"),
                          ("actor/zero_pp_rank_1_mp_rank_00_optim_states.pt", "optim_states.pt (cut short)")):
        target = manager.latest().path / damage
        if rank == 1 and damage.startswith("rng"):
            torch.save({"python": argparse.Namespace()}, target)
        elif rank == 1:
            target.write_bytes(target.read_bytes()[:200])
        barrier()
        try:
            manager.load_latest({"actor": t.build_engine(2)})
        except UserError as error:
            say("damaged refused", named in str(error))
    # a rank's own part of the loaded state malformed (its rank_state): rank 0 went on alone, into its next collective
    try:
        with manager.reading_loaded_state():
            if rank == 1:
                state["a key only rank 1 reads"]
    except UserError as error:
        say("malformed refused", "KeyError: 'a key only rank 1 reads'" in str(error))
"""


@pytest.mark.slow
def test_two_ranks_agree_on_checkpoints_lock_guard_and_stop(tmp_path):
    """torchrun with 2 ranks: ZeRO-2 resume is exact; lock, non-finite and stop decisions and a damaged file of one
    rank's reach both ranks."""
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT, TESTS_DIR

    from utils.dist import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{REPO_ROOT}"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script), str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        for line in ("lock refused", "diff 0.0", "non-finite agreed", "stop True", "damaged refused True",
                     "malformed refused True"):
            assert f"{rank} {line}" in result.stdout, result.stdout
        assert result.stdout.count(f"{rank} damaged refused True") == 2, result.stdout
    step2 = tmp_path / "run" / "checkpoints" / "step2"
    assert sorted(p.name for p in (step2 / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert json.loads((step2 / MARKER_FILE).read_text())["world_size"] == 2


def test_a_resume_compares_the_precision_dtype_auto_resolves_to(distributed, tmp_path, monkeypatch):
    """--dtype auto is bf16 on one machine and fp16 on another: a resume must share the resolved precision
    (--dtype auto after --dtype bf16 is the same run; auto resolving elsewhere is not)."""
    from step1_sft.main import build_parser
    from training.core.args import resume_fixed_flags

    import training.core.args

    def manager_for(dtype: str) -> CheckpointManager:
        settings = build_parser().parse_args(["--output_dir", str(tmp_path / "run"), "--dtype", dtype])
        return CheckpointManager(tmp_path / "run", fixed_flags=resume_fixed_flags(settings))

    def auto_resolves_to(dtype: torch.dtype) -> None:
        resolve = training.core.args.resolve_dtype
        monkeypatch.setattr("training.core.args.resolve_dtype", lambda name: dtype if name == "auto" else resolve(name))

    manager_for("bf16").save(2, {"actor": build_engine(0)}, {})
    auto_resolves_to(torch.bfloat16)
    manager_for("auto").check_start(resume=True)
    auto_resolves_to(torch.float16)  # on a GPU without bf16
    with pytest.raises(UserError, match=r"--dtype \(resolved\) 'bf16' -> 'fp16'"):
        manager_for("auto").check_start(resume=True)


@pytest.mark.parametrize("recorded, given, refused", [("auto", "fp32", False), ("fp32", "fp32", False),
                                                     ("fp32", "bf16", True), ("bf16", "auto", False)])
def test_a_checkpoint_that_recorded_dtype_as_given_is_compared_by_what_it_resolved_to(
        distributed, tmp_path, monkeypatch, recorded, given, refused):
    """Checkpoints written before the resolved precision was recorded hold `dtype` as given: a precision named there
    is compared with this run's resolved one (fp32 then, bf16 now is refused); an old "auto" resolved to what is no
    longer known, so it resumes."""
    import training.core.args
    from step1_sft.main import build_parser
    from training.core.args import resume_fixed_flags

    resolve = training.core.args.resolve_dtype
    monkeypatch.setattr("training.core.args.resolve_dtype",
                        lambda name: torch.bfloat16 if name == "auto" else resolve(name))
    settings = build_parser().parse_args(["--output_dir", str(tmp_path / "run"), "--dtype", given])
    older = {**resume_fixed_flags(settings), "dtype": recorded}
    del older["dtype (resolved)"]
    CheckpointManager(tmp_path / "run", fixed_flags=older).save(2, {"actor": build_engine(0)}, {})
    manager = CheckpointManager(tmp_path / "run", fixed_flags=resume_fixed_flags(settings))
    if refused:
        with pytest.raises(UserError, match=r"--dtype \(resolved\) 'fp32' -> 'bf16'"):
            manager.check_start(resume=True)
    else:
        manager.check_start(resume=True)


def test_a_folder_fingerprint_tells_retrained_weights_from_a_copy(tmp_path):
    """A local input folder is told by what its files hold, not when they were written: weights written anew (a
    model trained again, maybe in some layers alone: the middle of the file) differ, while a plain copy of the folder
    (new mtimes) or a model card added beside it is the same model and must not refuse its resume."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = np.random.default_rng(0).bytes(8 * 2**20)
    (folder / "model.safetensors").write_bytes(weights)
    recorded = folder_fingerprint(folder)
    copied = tmp_path / "copy"
    copied.mkdir()
    for path in folder.iterdir():
        (copied / path.name).write_bytes(path.read_bytes())
    (copied / "README.md").write_text("a model card")
    assert folder_fingerprint(copied) == recorded
    for changed_at in (len(weights) - 5, len(weights) // 2):
        retrained = bytearray(weights)
        retrained[changed_at] ^= 1
        (folder / "model.safetensors").write_bytes(bytes(retrained))
        assert folder_fingerprint(folder) != recorded


def test_a_folder_fingerprint_sees_any_tensor_of_a_safetensors_file_trained_again(tmp_path):
    """A fine-tune of one layer changes one tensor, wherever in the weights file it lies: each tensor of an 8 MiB
    safetensors file (64 of 128 KiB, most between any evenly spaced samples' offsets) trained again in turn changes
    the fingerprint, while the same tensors written again do not."""
    from safetensors.numpy import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {f"layers.{index}.weight": rng.standard_normal(32 * 1024, dtype=np.float32) for index in range(64)}
    save_file(tensors, folder / "model.safetensors")
    recorded = folder_fingerprint(folder)
    save_file(dict(tensors), folder / "model.safetensors")
    assert folder_fingerprint(folder) == recorded
    unseen = []
    for name, tensor in tensors.items():
        save_file({**tensors, name: tensor + np.float32(1e-3)}, folder / "model.safetensors")
        if folder_fingerprint(folder) == recorded:
            unseen.append(name)
    assert unseen == []


def test_a_folder_fingerprint_sees_any_tensor_of_a_torch_save_file_trained_again(tmp_path):
    """pytorch_model.bin is read by its first and last MiB and 16 chunks between, not by its tensors, yet each of 64
    tensors of 128 KiB (most between two samples' offsets) trained again in turn changes the fingerprint: torch.save
    writes a zip archive, whose directory at the end of the file, in the last MiB read, holds a CRC-32 of each
    tensor's storage. The same tensors saved again do not change it. A guard on that end read: without it, 32 of the
    64 go unseen."""
    folder = tmp_path / "model"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layers.{index}.weight": torch.randn(32 * 1024, generator=generator) for index in range(64)}
    torch.save(tensors, folder / "pytorch_model.bin")
    recorded = folder_fingerprint(folder)
    torch.save(dict(tensors), folder / "pytorch_model.bin")
    assert folder_fingerprint(folder) == recorded
    unseen = []
    for name, tensor in tensors.items():
        torch.save({**tensors, name: tensor + 1e-3}, folder / "pytorch_model.bin")
        if folder_fingerprint(folder) == recorded:
            unseen.append(name)
    assert unseen == []


def test_a_checkpoint_fingerprinting_its_input_folder_in_an_older_format_resumes(distributed, tmp_path, caplog):
    """A marker an older version wrote holds digests of other reads of the same files (no format recorded): the
    resume goes on, saying the folder is not compared, while one of this format still refuses a changed file."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    models = {"model_name_or_path": str(folder)}
    manager = CheckpointManager(tmp_path / "run")
    manager.check_inputs(models, resume=False)
    manager.save(2, {"actor": build_engine(0)}, {})
    marker = manager.checkpoints_dir / "step2" / MARKER_FILE
    written = json.loads(marker.read_text())
    older = {"files": {name: [size, "0" * 64] for name, (size, _) in written["inputs"][
        "model_name_or_path"]["files"].items()}}
    marker.write_text(json.dumps({**written, "inputs": {"model_name_or_path": older}}))
    with caplog.at_level("WARNING"):
        manager.check_inputs(models, resume=True)
    assert f"fingerprinted --model_name_or_path {folder} in another format" in caplog.text
    marker.write_text(json.dumps(written))
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UserError, match=r"its files changed \(config.json\)"):
        manager.check_inputs(models, resume=True)


def test_a_checkpoint_missing_a_ranks_random_number_state_is_damaged(distributed, tmp_path):
    """A rank's missing RNG file only warned, and that rank's random streams (dropout, sampling) restarted: the
    resumed run silently went another way than the checkpointed one."""
    manager = CheckpointManager(tmp_path / "run")
    path = manager.save(2, {"actor": build_engine(0)}, {"epoch": 1})
    (path / "rng" / "rank0.pt").unlink()
    with pytest.raises(UserError, match=rf"checkpoint {path} is damaged: rank 0's random-number state "
                                        r"\(rng/rank0.pt is missing\).* delete that folder"):
        manager.restore({"actor": build_engine(0)}, resume=True)
