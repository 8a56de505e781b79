"""Running one step: in this process (the `cpu` deployment) or through DeepSpeed's launcher,
either way with its output teed into a log file."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import IO, Iterator, Mapping, Sequence

import psutil

from training.reliability.signals import (
    EXIT_INTERRUPTED,
    handling_signals,
    output_reader_gone,
    record_signal,
    say_from_handler,
)
from utils.atomic import atomic_write_text
from utils.dist import LAUNCHED_BY, free_port, launcher_variables
from utils.errors import UserError

from .deployment import DeploymentType
from .failures import cause_in_output, exception_cause, output_tail, signal_cause
from .hostfile import is_this_machine, lines_as_deepspeed_reads
from .steps import StepMain, flag_value

REPO_ROOT = Path(__file__).resolve().parents[2]  # the project's root, importable from every launched rank

logger = logging.getLogger(__name__)

LAUNCHER_MODULE = "deepspeed.launcher.runner"  # what the `deepspeed` console script runs
DEEPSPEED_MASTER_PORT = 29500  # the launcher's --master_port when none is given
STOP_COMMAND_WAIT_S = 30  # how long a step's end waits for a stop command through pdsh (one pkill a node)
STOP_COMMAND_RETRY_S = 5.0  # how often a stop command through pdsh runs again until it reaches a rank on every node
PKILL_MATCHED_NONE = 1  # pkill's exit status where no process matched (2, 3: it failed); pdsh's own failures too
STOP_UNMATCHED_SAY_S = 60.0  # how long a stop command through pdsh matches no rank on some node before it is said
SSH_FAILED = 255  # ssh's exit status where it could not run the command on the node
LOOPBACK = "127.0.0.1"  # rank 0's address for ranks all on this machine
# the variables the steps and the libraries under them read (the hub's cache and offline mode, the op builds' folder,
# the project's cache, NCCL's settings), which DeepSpeed's launcher does not pass to the ranks it starts through pdsh:
# it passes those named PYTHON*, MLFLOW*, MV2* and UCX*, NCCL* only from a machine with a CUDA GPU, and its env file's
# lines
OTHER_NODES_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH_", "NCCL_", "RLHF_", "XDG_CACHE_HOME")
DS_ENV_FILE = "DS_ENV_FILE"  # names the env file (VAR=value lines) DeepSpeed's launcher exports on every node
DEFAULT_DS_ENV_FILE = ".deepspeed_env"  # the env file's name where DS_ENV_FILE is unset, in ~ and the working folder
PDSH = "pdsh"
SLURM = "slurm"
IMPI = "impi"
OPENMPI = "openmpi"
# train.py's --launcher choices: DeepSpeed's runner's own names for them, with the programs it looks for (its mvapich
# runner starts each rank as `python script` with no rank, world size or master address, which its ranks then find
# only through mpi4py; its mpich runner starts each rank through launcher_helper.py, which exits 0 whatever the rank's
# exit code, so a failed or stopped step would be reported finished; MPICH's Hydra mpirun reads the impi runner's
# flags too)
LAUNCHER_PROGRAMS = {PDSH: ("pdsh", "ssh"), SLURM: ("srun", "sinfo"), IMPI: ("mpirun",),
                     OPENMPI: ("mpirun", "ompi_info")}
LAUNCHER_SETUP = {  # how to have a --launcher's programs on PATH
    SLURM: "run train.py inside a Slurm allocation (sbatch or salloc) on a node with Slurm's commands (module load "
           "slurm, where your cluster uses modules)",
    IMPI: "load Intel MPI or MPICH here and on every node (module load intel-mpi or mpich, or source Intel MPI's "
            "setvars.sh)",
    OPENMPI: "load OpenMPI here and on every node (module load openmpi; Debian, Ubuntu: apt-get install "
             "openmpi-bin)",
}


def check_launcher_installed() -> None:
    """DeepSpeed's launcher must be importable by this interpreter (it starts the launcher, see `Launcher`)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError(
            f"the {LAUNCHER_MODULE} launcher needs DeepSpeed, which {sys.executable} cannot import; install it "
            f"with: {sys.executable} -m pip install deepspeed (or use --deployment-type cpu)"
        )


