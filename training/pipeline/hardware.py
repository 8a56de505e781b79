"""What the planner needs to know about the machine and the models: memory, cores, parameter counts."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from training.core.model_loading import load_config

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One node: its accelerators (0 on a CPU machine) and host resources."""

    num_gpus: int
    gpu_memory_gib: float | None
    cpu_memory_gib: float
    cpu_cores: int
    bf16: bool


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what `platform` knows where there is none)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 instructions (AVX512-BF16 or AMX), per /proc/cpuinfo's flags."""
    return bool({"avx512_bf16", "amx_bf16"} & set(_cpuinfo_field("flags").split()))


def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ('' where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def detect_hardware() -> Hardware:
    cores = cpu_cores()
    cpu_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / GIB
        return Hardware(count, memory, cpu_memory, cores, torch.cuda.is_bf16_supported())
    return Hardware(0, None, cpu_memory, cores, _cpu_supports_bf16())


def _cpu_supports_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class ModelSize:
    """The numbers memory and time estimates scale with."""

    parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_positions: int | None = None  # the longest sequence the model takes; None: no stated limit


def model_size(name_or_path: str) -> ModelSize:
    """Read a model's size from its config alone: the model is built on the meta device (no weights)."""
    config = load_config(name_or_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0))
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0))
    vocab = int(getattr(text, "vocab_size", 0))
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return ModelSize(_count_parameters(config, hidden, layers, vocab), hidden, layers, vocab,
                     int(positions) if positions else None)


def _count_parameters(config, hidden: int, layers: int, vocab: int) -> int:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except (ValueError, KeyError, TypeError, RuntimeError, ImportError):
        return 12 * layers * hidden * hidden + vocab * hidden  # the usual transformer estimate
