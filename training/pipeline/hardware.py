"""What the planner needs to know about the machine and the models: memory, cores, parameter counts."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import psutil
import torch

from training.core.lora import is_lora_target, linear_features
from training.core.model_loading import load_config
from utils.cpu import cpu_cores, cpu_has_native_bf16

GIB = 1024**3
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup per hierarchy: "0::/path" (v2), "4:memory:/path"
CGROUP_ROOT = Path("/sys/fs/cgroup")  # v2 is mounted here, v1's memory controller under memory/
# cgroup v1 says 'no limit' as the largest page-aligned 64-bit figure (9223372036854771712); no host has this much
NO_LIMIT_V1 = 2**62


@dataclass(frozen=True)
class Hardware:
    """One node: its accelerators (0 on a CPU machine) and host resources.

    `cpu_memory_gib` is the host memory installed, which the plan counts: the same command plans the same flags on
    the same machine whatever other jobs hold at the moment (a plan that changed with it made a rerun refuse its
    finished steps and checkpoints). `cpu_memory_available_gib` is what was free when detected, only to warn that
    the plan's offload may not fit now (None: not known, as for a machine a test describes). Where this process's
    cgroup limits its memory below what is installed (Slurm's --mem, Kubernetes, docker --memory), both are capped at
    the limit, as memory beyond it kills the job, and `cpu_memory_installed_gib` holds the figure installed."""

    num_gpus: int
    gpu_memory_gib: float | None
    cpu_memory_gib: float
    cpu_cores: int
    bf16: bool
    cpu_memory_available_gib: float | None = None
    cpu_memory_installed_gib: float | None = None  # None: no cgroup limit capped cpu_memory_gib

    @property
    def cpu_memory_said(self) -> str:
        """`cpu_memory_gib` as the plan's note says it: installed, or the cgroup's limit below what is installed."""
        if self.cpu_memory_installed_gib is None:
            return f"{self.cpu_memory_gib:.0f} GiB installed"
        return (f"{self.cpu_memory_gib:.0f} GiB (this process's cgroup memory limit; "
                f"{self.cpu_memory_installed_gib:.0f} GiB installed)")


def detect_hardware() -> Hardware:
    """This machine: its accelerators, cores and installed memory, and the memory available now beside it."""
    cores = cpu_cores()
    memory = psutil.virtual_memory()
    limit = cgroup_memory_limit()
    capped = limit is not None and limit < memory.total
    usable = limit if capped else memory.total
    installed, available = usable / GIB, min(memory.available, usable) / GIB
    uncapped = memory.total / GIB if capped else None
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        gpu_memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / GIB
        return Hardware(count, gpu_memory, installed, cores, torch.cuda.is_bf16_supported(), available, uncapped)
    return Hardware(0, None, installed, cores, cpu_has_native_bf16(), available, uncapped)


def cgroup_memory_limit() -> int | None:
    """The memory limit in bytes of this process's cgroup: the smallest set on its path from the root, in cgroup v2
    (memory.max) or v1 (memory.limit_in_bytes); None where none is set or the files cannot be read. A container sees
    its own cgroup as the mount's root, so the root's file is read too."""
    limits = [limit for file in _memory_limit_files() if (limit := _memory_limit_in(file)) is not None]
    return min(limits, default=None)


def _memory_limit_files() -> list[Path]:
    """The memory limit files of this process's cgroups (v2 and v1's memory controller) and of their ancestors."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            mount, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        cgroup = PurePosixPath(path.lstrip("/"))
        files += [mount / directory / name for directory in (cgroup, *cgroup.parents)]
    return files


def _memory_limit_in(file: Path) -> int | None:
    """The limit a cgroup memory file sets; None for none ('max' in v2, a huge figure in v1) or an unreadable file."""
    try:
        text = file.read_text().strip()
        limit = None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
    return limit if limit is not None and limit < NO_LIMIT_V1 else None


@dataclass(frozen=True)
class ModelSize:
    """The numbers memory and time estimates scale with."""

    parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_positions: int | None = None  # the longest sequence the model takes; None: no stated limit
    # the name of the list of decoder blocks plus "." ("h." in GPT-2, Falcon, BLOOM): the --lora_module_name that
    # adapts every block's linear layers in the causal LM and in a reward model on its backbone alike
    blocks_name: str = "layers."
    # (full name, input + output features) of each linear layer (`training.core.lora.linear_features`), which LoRA's
    # adapters are sized by (`lora_trainable_parameters`); empty where the model was not built
    linear_features: tuple[tuple[str, int], ...] = field(default=(), repr=False)


ESTIMATED_BLOCK_FEATURES = 18  # a block's linear features in hidden sizes: 4 attention projections, a 4h-wide MLP's 2


def lora_trainable_parameters(size: ModelSize, lora_dim: int, lora_module_name: str | None = None) -> int:
    """The parameters rank-`lora_dim` LoRA adapters train on the linear layers that `lora_module_name` selects
    (default: every block's, `size.blocks_name`), as `training.core.lora.apply_lora` makes them. A size read without
    its layers (the model could not be built) counts every block's, estimated as `ESTIMATED_BLOCK_FEATURES`."""
    if not size.linear_features:
        return lora_dim * ESTIMATED_BLOCK_FEATURES * size.hidden_size * size.num_layers
    selected = lora_module_name or size.blocks_name
    return lora_dim * sum(features for name, features in size.linear_features if is_lora_target(name, selected))


def model_size(name_or_path: str, trust_remote_code: bool = False) -> ModelSize:
    """Read a model's size from its config alone: the model is built on the meta device (no weights), by its own code
    with `trust_remote_code`."""
    config = load_config(name_or_path, trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0))
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0))
    vocab = int(getattr(text, "vocab_size", 0))
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    model = _meta_model(config, trust_remote_code)
    if model is None:
        parameters, blocks, linears = 12 * layers * hidden * hidden + vocab * hidden, "layers.", ()  # the usual estimate
    else:
        parameters, blocks, linears = sum(p.numel() for p in model.parameters()), _blocks_name(model), \
            linear_features(model)
    return ModelSize(parameters, hidden, layers, vocab, int(positions) if positions else None, blocks, linears)


def _meta_model(config, trust_remote_code: bool) -> torch.nn.Module | None:
    """The causal LM of `config`, built on the meta device; None where transformers cannot build it. Unless told
    either way, transformers asks at the terminal whether to run a model's own code, and waits 15 s for an answer."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, RuntimeError, ImportError):
        return None


def _blocks_name(model: torch.nn.Module) -> str:
    """The last part of the name of the module list holding most parameters (the decoder blocks), plus "."."""
    lists = [(sum(p.numel() for p in module.parameters()), name) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList)]
    return max(lists)[1].rpartition(".")[2] + "." if lists else "layers."