@dataclass(frozen=True)
class Launcher:
    """How step scripts are started: DeepSpeed's launcher on the local GPUs or on a hostfile's nodes.

    The launcher runs as `python -m deepspeed.launcher.runner` under this very interpreter, not as the
    `deepspeed` script looked up on PATH: a virtual environment's python that was never activated
    has no `deepspeed` on PATH (or finds another environment's).
    """

    deployment: DeploymentType
    num_gpus: int = 1
    hostfile: str | None = None
    master_port: int | None = None  # given by the user; None: one free at each launch, every rank here; else 29500
    master_addr: str | None = None  # multi_node; None: under pdsh the launcher asks the first node (`hostname -I`),
    # or 127.0.0.1 for this machine alone; under slurm, impi and openmpi the hostfile's first node (`rank_0_address`)
    nodes: int = 1  # the hostfile's
    on_this_machine: bool = False  # multi_node: the hostfile's first node is the machine train.py runs on
    hosts: tuple[str, ...] = ()  # multi_node: the hostfile's nodes, by name
    backend: str = PDSH  # multi_node: --launcher, the program DeepSpeed's launcher starts the ranks with
    backend_args: str | None = None  # multi_node: --launcher-args, that program's own flags
    slots: int | None = None  # multi_node: the hostfile's slots a node (the same on every node but under pdsh and
    # OpenMPI); needed under Slurm (`srun_layout`)

    def __post_init__(self) -> None:
        if self.deployment is DeploymentType.MULTI_NODE and self.backend == SLURM and not self.slots:
            raise ValueError(f"a multi_node Launcher under {SLURM} needs the hostfile's slots a node (srun's "
                             f"--ntasks-per-node), got {self.slots!r}")

    @property
    def through_nodes_launcher(self) -> bool:
        """multi_node: the ranks start through --launcher's program (pdsh, srun, mpirun). Under pdsh but those of a
        hostfile of this machine alone, which the launcher starts itself; under Slurm and MPI always: srun and mpirun
        place the ranks in the allocation, which DeepSpeed's own start on this machine would leave."""
        return self.deployment is DeploymentType.MULTI_NODE and (
            self.backend != PDSH or self.nodes > 1 or not self.on_this_machine)

    @property
    def through_pdsh(self) -> bool:
        """multi_node: every node's ranks start through pdsh and a remote shell, but those of one node that is this
        machine, which the launcher starts itself."""
        return self.through_nodes_launcher and self.backend == PDSH

    @property
    def output_prefixes(self) -> tuple[str, ...]:
        """The node names that may lead the ranks' output lines: pdsh's `node: ` prefix (srun and mpirun add none)."""
        return self.hosts if self.backend == PDSH else ()

    @property
    def master_on_this_machine(self) -> bool:
        """multi_node: whether rank 0, which serves the store on the master port, runs on this machine: the hostfile's
        first node is this machine and no --master-addr names another."""
        return self.on_this_machine and (self.master_addr is None or is_this_machine(self.master_addr))

    @property
    def settles_port_at_launch(self) -> bool:
        """Whether `command_now` picks a free master port at each launch: every rank on this machine, none given. With
        ranks on other nodes it stays DeepSpeed's, which their firewalls may open alone."""
        return not self.through_nodes_launcher and self.master_port is None

    @property
    def rank_0_address(self) -> str:
        """Under Slurm and MPI, where no ssh asks the first node: --master-addr, else the hostfile's first node (this
        machine's host name where it names this machine as `localhost`, which other nodes read as themselves)."""
        if self.master_addr is not None:
            return self.master_addr
        return socket.gethostname() if self.on_this_machine else self.hosts[0]

    @property
    def stop_status(self) -> int | None:
        """The launcher's exit status that says its ranks stopped on a stop request of their own (a signal that reached
        them, not through train.py): `EXIT_INTERRUPTED`. None under Intel MPI, whose mpirun (Hydra) ORs the ranks'
        exit statuses, so that one rank's 1 and another's 2 also made 3: there only a stop request train.py passed on
        makes a stop."""
        return None if self.through_nodes_launcher and self.backend == IMPI else EXIT_INTERRUPTED

    def ranks_env(self) -> dict[str, str]:
        """What the ranks need in the launcher's environment that --launcher's program does not give them: under
        Slurm, whose srun passes this environment on to every rank (DeepSpeed's `--export=ALL`) and sets only its own
        SLURM_PROCID and the like, the launcher's name (`utils.dist` reads its rank from those) and rank 0's address
        and port; under OpenMPI, whose mpirun sets only its OMPI_COMM_WORLD_RANK and the like, the same, which it
        exports to the ranks by name (`launcher_args`). DeepSpeed's impi runner sets RANK, WORLD_SIZE and the master's
        address themselves."""
        if not (self.through_nodes_launcher and self.backend in (SLURM, OPENMPI)):
            return {}
        return {LAUNCHED_BY: self.backend, "MASTER_ADDR": self.rank_0_address,
                "MASTER_PORT": str(self.master_port or DEEPSPEED_MASTER_PORT)}

    def launcher_args(self) -> str | None:
        """DeepSpeed's --launcher_args: --launcher-args, after srun's layout flags under Slurm (`srun_layout`; the
        user's own are refused while planning, `check_launcher_args`) and before mpirun's exports under OpenMPI
        (`openmpi_exports`)."""
        if self.backend == SLURM:
            return _joined(self.srun_layout(), self.backend_args)
        if self.backend == OPENMPI:
            return _joined(self.backend_args, self.openmpi_exports())
        return self.backend_args

    def srun_layout(self) -> str:
        """The hostfile's layout as srun's flags, `--nodes N --ntasks-per-node SLOTS --nodelist NODE,...`: DeepSpeed's
        Slurm runner gives srun `-n RANKS` alone, and inside a batch job srun took the job's node count
        (SLURM_JOB_NUM_NODES, which it reads before SLURM_NNODES since Slurm 20.11) and any of the job's nodes, so the
        ranks ran on other nodes, or unevenly, than the hostfile's: rank 0 away from MASTER_ADDR (the hostfile's
        first node), a rank's LOCAL_WORLD_SIZE (WORLD_SIZE // SLURM_STEP_NUM_NODES) wrong. Flags, not srun's input
        variables: they show in the logged command and win over the job's."""
        nodelist = ",".join(self.slurm_node_names)
        return f"--nodes {self.nodes} --ntasks-per-node {self.slots} --nodelist {shlex.quote(nodelist)}"

    @property
    def slurm_node_names(self) -> tuple[str, ...]:
        """The hostfile's nodes as srun's --nodelist takes them: the first, where it is this machine, by Slurm's name
        for it (SLURMD_NODENAME in a batch job, else this machine's host name), as a hostfile's `localhost` or
        address names no Slurm node."""
        if not self.on_this_machine:
            return self.hosts
        return (os.environ.get("SLURMD_NODENAME", socket.gethostname()), *self.hosts[1:])

    def openmpi_exports(self) -> str:
        """An `-x NAME` for each variable the ranks need from the launcher's environment (`ranks_env`'s, and those
        `_taken_for_other_nodes`, as pdsh's env file carries them): OpenMPI's mpirun gives the ranks on other nodes no
        other variables than those it exports, and `-x NAME` takes the value from its own environment as it is (where
        DeepSpeed's `-x NAME=VALUE` would wrap it in quotes)."""
        env = launcher_env(REPO_ROOT)
        names = sorted({*self.ranks_env(), *_taken_for_other_nodes(env, _users_deepspeed_env(env))})
        return shlex.join([word for name in names for word in ("-x", name)])

    def command(self, script: Path, step_argv: Sequence[str]) -> list[str]:
        # --no_local_rank: the steps read LOCAL_RANK from the environment the launcher sets
        command = [sys.executable, "-m", LAUNCHER_MODULE, "--no_local_rank"]
        if self.through_pdsh:
            check_remote_shell_tools()
            check_remote_shell_reads(script, step_argv)
        elif self.through_nodes_launcher:
            check_launcher_programs(self.backend)
            check_exports_arrive_intact(self.backend, {**launcher_env(REPO_ROOT), **self.ranks_env()})
        if self.deployment is DeploymentType.MULTI_NODE:
            command += ["--hostfile", str(self.hostfile)]
            if (launcher_args := self.launcher_args()) is not None:
                command.append(f"--launcher_args={launcher_args}")  # one word: a value may begin with a dash
            if self.backend != PDSH:  # no ssh: srun or mpirun reaches the nodes
                command += ["--launcher", self.backend, "--force_multi", "--no_ssh_check",
                            "--master_addr", self.rank_0_address]
            elif self.through_pdsh and self.nodes == 1:  # else the launcher starts a single node's ranks on this one
                command.append("--force_multi")
            elif not self.through_pdsh:  # which it does itself, yet asks ssh first (and for rank 0's address)
                command += ["--no_ssh_check", "--master_addr", self.master_addr or LOOPBACK]
        else:
            # with no --hostfile the launcher reads /job/hostfile where a cluster has one and spreads the run over
            # its nodes; a path that is not a file keeps it on this node
            command += ["--hostfile", os.devnull]
            if visible := visible_gpus():
                command += ["--include", f"localhost:{','.join(visible[: self.num_gpus])}"]
            else:
                command += ["--num_gpus", str(self.num_gpus)]
        if self.master_port is not None:
            command += ["--master_port", str(self.master_port)]
        if self.master_addr is not None and self.through_pdsh:
            command += ["--master_addr", self.master_addr]
        return command + [str(script), *step_argv]

    def command_now(self, script: Path, step_argv: Sequence[str], check_gpus: bool = True) -> list[str]:
        """`command` with its master port settled at this moment, not when the run was planned (hours before a
        later step starts, and another program may have taken the port since): where rank 0 runs on this machine,
        the given port checked free, else one free now. Another node's port is for that node to bind. `check_gpus`
        (False for a dry run, which launches nothing): refuse a `CUDA_VISIBLE_DEVICES` that lets this process see no
        GPU."""
        no_gpu_seen = no_gpu_visible()
        if check_gpus and self.deployment is not DeploymentType.MULTI_NODE and no_gpu_seen is not None:
            raise UserError(f"{no_gpu_seen}, and DeepSpeed's launcher would drop it and start the ranks on the GPUs "
                            "from 0; where this machine has some, unset the variable or list the GPUs to run on "
                            "(nvidia-smi -L gives their indices), else run with --deployment-type cpu")
        if self.settles_port_at_launch:
            return replace(self, master_port=free_port()).command(script, step_argv)
        if not self.through_nodes_launcher:
            check_port_free(self.master_port)
        elif self.master_on_this_machine and self.master_port is None:
            check_port_free(DEEPSPEED_MASTER_PORT, "DeepSpeed's default master port",
                            "choose a free one with --master-port")
        elif self.master_on_this_machine:
            check_port_free(self.master_port, way_out="choose another with --master-port")
        return self.command(script, step_argv)

    def ranks_stop_command(self, script: Path, step_argv: Sequence[str]) -> list[str] | None:
        """Through pdsh, the command that passes a stop request (a SIGTERM) to the step's ranks on every node, leaving
        the launcher, pdsh and ssh be (None: the ranks run under this process, signalled as its children).

        A stop request cannot go through DeepSpeed's launcher there: its handler kills pdsh, with it the ssh that
        carries the ranks' output (their next print fails on the closed pipe, before their checkpoint), and exits
        within a second, before they have saved. pkill on each node, matching the ranks' command line (this python,
        `-u`, the step's script, and its run folder), reaches them alone; they save, print, and end the launch with
        `EXIT_INTERRUPTED` as on one node. pdsh runs with `-S`, returning the largest of the nodes' exit statuses
        (without it, 0 whatever they were): 1 where pkill matched no rank on some node (`_RanksStopper`)."""
        if not self.through_pdsh:
            return None
        rank = f"^{_ere_literal(sys.executable)} -u {_ere_literal(str(script))} "
        run_dir = flag_value(step_argv, "--output_dir")  # train.py gives it as `--output_dir DIR`
        if run_dir is not None:
            rank += f".*--output_dir {_ere_literal(run_dir)}( |$)"
        return ["env", "PDSH_RCMD_TYPE=ssh", "pdsh", "-S", "-w", ",".join(self.hosts),
                *shlex.split(self.backend_args or ""), f"pkill -TERM -f {shlex.quote(rank)}"]


