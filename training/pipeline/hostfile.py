"""DeepSpeed hostfiles (`worker-1 slots=8`, one node a line), validated before anything is launched."""
from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import psutil

from utils.errors import UserError

logger = logging.getLogger(__name__)

# DeepSpeed's launcher takes no spaces around "=", and reads no further than the slots (an MPI hostfile's max_slots=N)
_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>-?\d+)(?:\s+\S+)*")
_EXAMPLE = "one node a line, e.g. 'worker-1 slots=8'"
_PDSH_HOST_LIST = re.compile(r"[,\[\]]")  # pdsh's -w reads a name with these as several hosts (`node[1-4]`, `a,b`)
_HOST_NAME_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"  # between dots: no - first or last
_HOST_NAME = re.compile(rf"{_HOST_NAME_PART}(?:\.{_HOST_NAME_PART})*\.?")
_IPV4_FORM = "an IPv4 address is four numbers from 0 to 255"
HOST_LOOKUP_TIMEOUT_S = 5.0  # how long looking a hostfile's hosts up waits for the system's resolver
_THIS_MACHINE = "this machine"  # what `_machines_named` gives for any of this machine's addresses
Answer = TypeVar("Answer")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """Parse and validate a hostfile: it exists, every line is `host slots=N` with N > 0, no host twice, this machine
    under one name at most (`names_this_machine`), no two names resolving to one machine (`_lookup`), no host name
    that pdsh reads as several or the resolver cannot look up.

    Blank lines, `#` comments and what follows the slots on a line are ignored, as DeepSpeed's launcher does.
    """
    hostfile = Path(path)
    if not hostfile.is_file():
        raise UserError(f"hostfile {hostfile} does not exist; write one ({_EXAMPLE}) and pass it with --hostfile")
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines_as_deepspeed_reads(hostfile), start=1):
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
        _check_host_name(hostfile, number, name)
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
    lookups = {host: _lookup(host) for host in seen}  # started beside this machine's names' getfqdn, waited with it
    _check_this_machine_listed_once(hostfile, seen)
    _check_each_machine_listed_once(hostfile, seen, {host: lookup.answer() for host, lookup in lookups.items()})
    return hosts


def lines_as_deepspeed_reads(path: Path) -> list[str]:
    """The lines of `path` as DeepSpeed's launcher reads its hostfile and env file (open, readlines), each without its
    line break: broken at \\n, \\r and \\r\\n alone, where str.splitlines also breaks at \\v, a form feed, \\x1c-\\x1e,
    \\x85, \\u2028 and \\u2029, which DeepSpeed's launcher keeps in the line. Refused where it is not text in the
    encoding the launcher reads it in, on which train.py ended in a UnicodeDecodeError's traceback."""
    with path.open() as text:
        try:
            return [line.removesuffix("\n") for line in text]
        except UnicodeDecodeError as error:
            raise UserError(f"{path} is not {text.encoding} text (a byte {error.object[error.start]:#04x}: "
                            f"{error.reason}); DeepSpeed's launcher reads it as {text.encoding} text and would fail on "
                            f"it: save it as {text.encoding}") from None


def _check_host_name(hostfile: Path, number: int, name: str) -> None:
    """Refuse a host the system's resolver cannot be asked about (`a..b`): it encodes every name as IDNA, which
    fails on an empty part between dots or one over 63 characters. Refuse a mistyped IPv4 address too (`10.0.0.999`,
    `1.2.3`: parts all digits, and no address), as --master-addr is refused: the resolver looks `10.0.0.999` up as a
    name and reads `1.2.3` as 1.2.0.3."""
    try:
        name.encode("idna")
    except UnicodeError as error:
        reason = error.__cause__ or error
        raise UserError(f"{hostfile}:{number}: host {name!r} is not a valid host name ({reason}: each part between "
                        "dots must be 1 to 63 characters); write the node's name or address") from None
    if _is_mistyped_address(name):
        raise UserError(f"{hostfile}:{number}: host {name!r} is not a host name or an IP address (a name's parts "
                        f"between dots are not all digits); {_IPV4_FORM}; write the node's name or address")


