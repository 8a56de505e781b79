"""Resume checkpoints: everything a run needs to continue as if it had never stopped.

One checkpoint is one folder `<output_dir>/checkpoints/step<N>/` holding
- `<engine name>/`: each DeepSpeed engine's own checkpoint (module, optimizer, LR scheduler, its
  step counters), written by `engine.save_checkpoint` from every rank;
- `rng/rank<R>.pt`: each rank's python, numpy, torch and accelerator RNG states;
- `rank_state/rank<R>.pt`: what else a rank alone holds, when the caller has any (a placement's per-chunk
  random streams, the rank's share of step 3's actor EMA);
- `client_state.pt`: rank 0's `client_state` (data position, KL controller, ...), loaded whole by every rank;
- `checkpoint.json`: the completion marker, written last; it records the run's fixed flags, its data
  (`data_record`) and which input models it started from (`model_identity`), which a resume must share.
The folder is staged under a hidden temporary name and renamed into place once every rank has
finished (`utils.atomic.shared_atomic_directory`); only then is the `latest` pointer file
replaced atomically. A crash at any moment leaves `latest` on the previous complete checkpoint.

Under a placement an engine lives on part of the ranks: each rank saves and loads the engines it holds, and
DeepSpeed's own world-wide barriers in `save_checkpoint` are kept to the engine's ranks
(`barriers_within`), so ranks saving different engines do not wait for each other.

Every file loads with `torch.load(weights_only=True)`, so a tampered checkpoint cannot run code:
`client_state` must hold only plain data (tensors, numbers, strings, None, and lists/tuples/dicts
of those). DeepSpeed 0.19.8 hard-codes `weights_only=False` in `TorchCheckpointEngine.load`, so
while loading we replace that method on the engine's checkpoint engine with a weights-only load
that allows the four DeepSpeed classes its ZeRO optimizer files contain (`DEEPSPEED_SAFE_GLOBALS`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import random
import re
import shutil
import time
import zipfile
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from training.core.embedded_model import EMBEDDED_MODEL_NAME, is_embedded_name
from training.core.model_loading import resolve_model_path
from training.reliability.run_records import (
    RUN_ID_KEY,
    as_recorded,
    changed_flags,
    run_id_of,
    with_resolved_flags,
)
from utils.atomic import (
    atomic_torch_save,
    atomic_write_text,
    remove_temporaries,
    shared_atomic_directory,
)
from utils.data.eval_splits import EVAL_SPLITS_NOTE
from utils.dist import (
    all_gather_objects,
    barrier,
    broadcast_from_main,
    get_rank,
    get_world_size,
    is_main_process,
    refuse_on_every_rank,
)
from utils.errors import UserError, refuse_wrong

logger = logging.getLogger(__name__)

CHECKPOINTS_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
MARKER_FILE = "checkpoint.json"
CLIENT_STATE_FILE = "client_state.pt"
RNG_DIR = "rng"
RANK_STATE_DIR = "rank_state"
FORMAT_VERSION = 1
_TAG_PATTERN = re.compile(r"^step(\d+)$")


@dataclass
class CheckpointSettings:
    """The resume-checkpoint flags of a step."""

    save_interval: int = field(default=0, metadata={
        "same_result": True,
        "help": "save a resume checkpoint every N optimizer steps (PPO steps in step 3; 0: only when interrupted)"})
    resume: bool = field(default=False, metadata={
        "same_result": True, "help": "continue from the latest complete checkpoint in <output_dir>/checkpoints"})
    keep_last_checkpoints: int = field(default=2, metadata={
        "same_result": True, "help": "how many resume checkpoints to keep (older ones are deleted)"})

    def check_flags(self) -> None:
        """Refuse a policy no manager runs (`check_checkpoint_policy`), before the step loads or writes anything."""
        check_checkpoint_policy(self.keep_last_checkpoints, self.save_interval)

    def manager(self, output_dir: str | Path, fixed_flags: Mapping[str, Any] | None = None,
                overridable: Iterable[str] = ()) -> "CheckpointManager":
        return CheckpointManager(output_dir, keep_last=self.keep_last_checkpoints, save_interval=self.save_interval,
                                 fixed_flags=fixed_flags, overridable=overridable)


def check_checkpoint_policy(keep_last: int, save_interval: int) -> None:
    """Refuse keeping no checkpoint, or a negative save interval (`CheckpointManager` and `CheckpointSettings`), both
    at once."""
    refuse_wrong(
        (keep_last < 1, f"--keep_last_checkpoints must be at least 1, got {keep_last}"),
        (save_interval < 0, f"--save_interval must be 0 (off) or a positive number of steps, got {save_interval}"))


# RNG ----------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """This rank's python, numpy, torch and accelerator RNG states, as weights_only-loadable data."""
    from deepspeed.accelerator import get_accelerator

    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Bring back the states `capture_rng_state` took (`_restore_accelerator_rng`: on another kind of device, all
    but the accelerator's)."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state["numpy"]
    np.random.set_state((
        numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
        numpy_state["has_gauss"], numpy_state["cached_gaussian"],
    ))
    torch.set_rng_state(state["torch"])
    _restore_accelerator_rng(state.get("accelerator"))


def _restore_accelerator_rng(saved: Any) -> None:
    """The accelerator's RNG state, `saved` by a run on an accelerator (a CPU run saves none: torch's state is its
    device's). A checkpoint resumed on the other kind of device (a GPU run's on CPU, a CPU run's on a GPU) restarts the
    accelerator's stream, with a warning: a CUDA state is no CPU generator's, which refused it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    if saved is not None and not on_cpu:
        accelerator.set_rng_state(saved)
    elif saved is not None:
        logger.warning("the checkpoint was saved on an accelerator and resumes on CPU: its accelerator random stream "
                       "is not restored (the python, numpy and torch streams are)")
    elif not on_cpu:
        logger.warning("the checkpoint was saved on CPU and resumes on %s: its random stream there starts anew (the "
                       "python, numpy and torch streams are restored)", accelerator.device_name())


# client state -------------------------------------------------------------------------------------

# exact types: a subclass (a numpy float, a namedtuple, an IntEnum, a defaultdict) pickles as its own class
_PLAIN_SCALARS = (bool, int, float, str, type(None), torch.Size)


def check_weights_only_safe(value: Any, where: str = "client_state") -> None:
    """Raise TypeError naming the first entry `torch.load(weights_only=True)` could not read back.

    Checked when saving, so a bad entry fails the first save rather than the resume.
    """
    if type(value) in _PLAIN_SCALARS or isinstance(value, torch.Tensor):
        return
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            check_weights_only_safe(item, f"{where}[{index}]")
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int, bool):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_weights_only_safe(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; checkpoints hold only tensors, numbers, strings, None and "
        "lists/tuples/dicts of those (convert it, e.g. dataclasses.asdict or .state_dict())"
    )


# DeepSpeed's own files -------------------------------------------------------------------------


def deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed pickles into its ZeRO optimizer files (loss scaler, stage enum, fragment map)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location=None, allowed: list[type] = ()) -> Any:
    """`torch.load(weights_only=True)`; a file that needs anything else ends in a `UserError`."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|$)", str(err), re.MULTILINE)
        reason = found.group(1) if found else type(err).__name__
        raise UserError(
            f"{path} holds objects a safe load refuses ({reason}); it was written by another version or "
            "altered: resume from a checkpoint this version wrote, or start without --resume"
        ) from err