def _joined(*flags: str | None) -> str:
    """Flag strings for one command line, in order, those not given left out."""
    return " ".join(words for words in flags if words is not None)


def _ere_literal(text: str) -> str:
    """`text` as a POSIX extended regular expression (pkill's) that matches it alone."""
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)


# what tells a process it is one of several a launcher started, by the variable holding how many: who started them
# and the variable with its rank. srun's is a job step's own (SLURM_NTASKS is also a batch script's, which runs once);
# Hydra's PMI_SIZE is MPICH's and Intel MPI's
SEVERAL_TASKS_VARIABLES = {
    "WORLD_SIZE": ("a launcher", "RANK"),
    "SLURM_STEP_NUM_TASKS": ("srun", "SLURM_PROCID"),
    "OMPI_COMM_WORLD_SIZE": ("OpenMPI's mpirun", "OMPI_COMM_WORLD_RANK"),
    "PMI_SIZE": ("mpirun (MPICH, Intel MPI)", "PMI_RANK"),
    "MV2_COMM_WORLD_SIZE": ("MVAPICH's mpirun", "MV2_COMM_WORLD_RANK"),
}


def drop_stray_launcher_name() -> None:
    """Take `LAUNCHED_BY` out of train.py's own environment: it tells a step that srun started it (`utils.dist` then
    reads SLURM_PROCID and the like as its rank), and train.py sets it for the ranks it launches so alone
    (`Launcher.ranks_env`). One exported in a batch script made a cpu run's step, run in this process, wait to join
    a world of SLURM_NTASKS ranks that no one started."""
    os.environ.pop(LAUNCHED_BY, None)


def check_not_under_a_launcher() -> None:
    """train.py starts each step's processes itself: started by a launcher as one of several ranks (torchrun, or srun
    or mpirun inside a batch job), every rank would plan and run the whole pipeline (for a GPU deployment each
    starting a launcher of its own on every GPU), all writing the same folders."""
    for variable, (launcher, rank_variable) in SEVERAL_TASKS_VARIABLES.items():
        count = os.environ.get(variable, "1")
        if count.isdigit() and int(count) > 1 and not _in_srun_pty_shell(variable):
            raise UserError(
                f"train.py was started by {launcher} as rank {os.environ.get(rank_variable, '?')} of {count} "
                f"processes ({variable}={count}); it starts each step's processes itself, so every rank would run the "
                "whole pipeline. Run it once, as `python train.py ...` (--deployment-type single_node for this "
                f"node's GPUs, multi_node with --hostfile for several nodes), {_one_task_hint(variable)}")


def _in_srun_pty_shell(variable: str) -> bool:
    """Whether srun's task count `variable` is that of an interactive step (`srun -n 8 --pty bash`, SLURM_PTY_PORT
    set) seen from its task 0 at the terminal: srun gives the terminal to task 0 alone, so train.py typed in that shell
    runs once (the other tasks' shells end at once on no input). A terminal on standard input too: a nested
    `srun -n 8 python train.py` typed there may inherit SLURM_PTY_PORT, and its task 0 has no terminal."""
    return variable == "SLURM_STEP_NUM_TASKS" and "SLURM_PTY_PORT" in os.environ and \
        os.environ.get("SLURM_PROCID") == "0" and os.isatty(0)


