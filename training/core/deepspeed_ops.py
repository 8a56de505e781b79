"""Building DeepSpeed's ops that compile at first use (FusedAdam, DeepSpeedCPUAdam) on the machines users have.

A failed build is a user's problem to fix (the CUDA toolkit, a compiler, ninja) or to step around (another
`--optimizer`), so it ends as a `UserError` saying which, the build's own error chained to it.

CUDA 12 names architecture-specific targets with a letter after the version: "9.0a" (Hopper's wgmma and bulk
copies), "10.0a", and from CUDA 12.9 family targets such as "10.0f". PyTorch's GPU images set the variable that way
(this workplace's H100 and H200 image: "9.0a"), but DeepSpeed 0.19.8's builder reads every entry as two integers and
stops with "invalid literal for int() with base 10: '0a'" before it compiles FusedAdam. FusedAdam's kernels use
nothing architecture-specific, so its build is given the plain versions and the user's value is put back after.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from utils.errors import UserError
from utils.op_builds import watching_build_locks

ARCH_LIST_VARIABLE = "TORCH_CUDA_ARCH_LIST"
_SUFFIXED_ENTRY = re.compile(r"^(?P<version>\d+\.\d+)[a-z](?P<ptx>\+PTX)?$")


def plain_arch_list(arch_list: str) -> str:
    """`arch_list` with each entry's architecture letter dropped ("8.0 9.0a;10.0f+PTX" -> "8.0;9.0;10.0+PTX"),
    separated by ';'; entries without one are kept as written."""
    entries = [entry for entry in arch_list.replace(" ", ";").split(";") if entry]
    plain = []
    for entry in entries:
        match = _SUFFIXED_ENTRY.match(entry)
        plain.append(f"{match['version']}{match['ptx'] or ''}" if match else entry)
    return ";".join(plain)


@contextmanager
def arch_list_for_deepspeed_ops() -> Iterator[None]:
    """Inside: TORCH_CUDA_ARCH_LIST without architecture letters, when it has any; after: the value it had."""
    original = os.environ.get(ARCH_LIST_VARIABLE)
    plain = None if original is None else plain_arch_list(original)
    if plain == original:
        yield
        return
    os.environ[ARCH_LIST_VARIABLE] = plain
    try:
        yield
    finally:
        os.environ[ARCH_LIST_VARIABLE] = original


@contextmanager
def building_deepspeed_op(op: str, instead: str) -> Iterator[None]:
    """Inside: the construction of something that builds DeepSpeed's `op` (under `arch_list_for_deepspeed_ops`,
    `watching_build_locks`); a failure becomes a `UserError` naming the op, the cause, what the build needs and
    `instead`, another way."""
    try:
        with arch_list_for_deepspeed_ops(), watching_build_locks():
            yield
    except UserError:
        raise
    except Exception as err:
        cause = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"DeepSpeed's {op} op could not be built ({type(err).__name__}: {cause}); it compiles at first use into "
            f"TORCH_EXTENSIONS_DIR and needs ninja and, for a CUDA op, nvcc of the CUDA toolkit (CUDA_HOME); "
            f"{instead}"
        ) from err
