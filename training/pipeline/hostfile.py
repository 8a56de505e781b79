"""DeepSpeed hostfiles (`worker-1 slots=8`, one node a line), validated before anything is launched."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from utils.errors import UserError

# DeepSpeed's launcher takes no spaces around "=", and reads no further than the slots (an MPI hostfile's max_slots=N)
_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>-?\d+)(?:\s+\S+)*")
_EXAMPLE = "one node a line, e.g. 'worker-1 slots=8'"
_PDSH_HOST_LIST = re.compile(r"[,\[\]]")  # pdsh's -w reads a name with these as several hosts (`node[1-4]`, `a,b`)


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """Parse and validate a hostfile: it exists, every line is `host slots=N` with N > 0, no host twice, no host name
    that pdsh reads as several.

    Blank lines, `#` comments and what follows the slots on a line are ignored, as DeepSpeed's launcher does.
    """
    hostfile = Path(path)
    if not hostfile.is_file():
        raise UserError(f"hostfile {hostfile} does not exist; write one ({_EXAMPLE}) and pass it with --hostfile")
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(hostfile.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise UserError(f"{hostfile}:{number}: expected 'HOST slots=N', found {raw.strip()!r}; {_EXAMPLE}")
        name, slots = match["host"], int(match["slots"])
        if _PDSH_HOST_LIST.search(name):
            raise UserError(f"{hostfile}:{number}: host {name!r} would reach pdsh as a list of hosts (it expands "
                            "[1-4] ranges and splits at commas), where DeepSpeed's launcher counts one node; list each "
                            "node on a line of its own")
        if slots <= 0:
            raise UserError(f"{hostfile}:{number}: {name} has slots={slots}; slots must be a positive GPU count")
        if name in seen:
            raise UserError(f"{hostfile}:{number}: host {name} is listed twice (first on line {seen[name]}); list each node once")
        seen[name] = number
        hosts.append(Host(name, slots))
    if not hosts:
        raise UserError(f"hostfile {hostfile} lists no hosts; {_EXAMPLE}")
    return hosts