def _one_task_hint(variable: str) -> str:
    """How to start train.py once where `variable` said it was one of several processes."""
    if variable == "WORLD_SIZE":
        return "or launch one step's main.py with deepspeed or torchrun"
    launchers = [name for name in LAUNCHER_PROGRAMS if name != PDSH]
    return ("as one task: in a Slurm batch script run it directly, not through srun or mpirun (or with srun -n 1), "
            f"and let --launcher {', '.join(launchers[:-1])} or {launchers[-1]} start the ranks on the allocation's "
            "nodes")


def check_launcher_programs(backend: str) -> None:
    """--launcher's programs must be on PATH here: DeepSpeed's launcher failed only as step 1 launched ("launcher
    'slurm' not installed", or mpirun's FileNotFoundError), and a dry run said nothing."""
    _check_on_path(backend, f"multi_node --launcher {backend}", f"DeepSpeed's {backend} launcher starts every rank "
                   f"with {LAUNCHER_PROGRAMS[backend][0]}; {LAUNCHER_SETUP[backend]}, or pick another --launcher")


def _check_on_path(backend: str, run: str, why_and_way_out: str) -> None:
    """Refuse a `run` whose --launcher `backend`'s programs (`LAUNCHER_PROGRAMS`) are not all on PATH here, naming
    those missing, then `why_and_way_out`: what needs them and what to do."""
    missing = [program for program in LAUNCHER_PROGRAMS[backend] if shutil.which(program) is None]
    if missing:
        raise UserError(f"{run}: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH here, "
                        f"and {why_and_way_out}")


def check_launcher_args(launcher: Launcher) -> None:
    """--launcher-args, while planning: DeepSpeed's launcher splits it as a shell does, and ended step 1's launch in
    a ValueError's traceback on an unclosed quote; under pdsh with a hostfile of this machine alone it starts the
    ranks itself, no pdsh, so pdsh's flags went unused, unsaid."""
    if launcher.backend_args is None:
        return
    try:
        shlex.split(launcher.backend_args)
    except ValueError as error:
        raise UserError(f"--launcher-args {launcher.backend_args!r}: {error}; DeepSpeed's launcher splits it into "
                        "words as a shell does: close the quote, or quote it as on a command line") from None
    if launcher.backend == PDSH and not launcher.through_pdsh:
        raise UserError(f"--launcher-args {launcher.backend_args!r}: the hostfile names this machine alone, whose "
                        "ranks DeepSpeed's launcher starts itself, without pdsh, so pdsh's flags would go unused; "
                        "drop --launcher-args (or pass the --launcher whose program they are for)")
    if launcher.backend == SLURM and (layout := _srun_layout_flags(launcher.backend_args)):
        raise UserError(f"--launcher-args {launcher.backend_args!r}: {', '.join(layout)} would override the layout "
                        "train.py gives srun from the hostfile (--nodes, --ntasks-per-node, --nodelist), which rank 0's "
                        "address (MASTER_ADDR) and each rank's LOCAL_WORLD_SIZE follow; drop them and give the nodes "
                        "and slots in the hostfile")


SRUN_LAYOUT_FLAGS = ("--nodes", "-N", "--ntasks-per-node", "--nodelist", "-w")  # `Launcher.srun_layout`'s, long and short


def _srun_layout_flags(backend_args: str) -> list[str]:
    """The words of `backend_args` that set srun's layout (`SRUN_LAYOUT_FLAGS`): `--nodes 3`, `--nodes=3`, `-N3`."""
    return [word for word in shlex.split(backend_args)
            if any(word == flag or word.startswith(f"{flag}=" if flag.startswith("--") else flag)
                   for flag in SRUN_LAYOUT_FLAGS)]


def check_same_slots(backend: str, hostfile: str, slots: Sequence[int]) -> None:
    """DeepSpeed's Slurm and Intel MPI runners start the same number of ranks on every node (srun -n, mpirun -ppn),
    and failed with a traceback at launch on a hostfile whose nodes have different slots (OpenMPI's mpirun fills each
    node's slots as the hostfile gives them)."""
    if backend not in (PDSH, OPENMPI) and len(set(slots)) > 1:
        raise UserError(f"{hostfile}: its nodes have {', '.join(map(str, slots))} slots, and DeepSpeed's {backend} "
                        "launcher starts as many ranks on every node; give every node the same slots, or use "
                        "--launcher pdsh")


def check_remote_shell_tools() -> None:
    """On other nodes DeepSpeed's launcher starts the ranks with pdsh over ssh from this machine, and train.py passes
    a stop request on with pdsh too: without them on PATH the launcher failed as step 1 launched ("launcher 'pdsh' not
    installed", or ssh's FileNotFoundError in its ssh check), and a dry run said nothing (`--launcher pdsh`, the
    default: its stop command and its quoting checks are pdsh's)."""
    _check_on_path(PDSH, "multi_node", "DeepSpeed's launcher starts the ranks on other nodes with pdsh over ssh from "
                   "this machine (--launcher pdsh, the default); install them here (Debian, Ubuntu: apt-get install "
                   "pdsh openssh-client; RHEL, Fedora: dnf install pdsh pdsh-rcmd-ssh openssh-clients), or on a Slurm "
                   "or MPI cluster pass --launcher slurm, impi or openmpi, or run on this node alone with "
                   "--deployment-type single_node")


# what a node's shell reads as itself, unquoted (DeepSpeed's test for its exports), less the `%` that pdsh reads first:
# it puts the node's name, the user and the node's rank for %h, %u and %n in the command it runs on each node
_REMOTE_LITERAL = re.compile(r"[\w@+=:,./-]+")
_CHANGED_IN_DOUBLE_QUOTES = ("$", "`", "\\", "%")  # by the node's shell, or by pdsh (the %)
_SPECIAL_IN_DOUBLE_QUOTES = ("\\", "$", "`", '"')  # to the node's shell, which reads each as itself after a backslash


def check_remote_shell_reads(script: Path, step_argv: Sequence[str]) -> None:
    """On several nodes DeepSpeed's launcher hands pdsh one command line that each node's shell parses: `cd` to this
    folder, the step's script, its flags, none of them quoted but a flag value with a space, which it puts in double
    quotes. Refuse, before anything starts, what a shell would read otherwise (split, expand, or fail on: a quote, a
    parenthesis, a `$`) or pdsh rewrite (a `%`), naming it."""
    unquoted = {"this folder (train.py's working directory, where every node's ranks start)": os.getcwd(),
                "this python (each node's ranks start under it)": sys.executable, "the step's script": str(script)}
    for what, path in unquoted.items():
        if not _REMOTE_LITERAL.fullmatch(path):
            raise UserError(
                f"multi_node: {what} {path!r} would reach each node's shell unquoted (DeepSpeed's launcher runs pdsh), "
                "which would read it otherwise (pdsh rewrites a %h, %u or %n in it); use a path of letters, digits "
                "and @+=:,./- only")
    for value in step_argv:
        literal = (" " in value and not any(char in value for char in _CHANGED_IN_DOUBLE_QUOTES)) or \
            _REMOTE_LITERAL.fullmatch(value)
        if not literal:
            raise UserError(
                f"multi_node: the step flag value {value!r} would reach each node's shell as DeepSpeed's launcher "
                "passes it to pdsh (unquoted, or in double quotes when it has a space), which would read it otherwise; "
                "use letters, digits, spaces and @+=:,./- (no quotes, $, `, \\, parentheses or other shell "
                "characters, nor %, which pdsh rewrites; a path can be renamed or linked)")


