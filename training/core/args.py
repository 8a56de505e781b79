"""Command-line flag groups shared by the step entry points, and the code that reads them back.

Each `add_*` function adds one group; `prefix` names the model a group belongs to when a step
trains several (step 3: `add_zero_args(parser, prefix="actor_")` gives `--actor_zero_stage`,
`--actor_offload`). Steps 1 and 2 use no prefix, so their flags read like DeepSpeed-Chat's.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch

from training.core.engine import OptimizationSettings
from training.core.lora import apply_lora
from training.core.model_loading import EMBEDDED_MODEL_NAME, resolve_dtype
from training.core.optim import OPTIMIZER_CHOICES, SCHEDULER_CHOICES
from utils.errors import UserError

DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def prefixed(args: argparse.Namespace, prefix: str, name: str):
    """The value of flag `--{prefix}{name}`."""
    return getattr(args, f"{prefix}{name}")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Run folder, precision and launcher plumbing (every step; `--seed` comes with `utils.data.add_data_args`)."""
    group = parser.add_argument_group("run")
    group.add_argument("--output_dir", required=True,
                       help="run folder: final model in <output_dir>/model, metrics, args, checkpoints")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="training precision; auto = bf16 where supported, else fp16 on GPU, fp32 on CPU")
    group.add_argument("--trust_remote_code", action="store_true", help="allow models whose code lives on the hub")
    group.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher


def add_model_args(parser: argparse.ArgumentParser, prefix: str = "", default: str | None = EMBEDDED_MODEL_NAME) -> None:
    """Which model, and the per-model switches: gradient checkpointing and dropout."""
    group = parser.add_argument_group(f"{prefix}model")
    group.add_argument(f"--{prefix}model_name_or_path", default=default, required=default is None,
                       help=f"hub name, local HF folder, a previous step's run folder, or '{EMBEDDED_MODEL_NAME}'")
    group.add_argument(f"--{prefix}gradient_checkpointing", action="store_true",
                       help="recompute activations in the backward pass (less memory, ~30%% slower)")
    group.add_argument(f"--{prefix}disable_dropout", action="store_true", help="set every dropout probability to 0")


def add_zero_args(parser: argparse.ArgumentParser, prefix: str = "", with_offload: bool = True) -> None:
    """ZeRO stage and optimizer-state offload of one trained model."""
    group = parser.add_argument_group(f"{prefix}zero")
    group.add_argument(f"--{prefix}zero_stage", type=int, choices=(0, 1, 2, 3), default=0,
                       help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters")
    if with_offload:
        group.add_argument(f"--{prefix}offload", action="store_true",
                           help="keep optimizer state (and at stage 3 the parameters) in CPU memory")


def add_lora_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """LoRA adapters on the linear layers whose name contains `--lora_module_name`."""
    group = parser.add_argument_group(f"{prefix}lora")
    group.add_argument(f"--{prefix}lora_dim", type=int, default=0, help="LoRA rank; 0 trains without LoRA")
    group.add_argument(f"--{prefix}lora_module_name", default="layers.",
                       help="substring of the module paths that get adapters ('layers.' Llama, 'h.' GPT-2)")
    group.add_argument(f"--{prefix}only_optimize_lora", action="store_true",
                       help="freeze the base weights and train only the adapters")
    group.add_argument(f"--{prefix}lora_learning_rate", type=float, default=None,
                       help="learning rate of the adapters (default: the model's --learning_rate)")


def add_optimization_args(parser: argparse.ArgumentParser, prefix: str = "", learning_rate: float = 1e-5) -> None:
    """Learning rate and weight decay of one trained model."""
    group = parser.add_argument_group(f"{prefix}optimizer")
    group.add_argument(f"--{prefix}learning_rate", type=float, default=learning_rate, help="peak learning rate")
    group.add_argument(f"--{prefix}weight_decay", type=float, default=0.0, help="AdamW weight decay")


def add_schedule_args(parser: argparse.ArgumentParser, num_warmup_steps: int = 0) -> None:
    """What every optimizer of a step shares: schedule, accumulation, clipping, optimizer kind, step cap."""
    group = parser.add_argument_group("schedule")
    group.add_argument("--lr_scheduler_type", choices=SCHEDULER_CHOICES, default="cosine")
    group.add_argument("--num_warmup_steps", type=int, default=num_warmup_steps,
                       help="linear warm-up, in optimizer steps")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="micro-batches per optimizer step")
    group.add_argument("--gradient_clipping", type=float, default=1.0, help="max gradient norm (0 disables)")
    group.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="auto",
                       help="auto: torch AdamW on CPU, DeepSpeedCPUAdam with --offload, FusedAdam on GPU")
    group.add_argument("--max_steps", type=int, default=None,
                       help="stop after this many optimizer steps (for quick runs); the schedule spans them")


