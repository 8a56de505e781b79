"""Distributed initialisation that works as a plain process, under torchrun and under `deepspeed`.

Both launchers export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. A plain
`python step1_sft/main.py` exports none of them, so it starts a world of one on 127.0.0.1 (its store on a port
the OS gives it), which lets the same DeepSpeed code path run everywhere. Either way the world is torn down at exit.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Callable, Mapping, NoReturn, Sequence

import torch
import torch.distributed as torch_dist

from utils.errors import UserError
from utils.op_builds import watching_build_locks

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# what torch.distributed.run / deepspeed set for their workers (plus TORCHELASTIC_*: with its agent-store flag a
# new process group's rendezvous looks for the launcher's store instead of starting its own)
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


LAUNCHED_BY = "RLHF_LAUNCHER"  # train.py's --launcher, set for the ranks where its program does not set RANK
# the variables srun and OpenMPI's mpirun set for each rank, by the name torch.distributed reads it under
LAUNCHERS_RANK_VARIABLES = {
    "slurm": {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"},
    "openmpi": {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
                "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"},
}
LAUNCHERS_PROGRAM = {"slurm": "srun", "openmpi": "OpenMPI's mpirun"}


def take_launcher_ranks() -> None:
    """Under train.py's `--launcher slurm` or `openmpi` srun or mpirun starts each rank as `python -u main.py`
    (DeepSpeed's runners), setting its own rank variables (SLURM_PROCID, OMPI_COMM_WORLD_RANK, ...), not RANK,
    WORLD_SIZE and LOCAL_RANK: without them every rank started a world of one on GPU 0, N runs writing the same
    folders. Read only where train.py says its launcher started the ranks (`LAUNCHED_BY`): a script run inside an
    allocation sees the batch step's SLURM_NTASKS too."""
    launcher = os.environ.get(LAUNCHED_BY)
    if launcher not in LAUNCHERS_RANK_VARIABLES or "RANK" in os.environ:
        return
    variables = LAUNCHERS_RANK_VARIABLES[launcher]
    missing = [name for name in variables.values() if name not in os.environ]
    if missing:
        raise UserError(f"{LAUNCHED_BY}={launcher} says {LAUNCHERS_PROGRAM[launcher]} started this rank, but "
                        f"{', '.join(missing)} is not set; start the step through train.py's --launcher {launcher}, "
                        "or unset it")
    os.environ.update({name: os.environ[launchers_name] for name, launchers_name in variables.items()})
    nodes = os.environ.get("SLURM_STEP_NUM_NODES")
    if launcher == "slurm" and nodes and nodes.isdigit() and int(nodes) > 0:
        os.environ["LOCAL_WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) // int(nodes))


# what mpirun sets for each of its tasks (OpenMPI, Hydra's MPICH and Intel MPI, MVAPICH, PMIx): DeepSpeed's engine
# reads OMPI_COMM_WORLD_LOCAL_RANK beside LOCAL_RANK and asserts they are equal. srun's task variables stay: a nested
# srun finds its allocation through the job's, and sets SLURM_PROCID and the like anew for its own tasks
MPI_TASK_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
MPI_TASK_PREFIXES = ("OMPI_COMM_WORLD_", "MV2_COMM_WORLD_")


def launcher_variables(env: Mapping[str, str]) -> list[str]:
    """The names in `env` a launcher set for its worker: a world of its own started from a worker drops them, and so
    do the ranks train.py launches where `mpirun -n 1` started it (its rank 0 of 1 reached every rank, and a rank of
    local rank 1 failed in deepspeed.initialize on LOCAL_RANK 1 != OMPI_COMM_WORLD_LOCAL_RANK 0)."""
    return [key for key in env if key in LAUNCHER_VARIABLES or key in MPI_TASK_VARIABLES
            or key.startswith(("TORCHELASTIC_", *MPI_TASK_PREFIXES))]


def _start_single_process_world(backend: str) -> None:
    """A world of one made here rather than by a launcher. Its store listens on a port the OS picks as it binds:
    a port chosen free first and bound later can be taken in between (six GPU test processes started at once on
    one machine collided so, EADDRINUSE)."""
    from deepspeed.constants import default_pg_timeout

    store = torch_dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=default_pg_timeout)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port))
    torch_dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=default_pg_timeout)