def check_port_free(port: int, what: str = "--master-port",
                    way_out: str = "choose another port, or leave --master-port out for a free one") -> None:
    """The master port of a run whose rank 0 runs on this machine is free here now: one in use (another run, or the
    ranks of one that crashed and linger) would fail every rank when its store binds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the ranks' store binds: TIME_WAIT is free
        try:
            probe.bind(("", port))
        except OSError as err:
            raise UserError(f"{what} {port} is taken on this machine ({err.strerror}): another run, or the ranks of "
                            f"one that crashed, may hold it; {way_out}") from None


def visible_gpus() -> list[str]:
    """The GPU indices `CUDA_VISIBLE_DEVICES` restricts this node to (empty: unset, GPUs named otherwise than by
    index, or none visible: `Launcher.command_now` refuses that at launch). DeepSpeed's launcher drops the variable when
    it is given `--num_gpus` and numbers the GPUs from 0, so a restricted run names them in `--include` instead."""
    return _cuda_visible_indices() or []


def no_gpu_visible() -> str | None:
    """Where `CUDA_VISIBLE_DEVICES` lets this process see no GPU (empty, `-1`), that said, in words true on a machine
    without GPUs too (an empty variable is a common way to keep a CI job on the CPU); else None."""
    if _cuda_visible_indices() != []:
        return None
    return (f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} lets this process see no GPU, whether or "
            "not this machine has any")


def _cuda_visible_indices() -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as CUDA reads it, up to its first invalid entry (`-1`, or nothing: no GPU at all); None
    where it does not restrict the GPUs by index (unset, or UUIDs, said)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    devices = []
    for device in (entry.strip() for entry in value.split(",")):
        if device.isdigit():
            devices.append(device)
        elif not device or device.lstrip("-").isdigit():  # invalid to CUDA, which reads no further
            break
        else:
            logger.warning("CUDA_VISIBLE_DEVICES=%s names GPUs by UUID or MIG instance, which DeepSpeed's launcher "
                           "cannot select: it runs on the first GPUs the processes see; give indices (nvidia-smi -L) "
                           "to choose", value)
            return None
    return devices


def format_command(command: Sequence[str]) -> str:
    return shlex.join(command)


class _Tee:
    """A text stream that writes to a console stream and a log file."""

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        self._console.write(text)
        self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._console.flush()
        self._log.flush()

    def isatty(self) -> bool:
        return self._console.isatty()

    def __getattr__(self, name: str):
        return getattr(self._console, name)


@contextlib.contextmanager
def teed_output(log_path: Path) -> Iterator[None]:
    """Copy stdout, stderr and log records of the code inside into `log_path` (appending)."""
    from utils.log import setup_logging

    setup_logging()  # console handler first, so a step's own basicConfig adds no second one
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger()
        root.addHandler(handler)
        level = root.level
        root.setLevel(min(level, logging.INFO) if level else logging.INFO)
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = stdout, stderr
            root.removeHandler(handler)
            root.setLevel(level)


class StepStopped(Exception):
    """A step stopped on a stop request (SIGINT/SIGTERM) before it finished: its checkpoints resume it."""


def run_in_process(main: StepMain, argv: list[str], log_path: Path, label: str) -> dict:
    """Call a step's main directly. Its UserError keeps its message; an exit on a stop request becomes
    `StepStopped`; any other exit becomes a UserError that points at the log."""
    entry = getattr(main, "__wrapped__", main)  # past run_cli, so a UserError reaches us whole
    with teed_output(log_path):
        try:
            summary = entry(argv)
        except UserError as err:
            logging.getLogger(__name__).error("%s failed: %s", label, err)
            raise UserError(f"{label}: {err}") from err
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return {}
            if exit_.code == EXIT_INTERRUPTED:
                raise StepStopped(label) from exit_
            raise UserError(f"{label} exited with status {exit_.code}; see the messages above and {log_path}") from exit_
        except Exception as error:  # its traceback goes to the log; train.py ends with one line naming it
            logging.getLogger(__name__).exception("%s crashed", label)
            raise UserError(f"{label} crashed: {exception_cause(error)}; the traceback is in {log_path}") from error
    return summary if isinstance(summary, dict) else {}


class _StopRequests:
    """SIGINT and SIGTERM taken as stop requests while a launcher runs, passed on to every process under it (the
    launcher alone would die of one without telling the ranks).

    A stop request is passed on as a SIGTERM, whichever came: a `kill -INT` reaches train.py alone, but a terminal's
    Ctrl-C reaches its whole process group, the ranks too, and a SIGINT passed on would be their second, which
    aborts their save. A second SIGINT is passed on as itself: the ranks abort, as at a second Ctrl-C.

    With `stop_ranks` (`Launcher.ranks_stop_command`: ranks on other nodes, reached through pdsh) a stop request is
    that command instead, run by a thread of its own (not in the signal handler) every `STOP_COMMAND_RETRY_S` until
    one run reaches a rank on every node (status 0) or the launcher ends: a request taken before pdsh has started
    the ranks matches none at first. A second SIGINT still goes to the launcher, whose own handler kills them all."""

    def __init__(self, stop_ranks: Sequence[str] | None = None) -> None:
        self.taken: list[signal.Signals] = []
        self._process: subprocess.Popen | None = None
        self._passed_on = False
        self._stop_ranks = stop_ranks
        self._stopper: _RanksStopper | None = None

    def take(self, signum: int, frame: FrameType | None) -> None:
        record_signal(signum)
        again = signum == signal.SIGINT and signal.SIGINT in self.taken
        self.taken.append(signal.Signals(signum))
        self._pass_on(signal.SIGINT if again else signal.SIGTERM)

    def watch(self, process: subprocess.Popen) -> None:
        """Pass stop requests on to `process` from now on, and one taken while it started."""
        if self._stop_ranks is not None:
            self._stopper = _RanksStopper(self._stop_ranks)
        self._process = process
        if self.taken and not self._passed_on:
            self._pass_on(signal.SIGTERM)

    def stop(self) -> None:
        """Pass a stop request on now, as a SIGTERM would, though none came."""
        self._pass_on(signal.SIGTERM)

    def _pass_on(self, signum: signal.Signals) -> None:
        process = self._process
        if process is None or process.returncode is not None:  # not started, or reaped (its pid free for another)
            return
        self._passed_on = True
        if self._stopper is None or signum != signal.SIGTERM:
            _signal_process_tree(process.pid, signum)
        else:
            say_from_handler(f"\ntrain.py: passing the stop request on to the ranks on every node as a SIGTERM, which "
                             f"lets them save (DeepSpeed's launcher would cut their output first): "
                             f"{format_command(self._stop_ranks)}\n")
            self._stopper.request()

    def launcher_ended(self) -> None:
        """Once the launcher has ended: stop running the stop command, and say if the stop request never reached a
        rank on some node (those ranks may have run on and saved nothing)."""
        if self._stopper is not None:
            self._stopper.finish()


class _RanksStopper:
    """Runs the command that passes a stop request to the ranks on every node (`Launcher.ranks_stop_command`, under
    `pdsh -S`: its status is the largest of the nodes' pkill statuses) in a thread, at each request, again every
    `STOP_COMMAND_RETRY_S` until a run reaches a rank on every node or the launcher ends. The ranks take a repeated
    SIGTERM as nothing new; once every node is reached no more are sent (a rank past its save, shutting down without
    its handler, would die of one)."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.runs = 0
        self.reached_every_node = False
        self.last_status: int | None = None
        self._requested_at: float | None = None  # the first request's time: a repeated one keeps the clock going
        self._said_unmatched = False
        self._running: subprocess.Popen | None = None
        self._requested = threading.Event()  # set by a stop request (from the signal handler: it only sets this)
        self._launcher_ended = threading.Event()
        self._thread = threading.Thread(target=self._run_on_requests, name="stop-ranks", daemon=True)
        self._thread.start()

    def request(self) -> None:
        if self._requested_at is None:
            self._requested_at = time.monotonic()
        self._requested.set()

    def finish(self) -> None:
        """The launcher has ended: no more runs; wait up to `STOP_COMMAND_WAIT_S` for one under way (killed past
        that), then say if the stop request never reached a rank on some node."""
        self._launcher_ended.set()
        self._requested.set()
        self._thread.join(STOP_COMMAND_WAIT_S)
        running = self._running
        if self._thread.is_alive() and running is not None:
            running.kill()
            self._thread.join()
            self._say(f"{format_command(self.command)} was still running {STOP_COMMAND_WAIT_S} s after the launcher "
                      "ended, and was killed (its messages are above)")
        elif self.runs and not self.reached_every_node:
            self._say(f"the stop request never reached a rank on some node: {format_command(self.command)} ran "
                      f"{self.runs} times, the last one {stop_status_meaning(self.last_status)} (its messages are "
                      "above); the ranks there may have had no stop request, and saved no checkpoint")

    def _run_on_requests(self) -> None:
        while self._requested.wait() and not self._launcher_ended.is_set():
            self._requested.clear()
            while not self._run_once() and not self._launcher_ended.wait(STOP_COMMAND_RETRY_S):
                pass

    def _run_once(self) -> bool:
        """Run the stop command once; whether it reached a rank on every node. A failure other than 'no rank
        matched' (which it is, while pdsh starts the ranks) is said when its status is new."""
        self._running = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
        status = self._running.wait()
        self._running = None
        if status not in (0, PKILL_MATCHED_NONE, self.last_status) and not self._launcher_ended.is_set():
            self._say(f"{format_command(self.command)} {stop_status_meaning(status)} (its messages are above); trying "
                      f"again every {STOP_COMMAND_RETRY_S} s until it reaches a rank on every node")
        elif status == PKILL_MATCHED_NONE and self._unmatched_too_long():
            self._say(f"{format_command(self.command)} has returned 1 for {STOP_UNMATCHED_SAY_S:g} s since the stop "
                      "request: pkill matched no rank on some node, or pdsh failed (its own failures return 1 too, "
                      f"with its messages above); trying again every {STOP_COMMAND_RETRY_S} s until it reaches a rank "
                      "on every node or the launcher ends")
        self.runs += 1
        self.last_status = status
        self.reached_every_node = self.reached_every_node or status == 0
        return status == 0

    def _unmatched_too_long(self) -> bool:
        """Whether 'no rank matched' has lasted `STOP_UNMATCHED_SAY_S` since the request, not yet said: past the
        ranks' start, or pdsh failing on its own (status 1 as well)."""
        if self._said_unmatched or self._launcher_ended.is_set():
            return False
        self._said_unmatched = time.monotonic() - self._requested_at >= STOP_UNMATCHED_SAY_S
        return self._said_unmatched

    @staticmethod
    def _say(text: str) -> None:
        print(f"train.py: {text}", file=sys.stderr, flush=True)


def stop_status_meaning(status: int | None) -> str:
    """What the exit status of `pdsh -S ... pkill` says (the largest of the nodes' statuses)."""
    if status == PKILL_MATCHED_NONE:
        return "matched no rank on some node (pkill's status 1)"
    if status in (2, 3):
        return f"failed on some node (pkill's status {status})"
    if status == SSH_FAILED:
        return "could not reach some node (ssh's status 255)"
    return f"failed (exit status {status})"


@contextlib.contextmanager
def _stop_requests_passed_on(stop_ranks: Sequence[str] | None = None) -> Iterator[_StopRequests]:
    """While the step's processes start and run, take this process's SIGINT and SIGTERM as stop requests rather than
    dying of them (which closed the pipe the ranks write to, and they died before saving); `_StopRequests.watch`
    names the processes to pass them on to once started."""
    requests = _StopRequests(stop_ranks)
    with handling_signals((signal.SIGINT, signal.SIGTERM), requests.take):
        yield requests


def _signal_process_tree(pid: int, signum: signal.Signals) -> None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signum)


