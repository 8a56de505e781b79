"""Exponential moving average (EMA) of the actor's weights: ema = beta * ema + (1 - beta) * param.

Scaling: only trainable parameters are tracked, in fp32. Under ZeRO-3 each rank averages only
its own partition (`param.ds_tensor`), so an update moves no data between ranks and the EMA is
partitioned exactly like the model; with ZeRO 0-2 every rank holds a full copy, as it does of the
weights. `offload=True` keeps the EMA in CPU memory instead of on the accelerator.

Create the EMA after `deepspeed.initialize` (ZeRO-3 converts LoRA adapters and other late-added
parameters there) and call `update(engine)` after every actor optimizer step.

Resume: no rank writes or reads another's share, and a save gathers nothing. `state_dict()` holds the small fields and the layout of the
shares (the same on every rank); `local_state_dict()` is this rank's share of the weights, which each rank saves
on its own: its ZeRO-3 partition, or under ZeRO 0-2, where every rank of the model's data-parallel group holds
the same copy, a balanced 1/N slice of every flattened parameter (the group writes one copy between them, and a
load all-gathers the slices one parameter at a time). `load_state_dict` also takes the earlier layout: full
tensors in `state["shadow"]`, on every rank. `save_ema_model` writes the EMA weights as a Hugging Face folder.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch

from training.core.save import save_hf_model, unwrap
from training.core.zero import full_shape, is_zero3_param
from training.placement.spec import ranks_text
from utils.dist import get_rank, refuse_on_every_rank
from utils.errors import UserError


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


def _data_parallel_group(model: torch.nn.Module) -> tuple[Any, int, int]:
    """A DeepSpeed engine's data-parallel group (under ZeRO 0-2 its ranks hold the same copy of the model), its size
    and this rank's place in it; a module outside an engine is this rank's alone."""
    group = getattr(model, "data_parallel_group", None)
    if group is None:
        return None, 1, 0
    from deepspeed import comm

    return group, comm.get_world_size(group=group), comm.get_rank(group=group)


def _slice_bounds(numel: int, ranks: int, index: int) -> tuple[int, int]:
    """Start and end of slice `index` of `ranks` balanced slices of `numel` elements (the first `numel % ranks`
    slices one element longer)."""
    base, longer = divmod(numel, ranks)
    start = index * base + min(index, longer)
    return start, start + base + (index < longer)


def _gather_slices(share: torch.Tensor, into: torch.Tensor, group: Any, ranks: int) -> None:
    """Fill `into` (contiguous) from every rank's `_slice_bounds` slice of it, `share` being this rank's (collective
    over `group`). The slices travel zero-padded to the longest, in one buffer the size of `into`."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    numel = into.numel()
    width = -(-numel // ranks)
    device = get_accelerator().current_device_name()
    padded = torch.zeros(width, dtype=into.dtype, device=device)
    padded[:share.numel()].copy_(share)
    gathered = torch.empty(ranks * width, dtype=into.dtype, device=device)
    parts = list(gathered.split(width))
    comm.all_gather(parts, padded, group=group)
    flat = into.view(-1)
    for index, part in enumerate(parts):
        start, end = _slice_bounds(numel, ranks, index)
        flat[start:end].copy_(part[:end - start])


def _layout_problem(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What makes shares saved with layout `saved` unloadable into an EMA of layout `current`, or None."""
    def kind(layout: Mapping[str, Any]) -> str:
        return f"{'ZeRO-3 partitions' if layout['zero3'] else 'slices'} over {ranks_text(layout['ranks'])}"

    if kind(saved) != kind(current):
        return f"the checkpoint holds the actor EMA as {kind(saved)}, this run as {kind(current)}"
    other = sorted(saved["shapes"].keys() ^ current["shapes"].keys())
    if other:
        return f"the checkpoint's actor EMA and this run's track different parameters ({', '.join(other[:3])}, ...)"
    for name, shape in current["shapes"].items():
        if list(saved["shapes"][name]) != shape:
            return f"the actor EMA's {name} has the shape {tuple(saved['shapes'][name])} in the checkpoint and " \
                   f"{tuple(shape)} in this run"
    return None


class ModelEMA:
    """EMA of a model's trainable parameters (the model may be a DeepSpeed engine, ZeRO 0-3, or a peft model)."""

    def __init__(self, model: torch.nn.Module, beta: float = 0.992, offload: bool = False):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EMA beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.num_updates = 0
        self._offload = offload
        self._shadow: dict[str, torch.Tensor] = {}
        self._params = dict(self._tracked(model))  # for the ZeRO-3 layout of the resume state
        self._group, self._group_size, self._group_rank = _data_parallel_group(model)
        with torch.no_grad():
            for name, param in self._params.items():
                local = _local_tensor(param)
                device = torch.device("cpu") if offload else local.device
                self._shadow[name] = local.detach().to(device=device, dtype=torch.float32,
                                                       memory_format=torch.contiguous_format, copy=True)

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

    def _layout(self) -> dict[str, Any]:
        """How `local_state_dict` divides the EMA between ranks, and each parameter's full shape."""
        return {"zero3": any(is_zero3_param(param) for param in self._params.values()), "ranks": self._group_size,
                "shapes": {name: list(full_shape(param)) for name, param in self._params.items()}}

    def _share_bounds(self, name: str) -> tuple[int, int]:
        """Where this rank's share of parameter `name` lies in its flattened shadow: all of a ZeRO-3 partition, or
        this rank's slice of the full copy."""
        numel = self._shadow[name].numel()
        if is_zero3_param(self._params[name]):
            return 0, numel
        return _slice_bounds(numel, self._group_size, self._group_rank)

    def state_dict(self) -> dict[str, Any]:
        """The small fields and the shares' layout, the same on every rank: no weights (`local_state_dict`)."""
        return {"beta": self.beta, "num_updates": self.num_updates, "layout": self._layout()}

    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's share of the EMA weights, as CPU copies (no communication): its ZeRO-3 partition of each
        parameter, or its slice of each flattened parameter (module docstring)."""
        shares = {}
        for name, shadow in self._shadow.items():
            start, end = self._share_bounds(name)
            shares[name] = shadow.view(-1)[start:end].to("cpu", copy=True)
        return shares

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any], local: Mapping[str, torch.Tensor] | None = None) -> None:
        """Restore from `state_dict()` and this rank's `local_state_dict()` (collective over the data-parallel
        group under ZeRO 0-2), or from a `state` of the earlier layout, full tensors in `state["shadow"]`, which
        every rank must pass whole (as DeepSpeed's `load_checkpoint` hands its client state to every rank)."""
        if "shadow" in state:
            self._load_full(state["shadow"])
        else:
            self._load_shares(state["layout"], local)
        self.beta = float(state["beta"])
        self.num_updates = int(state["num_updates"])

    def _load_shares(self, layout: Mapping[str, Any], local: Mapping[str, torch.Tensor] | None) -> None:
        """All checks come first, so a refused resume raises on every rank before any enters the all-gather: the
        layout's (from the client state, alike on every rank), then each rank's own shares, agreed over the group (under
        ZeRO-3 too, where nothing is gathered here: a rank refusing alone left the others waiting in training's first
        collective)."""
        problem = _layout_problem(layout, self._layout())
        if problem is not None:
            raise UserError(f"--resume: {problem}; resume with the checkpointed run's model, LoRA and ZeRO settings, "
                            "or start a new run in another --output_dir")
        damaged = self._damaged_share(local or {})
        problem = None if damaged is None else (f"the checkpoint is damaged: {damaged}; delete that checkpoint to "
                                                "resume from the one before it")
        if self._group_size > 1:  # a rank refusing alone would leave the others waiting in a collective
            refuse_on_every_rank(problem, self._group)
        elif problem is not None:
            raise UserError(problem)
        for name, shadow in self._shadow.items():
            if is_zero3_param(self._params[name]) or self._group_size == 1:
                shadow.view(-1).copy_(local[name])
            else:
                _gather_slices(local[name], shadow, self._group, self._group_size)

    def _damaged_share(self, local: Mapping[str, torch.Tensor]) -> str | None:
        """What is wrong with this rank's saved shares (None: each is there, of its size)."""
        for name in self._shadow:
            share = local.get(name)
            start, end = self._share_bounds(name)
            if share is None or share.numel() != end - start:
                return (f"rank {get_rank()}'s share of the actor EMA's {name} is "
                        f"{'missing' if share is None else 'of another size'}")
        return None

    def _load_full(self, full_shadow: Mapping[str, torch.Tensor]) -> None:
        for name, param in self._params.items():
            shadow = self._shadow[name]
            if name not in full_shadow:
                raise KeyError(f"EMA state has no entry for parameter {name}")
            full = full_shadow[name].float()
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