def add_supervised_loop_args(parser: argparse.ArgumentParser, train_batch_size: int = 8) -> None:
    """Epochs, batch sizes and evaluation cadence of the supervised loop (steps 1 and 2)."""
    group = parser.add_argument_group("loop")
    group.add_argument("--per_device_train_batch_size", type=int, default=train_batch_size,
                       help="micro-batch size per rank")
    group.add_argument("--per_device_eval_batch_size", type=int, default=train_batch_size)
    group.add_argument("--num_train_epochs", type=int, default=1)
    group.add_argument("--eval_interval", type=int, default=0,
                       help="also evaluate every N optimizer steps (0: only before training and after each epoch)")
    group.add_argument("--eval_iters", type=int, default=None,
                       help="evaluate on at most this many held-out batches per rank (default: all)")
    group.add_argument("--log_interval", type=int, default=10, help="log the training loss every N optimizer steps")


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")


def dtype_name(args: argparse.Namespace) -> str:
    """`--dtype` resolved for this device, as the DeepSpeed config spells it ("bf16", "fp16", "fp32")."""
    return _DTYPE_NAMES[resolve_dtype(args.dtype)]


def optimization_settings(
    args: argparse.Namespace,
    num_training_steps: int,
    micro_batch_size: int,
    prefix: str = "",
    job_name: str = "train",
) -> OptimizationSettings:
    """The `OptimizationSettings` of the model whose flags carry `prefix`."""
    return OptimizationSettings(
        learning_rate=prefixed(args, prefix, "learning_rate"),
        num_training_steps=num_training_steps,
        weight_decay=prefixed(args, prefix, "weight_decay"),
        zero_stage=prefixed(args, prefix, "zero_stage"),
        offload=bool(getattr(args, f"{prefix}offload", getattr(args, "offload", False))),
        dtype=dtype_name(args),
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_clipping=args.gradient_clipping,
        lr_scheduler_type=args.lr_scheduler_type,
        num_warmup_steps=args.num_warmup_steps,
        lora_learning_rate=prefixed(args, prefix, "lora_learning_rate"),
        optimizer=args.optimizer,
        job_name=job_name,
    )


def apply_model_options(
    model: torch.nn.Module, args: argparse.Namespace, prefix: str = "", trainable_heads: Sequence[str] = ()
) -> torch.nn.Module:
    """Apply the model's `--gradient_checkpointing` and LoRA flags; returns the (possibly peft-wrapped) model.

    `trainable_heads` name freshly initialised parameters (a reward model's `v_head`) that must
    train even under `--only_optimize_lora`, which otherwise freezes everything but the adapters.
    """
    if prefixed(args, prefix, "gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "config"):
            model.config.use_cache = False
    lora_dim = prefixed(args, prefix, "lora_dim")
    if lora_dim > 0:
        model = apply_lora(
            model,
            lora_dim,
            lora_module_name=prefixed(args, prefix, "lora_module_name"),
            only_optimize_lora=prefixed(args, prefix, "only_optimize_lora"),
        )
        for name, param in model.named_parameters():
            if any(head in name for head in trainable_heads):
                param.requires_grad_(True)
    elif prefixed(args, prefix, "only_optimize_lora"):
        raise UserError(f"--{prefix}only_optimize_lora needs --{prefix}lora_dim > 0")
    return model


def final_model_dir(args: argparse.Namespace) -> Path:
    from training.core.model_loading import FINAL_MODEL_SUBDIR

    return Path(args.output_dir) / FINAL_MODEL_SUBDIR
