"""What train.py says of a step that failed: the cause, from the exception or the last words of the step's output,
and what to do about it (out of memory: accelerator or host)."""
from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from pathlib import Path

TAIL_BYTES = 65536  # of a step's log read for its cause: a traceback's last line is near its end
# the line a rank ends on: a Python traceback's last ('torch.OutOfMemoryError: CUDA out of memory...', "KeyError:
# 'chosen'"), a step's `error: ...` (a UserError, as `run_cli` prints it) or argparse's `main.py: error: ...` (its
# program's name ahead), maybe behind torch's '[rankN]:' prefix
CAUSE_LINE = re.compile(r"(?:\[rank\d+\]:\s*)?(?:(?:(?P<program>[\w.-]+): )?error: (?P<error>.+)|"
                        r"(?P<exception>[A-Za-z_][\w.]*(?:Error|Exception)(?::.*)?))$")
# DeepSpeed's launcher on a node where one of its ranks ended with a status: "[...] [ERROR] [launch.py:259:...] ['python',
# '-u', 'main.py', '--data_path', ...] exits with return code = -9" (negative: the signal that killed it). The command
# it prints is the last rank it started, not the one that ended, so the line names no rank.
RANK_ENDED = re.compile(r"\[.*\] exits with return code = (?P<status>-?\d+)$")
ACCELERATOR_OOM_ADVICE = ("out of accelerator memory: give the step a smaller per-device batch, or --offload, or "
                          "LoRA (--lora_dim 128; step 3: the --actor_/--critic_ flags)")
# torch's zip writer on a write that failed ('unexpected pos 576 vs 534', 'file write failed'), as a full disk shows
DISK_FULL_MARKERS = ("no space left on device", "disk quota exceeded", "unexpected pos", "file write failed")
DISK_FULL_ADVICE = ("a write failed, most often as the disk is full: free space where the run writes (--output-dir), "
                    "then go on; what was being saved is dropped, earlier checkpoints stay whole")
HOST_MEMORY_ADVICE = "run with fewer models offloaded, a smaller batch, or on a machine with more memory"
HOST_OOM_ADVICE = f"likely out of host memory (the OS's out-of-memory killer; `dmesg` says): {HOST_MEMORY_ADVICE}"
# an allocation the host refused: Python's MemoryError or a subclass named for it (numpy's '_ArrayMemoryError: Unable
# to allocate ...'), errno 12's words, torch's CPU allocator ('DefaultCPUAllocator: can't allocate memory: ... Error
# code 12 (Cannot allocate memory)'); not torch.OutOfMemoryError, which is CUDA's
HOST_MEMORY_MARKERS = re.compile(r"\b\w*(?<!OutOf)MemoryError\b|cannot allocate memory|DefaultCPUAllocator",
                                 re.IGNORECASE)


def signal_cause(signum: int) -> str:
    """A process ended by signal `signum`, and why where a signal says it (SIGKILL: the OOM killer, most often)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "unknown"
    killed = f"killed (signal {signum}, {name})"
    return f"{killed}, {HOST_OOM_ADVICE}" if signum == signal.SIGKILL else killed


def exception_cause(error: BaseException) -> str:
    """A step's exception as its traceback's last line says it (its name alone where it has no message: a bare
    MemoryError), with the advice it calls for: a MemoryError of any name is the host's memory running out."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    cause = f"{name}: {error}" if str(error) else name
    return with_host_memory_advice(cause) if isinstance(error, MemoryError) else with_advice(cause)


def with_advice(cause: str) -> str:
    """`cause`, followed by what to do where it is running out of accelerator memory, of host memory or of disk
    space."""
    lowered = cause.lower()
    if "out of memory" in lowered:
        return f"{cause}; {ACCELERATOR_OOM_ADVICE}"
    if HOST_MEMORY_MARKERS.search(cause):
        return with_host_memory_advice(cause)
    if any(marker in lowered for marker in DISK_FULL_MARKERS):
        return f"{cause}; {DISK_FULL_ADVICE}"
    return cause


def with_host_memory_advice(cause: str) -> str:
    """`cause`, followed by what to do where the host's memory ran out."""
    return f"{cause}; out of host memory: {HOST_MEMORY_ADVICE}"


def cause_in_output(output: str, nodes: Sequence[str] = ()) -> str | None:
    """Why a launched step failed, read from the end of its output: the first node whose DeepSpeed launcher saw a rank
    end (the ranks of other nodes most often fail after, their peers gone), and the signal that killed it or else the
    last exception or `error:` line a rank of that node printed; where its ranks printed none, that node and its exit
    status, then the last such line of another node (None: none found). `nodes`: the hostfile's, whose names pdsh
    puts ahead of each line of their ranks ('worker-1: '); a line's prefix names a node only where it is one of them,
    as argparse's 'main.py: error: ...' is no node's."""
    lines = [_node_and_line(line.strip(), nodes) for line in output.splitlines()]
    ended = [(node, match) for node, line in lines if (match := RANK_ENDED.match(line))]
    ended_node = ended[0][0] if ended else None
    if ended and int(ended[0][1]["status"]) < 0:
        return f"{_a_rank_on(ended_node)} was {signal_cause(-int(ended[0][1]['status']))}"
    causes = [(node, match) for node, line in lines if (match := CAUSE_LINE.match(line))]
    if not causes:
        return None
    of_ended_node = [(node, match) for node, match in causes if node == ended_node]
    node, cause = (of_ended_node if ended and of_ended_node else causes)[-1]
    line = cause["exception"] or (f"{cause['program']}: {cause['error']}" if cause["program"] else cause["error"])
    if ended and not of_ended_node:
        return with_advice(f"{_ended_first_silent(ended_node, ended[0][1]['status'])}; "
                           f"{node or 'the output'}'s last: {line}")
    return with_advice(f"{_a_rank_on(node)}: {line}" if node else line)


def _ended_first_silent(node: str | None, status: str) -> str:
    """The rank that ended first, on the node pdsh names, where its node printed no cause line: another node's line,
    said after it, is most often a rank that failed after it, its peer gone, not the cause."""
    return f"{_a_rank_on(node)} ended first (exit status {status}) printing no error"


def _a_rank_on(node: str | None) -> str:
    """A rank, on the node pdsh names where it names one."""
    return f"a rank on {node}" if node else "a rank"


def _node_and_line(line: str, nodes: Sequence[str]) -> tuple[str | None, str]:
    """The node pdsh names ahead of `line` (None: none of `nodes`), and the rank's line behind it."""
    name, separator, rest = line.partition(": ")
    return (name, rest) if separator and name in nodes else (None, line)


def output_tail(log_path: Path, attempt_start: int = 0) -> str:
    """The last `TAIL_BYTES` of a step's log from `attempt_start` on, as text: the log holds every attempt at the step
    (a rerun appends to it), and only the last attempt's output says why it failed."""
    with log_path.open("rb") as log:
        size = log.seek(0, 2)
        log.seek(max(attempt_start, size - TAIL_BYTES))
        return log.read().decode(errors="replace")