@contextmanager
def weights_only_engine_loads(engine) -> Iterator[None]:
    """Within this context `engine.load_checkpoint` reads its files with `safe_load`, each file once: DeepSpeed's
    loader reads the model-states file whole (the module, and below ZeRO the optimizer state) to check one entry
    (`SDLoaderBase.check_ckpt_list`), drops it, then reads it again to load it; that second read takes the first
    one's objects (both read onto the CPU, and the check only looks)."""
    checkpoint_engine = engine.checkpoint_engine
    allowed = deepspeed_safe_globals()
    last_read: dict[str, Any] = {}

    def load_once(path, map_location=None):
        if str(path) in last_read:
            return last_read.pop(str(path))
        last_read.clear()
        last_read[str(path)] = safe_load(path, map_location, allowed)
        return last_read[str(path)]

    checkpoint_engine.load = load_once
    try:
        yield
    finally:
        del checkpoint_engine.load
        last_read.clear()


# the manager --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    engines: tuple[str, ...]
    world_size: int | None = None  # the processes that wrote it (None: not recorded, by an older version)


def _read_marker(folder: Path) -> CheckpointInfo | None:
    """The checkpoint in `folder` if its completion marker is present and readable."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        return CheckpointInfo(path=folder, step=int(marker["step"]), engines=tuple(marker["engines"]),
                              world_size=marker.get("world_size"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_checkpoint(folder: Path) -> None:
    # the marker first: a deletion cut short leaves a folder no resume takes for complete
    (folder / MARKER_FILE).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


class CheckpointManager:
    """Saves and restores resume checkpoints under `<output_dir>/checkpoints` (all ranks call every method
    except `latest`, `complete_checkpoints` and `should_save`, which only read)."""

    def __init__(self, output_dir: str | Path, keep_last: int = 2, save_interval: int = 0,
                 fixed_flags: Mapping[str, Any] | None = None, overridable: Iterable[str] = ()):
        """`fixed_flags`: the flags a resumed run must share with its checkpoint (`training.core.args.
        resume_fixed_flags`), recorded in each checkpoint's marker and compared by `check_start`; `overridable`: the
        step's flags a resumed run may change (`training.core.args.resume_override_flags`), which a refusal names."""
        check_checkpoint_policy(keep_last, save_interval)
        self.checkpoints_dir = Path(output_dir) / CHECKPOINTS_SUBDIR
        self.keep_last = keep_last
        self.save_interval = save_interval
        self.fixed_flags = None if fixed_flags is None else as_recorded(fixed_flags)
        self.overridable = sorted(overridable)
        self.data: dict[str, Any] | None = None
        self.inputs: dict[str, Any] | None = None
        self.loaded: Path | None = None  # the checkpoint `load_latest` loaded last

    def check_data(self, data: Mapping[str, Any], resume: bool) -> None:
        """Record what the run trains and evaluates on (`data_record` of each dataset, by name) in every checkpoint;
        with --resume, refuse data other than the latest checkpoint's (every rank): the loop's position, the
        shuffle and the schedule's length are the checkpointed run's, so other items would be skipped or repeated
        (a data file rewritten under the same --data_path). A checkpoint that recorded no data is not checked."""
        self.data = as_recorded(data)
        problem = None
        if resume and is_main_process():
            info = self.latest()
            recorded = _marker_entry(info, "data")
            if recorded is not None and recorded != self.data:
                problem = (f"--resume continues the run checkpointed in {info.path}, but its data differ from that "
                           f"run's ({_data_changes(recorded, self.data)}): the data files changed, or flags that "
                           f"pick the items did. Resume on that run's data, or start a new run in another "
                           f"--output_dir{_eval_splits_note(recorded, self.data)}")
        refuse_on_every_rank(problem)

    def check_inputs(self, models: Mapping[str, str | None], resume: bool) -> None:
        """Record which input models the run starts from ({flag: name or path}, a flag given no model left out;
        `model_identity`) in every checkpoint; with --resume, refuse inputs other than the latest checkpoint's (every
        rank): a model trained again or replaced at the same path would become the resumed run's frozen reference
        or reward model, its tokenizer or its config. A checkpoint that recorded no inputs (written before this
        record) is resumed unchecked, as it was then. Rank 0 alone, which writes the markers, reads the models'
        identities (a fingerprint reads some MiB of each file)."""
        problem = None
        if is_main_process():
            self.inputs = {flag: model_identity(path) for flag, path in models.items() if path is not None}
        if resume and is_main_process():
            info = self.latest()
            recorded = _marker_entry(info, "inputs")
            if info is not None and recorded is None:
                logger.info("%s records no input models (an older version wrote it): the inputs are not compared",
                            info.path)
            elif recorded is not None:
                problem = _inputs_problem(info, recorded, self.inputs, models)
        refuse_on_every_rank(problem)

    def should_save(self, step: int) -> bool:
        """Whether `--save_interval` asks for a checkpoint after optimizer step `step`."""
        return self.save_interval > 0 and step > 0 and step % self.save_interval == 0

    # reading ----------------------------------------------------------------------------------

    def complete_checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint whose completion marker is present, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for folder in self.checkpoints_dir.iterdir():
            if folder.is_dir() and _TAG_PATTERN.match(folder.name):
                info = _read_marker(folder)
                if info is not None:
                    found.append(info)
        return sorted(found, key=lambda info: info.step)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint `latest` points to; if the pointer is missing or names an incomplete folder,
        the newest complete checkpoint."""
        pointer = self.checkpoints_dir / LATEST_FILE
        if pointer.is_file():
            tag = pointer.read_text().strip()
            if _TAG_PATTERN.match(tag):
                info = _read_marker(self.checkpoints_dir / tag)
                if info is not None:
                    return info
            logger.warning("%s names '%s', which is not a complete checkpoint; using the newest complete one", pointer, tag)
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    # writing ----------------------------------------------------------------------------------

    def save(self, step: int, engines: Mapping[str, Any], client_state: Mapping[str, Any] | None = None,
             rank_state: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint `step<step>` (every rank calls it, right after an optimizer step, with the engines it
        holds) and return its folder.

        `client_state` is taken from rank 0 and handed back to every rank by `load_latest`; it gets
        a `step` entry. `rank_state` (plain data, like `client_state`) is each rank's own, handed back to the
        same rank as the client state's `rank_state`: every rank passes one, or none does (a resume refuses a
        checkpoint where one rank's is missing). A checkpoint of the same step that is already complete is
        kept as it is.
        """
        client_state = dict(client_state or {})
        if client_state.setdefault("step", step) != step:
            raise ValueError(f"client_state['step'] is {client_state['step']}, but the checkpoint is for step {step}")
        check_weights_only_safe(client_state)
        if rank_state is not None:
            check_weights_only_safe(rank_state, "rank_state")
        names = all_engine_names(engines)
        final = self.checkpoints_dir / f"step{step}"
        if broadcast_from_main(_read_marker(final) is not None):
            logger.info("checkpoint for step %d already saved at %s", step, final)
            return final
        if is_main_process():
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.checkpoints_dir)
        with shared_atomic_directory(final) as tmp:
            for name in names:
                if name in engines:
                    with barriers_within(engines[name]):
                        engines[name].save_checkpoint(str(tmp), tag=name, save_latest=False)
            (tmp / RNG_DIR).mkdir(exist_ok=True)
            atomic_torch_save(capture_rng_state(), tmp / RNG_DIR / f"rank{get_rank()}.pt")
            if rank_state is not None:
                (tmp / RANK_STATE_DIR).mkdir(exist_ok=True)
                atomic_torch_save(dict(rank_state), tmp / RANK_STATE_DIR / f"rank{get_rank()}.pt")
            barrier()
            if is_main_process():
                atomic_torch_save(client_state, tmp / CLIENT_STATE_FILE)
                marker = {"format": FORMAT_VERSION, "step": step, "engines": names,
                          "world_size": get_world_size(), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          "flags": self.fixed_flags, "data": self.data, "inputs": self.inputs}
                atomic_write_text(tmp / MARKER_FILE, json.dumps(marker, indent=2) + "\n")
        if is_main_process():
            atomic_write_text(self.checkpoints_dir / LATEST_FILE, final.name)
            self.prune()
        barrier()
        logger.info("saved checkpoint for step %d to %s", step, final)
        return final

    def prune(self) -> list[Path]:
        """Delete all but the newest `keep_last` complete checkpoints, never the one `latest` names (rank 0 only)."""
        keep = {info.path for info in self.complete_checkpoints()[-self.keep_last:]}
        current = self.latest()
        if current is not None:
            keep.add(current.path)
        removed = []
        for folder in sorted(self.checkpoints_dir.iterdir()):
            if folder.is_dir() and _TAG_PATTERN.match(folder.name) and folder not in keep:
                _remove_checkpoint(folder)
                removed.append(folder)
        return removed

    def _discard_newer_than(self, loaded: CheckpointInfo) -> None:
        """Delete complete checkpoints past the one a resume loads (rank 0): a save cut short between its rename and
        `latest` left one, of a trajectory the resumed run abandons. Kept, the resumed run's save of that step
        would find it complete and keep it, and `latest` would stay behind."""
        for info in self.complete_checkpoints():
            if info.step > loaded.step:
                logger.warning("removing %s: the resume goes on from %s, which `latest` names", info.path, loaded.path)
                _remove_checkpoint(info.path)

    # restoring --------------------------------------------------------------------------------

    def load_latest(self, engines: Mapping[str, Any]) -> dict[str, Any] | None:
        """Load the latest complete checkpoint into `engines` and this rank's RNG; return the client
        state (with its `step`), or None when there is no checkpoint. Every rank calls it."""
        path = broadcast_from_main(None if (info := self.latest()) is None else str(info.path))
        if path is None:
            return None
        info = _read_marker(Path(path))
        refuse_on_every_rank(None if info is not None else
                             f"checkpoint {path} vanished while loading; is another run using {self.checkpoints_dir}?")
        state = self._load(info, engines)
        self.loaded = info.path
        if is_main_process():  # once loaded: a damaged `latest` leaves the newer ones for the user to take
            self._discard_newer_than(info)
        return state

    @contextmanager
    def reading_loaded_state(self) -> Iterator[None]:
        """Around a caller taking back the client state `restore` returned: a key it lacks or an entry of another
        form (a checkpoint another version wrote, or altered) ends in a `UserError` naming the checkpoint, on every
        rank when one finds it (collective: every rank reads its own part, its rank_state, in the block; a rank that
        refused alone left the others in their next collective, which crashed on gloo and waits on NCCL)."""
        problem = None
        try:
            with _refused_if_malformed(self.loaded, "a loop state"):
                yield
        except UserError as error:
            problem = str(error)
        refuse_on_every_rank(problem)

    def check_start(self, resume: bool) -> None:
        """Before anything loads (every rank): without --resume, refuse a folder holding an earlier run's
        checkpoints; with it, require one, written by a run with this run's `fixed_flags`."""
        if not resume:
            self.restore({}, resume=False)
            return
        problem = None
        if is_main_process():
            info = self.latest()
            if info is None:
                problem = self._nothing_to_resume()
            else:
                problem = self._resume_problem(info)
        refuse_on_every_rank(problem)

    def _nothing_to_resume(self) -> str:
        return (f"--resume: there is no complete checkpoint in {self.checkpoints_dir}; "
                "run without --resume to start from the beginning")

    def _resume_problem(self, info: CheckpointInfo) -> str | None:
        """What refuses resuming `info` in this run, or None: another number of processes (ZeRO shards the optimizer
        state by process, and each rank goes on from its own data position and random streams), or a flag of
        `fixed_flags` with another value (a flag only one of the two runs had is not compared; a checkpoint that
        recorded no flags is not checked)."""
        saved_by = info.world_size or get_world_size()
        if saved_by != get_world_size():
            return (f"--resume: {info.path} was written by {saved_by} processes and this run has {get_world_size()}; "
                    f"resume with {saved_by} (the same launcher command), or start a new run in another --output_dir")
        if self.fixed_flags is None:
            return None
        recorded = _marker_entry(info, "flags")
        if recorded is None:
            return None
        recorded = with_resolved_flags(recorded, self.fixed_flags)
        # a flag one of the two runs did not have (another version of this project) is not compared
        changed = changed_flags(recorded, self.fixed_flags, frozenset(recorded.keys() ^ self.fixed_flags.keys()))
        if not changed:
            return None
        flags = ", ".join(f"--{name} {then!r} -> {now!r}" for name, (then, now) in changed.items())
        return (f"--resume continues the run checkpointed in {info.path}, but these flags differ from that run's: "
                f"{flags}. Resume with that run's flags (its checkpoint.json records them; "
                f"{self._flags_free_to_change()} may differ), or start a new run in another --output_dir")

    def _flags_free_to_change(self) -> str:
        """The flags a resumed run of this step may change, as a refusal says them."""
        named = "".join(f"--{name}, " for name in self.overridable)
        return f"{named}{'and ' if named else ''}what only changes saving, logging or speed"

    def restore(self, engines: Mapping[str, Any], resume: bool) -> dict[str, Any] | None:
        """`load_latest` behind the `--resume` rules: with it, a checkpoint must exist; without it, none may
        (a fresh run would otherwise mix its checkpoints with an earlier run's and prune them)."""
        problem = None
        if is_main_process():
            info = self.latest()
            if info is not None and not resume:
                problem = (f"{self.checkpoints_dir} holds checkpoints of an earlier run (latest: step {info.step}); "
                           "pass --resume to continue it, or choose another --output_dir")
            elif info is None and resume:
                problem = self._nothing_to_resume()
        refuse_on_every_rank(problem)
        return self.load_latest(engines) if resume else None

    def _load(self, info: CheckpointInfo, engines: Mapping[str, Any]) -> dict[str, Any]:
        names = all_engine_names(engines)
        if set(info.engines) != set(names):
            raise UserError(
                f"checkpoint {info.path} holds the models {sorted(info.engines)}, but this run trains "
                f"{names}; resume with the same settings, or choose another --output_dir"
            )
        cut = cut_short_files(info.path) if is_main_process() else []
        # before any rank loads: one rank refusing mid-load left the others in DeepSpeed's collectives
        refuse_on_every_rank(_damaged(info, f"{', '.join(cut)} (cut short)") if cut else None)
        for name, engine in engines.items():
            rates = peak_learning_rates(engine)
            with weights_only_engine_loads(engine), _damaged_if_unreadable(info, f"'{name}'"), \
                    _refused_if_malformed(info.path, f"the '{name}' model's state ({name}/)"):
                load_path, _ = engine.load_checkpoint(str(info.path), tag=name)
            if load_path is None:
                raise UserError(_damaged(info, f"'{name}'"))
            take_peak_learning_rates(engine, rates, name)
        problem, client_state = None, {}
        try:
            client_state = self._load_rank_files(info)
        except UserError as error:
            problem = str(error)
        refuse_on_every_rank(problem)
        logger.info("resumed from %s (step %d)", info.path, info.step)
        return client_state

    @staticmethod
    def _load_rank_files(info: CheckpointInfo) -> dict[str, Any]:
        """This rank's RNG restored and the client state, with this rank's own state under "rank_state"."""
        rank = get_rank()
        rng_file = info.path / RNG_DIR / f"rank{rank}.pt"
        with _damaged_if_unreadable(info, f"rank {rank}'s random-number state or the loop state"):
            if not rng_file.is_file():  # every rank saves its own: restarting its streams would change the run
                raise UserError(_damaged(info, f"rank {rank}'s random-number state ({RNG_DIR}/{rng_file.name} is "
                                               "missing)"))
            rng_state = safe_load(rng_file)
            with _refused_if_malformed(info.path, f"a random-number state ({RNG_DIR}/{rng_file.name})"):
                restore_rng_state(rng_state)
            client_state = _as_dict(safe_load(info.path / CLIENT_STATE_FILE, map_location="cpu"), info.path,
                                    f"a loop state ({CLIENT_STATE_FILE})")
            if client_state.get("step") != info.step:
                raise UserError(_malformed(info.path, f"a loop state ({CLIENT_STATE_FILE})",
                                           f"step {client_state.get('step')!r} where {MARKER_FILE} says {info.step}"))
            rank_file = info.path / RANK_STATE_DIR / f"rank{rank}.pt"
            if rank_file.is_file():
                client_state["rank_state"] = _as_dict(safe_load(rank_file, map_location="cpu"), info.path,
                                                      f"a rank's own state ({RANK_STATE_DIR}/{rank_file.name})")
            elif rank_file.parent.is_dir():  # every rank saved its own state, or none did
                raise UserError(_damaged(info, f"rank {rank}'s own state ({RANK_STATE_DIR}/{rank_file.name} is "
                                               "missing)"))
        return client_state


