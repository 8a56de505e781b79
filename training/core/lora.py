"""LoRA through peft, selected the DeepSpeed-Chat way: `--lora_module_name` is a substring of the
module path (e.g. `layers.` or `decoder.layers.`) and every linear layer under it gets an adapter."""
from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.pytorch_utils import Conv1D

from utils.errors import UserError

_LINEAR_TYPES = (torch.nn.Linear, Conv1D)


def is_lora_target(name: str, lora_module_name: str) -> bool:
    """Whether LoRA adapts the linear layer of full name `name`: its path contains `lora_module_name`, and it is not
    the LM head."""
    return lora_module_name in name and "lm_head" not in name


def linear_features(model: torch.nn.Module) -> tuple[tuple[str, int], ...]:
    """(full name, input + output features) of each linear layer of `model`: a rank-r adapter on one trains r times
    its features (A: r x in, B: out x r). Read from the weights' shapes, so a model on the meta device does."""
    return tuple((name, sum(module.weight.shape)) for name, module in model.named_modules()
                 if isinstance(module, _LINEAR_TYPES))


def lora_target_modules(model: torch.nn.Module, lora_module_name: str, flag_prefix: str = "") -> list[str]:
    """Full names of the linear layers whose path contains `lora_module_name` (never the LM head); `flag_prefix`
    names the model's flag in the error (`actor_`)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, _LINEAR_TYPES) and is_lora_target(name, lora_module_name)
    ]
    if not names:
        raise UserError(
            f"--{flag_prefix}lora_module_name {lora_module_name!r} matches no linear layer of this model; "
            "pick a substring of its layer names such as 'layers.' (Llama), 'h.' (GPT-2) or 'decoder.layers.' (OPT)"
        )
    return names


def apply_lora(
    model: torch.nn.Module,
    lora_dim: int,
    lora_module_name: str = "layers.",
    only_optimize_lora: bool = False,
    lora_alpha: float | None = None,
    flag_prefix: str = "",
) -> PeftModel:
    """Wrap `model` with LoRA adapters of rank `lora_dim`, in the dtype of the weights they adapt.

    peft would make them fp32 beside bf16 weights, which DeepSpeed ZeRO-3 refuses (it partitions one dtype: an
    AssertionError in `deepspeed.initialize`) and ZeRO-1/2 cast to bf16 anyway; the optimizers keep fp32 masters
    of them as of every trained weight. peft freezes the base weights; unless `only_optimize_lora`, they are made
    trainable again so the adapters and the base train together (DeepSpeed-Chat's default). `flag_prefix` names
    the model's flags in errors (`actor_`).
    """
    if lora_dim <= 0:
        raise ValueError("lora_dim must be positive")
    config = LoraConfig(
        r=lora_dim,
        lora_alpha=lora_alpha if lora_alpha is not None else lora_dim,
        lora_dropout=0.0,  # the adapters add no dropout of their own (the model's is --disable_dropout's)
        target_modules=lora_target_modules(model, lora_module_name, flag_prefix),
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        bias="none",
    )
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if not only_optimize_lora:
        for param in peft_model.parameters():
            param.requires_grad_(True)
    return peft_model