def check_host_or_address(value: str, flag: str) -> None:
    """Refuse a `flag` value that is neither a host name nor an IP address: the launcher hands it to every rank as
    rank 0's address, and torch's rendezvous failed there, on every node, on an empty one, 'host:port', a URL or a
    space, with an error that named neither the value nor the flag. A name whose parts are all digits and is
    no address ('10.0.0.999', '1.2.3') is neither: the resolver looks '10.0.0.999' up as a name, and reads '1.2.3'
    as 1.2.0.3. A name whose last part alone is all digits (`gpu.1`) is one some clusters' /etc/hosts resolve."""
    if _is_ip_address(value) or _is_host_name(value):
        return
    if "://" in value:
        hint = "; write the host alone, without the scheme"
    elif value.rpartition(":")[2].isdigit():
        hint = "; write the host alone, and the port with --master-port"
    elif _is_mistyped_address(value):
        hint = f"; {_IPV4_FORM}"
    else:
        hint = ""
    raise UserError(f"{flag} {value!r} is not a host name or an IP address (a name's parts between dots are letters, "
                    f"digits, - and _, 1 to 63 of them, not all of them all digits){hint}")


def _is_host_name(value: str) -> bool:
    """Whether `value` is a host name: parts between dots of letters, digits, - and _, not all of them all digits
    (a dotted number is an address or none)."""
    return _HOST_NAME.fullmatch(value) is not None and not _is_dotted_number(value)


def _is_mistyped_address(value: str) -> bool:
    """Whether `value` is parts of digits between dots and no IP address (`10.0.0.999`, `1.2.3`): a mistyped IPv4
    address, most likely."""
    return _HOST_NAME.fullmatch(value) is not None and _is_dotted_number(value) and not _is_ip_address(value)


def _is_dotted_number(value: str) -> bool:
    """Whether every part of `value` between dots (a trailing dot left out) is all digits."""
    return all(part.isdigit() for part in value.rstrip(".").split("."))


def _is_ip_address(value: str) -> bool:
    """Whether `value` is an IPv4 or IPv6 address (one with its interface too: fe80::1%eth0)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


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


def _check_each_machine_listed_once(hostfile: Path, lines: Mapping[str, int],
                                    looked_up: Mapping[str, frozenset[str] | None]) -> None:
    """Refuse two lines whose hosts resolve to one machine (`node1` and its address, a short name and a fully
    qualified one): DeepSpeed's launcher starts each line's ranks there on the GPUs from 0, two ranks on each GPU. A
    host whose lookup finds nothing in time (None in `looked_up`, {host: its addresses}) is not compared. `lines`:
    {host: its line number}."""
    first_named: dict[str, tuple[int, str]] = {}  # machine: the first line naming it, its host
    for host, addresses in looked_up.items():  # in the order of the lines
        for machine in _machines_named(host, addresses or frozenset()):
            first, first_host = first_named.setdefault(machine, (lines[host], host))
            if first_host != host:
                raise UserError(
                    f"{hostfile}: line {first} ({first_host}) and line {lines[host]} ({host}) name the same machine "
                    f"(both resolve to {machine}); DeepSpeed's launcher would start each line's ranks there on the "
                    "GPUs from 0, two ranks on each GPU (NCCL refuses a duplicate GPU); list each node once, its slots "
                    "all the GPUs it runs on")


def _machines_named(host: str, addresses: frozenset[str]) -> set[str]:
    """The machines `host` names, known by its `addresses`: each address, or `_THIS_MACHINE` for any of this
    machine's (its loopback and its interfaces' addresses are one machine)."""
    machines = {_THIS_MACHINE if names_this_machine(address) else address for address in addresses}
    return machines | ({_THIS_MACHINE} if names_this_machine(host) else set())


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
    """`localhost` and this machine's host name and fully qualified one (socket.getfqdn's answer, where it comes within
    HOST_LOOKUP_TIMEOUT_S: a name server down held each look at this machine's names up for as long as the resolver
    kept trying, 8 s), lower case: found once a process, since getfqdn may ask the system's resolver (a hostfile of 64
    lines asked it 64 times)."""
    asked = _Asked(socket.getfqdn, "look up this machine's name")
    names, fully_qualified = {"localhost", socket.gethostname().lower()}, asked.answer()
    return frozenset(names | {fully_qualified.lower()} if fully_qualified else names)


@functools.cache
def _interface_addresses() -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This machine's IPv4 and IPv6 addresses, one set for all its network interfaces, found once a process."""
    return frozenset(ipaddress.ip_address(address.address.split("%")[0]) for nic in psutil.net_if_addrs().values()
                     for address in nic if address.family in (socket.AF_INET, socket.AF_INET6))


