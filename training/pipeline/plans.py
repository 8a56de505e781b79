"""Typed plans: the settings a deployment picks for one step, each field a flag of that step's CLI.

A field left at None is not planned (the step keeps its own default). Field order is argv order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StepPlan:
    """Base of the per-step plans."""

    @property
    def flags(self) -> dict[str, Any]:
        """The planned settings, flag name (no dashes) -> value, in field order; None fields left out."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: value for name, value in values if value is not None}

    def argv(self) -> list[str]:
        """`--name value` per planned setting; True is a bare switch and False leaves the flag out."""
        args: list[str] = []
        for name, value in self.flags.items():
            if value is False:
                continue
            args.append(f"--{name}")
            if value is not True:
                args.append(str(value))
        return args


@dataclass(frozen=True)
class SupervisedPlan(StepPlan):
    """Steps 1 and 2 (`training.loops` supervised steps)."""

    zero_stage: int | None = None
    offload: bool | None = None
    lora_dim: int | None = None
    lora_module_name: str | None = None
    only_optimize_lora: bool | None = None
    gradient_checkpointing: bool | None = None
    dtype: str | None = None
    gradient_accumulation_steps: int | None = None
    max_seq_len: int | None = None
    per_device_train_batch_size: int | None = None
    per_device_eval_batch_size: int | None = None
    learning_rate: float | None = None
    num_warmup_steps: int | None = None
    max_steps: int | None = None
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


@dataclass(frozen=True)
class DPOPlan(SupervisedPlan):
    """DPO: a supervised step's settings, and its frozen reference's offload."""

    offload_reference_model: bool | None = None


@dataclass(frozen=True)
class RLHFPlan(StepPlan):
    """Step 3 (PPO): actor and critic settings, rollout and training batch sizes."""

    actor_zero_stage: int | None = None
    critic_zero_stage: int | None = None
    actor_offload: bool | None = None
    critic_offload: bool | None = None
    offload_reference_model: bool | None = None
    offload_reward_model: bool | None = None
    actor_lora_dim: int | None = None
    critic_lora_dim: int | None = None
    actor_lora_module_name: str | None = None
    critic_lora_module_name: str | None = None
    actor_only_optimize_lora: bool | None = None
    critic_only_optimize_lora: bool | None = None
    actor_gradient_checkpointing: bool | None = None
    critic_gradient_checkpointing: bool | None = None
    dtype: str | None = None
    per_device_generation_batch_size: int | None = None
    per_device_training_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    max_prompt_seq_len: int | None = None
    max_answer_seq_len: int | None = None
    enable_hybrid_engine: bool | None = None
    actor_learning_rate: float | None = None
    max_steps: int | None = None
    max_train_samples: int | None = None
    eval_samples: int | None = None
