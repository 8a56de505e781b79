"""A process's own world of one (no launcher), as every step and GPU test worker starts it."""
import subprocess
import sys

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
