"""Telling ZeRO-3 partitioned parameters apart, and their full sizes.

ZeRO-3 replaces a partitioned parameter's `data` with an empty tensor (each rank keeps only its
slice in `ds_tensor`) and records the real size in `ds_shape` / `ds_numel`, so `param.shape` and
`param.numel()` describe nothing useful; the marker DeepSpeed adds to every such parameter is `ds_id`.
"""
from __future__ import annotations

import torch


def is_zero3_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def is_zero3_module(module: torch.nn.Module) -> bool:
    """Whether any of the module's parameters is ZeRO-3 partitioned."""
    return any(is_zero3_param(p) for p in module.parameters())


def full_numel(param: torch.Tensor) -> int:
    """The element count of the whole parameter, partitioned or not."""
    return param.ds_numel if is_zero3_param(param) else param.numel()


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter, partitioned or not."""
    return tuple(param.ds_shape if is_zero3_param(param) else param.shape)
