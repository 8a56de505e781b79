"""Process groups of a placement, and DeepSpeed engines that live on a subgroup of the ranks.

DeepSpeed reads a model's data-parallel group from a process-wide `deepspeed.utils.groups.mpu` (at
`deepspeed.initialize` and again at run time: the gradient all-reduce and the gradient-norm clip look it up),
so two engines on different groups cannot both be installed there. `GroupEngine` installs its own group for
the duration of every call into its engine; an engine spanning every rank needs none (DeepSpeed's default).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist
from deepspeed.utils import groups as ds_groups

from training.placement.spec import Placement


class GroupUnit:
    """The model-parallel unit DeepSpeed asks for a model's groups: data parallel over the model's ranks, no
    tensor or pipeline parallelism (each rank is its own model-parallel group)."""

    def __init__(self, ranks: tuple[int, ...], group: Any, own_group: Any, rank: int):
        self.ranks = ranks
        self.group = group
        self.own_group = own_group
        self.rank = rank

    def get_data_parallel_group(self) -> Any:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_rank(self) -> int:
        return self.ranks.index(self.rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.ranks)

    def get_model_parallel_group(self) -> Any:
        return self.own_group

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.rank


@contextlib.contextmanager
def installed(unit: GroupUnit | None) -> Iterator[None]:
    """`unit` as DeepSpeed's process-wide model-parallel unit for the duration (None: the whole world)."""
    previous = ds_groups.mpu
    ds_groups.mpu = unit
    try:
        yield
    finally:
        ds_groups.mpu = previous


class GroupEngine:
    """A DeepSpeed engine on a subgroup: every method call (and the forward) runs with its unit installed;
    attributes and submodules pass through unchanged."""

    def __init__(self, engine: torch.nn.Module, unit: GroupUnit):
        self.__dict__.update(_engine=engine, _unit=unit)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if callable(value) and not isinstance(value, torch.nn.Module):
            return functools.partial(self._run, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def _run(self, method, *args, **kwargs):
        with installed(self._unit):
            return method(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._run(self._engine, *args, **kwargs)


class PlacementGroups:
    """Every group a placement needs, created on every rank in the same order (group creation is collective):
    one per rank (its own model-parallel group), one per role on a subgroup, and, with a shadow actor, the
    weight-sync group of the first actor rank and the rollout ranks."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.rank = torch_dist.get_rank()
        world = placement.world_size
        own = [torch_dist.new_group([rank]) for rank in range(world)]
        self.units: dict[str, GroupUnit | None] = {}
        for role, ranks in placement.ranks.items():
            if len(ranks) == world:
                self.units[role] = None
                continue
            group = torch_dist.new_group(list(ranks))
            self.units[role] = GroupUnit(ranks, group, own[self.rank], self.rank)
        self.sync_ranks: tuple[int, ...] = ()
        self.sync_group = None
        if placement.has("rollout"):
            self.sync_ranks = (placement.ranks["actor"][0], *placement.ranks["rollout"])
            self.sync_group = torch_dist.new_group(list(self.sync_ranks))

    def unit(self, role: str) -> GroupUnit | None:
        return self.units.get(role)

    def process_group(self, role: str) -> Any:
        """The role's process group for collectives among its ranks (None: the whole world)."""
        unit = self.units.get(role)
        return unit.group if unit is not None else None

    def group_size(self, role: str) -> int:
        return len(self.placement.ranks[role])

    def bind(self, role: str, engine: torch.nn.Module) -> torch.nn.Module:
        """The engine as step 3 calls it: wrapped in its group when the role is on a subgroup."""
        unit = self.units.get(role)
        return engine if unit is None else GroupEngine(engine, unit)
