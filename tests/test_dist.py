"""A process's own world of one (no launcher), as every step and GPU test worker starts it, and how a rank ends."""
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO_ROOT
from crash_resume import step_env

STARTS_WITH_ITS_PORT_TAKEN = """
import os, socket
import torch, torch.distributed as torch_dist
import deepspeed.comm
import utils.dist as dist

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
# another process takes the port a choose-then-bind start would have chosen
dist.free_port = lambda: taken.getsockname()[1]
dist.init_distributed()
total = torch.ones(1)
torch_dist.all_reduce(total)
assert deepspeed.comm.get_world_size() == 1 and total.item() == 1.0
assert os.environ["MASTER_PORT"] != str(taken.getsockname()[1])
dist.init_distributed()
print("WORLD_OK")
"""


def test_a_world_of_one_starts_even_when_another_process_takes_a_free_port_first():
    """Six GPU test workers starting at once on one machine collided (EADDRINUSE): a port found free was bound by
    another process before this one's store bound it. The store now binds a port the OS gives it."""
    result = subprocess.run([sys.executable, "-c", STARTS_WITH_ITS_PORT_TAKEN], cwd=REPO_ROOT, env=step_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "WORLD_OK" in result.stdout, result.stderr[-3000:]


EXITS = """
import atexit
import torch.distributed as torch_dist
import utils.dist as dist

dist.init_distributed()
dist.init_distributed()
atexit._run_exitfuncs()  # what the interpreter runs first at exit, while Python still runs destructors
assert not torch_dist.is_initialized()
print("ENDED_OK")
"""


def test_the_world_is_torn_down_at_exit_before_the_interpreters_finalization():
    """Left to finalization, a 2-rank ZeRO-3 evaluation aborted after its work was done now and then (a gloo worker
    thread freeing an all-reduce's tensors when it could no longer take the GIL): `init_distributed` registers
    `end_distributed` to run at exit, once however often it is called."""
    result = subprocess.run([sys.executable, "-c", EXITS], cwd=REPO_ROOT, env=step_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ENDED_OK" in result.stdout, result.stderr[-3000:]


REFUSES_ON_EVERY_RANK = """
import torch, torch.distributed as torch_dist
from utils.dist import get_rank, init_distributed, refuse_on_every_rank
from utils.errors import UserError

init_distributed()
rank = get_rank()
refuse_on_every_rank(None)  # no rank found a problem: none raises
for case, problem in (("one", "rank 1's file is cut short" if rank == 1 else None),
                      ("both", f"rank {rank}'s file is cut short")):
    try:
        refuse_on_every_rank(problem)
        print(f"{case} {rank} went on", flush=True)
    except UserError as error:
        print(f"{case} {rank} refused: {str(error)!r}", flush=True)
total = torch.ones(1)
torch_dist.all_reduce(total)  # every rank is still in step
print(f"in step {rank} {total.item()}", flush=True)
"""


def test_a_problem_one_rank_finds_is_raised_on_every_rank_naming_it(tmp_path):
    """A rank that raised alone would leave the others waiting in their next collective (for ever under NCCL):
    `refuse_on_every_rank` raises on every rank, the one that found nothing included, with each rank's problem."""
    from conftest import run_on_two_ranks

    out = run_on_two_ranks(REFUSES_ON_EVERY_RANK, tmp_path)
    for rank in (0, 1):
        assert f"one {rank} refused: \"rank 1's file is cut short\"" in out, out
        assert f"both {rank} refused: \"rank 0's file is cut short\\nrank 1's file is cut short\"" in out, out
        assert f"in step {rank} 2.0" in out and "went on" not in out, out


# A step rank's program: `SaysWhenFinalized` marks the interpreter's finalization (a module global is deleted there
# and nowhere else), an exit handler marks that the exit handlers ran.
FINALIZATION_MARKER = """
import atexit, os, sys
from pathlib import Path

class SaysWhenFinalized:
    def __init__(self, marker):
        self.marker = str(marker)

    # bound now: by then the module's globals and the builtins may be gone
    def __del__(self, create=os.open, close=os.close, flags=os.O_CREAT | os.O_WRONLY):
        close(create(self.marker, flags))

markers = Path(sys.argv[1])
kept = SaysWhenFinalized(markers / "finalized")
atexit.register((markers / "exit handlers ran").touch)
"""

ENDS_AS_A_RANK = FINALIZATION_MARKER + """
import logging
import torch, torch.distributed as torch_dist
from deepspeed.utils import groups
import utils.dist as dist
from utils.errors import UserError, run_cli

def gloo_threads():
    names = [Path(f"/proc/self/task/{task}/comm").read_text() for task in os.listdir("/proc/self/task")]
    return sum(name.startswith("pt_gloo") for name in names)

# registered before the world's teardown, so it runs after it
atexit.register(lambda: (markers / "gloo threads after the teardown").write_text(str(gloo_threads())))

@run_cli
def main():
    dist.init_distributed()
    groups._clone_world_group()  # DeepSpeed holds the group it makes, as a ZeRO engine's state holds its groups
    torch_dist.all_reduce(torch.ones(4))
    print("the rank's last words")  # into a pipe: buffered until the end
    logging.getLogger("DeepSpeed").handlers.clear()  # its handler on standard output flushes it at logging's exit
    outcome = sys.argv[2]
    if outcome == "refusal":
        raise UserError("a flag is wrong")
    if outcome == "exception":
        raise RuntimeError("a step failed")
    if outcome == "interrupt":
        raise KeyboardInterrupt

dist.run_as_program(main)
"""


@pytest.mark.parametrize("outcome, status, said", [("return", 0, ""), ("refusal", 2, "error: a flag is wrong"),
                                                   ("exception", 1, "RuntimeError: a step failed"),
                                                   ("interrupt", -signal.SIGINT, "KeyboardInterrupt")])
def test_a_rank_ends_with_its_status_after_its_exit_handlers_without_the_interpreters_finalization(
        outcome, status, said, tmp_path):
    """A DeepSpeed engine keeps its gloo groups alive past the world's teardown, and a gloo thread that frees a
    tensor while the interpreter finalizes aborts the finished rank (SIGABRT): `run_as_program` ends the process
    after its exit handlers, with the status the interpreter would give it, without finalizing."""
    buffered = {key: value for key, value in step_env().items() if key != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", ENDS_AS_A_RANK, str(tmp_path), outcome], cwd=REPO_ROOT,
                            env=buffered, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == status and said in result.stderr, (result.returncode, result.stderr[-3000:])
    assert "the rank's last words" in result.stdout, "what it printed was lost"
    assert (tmp_path / "exit handlers ran").is_file(), result.stderr[-3000:]
    assert int((tmp_path / "gloo threads after the teardown").read_text()) > 0, "the hazard this guards against"
    assert not (tmp_path / "finalized").exists(), "the interpreter finalized with gloo threads running"


RUNS_AS_MAIN = FINALIZATION_MARKER + """
import runpy
sys.argv = [sys.argv[2], "--no_such_flag"]  # refused: the quickest way through
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("entry_point", ["step1_sft/main.py", "step2_reward/main.py", "step2_reward/dpo/main.py",
                                         "step3_rlhf/main.py", "train.py"])
def test_each_program_that_starts_a_world_ends_without_the_interpreters_finalization(entry_point, tmp_path):
    """Every step whose ranks start a world, and train.py, which runs the steps in its own process on the cpu
    deployment, ends through `run_as_program`: its status kept (2 on a refused flag), its exit handlers run, the
    interpreter not finalized."""
    result = subprocess.run([sys.executable, "-c", RUNS_AS_MAIN, str(tmp_path), entry_point], cwd=REPO_ROOT,
                            env=step_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "error:" in result.stderr, (result.returncode, result.stderr[-3000:])
    assert (tmp_path / "exit handlers ran").is_file(), result.stderr[-3000:]
    assert not (tmp_path / "finalized").exists(), f"{entry_point} ended through the interpreter's finalization"


RUNS_AS_CONSOLE_SCRIPT = FINALIZATION_MARKER + """
import importlib
module, function = sys.argv[2].split(":")
sys.argv = ["rlhf-train", "--no_such_flag"]
sys.exit(getattr(importlib.import_module(module), function)())  # what the script pip writes does
"""


def test_the_rlhf_train_command_ends_without_the_interpreters_finalization(tmp_path):
    """`rlhf-train` called train.py's `main` and returned to the interpreter, which finalized with the steps' engines
    (cpu deployment) keeping their gloo threads running, where `python train.py` left through `run_as_program`. The
    entry point as setup.py declares it (an installed copy's metadata may be older)."""
    entry = re.search(r'"rlhf-train=([\w.]+:\w+)"', (REPO_ROOT / "setup.py").read_text(encoding="utf-8"))
    assert entry, "setup.py declares no rlhf-train console script"
    result = subprocess.run([sys.executable, "-c", RUNS_AS_CONSOLE_SCRIPT, str(tmp_path), entry.group(1)],
                            cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "error:" in result.stderr, (result.returncode, result.stderr[-3000:])
    assert (tmp_path / "exit handlers ran").is_file(), result.stderr[-3000:]
    assert not (tmp_path / "finalized").exists(), "rlhf-train ended through the interpreter's finalization"


PROGRAM_WITH_AN_OPEN_POOL = """
import sys
from concurrent.futures import ThreadPoolExecutor
import utils.dist as dist

pools = []

def main():
    pools.append(ThreadPoolExecutor(2))  # left open, as a library may leave one
    pools[0].submit(print, "pooled")
    print("the last words")

dist.run_as_program(main)
"""


def test_a_program_ends_as_the_interpreter_ends_it_past_an_open_pool_and_a_failed_last_flush(tmp_path):
    """An executor left open kept its worker threads waiting for the interpreter's word to stop, which the joins
    before the exit handlers never gave: the program hung after its work. And a last flush that failed (standard
    output on a full disk) ended with status 0, where the interpreter says 120."""
    buffered = {key: value for key, value in step_env().items() if key != "PYTHONUNBUFFERED"}
    ended = subprocess.run([sys.executable, "-c", PROGRAM_WITH_AN_OPEN_POOL], cwd=REPO_ROOT, env=buffered,
                           capture_output=True, text=True, timeout=120, check=False)
    assert ended.returncode == 0 and "the last words" in ended.stdout, (ended.returncode, ended.stderr[-3000:])
    with open("/dev/full", "w") as full:
        on_a_full_disk = subprocess.run([sys.executable, "-c", PROGRAM_WITH_AN_OPEN_POOL], cwd=REPO_ROOT, env=buffered,
                                        stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert on_a_full_disk.returncode == 120, on_a_full_disk.stderr[-3000:]
    assert "Exception ignored in" in on_a_full_disk.stderr and "No space left" in on_a_full_disk.stderr


INTERRUPTED_WHILE_WAITING = FINALIZATION_MARKER + """
import signal, threading, time
import utils.dist as dist

def interrupt_soon():
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGINT)

def main():
    signal.signal(signal.SIGINT, signal.default_int_handler)  # an xdist worker's children start with SIGINT ignored
    threading.Thread(target=time.sleep, args=(4,)).start()  # no daemon: waited for at the end
    threading.Thread(target=interrupt_soon, daemon=True).start()

dist.run_as_program(main)
"""


def test_a_ctrl_c_while_the_program_waits_for_its_threads_is_said_and_the_program_ends_as_it_would(tmp_path):
    """A KeyboardInterrupt while the end waited for a thread escaped `run_as_program`: the interpreter finalized (the
    hazard it guards against) and the program died by SIGINT, where the interpreter says the exception and keeps the
    program's status."""
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_WHILE_WAITING, str(tmp_path)], cwd=REPO_ROOT,
                            env=step_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "Exception ignored on threading shutdown" in result.stderr and "KeyboardInterrupt" in result.stderr
    assert (tmp_path / "exit handlers ran").is_file(), result.stderr[-3000:]
    assert not (tmp_path / "finalized").exists(), "the interpreter finalized"
