"""DeepSpeed configuration dictionaries for trained and for frozen (inference-only) models."""
from __future__ import annotations

from typing import Any

from utils.dist import get_world_size


def _precision_section(dtype: str) -> dict[str, Any]:
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale_window": 100, "initial_scale_power": 16}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp32":
        return {}
    raise ValueError(f"unknown dtype {dtype!r}")


def _zero_section(stage: int, offload: bool) -> dict[str, Any]:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    zero: dict[str, Any] = {"stage": stage}
    if offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=10_000,
            stage3_max_live_parameters=30_000_000,
            stage3_prefetch_bucket_size=30_000_000,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    return zero


def runs_gradient_allreduce(zero_stage: int, data_parallel_size: int) -> bool:
    """Whether a trained model's backward ends with DeepSpeed's gradient all-reduce. ZeRO-0 over a single rank
    skips it (`training.core.engine.skip_single_rank_gradient_allreduce`): a sum over one rank changes nothing.
    ZeRO-1 and above reduce inside their optimizers, on one rank too."""
    return not (zero_stage == 0 and data_parallel_size == 1)


def get_train_ds_config(
    stage: int = 0,
    offload: bool = False,
    dtype: str = "fp32",
    train_micro_batch_size_per_gpu: int = 1,
    gradient_accumulation_steps: int = 1,
    gradient_clipping: float = 1.0,
    data_parallel_size: int | None = None,
) -> dict[str, Any]:
    """Config for a model that trains: ZeRO stage, optimizer (and, at stage 3, parameter) offload,
    precision, accumulation and clipping. The optimizer and scheduler are passed to
    `deepspeed.initialize` as objects, so the dict carries neither. `data_parallel_size`: the ranks the model
    is on (default: all)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": train_micro_batch_size_per_gpu * gradient_accumulation_steps
        * (data_parallel_size or get_world_size()),
        "gradient_clipping": gradient_clipping,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(stage, offload),
        # checkpoint tags are the engines' names, the same on every rank by construction; DeepSpeed's check of
        # that is an all-reduce over the whole world, which an engine on part of the ranks (a placement) must not
        # start
        "checkpoint": {"tag_validation": "Ignore"},
        **_precision_section(dtype),
    }
    if offload:
        # a client torch optimizer with offload is otherwise refused by DeepSpeed
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def get_eval_ds_config(stage: int = 0, offload: bool = False, dtype: str = "fp32",
                       data_parallel_size: int | None = None) -> dict[str, Any]:
    """Config for a frozen model (reference, reward): no optimizer. ZeRO-3 shards its weights; lower
    stages keep a full copy per rank. `offload` keeps the weights in CPU memory, which DeepSpeed only
    supports through ZeRO-3 parameter offload, so it implies stage 3."""
    zero: dict[str, Any] = {"stage": 3 if stage == 3 or offload else 0}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 10_000
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 1,  # never trained, but a DeepSpeed config needs its batch sizes
        "train_batch_size": data_parallel_size or get_world_size(),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        **_precision_section(dtype),
    }