def data_record(dataset: Any) -> dict[str, Any]:
    """What `CheckpointManager.check_data` compares of a dataset: its size and a hash of its items."""
    return {"items": len(dataset), "sha256": dataset.digest()}


def model_identity(name_or_path: str) -> dict[str, Any]:
    """What tells an input model from another one at the same name or path, cheaply: the embedded default by its
    name; a run folder of this project (or the model folder inside one) by its finished run's `run_id` (a run made
    again has another); another local folder by `folder_fingerprint`; a hub name by its cached revision (None: not
    cached)."""
    if is_embedded_name(name_or_path):
        return {"embedded": EMBEDDED_MODEL_NAME}
    run_id = run_id_of(name_or_path)
    if run_id is not None:
        return {RUN_ID_KEY: run_id}
    folder = Path(resolve_model_path(name_or_path))
    if folder.is_dir():
        return {"files": folder_fingerprint(folder), FINGERPRINT_FORMAT_KEY: FINGERPRINT_FORMAT}
    return {"hub": name_or_path, "revision": _cached_hub_revision(name_or_path)}


FINGERPRINT_FORMAT = 3  # how `folder_fingerprint` reads a file (the two before: its ends; its ends and 16 chunks)
FINGERPRINT_FORMAT_KEY = "fingerprint_format"
FINGERPRINT_END_BYTES = 1 << 20  # read at each end of a model folder's file that is no safetensors file
FINGERPRINT_SAMPLES = 16  # chunks read in between, evenly spaced
FINGERPRINT_SAMPLE_BYTES = 1 << 16
FINGERPRINT_TENSOR_SAMPLE_BYTES = 1 << 14  # read at the start, middle and end of each tensor of a safetensors file
SAFETENSORS_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
NOT_MODEL_FILES = re.compile(r"(?i)^(readme|license|licence|notice|use_policy)\b|\.md$")  # a model card, terms


