"""DeepSpeed engines for a model that trains and for a frozen one."""
from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from training.core.attention_kernels import exclude_cudnn_attention
from training.core.ds_config import get_eval_ds_config, get_train_ds_config, runs_gradient_allreduce
from training.core.model_loading import load_causal_lm, resolve_dtype
from training.core.optim import build_lr_scheduler, build_optimizer, uses_master_weights
from training.placement.groups import GroupUnit, installed


@dataclass
class OptimizationSettings:
    """What `deepspeed.initialize` needs to train one model."""

    learning_rate: float
    num_training_steps: int
    weight_decay: float = 0.0
    zero_stage: int = 0
    offload: bool = False
    dtype: str = "fp32"
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    lr_scheduler_type: str = "cosine"
    num_warmup_steps: int = 0
    lora_learning_rate: float | None = None
    optimizer: str = "auto"
    data_parallel_size: int | None = None  # the ranks the model is on (None: all)

    @property
    def master_weights(self) -> bool:
        return uses_master_weights(self.dtype, self.zero_stage, self.offload, self.optimizer)

    def ds_config(self) -> dict:
        """With `master_weights` DeepSpeed runs in fp32 mode without clipping: the optimizer does both."""
        return get_train_ds_config(
            stage=self.zero_stage,
            offload=self.offload,
            dtype="fp32" if self.master_weights else self.dtype,
            train_micro_batch_size_per_gpu=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            gradient_clipping=0.0 if self.master_weights else self.gradient_clipping,
            data_parallel_size=self.data_parallel_size,
        )


def create_train_engine(model: torch.nn.Module, settings: OptimizationSettings,
                        unit: GroupUnit | None = None) -> deepspeed.DeepSpeedEngine:
    """Wrap `model` with its optimizer and warm-up schedule in a ZeRO engine (on `unit`'s ranks; default all).

    The schedule counts optimizer steps (micro-batches / gradient accumulation). With master weights the model
    goes to the engine's device first, so the fp32 copies are made there. On a GPU the process's attention leaves
    cuDNN's kernel out from here on (`exclude_cudnn_attention`). The engine starts in train mode: `from_pretrained`
    leaves a model in eval mode, where transformers skips gradient checkpointing (step 3's updates ran without it).
    """
    exclude_cudnn_attention(get_accelerator().device_name())
    if settings.master_weights:
        model.to(get_accelerator().current_device_name())
    optimizer = build_optimizer(
        model,
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        offload=settings.offload,
        lora_learning_rate=settings.lora_learning_rate,
        kind=settings.optimizer,
        master_weights=settings.master_weights,
        max_grad_norm=settings.gradient_clipping,
    )
    scheduler = build_lr_scheduler(
        optimizer, settings.lr_scheduler_type, settings.num_warmup_steps, max(1, settings.num_training_steps)
    )
    with installed(unit):
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=settings.ds_config(), mpu=unit
        )
    skip_single_rank_gradient_allreduce(engine)
    engine.train()
    return engine


def skip_single_rank_gradient_allreduce(engine: deepspeed.DeepSpeedEngine) -> None:
    """Turn off ZeRO-0's gradient all-reduce where the model's data-parallel group is one rank.

    DeepSpeed runs it after every backward even then: it flattens every gradient into one fresh buffer, divides
    by 1, sums over the one rank and copies back, which changes no value but on CPU costs ~0.7 s a step at 135M
    parameters (a 540 MB copy into freshly faulted memory). The placement cost model follows the same rule.
    """
    if not runs_gradient_allreduce(engine.zero_optimization_stage(), engine.dp_world_size):
        engine.enable_backward_allreduce = False


def create_frozen_engine(
    model: torch.nn.Module, zero_stage: int = 0, offload: bool = False, dtype: str = "fp32",
    unit: GroupUnit | None = None,
) -> deepspeed.DeepSpeedEngine:
    """An inference-only engine (reference or reward model) on `unit`'s ranks (default all): eval mode, no
    gradients. On a GPU the process's attention leaves cuDNN's kernel out from here on (`exclude_cudnn_attention`)."""
    exclude_cudnn_attention(get_accelerator().device_name())
    model.requires_grad_(False)
    size = unit.get_data_parallel_world_size() if unit is not None else None
    with installed(unit):
        engine, *_ = deepspeed.initialize(model=model, config=get_eval_ds_config(
            zero_stage, offload, dtype, data_parallel_size=size), mpu=unit)
    engine.eval()
    return engine


def create_reference_engine(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, dtype: str, trained_zero_stage: int, offload: bool = False,
    trust_remote_code: bool = False, unit: GroupUnit | None = None,
) -> deepspeed.DeepSpeedEngine:
    """A frozen copy of a causal LM that a trained policy is compared with (a reference model), dropout off.

    Sharded with ZeRO-3 when the trained model is; otherwise one full copy per rank, since stages 1
    and 2 shard only optimizer state and gradients, which a frozen model has none of. `dtype` as
    `RunArguments.dtype_name` gives it.
    """
    stage = 3 if trained_zero_stage == 3 else 0
    model = load_frozen_causal_lm(name_or_path, tokenizer, dtype, stage, offload, trust_remote_code)
    return create_frozen_engine(model, stage, offload, dtype, unit)


def load_frozen_causal_lm(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, dtype: str, zero_stage: int, offload: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A causal LM, dropout off, for `create_frozen_engine` with the same `zero_stage`, `offload` and `dtype`:
    loaded under the frozen engine's own config, so at ZeRO-3 zero.Init partitions it as that engine expects."""
    return load_causal_lm(name_or_path, tokenizer, dtype=resolve_dtype(dtype),
                          ds_config=get_eval_ds_config(zero_stage, offload, dtype), disable_dropout_layers=True,
                          trust_remote_code=trust_remote_code)