def run_subprocess(command: Sequence[str], log_path: Path, label: str, env: dict[str, str] | None = None,
                   stop_ranks: Sequence[str] | None = None, nodes: Sequence[str] = (),
                   stop_status: int | None = EXIT_INTERRUPTED) -> None:
    """Run a launcher command, streaming its combined output to the console and the log as it comes; a stop
    request during it ends in `StepStopped` unless the step finished all the same. With `stop_ranks` (ranks on other
    nodes: `Launcher.ranks_stop_command`) the launcher runs in a session of its own, which a terminal's Ctrl-C does
    not reach: its handler would kill pdsh, and with it the ranks' output. Where copying the output fails (the disk
    full, the console gone), the step's processes are stopped as on a stop request and waited for before the error
    goes on: train.py does not end leaving them running unwatched. `nodes`: the hostfile's, whose names pdsh puts ahead
    of their ranks' lines (`cause_in_output`). `stop_status`: the exit status read as the ranks' own stop
    (`Launcher.stop_status`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log, _stop_requests_passed_on(stop_ranks) as stop_requests:
        attempt_start = log.tell()
        log.write(f"$ {format_command(command)}\n".encode())
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=stop_ranks is not None)
        except FileNotFoundError as err:
            raise UserError(f"cannot start {command[0]!r} ({err.strerror}); check that this program exists") from err
        stop_requests.watch(process)
        try:
            _copy_output(process, log)
        except BaseException as error:
            _stop_unread(process, stop_requests, f"{label}: copying its output failed ({error})")
            raise
        finally:
            status = process.wait()
            stop_requests.launcher_ended()
    if status != 0 and (stop_requests.taken or status == stop_status):
        raise StepStopped(label)
    if status != 0:
        cause = _failure_cause(status, log_path, attempt_start, nodes)
        raise UserError(f"{label} failed (exit status {status}){cause}; its output is in {log_path}")


def _failure_cause(status: int, log_path: Path, attempt_start: int, nodes: Sequence[str]) -> str:
    """': <why>' a launched step ended with `status`, from the signal that ended the launcher or the end of the
    step's output in its log from `attempt_start` on (this attempt's); empty where neither says."""
    cause = signal_cause(-status) if status < 0 else cause_in_output(output_tail(log_path, attempt_start), nodes)
    return f": {cause}" if cause else ""


def _copy_output(process: subprocess.Popen, log: IO[bytes]) -> None:
    """Copy `process`'s output to the log and the console as it comes, to its end: the ranks' last words matter most."""
    assert process.stdout is not None
    while chunk := os.read(process.stdout.fileno(), 65536):
        log.write(chunk)
        log.flush()
        _to_console(chunk)


def _to_console(chunk: bytes) -> None:
    """Write `chunk` to stdout, as bytes where it has a buffer. The console gone (`train.py | tee`, tee killed) in the
    moment before the output watch redirects it to /dev/null is the watch's stop request, not an error."""
    if not hasattr(sys.stdout, "buffer"):
        sys.stdout.write(chunk.decode(errors="replace"))
        return
    try:
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        if not output_reader_gone(sys.stdout):
            raise