@functools.cache
def is_this_machine(host: str) -> bool:
    """Whether a hostfile's host (or --master-addr) names the machine this runs on: its name, or a name or address
    that resolves to a loopback address or one of its interfaces'. Told once a process for each host: each step's
    launch asks it of the master address, and the resolver may take up to HOST_LOOKUP_TIMEOUT_S to answer: the host's
    lookup is started before this machine's names are looked at (their getfqdn waits as long), to wait for both
    together."""
    lookup = _lookup(host)
    if names_this_machine(host):
        return True
    addresses = lookup.answer()
    if addresses is None:
        logger.warning("looking up %s found no address in %g s (the name server does not answer); train.py takes it "
                       "for another machine than this one, reached through pdsh and ssh. If it is this machine, name "
                       "it localhost or %s in the hostfile (and in --master-addr)", host, HOST_LOOKUP_TIMEOUT_S,
                       socket.gethostname())
        return False
    return any(names_this_machine(address) for address in addresses)


@functools.cache
def _lookup(host: str) -> _Asked[frozenset[str]]:
    """The lookup of `host`, started once a process: its addresses from the system's resolver (none where it does
    not resolve: a name this machine cannot resolve is not its own)."""
    return _Asked(functools.partial(_addresses_of, host), f"look up {host}")


def _addresses_of(host: str) -> frozenset[str]:
    """`host`'s addresses from the system's resolver; none where it does not resolve or IDNA cannot encode it
    (`a..b`)."""
    with contextlib.suppress(OSError, UnicodeError):
        return frozenset(info[4][0] for info in socket.getaddrinfo(host, None))
    return frozenset()


class _Asked(Generic[Answer]):
    """What `ask()` answers, asked of the system's resolver in a thread of its own, started as this is made, and waited
    for until HOST_LOOKUP_TIMEOUT_S after that at most: getaddrinfo and getfqdn take no time limit, and a name server
    down held planning up, with no word, for as long as the resolver kept trying. Those started together are waited
    for that long in all, where one after another waited it each (is_this_machine took 10 s: getfqdn's 5, then the
    host's lookup's)."""

    def __init__(self, ask: Callable[[], Answer], name: str) -> None:
        self._ask = ask
        self._deadline = time.monotonic() + HOST_LOOKUP_TIMEOUT_S
        self._answer: Answer | None = None
        self._answered = threading.Event()
        self._given_up = False
        threading.Thread(target=self._wait_for_answer, name=name, daemon=True).start()

    def _wait_for_answer(self) -> None:
        self._answer = self._ask()
        self._answered.set()

    def answer(self) -> Answer | None:
        """The answer, waited for until the deadline at most; None where it has not come by then (a name server down
        or out of reach), which is not waited for again."""
        if not self._given_up and not self._answered.wait(max(0.0, self._deadline - time.monotonic())):
            self._given_up = True
        return None if self._given_up else self._answer
