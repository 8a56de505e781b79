"""DeepSpeed hostfiles (`worker-1 slots=8`, one node a line), validated before anything is launched."""
from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

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
    """Parse and validate a hostfile: it exists, every line is `host slots=N` with N > 0, no host twice, this machine
    under one name at most (`names_this_machine`), no host name that pdsh reads as several.

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
        twin = next((other for other in seen if other.lower() == name.lower()), None)  # host names ignore case
        if twin is not None:
            spelled = "" if twin == name else f", as {twin}: host names are the same in any case"
            raise UserError(f"{hostfile}:{number}: host {name} is listed twice (first on line {seen[twin]}{spelled}); "
                            "list each node once")
        seen[name] = number
        hosts.append(Host(name, slots))
    if not hosts:
        raise UserError(f"hostfile {hostfile} lists no hosts; {_EXAMPLE}")
    _check_this_machine_listed_once(hostfile, seen)
    return hosts


def _check_this_machine_listed_once(hostfile: Path, lines: Mapping[str, int]) -> None:
    """Refuse two lines naming this machine under different names (`localhost` and `127.0.0.1`, or its host name):
    DeepSpeed's launcher counts them two nodes and starts each one's ranks here on the GPUs from 0, two ranks on a GPU,
    which NCCL refuses as a duplicate GPU. `lines`: {host: its line number}."""
    here = [(number, name) for name, number in lines.items() if names_this_machine(name)]
    if len(here) > 1:
        (first, first_name), (second, second_name) = sorted(here)[:2]
        raise UserError(f"{hostfile}: line {first} ({first_name}) and line {second} ({second_name}) both name this "
                        "machine; DeepSpeed's launcher would start each line's ranks here on the GPUs from 0, two "
                        "ranks on each GPU (NCCL refuses a duplicate GPU); list this machine once, its slots all the "
                        "GPUs it runs on")


def names_this_machine(host: str) -> bool:
    """Whether a hostfile's host names the machine this runs on, as known here without looking the host up:
    `localhost`, its host name or fully qualified one (any case), a loopback address or one of its interfaces'."""
    if host.lower() in _this_machine_names():
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])  # an IPv6 address may carry its interface: fe80::1%eth0
    except ValueError:
        return False
    return address.is_loopback or address in _interface_addresses()


@functools.cache
def _this_machine_names() -> frozenset[str]:
    """`localhost` and this machine's host name and fully qualified one, lower case: found once a process, since
    getfqdn may ask the system's resolver (a hostfile of 64 lines asked it 64 times)."""
    return frozenset({"localhost", socket.gethostname().lower(), socket.getfqdn().lower()})


@functools.cache
def _interface_addresses() -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This machine's IPv4 and IPv6 addresses, one set for all its network interfaces, found once a process."""
    return frozenset(ipaddress.ip_address(address.address.split("%")[0]) for nic in psutil.net_if_addrs().values()
                     for address in nic if address.family in (socket.AF_INET, socket.AF_INET6))
