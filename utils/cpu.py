"""What this CPU is and has: cores, model name, native bf16 (from /proc/cpuinfo where there is one)."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# x86's "flags" (AVX512-BF16, AMX) and Arm's "Features" (the BF16 extension) name bf16 instructions thus
_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what `platform` knows where there is none)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 instructions. Without them torch emulates bf16 (over 10x slower than fp32 on an
    AVX2 machine), and oneDNN's own check also says yes on AVX-512 CPUs that only emulate it."""
    flags = _cpuinfo_field("flags") or _cpuinfo_field("Features")
    return bool(_NATIVE_BF16_FLAGS & set(flags.split()))


def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ('' where there is none)."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo, read once a process (`resolve_dtype` asks on every call; the CPU does not change)."""
    cpuinfo = Path("/proc/cpuinfo")
    return tuple(cpuinfo.read_text().splitlines()) if cpuinfo.is_file() else ()