def _stop_unread(process: subprocess.Popen, stop_requests: _StopRequests, why: str) -> None:
    """`why` train.py cannot copy `process`'s output any more: pass a stop request on to its processes, and read their
    output to its end unwritten, so that they save and end rather than run on unwatched (or block on a full pipe)."""
    say_from_handler(f"\ntrain.py: {why}; passing a stop request on to the step's processes and waiting for them to "
                     "end\n")
    stop_requests.stop()
    assert process.stdout is not None
    while os.read(process.stdout.fileno(), 65536):
        pass


def launcher_env(repo_root: Path) -> dict[str, str]:
    """The environment for launched steps: the project importable from every rank, and none of the variables a
    launcher that started train.py as its only rank set for it (`torchrun --nproc_per_node 1 train.py`): the ranks'
    launcher sets RANK and the like anew, but not torchrun's agent-store flag, with which every rank waited for a
    store no one served."""
    env = {key: value for key, value in os.environ.items() if key not in launcher_variables(os.environ)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p)
    return env


def env_for_other_nodes(env: Mapping[str, str], env_file: Path) -> dict[str, str]:
    """`env` for a launch through pdsh, its `DS_ENV_FILE` naming `env_file`, written now: the variables of `env` the
    ranks on other nodes need (`OTHER_NODES_ENV_PREFIXES`; a token is left to each node's own login), each written so
    that it arrives as itself, then the lines of the env files DeepSpeed's launcher would have read in its place, which
    win. Without it those ranks ran without them: a run with HF_HUB_OFFLINE=1 went to the hub there, one with HF_HOME
    or RLHF_CACHE_DIR read and filled other caches than this machine's. A value no line can carry is left out
    (`other_nodes_env_warnings` says which)."""
    users_lines = _users_deepspeed_env(env)
    lines = [f"{name}={_as_written_for_pdsh(value)}" for name, value in _taken_for_other_nodes(env, users_lines).items()
             if _why_not_carried(value) is None]
    env_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(env_file, "".join(f"{line}\n" for line in [*lines, *users_lines]))
    return {**env, DS_ENV_FILE: str(env_file)}


def env_for_launcher_program(env: Mapping[str, str], env_file: Path) -> dict[str, str]:
    """`env` for a launch through srun or mpirun, its `DS_ENV_FILE` naming `env_file`, written now with the lines of
    the env files DeepSpeed's launcher would have read in its place (`_users_deepspeed_env`: checked, blank ones left
    out), which it read unchecked: a comment or a blank line there ended step 1's launch in a ValueError's traceback.
    srun and mpirun pass this environment on themselves."""
    env_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(env_file, "".join(f"{line}\n" for line in _users_deepspeed_env(env)))
    return {**env, DS_ENV_FILE: str(env_file)}


def check_exports_arrive_intact(backend: str, env: Mapping[str, str]) -> None:
    """Under srun and mpirun, which no shell reads, each variable DeepSpeed's launcher exports (the user's env file
    lines, and its own PYTHON*, NCCL*, UCX*, MV2* and MLFLOW* of `env`) must reach the ranks as itself: it wraps a
    value with other characters than letters, digits and @%+=:,./- in double quotes, which arrived in the value
    (PYTHONPATH='"/tmp/my dir:..."', the project not importable), and srun's comma-separated --export cut a value at
    its comma. Refused while planning, a dry run too."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import EXPORT_ENVS

    prefixes = (*EXPORT_ENVS, *get_accelerator().export_envs())
    exported = {name: value for name, value in env.items() if name.startswith(prefixes)}
    exported.update(line.split("=", 1) for line in _users_deepspeed_env(env))
    for name, value in exported.items():
        value = value.strip()
        if not _DEEPSPEED_UNQUOTED.fullmatch(value) or (backend == SLURM and "," in value):
            raise UserError(
                f"multi_node --launcher {backend}: {name.strip()}={value!r} would not reach the ranks as it is: "
                "DeepSpeed's launcher passes it to "
                f"{'srun in its comma-separated --export' if backend == SLURM else 'mpirun'}, in double quotes where "
                "it has other characters than letters, digits and @%+=:,./-, which no shell removes there; give it "
                "a value without them (for PYTHONPATH: run train.py from a folder whose path has none), or unset it")


def other_nodes_env_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning for each variable `env_for_other_nodes` leaves out, naming it, why and how to pass it: said before
    any step starts, by a dry run too."""
    return [f"multi_node: {name} is left out of train.py's env file for the ranks on other nodes: its value has "
            f"{why}, which DeepSpeed's launcher cannot carry there as it is (it reads an env file as text, a line at a "
            "time, and strips each value); to have it there, set it in each node's own environment, or give it a line "
            f"of your own in {DEFAULT_DS_ENV_FILE} in your home or working folder, which train.py passes on as you "
            "wrote it"
            for name, value in _taken_for_other_nodes(env, _users_deepspeed_env(env)).items()
            if (why := _why_not_carried(value))]


