"""Write a final model as a Hugging Face folder (safetensors, config, tokenizer).

Correct under ZeRO-3 (every parameter is gathered, one at a time, and only rank 0 keeps a copy)
and for LoRA (adapters folded into the weights, so the folder loads with plain `from_pretrained`).
The folder appears atomically: it is written under a temporary name and renamed into place.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from peft import PeftModel

from training.core.model_loading import configs_dropout_as_loaded
from training.core.zero import is_zero3_param
from utils.atomic import atomic_directory
from utils.dist import barrier, is_main_process


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model, "module", model)


def gathered_state_dict(model: torch.nn.Module, keep: bool | None = None) -> dict[str, torch.Tensor]:
    """A full CPU state dict on the writing rank (`keep`; default rank 0), empty on the others, gathering ZeRO-3
    partitions one tensor at a time."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    keep = is_main_process() if keep is None else keep
    persistent = set(model.state_dict().keys())  # non-persistent buffers (rotary inv_freq) are not saved
    buffers = [(name, buffer) for name, buffer in model.named_buffers() if name in persistent]
    for name, tensor in list(model.named_parameters()) + buffers:
        if is_zero3_param(tensor):
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                if keep:
                    state[name] = tensor.detach().to("cpu", copy=True)
        elif keep:
            state[name] = tensor.detach().to("cpu", copy=True)
    return state


def merge_lora_state_dict(peft_model: PeftModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold LoRA adapters into the base weights of a peft state dict and return base-model keys.

    Done on the gathered CPU tensors so that no second model copy is needed: W' = W + s * B @ A
    (transposed for GPT-2's Conv1D layers, which peft marks `fan_in_fan_out`).
    """
    adapter = peft_model.active_adapter
    config = peft_model.peft_config[adapter]
    scaling = config.lora_alpha / config.r
    prefix = "base_model.model."
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            module_path = key.split(".base_layer.")[0]
            if key.endswith(".weight"):
                lora_a = state[f"{module_path}.lora_A.{adapter}.weight"].float()
                lora_b = state[f"{module_path}.lora_B.{adapter}.weight"].float()
                delta = (lora_b @ lora_a) * scaling
                if config.fan_in_fan_out:
                    delta = delta.T
                value = (value.float() + delta).to(value.dtype)
            key = key.replace(".base_layer.", ".")
        merged[key[len(prefix):] if key.startswith(prefix) else key] = value
    return merged


@contextlib.contextmanager
def _writes_on_this_rank() -> Iterator[None]:
    """transformers' `save_pretrained` writes weights only on torch.distributed rank 0, whatever it is told; a
    model that a placement keeps on other ranks is written by its own first rank, so that rank answers 0."""
    from transformers.distributed import mixin

    original = mixin._get_torch_distributed_rank
    mixin._get_torch_distributed_rank = lambda: 0
    try:
        yield
    finally:
        mixin._get_torch_distributed_rank = original


@contextlib.contextmanager
def _cache_on_in_saved_config(module: torch.nn.Module) -> Iterator[None]:
    """`use_cache` on in the config.json written inside, whatever training set: gradient checkpointing turns it off
    (`apply_model_options`), and a folder saved so decoded without a KV cache wherever it was loaded without its
    generation_config.json (each token recomputed the whole sequence), and its plain forward returned no cache. The
    live model keeps its setting."""
    config = getattr(module, "config", None)
    training_value = getattr(config, "use_cache", None)
    if training_value is not None:
        config.use_cache = True
    try:
        yield
    finally:
        if training_value is not None:
            config.use_cache = training_value


def save_hf_model(model: torch.nn.Module, tokenizer, output_dir: str | os.PathLike, writer: bool | None = None,
                  synchronize: bool = True) -> None:
    """Save a (possibly ZeRO-3-partitioned, possibly LoRA) model as a loadable HF folder.

    Every rank must call this (ZeRO-3 gathers are collective); rank 0 writes. A model that lives on one group
    of a placement (never ZeRO-3 there) is saved by its first rank alone: `writer=True, synchronize=False`.
    """
    module = unwrap(model)
    writer = is_main_process() if writer is None else writer
    state = gathered_state_dict(module, writer)
    if writer:
        if isinstance(module, PeftModel):
            state = merge_lora_state_dict(module, state)
            module = module.get_base_model()
        with (atomic_directory(output_dir) as tmp, _writes_on_this_rank(), _cache_on_in_saved_config(module),
              configs_dropout_as_loaded(module)):
            module.save_pretrained(tmp, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    if synchronize:
        barrier()
