"""Exponential moving average (EMA) of the actor's weights: ema = beta * ema + (1 - beta) * param.

Scaling: only trainable parameters are tracked, in fp32. Under ZeRO-3 each rank averages only
its own partition (`param.ds_tensor`), so an update moves no data between ranks and the EMA is
partitioned exactly like the model; with ZeRO 0-2 every rank holds a full copy, as it does of the
weights. `offload=True` keeps the EMA in CPU memory instead of on the accelerator.

Create the EMA after `deepspeed.initialize` (ZeRO-3 converts LoRA adapters and other late-added
parameters there) and call `update(engine)` after every actor optimizer step.
`state_dict()` / `load_state_dict()` use full, world-size-independent tensors for resume;
`save_ema_model` writes the EMA weights as a Hugging Face folder.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from training.core.save import save_hf_model, unwrap
from training.core.zero import is_zero3_param
from utils.dist import get_rank


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `param`: its ZeRO-3 partition (flat, zero-padded) or the whole tensor."""
    if not is_zero3_param(param):
        return param.data
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    if param.ds_tensor.status != PartitionedParamStatus.AVAILABLE:
        raise NotImplementedError("the actor EMA does not support ZeRO-3 parameters swapped out to NVMe")
    return param.ds_tensor.data


def _gather_partitions(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Reassemble a full CPU tensor of `param`'s shape from every rank's partition `local` (collective)."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    group = param.ds_process_group
    local = local.to(get_accelerator().current_device_name())
    parts = [torch.empty_like(local) for _ in range(comm.get_world_size(group=group))]
    comm.all_gather(parts, local, group=group)
    return torch.cat(parts)[: param.ds_numel].view(param.ds_shape).cpu()


def _own_partition(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full tensor, laid out as ZeRO-3 lays out `param.ds_tensor`."""
    from deepspeed import comm

    size = param.ds_tensor.numel()
    start = size * comm.get_rank(group=param.ds_process_group)
    flat = full.reshape(-1)
    part = torch.zeros(size, dtype=full.dtype)
    count = max(0, min(size, flat.numel() - start))
    part[:count] = flat[start:start + count]
    return part


def _write_partitions(param: torch.Tensor, local: torch.Tensor) -> None:
    """Set `param` to the value whose partitions are `local` on each rank.

    ZeRO-3 parameters go through `GatheredParameters(modifier_rank=0)` so DeepSpeed itself
    re-partitions the new value (primary and secondary partitions, persistent parameters alike).
    """
    if not is_zero3_param(param):
        param.data.copy_(local)
        return
    import deepspeed

    full = _gather_partitions(param, local)
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if get_rank() == 0:
            param.data.copy_(full.to(param.device, param.dtype))


class ModelEMA:
    """EMA of a model's trainable parameters (the model may be a DeepSpeed engine, ZeRO 0-3, or a peft model)."""

    def __init__(self, model: torch.nn.Module, beta: float = 0.992, offload: bool = False):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EMA beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.num_updates = 0
        self._offload = offload
        self._shadow: dict[str, torch.Tensor] = {}
        self._params = dict(self._tracked(model))  # for the ZeRO-3 layout in state_dict/load_state_dict
        with torch.no_grad():
            for name, param in self._params.items():
                local = _local_tensor(param)
                device = torch.device("cpu") if offload else local.device
                self._shadow[name] = local.detach().to(device=device, dtype=torch.float32, copy=True)

    @staticmethod
    def _tracked(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in unwrap(model).named_parameters():
            if param.requires_grad:
                yield name, param

    def _pairs(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        for name, param in self._tracked(model):
            if name not in self._shadow:
                raise RuntimeError(f"parameter {name} is not tracked by this EMA; build the EMA from the same model")
            yield name, param, self._shadow[name]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """ema = beta * ema + (1 - beta) * param, on this rank's share of every trainable parameter."""
        for name, param, shadow in self._pairs(model):
            local = _local_tensor(param)
            if local.shape != shadow.shape:
                raise RuntimeError(
                    f"parameter {name} changed shape from {tuple(shadow.shape)} to {tuple(local.shape)}; "
                    "create the EMA after deepspeed.initialize"
                )
            shadow.mul_(self.beta).add_(local.to(shadow.device, torch.float32), alpha=1.0 - self.beta)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Overwrite the model's trainable parameters with the EMA (collective under ZeRO-3)."""
        for _, param, shadow in self._pairs(model):
            _write_partitions(param, shadow.to(_local_tensor(param).device, param.dtype))

    @contextmanager
    def applied_to(self, model: torch.nn.Module) -> Iterator[None]:
        """Within the block the model holds the EMA weights; on exit its own weights come back exactly."""
        with torch.no_grad():
            saved = {name: _local_tensor(param).detach().clone() for name, param in self._tracked(model)}
        self.copy_to(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self._tracked(model):
                    _write_partitions(param, saved[name])

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 CPU tensors, independent of the world size (collective under ZeRO-3).

        Rank 0 receives every tensor; other ranks get an empty `shadow` (they need not store it).
        """
        shadow: dict[str, torch.Tensor] = {}
        for name, param in self._params.items():
            local = self._shadow[name]
            full = _gather_partitions(param, local) if is_zero3_param(param) else local.detach().cpu().clone()
            if get_rank() == 0:
                shadow[name] = full
        return {"beta": self.beta, "num_updates": self.num_updates, "shadow": shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`; every rank must pass the full state (as DeepSpeed's
        `load_checkpoint` hands its client state to every rank)."""
        self.beta = float(state["beta"])
        self.num_updates = int(state["num_updates"])
        for name, param in self._params.items():
            shadow = self._shadow[name]
            if name not in state["shadow"]:
                raise KeyError(f"EMA state has no entry for parameter {name}")
            full = state["shadow"][name].float()
            local = _own_partition(param, full) if is_zero3_param(param) else full
            if local.shape != shadow.shape:
                raise ValueError(f"EMA state for {name} has shape {tuple(full.shape)}, the model's differs")
            shadow.copy_(local.to(shadow.device))


def save_ema_model(ema: ModelEMA, model: torch.nn.Module, tokenizer, output_dir: str | os.PathLike,
                   writer: bool | None = None, synchronize: bool = True) -> None:
    """Write the EMA weights as a Hugging Face folder (every rank must call it; rank 0 writes). An actor that
    lives on one group of a placement (never ZeRO-3 there) is saved by its first rank alone, as `save_hf_model`
    does: `writer=True, synchronize=False`."""
    with ema.applied_to(model):
        save_hf_model(model, tokenizer, output_dir, writer=writer, synchronize=synchronize)