def _taken_for_other_nodes(env: Mapping[str, str], users_lines: Sequence[str]) -> dict[str, str]:
    """The variables of `env` the ranks on other nodes need, but a token, those each node sets itself
    (`_each_nodes_own`) and those the user's env file lines set (their line wins)."""
    set_elsewhere = {_exported_name(line) for line in users_lines} | _each_nodes_own(env)
    return {name: value for name, value in sorted(env.items())
            if name.startswith(OTHER_NODES_ENV_PREFIXES) and not name.endswith("_TOKEN") and name not in set_elsewhere}


def _each_nodes_own(env: Mapping[str, str]) -> set[str]:
    """The variables DeepSpeed's launcher leaves to each node on a cluster `env` marks as one whose nodes set them
    themselves, not to give every node this machine's (its EXCLUDE_ENVS: NCCL_IB_HCA under AISC_JOB_NAME)."""
    from deepspeed.launcher.runner import EXCLUDE_ENVS

    return {name for marker, names in EXCLUDE_ENVS.items() if marker in env for name in names}


def _why_not_carried(value: str) -> str | None:
    """Why an env file line cannot carry `value` to the ranks on other nodes as it is, or None where it can."""
    if "\n" in value or "\r" in value:
        return "a line break"
    if value != value.strip():
        return "white space at its start or end"
    if not _is_utf8(value):
        return "bytes that are not UTF-8 text"
    return None


def _is_utf8(value: str) -> bool:
    """Whether `value` is text: a variable's bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_written_for_pdsh(value: str) -> str:
    """`value` as an env file line gives it for the ranks on other nodes to read it as itself: DeepSpeed's launcher
    exports it on the command line pdsh runs there, in double quotes where it has other characters than letters,
    digits and @%+=:,./- (in which the node's shell reads a backslash, `$`, a backquote and a double quote as
    themselves after a backslash), and pdsh first reads %h, %u, %n and %% there (%% as a %)."""
    escaped = "".join(f"\\{char}" if char in _SPECIAL_IN_DOUBLE_QUOTES else char for char in value)
    return escaped.replace("%", "%%")


def _users_deepspeed_env(env: Mapping[str, str]) -> list[str]:
    """The lines of the env files DeepSpeed's launcher reads where `DS_ENV_FILE` does not name one of train.py's:
    `.deepspeed_env` (or the name DS_ENV_FILE gives) in the home folder, then in the working folder."""
    name = env.get(DS_ENV_FILE, DEFAULT_DS_ENV_FILE)
    files = dict.fromkeys(Path(folder, name).resolve() for folder in (Path.home(), Path.cwd()))
    return [line for file in files if file.is_file() for line in _variable_lines(file)]


def _variable_lines(env_file: Path) -> list[str]:
    """The lines of the user's `env_file` but blank ones (train.py's env file leaves those out), each refused unless
    it is KEY=VALUE, no comment: DeepSpeed's launcher splits every line at its first `=`, and a line without one (a
    comment too, which it does not skip) ended its launch in a ValueError, seen only as the step's 'exit status 1';
    it exports KEY on each node's command line, where a commented-out `#HF_HOME=...` made the rest of that line a
    comment, so no rank started there (`_misread_on_the_nodes`: what else that command line would misread)."""
    lines = []
    for number, line in enumerate(lines_as_deepspeed_reads(env_file), 1):
        if not line.strip():
            continue
        if "=" not in line or line.lstrip().startswith("#"):
            raise UserError(f"{env_file}, line {number}: {line.strip()!r} is not a variable's line; DeepSpeed's "
                            "launcher reads each line of its env file as KEY=VALUE (it takes no comments) and fails "
                            "on this one: write it as KEY=VALUE or remove it")
        if misread := _misread_on_the_nodes(line):
            raise UserError(f"{env_file}, line {number}: {line.strip()!r} {misread}; DeepSpeed's launcher puts "
                            "`export KEY=VALUE` on each node's command line as it reads the line (the value in double "
                            "quotes where it has other characters than letters, digits and @%+=:,./-): write it as "
                            "KEY=VALUE, KEY a variable's name, the value unquoted")
        lines.append(line)
    return lines


_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # POSIX's name, which bash and dash both take for `export`
_EXPORT_PREFIX = re.compile(r"export[ \t]+(?P<name>.*)", re.DOTALL)  # a shell parts words at spaces and tabs alone
_DEEPSPEED_UNQUOTED = re.compile(r"[\w@%+=:,./-]*")  # a value DeepSpeed's launcher exports without double quotes


def _exported_name(line: str) -> str:
    """The variable a user's env file `line` sets on the nodes: its key as DeepSpeed's launcher strips it, less an
    `export` and the spaces or tabs after it (`export export HF_HOME=...` exports HF_HOME there all the same). What
    follows them is the name as the nodes' shells read it: Python's strip also took a \\v or \\x1c there, which the
    shells keep in the name (`export \\vHF_HOME=...` set nothing on a node, and failed its command under dash)."""
    key = line.split("=", 1)[0].strip()
    exported = _EXPORT_PREFIX.fullmatch(key)
    return exported["name"] if exported else key


def _misread_on_the_nodes(line: str) -> str | None:
    """What the nodes' shells would make of `line`'s `export KEY=VALUE` other than setting one variable to its value,
    or None where they read it as it is: a key that is no variable's name (`=value`, `HF HOME=...` exported HF and set
    HOME, `A;B=...` set B unexported), a value read as more than one word (`A="x y"`, quoted again, set A to x alone)
    or with a quote it does not close (the whole command line failed: no rank started)."""
    if not _VARIABLE_NAME.fullmatch(_exported_name(line)):
        return "does not begin with a variable's name (letters, digits and _, not a digit first)"
    value = line.split("=", 1)[1].strip()
    exported = value if _DEEPSPEED_UNQUOTED.fullmatch(value) else f'"{value}"'
    try:
        words = shlex.split(f"KEY={exported}")
    except ValueError:
        return "has a quote the node's shell would not see closed"
    return None if len(words) == 1 else "has a value the node's shell would read as several words"