def folder_fingerprint(folder: Path) -> dict[str, list]:
    """{file name: [size, sha256 of sampled reads]} of the files of a model folder the loaders read (weights,
    tokenizer, config, value head; not its card or license, which a user may add): what they hold, not when they
    were written, so a plain copy of the folder is the same model. A safetensors file is read by its tensors
    (`_safetensors_reads`), so a model trained again in any tensor (a fine-tune of one layer too) changes it; another
    file by its ends and chunks between (`_spread_reads`), whose last MiB holds a torch.save file's zip directory
    and so a CRC-32 of each tensor (of fewer than about 10,000 tensors: a directory entry takes about 100 bytes),
    where torch wrote them: not after torch.serialization.set_crc32_options(False), which writes zeros, nor in a
    legacy file (_use_new_zipfile_serialization=False), which has no zip directory; there a change only the samples
    meet is seen. Neither reads the weights' gigabytes."""
    fingerprint = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not NOT_MODEL_FILES.search(path.name):
            fingerprint[path.name] = [path.stat().st_size, _sampled_digest(path)]
    return fingerprint


def _sampled_digest(path: Path) -> str:
    """sha256 of the reads `_safetensors_reads` (a readable safetensors file) or `_spread_reads` name of `path`."""
    size = path.stat().st_size
    reads = _safetensors_reads(path, size) if path.suffix == ".safetensors" else None
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for offset, length in reads or _spread_reads(size):
            file.seek(offset)
            digest.update(file.read(length))
    return digest.hexdigest()