def init_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed once; safe to call repeatedly. Without a launcher's
    variables (RANK and WORLD_SIZE), the process starts a world of its own."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    with watching_build_locks():  # DeepSpeed's CPU communication op compiles at its first initialisation
        if not is_initialized():
            take_launcher_ranks()
            accelerator = get_accelerator()
            if accelerator.device_name() != "cpu":
                accelerator.set_device(get_local_rank())
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
            else:
                _start_single_process_world(accelerator.communication_backend_name())
            atexit.register(end_distributed)
        deepspeed.init_distributed(dist_init_required=False)


def end_distributed() -> None:
    """At exit (registered by `init_distributed`): tear the world down while Python can still run destructors. Left
    to the interpreter's finalization, a 2-rank ZeRO-3 evaluation under torchrun aborted after its work was done in
    1 run of 8 ("terminate called without an active exception", exit -6): a core dump showed a gloo worker thread
    freeing an all-reduce's tensors during finalization, when it can no longer take the GIL. No barrier: a rank
    leaving on an error must not wait for peers that may be in another collective."""
    if is_initialized():
        torch_dist.destroy_process_group()
        gc.collect()


def leave_spawned_rank() -> None:
    """End a spawned rank whose work is done and whose result is handed over, without the interpreter's finalization.
    A gloo group that torch's profiler or a DeepSpeed import still holds outlives `destroy_process_group`, and one of
    its worker threads may free the last collective's tensor after this thread let go of it; freeing it takes the
    GIL, and a thread asking for the GIL while the interpreter finalizes is ended by CPython, which aborts the rank
    inside gloo ("terminate called without an active exception", SIGABRT)."""
    torch_dist.destroy_process_group()
    _exit_now(0)


def run_as_program(main: Callable[[], object]) -> NoReturn:
    """Run `main` as this process's program (the `__main__` of a step, and of train.py, which runs the steps in its
    own process on the cpu deployment) and end the process as the interpreter would, less its finalization. A
    DeepSpeed engine keeps its gloo groups alive past `end_distributed` (its ZeRO parameters and optimizer and
    `deepspeed.utils.groups` hold them, and the engine is never collected), so their worker threads still run while
    the interpreter finalizes: one that frees the last collective's tensor then asks for the GIL, is ended by CPython
    inside gloo, and the finished rank aborts ("terminate called without an active exception", SIGABRT), as a
    calibration rank did (`leave_spawned_rank`). What comes before the finalization is done as the interpreter does
    it: the outcome said (a traceback, `sys.exit`'s message), the other threads that are no daemons joined, the exit
    handlers run (the world's teardown, logging's), the standard streams flushed. The status is the interpreter's:
    0, `sys.exit`'s code, 1 after an exception, 120 where the last flush failed, death by SIGINT after a
    KeyboardInterrupt."""
    status = _run_program(main)
    try:
        threading._shutdown()  # the interpreter's step: executors told to stop, the threads that are no daemons joined
    except BaseException as error:  # noqa: BLE001 -- a Ctrl-C while waiting: said, and on to the exit handlers
        _say_ignored("on threading shutdown", error)
    atexit._run_exitfuncs()
    if not _flush_standard_streams():
        status = 120 if status is not None else None  # the interpreter's status where its last flush fails
    if status is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    os._exit(status)


def _run_program(main: Callable[[], object]) -> int | None:
    """`main()`'s exit status as the interpreter gives a program's, its outcome said as the interpreter says it; None
    for a KeyboardInterrupt, which ends the interpreter by SIGINT."""
    try:
        main()
    except SystemExit as ended:
        if ended.code is None or isinstance(ended.code, int):
            return ended.code or 0
        print(ended.code, file=sys.stderr)
        return 1
    except BaseException as error:  # noqa: BLE001 -- said and turned into a status, as the interpreter does
        sys.excepthook(type(error), error, error.__traceback__)
        return None if isinstance(error, KeyboardInterrupt) else 1
    return 0


def _exit_now(status: int) -> NoReturn:
    """End the process with `status` without the interpreter's finalization, the standard streams flushed first."""
    _flush_standard_streams()
    os._exit(status)


def _flush_standard_streams() -> bool:
    """Flush standard output and error, as the interpreter does before it ends (also before it ends by SIGINT);
    whether what they held was written or had nowhere to go. A closed stream is passed over, as the interpreter
    passes it; so is one without a reader any more (the interpreter says 120 there too: here the reader that left,
    a `head` or train.py's output reader, chose to, and the program's own status stands). Another failure (a full
    disk) is said and makes the status 120, as the interpreter's."""
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass
        except OSError as error:
            _say_ignored(f"in: {stream!r}", error)
            flushed = False
    return flushed


def _say_ignored(where: str, error: BaseException) -> None:
    """Say on the process's error output, as the interpreter says an exception it ignores at its end, that `error`
    happened `where`; said nowhere if that output fails too."""
    with contextlib.suppress(OSError, ValueError):
        print(f"Exception ignored {where}", file=sys.__stderr__)
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.__stderr__)
        sys.__stderr__.flush()


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def _rank_environ() -> Mapping[str, str]:
    """The environment with the launcher's own rank variables read as RANK, WORLD_SIZE and LOCAL_RANK
    (`take_launcher_ranks`): a step asks its rank and world size before `init_distributed` (its flag checks, its
    logging level), and under srun read a world of one there, refusing a placement that needs more ranks in every
    rank."""
    take_launcher_ranks()
    return os.environ


def get_rank() -> int:
    return torch_dist.get_rank() if is_initialized() else int(_rank_environ().get("RANK", 0))


def get_world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else int(_rank_environ().get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(_rank_environ().get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()


def current_device() -> torch.device:
    """The accelerator device this rank computes on (`cpu` on a CPU machine)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def print_rank0(*args, **kwargs) -> None:
    if is_main_process():
        print(*args, **kwargs, flush=True)


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when `flag` is true on at least one (collective: every rank of `group`, default all,
    must call it)."""
    if not is_initialized() or torch_dist.get_world_size(group) == 1:
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=current_device())
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def broadcast_from_main(value):
    """Rank 0's picklable `value`, returned on every rank (collective: every rank must call it)."""
    if not is_initialized() or get_world_size() == 1:
        return value
    box = [value]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_over_ranks(values: Sequence[float], group=None) -> list[float]:
    """Element-wise sum of each rank's numbers, in float64 (collective: every rank of `group`, default all, must
    call it)."""
    if not is_initialized() or torch_dist.get_world_size(group) == 1:
        return [float(value) for value in values]
    totals = torch.tensor([float(value) for value in values], dtype=torch.float64, device=current_device())
    torch_dist.all_reduce(totals, group=group)
    return totals.tolist()


def mean_over_ranks(stats: Mapping[str, float]) -> dict[str, float]:
    """The mean over ranks of each per-rank scalar (collective: every rank must call it with the same keys)."""
    if not is_initialized() or get_world_size() == 1:
        return dict(stats)
    keys = sorted(stats)
    return {key: total / get_world_size() for key, total in zip(keys, sum_over_ranks([stats[k] for k in keys]))}


def max_over_ranks(value: float) -> float:
    """The largest of each rank's `value` (collective: every rank must call it)."""
    if not is_initialized() or get_world_size() == 1:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=current_device())
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return float(tensor.item())


def all_gather_objects(value, group=None) -> list:
    """Every rank's picklable `value`, in rank order (collective: every rank of `group`, default all, must call it)."""
    if not is_initialized() or torch_dist.get_world_size(group) == 1:
        return [value]
    values = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(values, value, group=group)
    return values


def refuse_on_every_rank(problem: str | None, group=None) -> None:
    """Raise `UserError` on every rank (of `group`, default all) when any of them found a problem, with each distinct
    problem's message in rank order; `problem` is this rank's message, or None (collective: every rank of the group
    calls it). A rank that raised alone would leave the others waiting for it in their next collective, for ever
    under NCCL."""
    problems = [found for found in all_gather_objects(problem, group) if found is not None]
    if problems:
        raise UserError("\n".join(dict.fromkeys(problems)))