def _spread_reads(size: int) -> list[tuple[int, int]]:
    """(offset, length) of a file's first and last FINGERPRINT_END_BYTES and FINGERPRINT_SAMPLES chunks between:
    about 3 MiB, however large the file."""
    between = size - 2 * FINGERPRINT_END_BYTES
    return [(0, FINGERPRINT_END_BYTES),
            *((FINGERPRINT_END_BYTES + between * k // FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES)
              for k in range(FINGERPRINT_SAMPLES) if between > 0),
            (max(0, size - FINGERPRINT_END_BYTES), FINGERPRINT_END_BYTES)]


def _safetensors_reads(path: Path, size: int) -> list[tuple[int, int]] | None:
    """(offset, length) of a safetensors file's header (each tensor's name, dtype, shape and place) and of
    FINGERPRINT_TENSOR_SAMPLE_BYTES at the start, middle and end of each tensor's bytes: at most the header and 48 KiB
    a tensor (about 15 MiB for a 7B model's ~300 tensors), wherever in the file a tensor lies. None where the file
    is no readable safetensors file (read as another file is)."""
    header = _safetensors_header(path, size)
    if header is None:
        return None
    data_start = 8 + header[0]
    reads = [(0, data_start)]
    for begin, end in header[1]:
        reads.extend(_tensor_reads(data_start + begin, end - begin))
    return reads


def _safetensors_header(path: Path, size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """(the header's length, each tensor's [begin, end) within the data) of a safetensors file, None where its
    header is unreadable or places a tensor outside the file."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little") if size >= 8 else 0
        if not 0 < length <= min(SAFETENSORS_MAX_HEADER_BYTES, size - 8):
            return None
        try:
            header = json.loads(file.read(length))
            places = [tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
    valid = all(len(place) == 2 and all(isinstance(at, int) for at in place)
                and 0 <= place[0] <= place[1] <= size - 8 - length for place in places)
    return (length, places) if valid else None


def _tensor_reads(offset: int, length: int) -> list[tuple[int, int]]:
    """(offset, length) of the start, middle and end of a tensor's bytes (the whole tensor where that is as short)."""
    chunk = FINGERPRINT_TENSOR_SAMPLE_BYTES
    if length <= 3 * chunk:
        return [(offset, length)]
    return [(offset, chunk), (offset + (length - chunk) // 2, chunk), (offset + length - chunk, chunk)]


def _cached_hub_revision(repo_id: str) -> str | None:
    """The commit of the hub model's cached config.json (its snapshot folder), None when none is cached."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    return Path(cached).parent.name if isinstance(cached, str) else None


def _inputs_problem(info: CheckpointInfo, recorded: Mapping[str, Any], current: Mapping[str, Any],
                    models: Mapping[str, str | None]) -> str | None:
    """The refusal of a resume whose input models differ from those `info` recorded (a flag only one of the two runs
    gave is the flags' check's to compare), or None. A model folder `info` fingerprinted in another format is not
    compared (its digests differ from this version's, the files unchanged), with a warning: a model trained again
    since would go on unseen."""
    shared = sorted(recorded.keys() & current.keys())
    unread = [flag for flag in shared if _other_fingerprint_format(recorded[flag], current[flag])]
    if unread:
        logger.warning("%s fingerprinted %s in another format (an older version wrote it), so they are not compared: "
                       "make sure they are the models that run started from", info.path,
                       ", ".join(f"--{flag} {models[flag]}" for flag in unread))
    changed = [flag for flag in shared if flag not in unread and recorded[flag] != current[flag]]
    if not changed:
        return None
    inputs = "; ".join(f"--{flag} {models[flag]}: {_identity_change(recorded[flag], current[flag])}"
                       for flag in changed)
    return (f"--resume continues the run checkpointed in {info.path}, but its input models are not those that run "
            f"started from ({inputs}): trained again or replaced at the same path. Put that run's models back, or "
            f"start a new run from these in another --output_dir")


def _other_fingerprint_format(then: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether two `model_identity`s are model folders' fingerprints of different formats, which cannot be compared."""
    return "files" in then and "files" in now and then.get(FINGERPRINT_FORMAT_KEY) != now.get(FINGERPRINT_FORMAT_KEY)


def _identity_change(then: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """How `model_identity` changed, in words."""
    if RUN_ID_KEY in then and RUN_ID_KEY in now:
        return f"another run made it (run_id {then[RUN_ID_KEY]} -> {now[RUN_ID_KEY]})"
    if "files" in then and "files" in now:
        files = sorted(name for name in then["files"].keys() | now["files"].keys()
                       if then["files"].get(name) != now["files"].get(name))
        return f"its files changed ({', '.join(files)})"
    if "hub" in then and "hub" in now:
        return f"its cached revision changed ({then['revision']} -> {now['revision']})"
    return f"{_identity_kind(then)} then, {_identity_kind(now)} now"


def _identity_kind(identity: Mapping[str, Any]) -> str:
    kinds = {RUN_ID_KEY: "a run folder of this project", "files": "a model folder", "hub": "a hub model",
             "embedded": "the embedded model"}
    return next((kind for key, kind in kinds.items() if key in identity), "an unknown model")


def cut_short_files(folder: Path) -> list[str]:
    """The torch files of a checkpoint, every rank's, that are not whole (torch saves a zip archive, whose
    directory comes last), relative to `folder`."""
    return [str(path.relative_to(folder)) for path in sorted(folder.rglob("*.pt")) if not zipfile.is_zipfile(path)]


def _marker_entry(info: CheckpointInfo | None, key: str) -> Any:
    """What the marker of checkpoint `info` records under `key` (None: no checkpoint, or not recorded)."""
    return None if info is None else json.loads((info.path / MARKER_FILE).read_text()).get(key)


def _data_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    changes = []
    for name in sorted(recorded.keys() | current.keys()):
        then, now = recorded.get(name) or {}, current.get(name) or {}
        if then != now:
            same_size = then.get("items") == now.get("items")
            changes.append(f"{name}: {then.get('items')} items -> {now.get('items')}{', other items' if same_size else ''}")
    return "; ".join(changes)


def _eval_splits_note(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """Where a dataset lost items, that this version leaves out evaluation splits a run checkpointed before it read."""
    dropped = any((current.get(name) or {}).get("items", 0) < (then or {}).get("items", 0)
                  for name, then in recorded.items())
    return f". {EVAL_SPLITS_NOTE}: start a new run on the data as this version reads it" if dropped else ""


def _damaged(info: CheckpointInfo, what: str) -> str:
    return f"checkpoint {info.path} is damaged: {what} could not be loaded; delete that folder to resume from the " \
           "one before it"


def _malformed(path: Path, what: str, detail: str) -> str:
    return (f"checkpoint {path} holds {what} in a form this version does not read ({detail}): it was written by "
            "another version or altered; delete that folder to resume from the one before it, or start without "
            "--resume")


@contextmanager
def _refused_if_malformed(path: Path, what: str) -> Iterator[None]:
    """A file that loads but holds other data than this version writes (a key missing, a list where a dict was
    written) raises from the code that takes it back: said as the checkpoint it is, with the way out."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise UserError(_malformed(path, what, f"{type(err).__name__}: {err}")) from err


def _as_dict(value: Any, path: Path, what: str) -> dict[str, Any]:
    """`value`, read from a file of checkpoint `path` that this version writes as a dict (`what`, for the message)."""
    if type(value) is not dict:
        raise UserError(_malformed(path, what, f"a {type(value).__name__} where a dict was written"))
    return value


@contextmanager
def _damaged_if_unreadable(info: CheckpointInfo, what: str) -> Iterator[None]:
    """A file of the checkpoint cut short or overwritten (a disk filled, a copy interrupted) raises from inside torch's
    reader: said as the damaged checkpoint it is, with the way out."""
    try:
        yield
    except (EOFError, OSError, pickle.UnpicklingError) as err:  # torch's reader: OSError for some cut lengths
        raise UserError(f"{_damaged(info, what)} ({err})") from err
    except RuntimeError as err:
        if "PytorchStreamReader" not in str(err):
            raise
        raise UserError(f"{_damaged(info, what)} ({err})") from err


def peak_learning_rates(engine: Any) -> list[float] | None:
    """The peak learning rate of each parameter group as this run's flags built the engine's schedule."""
    scheduler = getattr(engine, "lr_scheduler", None)
    return list(scheduler.base_lrs) if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None


def take_peak_learning_rates(engine: Any, rates: list[float] | None, name: str) -> None:
    """After loading a checkpoint, which brings back its own rates: each parameter group's peak becomes `rates`
    (this run's `--learning_rate`, LoRA's), at the schedule's step, so a resumed run can go on with a lower rate."""
    scheduler = engine.lr_scheduler
    if rates is None or rates == scheduler.base_lrs:
        return
    logger.info("%s: peak learning rates %s -> %s (this run's flags), the schedule going on at step %d", name,
                scheduler.base_lrs, rates, scheduler.last_epoch)
    scheduler.base_lrs = list(rates)
    current = [rate * factor(scheduler.last_epoch) for factor, rate in zip(scheduler.lr_lambdas, rates)]
    for group, rate, peak in zip(scheduler.optimizer.param_groups, current, rates):
        group["lr"], group["initial_lr"] = rate, peak
    scheduler._last_lr = current


def all_engine_names(engines: Mapping[str, Any]) -> list[str]:
    """The engines every rank holds together (collective): each rank's own under a placement, all of them else."""
    return sorted(set().union(*all_gather_objects(sorted(engines))))


@contextmanager
def barriers_within(engine: Any) -> Iterator[None]:
    """DeepSpeed barriers given no group (the world: `save_checkpoint` opens and closes with one) synchronise
    `engine`'s data-parallel group instead for the duration, so an engine on part of the ranks (a placement)
    waits only for them. (Its tag check, an all-reduce over the world, is off in the training config.)"""
    from deepspeed import comm as ds_comm

    scope = getattr(engine, "data_parallel_group", None)
    original = ds_comm.barrier

    def barrier(group=None, *args, **kwargs):
        return original(scope if group is None else group, *args, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original
