"""Settings defined once: dataclass groups whose fields are the command-line flags.

A group is a dataclass whose every field is one flag, its help in `field(metadata={"help": ...})`
and its choices in `metadata["choices"]`. A tool's settings are a dataclass of groups (step 3:
`Step3Settings.actor: ModelTrainingConfig`), and `SettingsParser(settings)`, a transformers
`HfArgumentParser`, derives the flags from them and parses a command line into the typed groups.
Field metadata beyond argparse's:
- "flag": the flag's name where it differs from the field's (`HybridEngineSettings.enable` is
  `--enable_hybrid_engine`), or None for a field that is no flag (set by the settings' own code);
- "negated": the flag is a switch that turns the field (default True) off (`--disable_cuda_graph`);
- "nargs": replaces the nargs HfArgumentParser derives (list flags accept no values: "*"; None with
  action="append").
- "same_result": the flag does not change what a run computes, only where it writes, how often it saves or
  logs, or how it executes (`--save_interval`, `--disable_cuda_graph`): a resumed run may change it;
- "resume_override": a resumed run takes the flag's new value (`--learning_rate`, `--gradient_clipping`: lowered
  after a divergence). Every other flag a resumed run must share with its checkpoint (`resume_fixed_flags`).
- "resolved": the name of the group's property that gives the value the flag resolves to on this machine
  (`--dtype auto` is bf16 on one GPU and fp16 on another): a resumed run must share that value, not the flag's.
A settings field declared with `group(prefix)` gets its group's flags prefixed: step 3 trains two
models with one `ModelTrainingConfig` each, `--actor_zero_stage` and `--critic_zero_stage`.
Switches are bool fields (default False) and `bool | None` fields: `--flag` alone means True.
"""
from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import torch
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from training.core.engine import OptimizationSettings
from training.core.lora import apply_lora
from training.core.model_loading import EMBEDDED_MODEL_NAME, FINAL_MODEL_SUBDIR, resolve_dtype
from training.core.optim import OPTIMIZER_CHOICES, SCHEDULER_CHOICES
from utils.errors import UserError, refuse_messages

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_OWN_METADATA = ("flag", "negated", "same_result", "resume_override", "resolved")
RESOLVED_SUFFIX = " (resolved)"  # a flag recorded as it resolved on the machine: "dtype (resolved)"

S = TypeVar("S")


# the machinery -----------------------------------------------------------------------------------


def group(prefix: str) -> Any:
    """A settings field whose group's flags are named `prefix + name` (`group("actor_")`)."""
    return field(metadata={"prefix": prefix})


@dataclass(frozen=True)
class _Flag:
    field: str  # the group's field
    name: str  # the flag, prefix included
    negated: bool


def _flags(group_type: type, prefix: str) -> list[_Flag]:
    return [_Flag(f.name, prefix + f.metadata.get("flag", f.name), f.metadata.get("negated", False))
            for f in _flag_fields(group_type)]


def _flag_class(group_type: type, prefix: str, title: str) -> type:
    """`group_type` as HfArgumentParser sees it: one field per flag, named and defaulted as the flag."""
    hints = get_type_hints(group_type)
    by_name = {f.name: f for f in fields(group_type)}
    specs = []
    for flag in _flags(group_type, prefix):
        source = by_name[flag.field]
        metadata = {key: value for key, value in source.metadata.items() if key not in _OWN_METADATA}
        if flag.negated:
            specs.append((flag.name, bool, field(default=False, metadata=metadata)))
        else:
            specs.append((flag.name, hints[flag.field], field(metadata=metadata, **_default_of(source))))
    flag_class = make_dataclass(f"{group_type.__name__}Flags", specs)
    flag_class._argument_group_name = title
    return flag_class


def _default_of(source: Field) -> dict[str, Any]:
    if source.default is not MISSING:
        return {"default": source.default}
    if source.default_factory is not MISSING:
        return {"default_factory": source.default_factory}
    return {}  # a required flag


def _groups(settings: type) -> list[tuple[str, type, str]]:
    """(attribute, group type, flag prefix) of each group of a settings dataclass."""
    hints = get_type_hints(settings)
    return [(f.name, hints[f.name], f.metadata.get("prefix", "")) for f in fields(settings)]


def flag_values(settings: Any) -> dict[str, Any]:
    """{flag name: value}, one entry per flag of `settings` (what a run's `args.json` records)."""
    values = {}
    for name, group_type, prefix in _groups(type(settings)):
        value = getattr(settings, name)
        for flag in _flags(group_type, prefix):
            values[flag.name] = not getattr(value, flag.field) if flag.negated else getattr(value, flag.field)
    return values


def non_default_flags(settings: Any) -> dict[str, Any]:
    """The `flag_values` of `settings` that differ from their flag's default: the flags a command line changed. A flag
    given its default value is not among them; a required flag, and a field that `__post_init__` fills when left at
    its default None (`PPOConfig.ALGORITHM_DEFAULTS`), always are."""
    defaults = {flag.name: _flag_default(source, flag) for _, group_type, prefix in _groups(type(settings))
                for source, flag in zip(_flag_fields(group_type), _flags(group_type, prefix))}
    return {name: value for name, value in flag_values(settings).items() if value != defaults[name]}


def _flag_default(source: Field, flag: _Flag) -> Any:
    """The value `flag_values` gives a flag left out (MISSING for a required one)."""
    if flag.negated:
        return False
    if source.default_factory is not MISSING:
        return source.default_factory()
    return source.default


def resume_fixed_flags(settings: Any, unread: Collection[str] = frozenset()) -> dict[str, Any]:
    """The `flag_values` a resumed run must share with its checkpoint: all but those marked "same_result" or
    "resume_override" and the `unread` ones (flags this step takes but does not read: `utils.data.args.
    flags_another_step_reads`; a checkpoint recording them is not compared on them), and in place of a flag marked
    "resolved", its resolved value under the key "<flag> (resolved)"
    (`training.reliability.run_records.with_resolved_flags` reads older checkpoints, which record the flag as given)."""
    free = _marked_flags(type(settings), "same_result") | _marked_flags(type(settings), "resume_override") | set(unread)
    fixed = {name: value for name, value in flag_values(settings).items() if name not in free}
    for name, group_type, prefix in _groups(type(settings)):
        for source, flag in zip(_flag_fields(group_type), _flags(group_type, prefix)):
            if source.metadata.get("resolved") and flag.name in fixed:
                del fixed[flag.name]
                fixed[flag.name + RESOLVED_SUFFIX] = getattr(getattr(settings, name), source.metadata["resolved"])
    return fixed


def resume_override_flags(settings: Any) -> frozenset[str]:
    """The flags marked "resume_override": a resumed run may give them other values (a refusal names them)."""
    return _marked_flags(type(settings), "resume_override")


def same_result_flags(settings: Any) -> frozenset[str]:
    """The flags marked "same_result": a finished run made with other values of them is the same run."""
    return _marked_flags(type(settings), "same_result")


def _marked_flags(settings: type, mark: str) -> frozenset[str]:
    return frozenset(flag.name for _, group_type, prefix in _groups(settings)
                     for source, flag in zip(_flag_fields(group_type), _flags(group_type, prefix))
                     if source.metadata.get(mark))


def _flag_fields(group_type: type) -> list[Field]:
    """The fields of a group that are flags, in `_flags`' order."""
    return [f for f in fields(group_type) if f.metadata.get("flag", f.name) is not None]


class _ExactFlags:
    """Takes HfArgumentParser's `add_argument` call for one field: drops the dashed alias it adds
    (`--zero-stage`), so a tool accepts exactly its DeepSpeed-Chat flag names, makes a `bool | None`
    field (None: decided by other settings) a switch like a bool one, and applies the field's "nargs"."""

    def __init__(self, container: argparse._ActionsContainer, source: Field):
        self.container = container
        self.source = source

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        if kwargs.get("type") is string_to_bool and "nargs" not in kwargs:  # `bool | None`: a switch too
            kwargs.update(nargs="?", const=True)
        if "nargs" in self.source.metadata:
            kwargs["nargs"] = self.source.metadata["nargs"]
        return self.container.add_argument(*(name for name in names if "-" not in name[2:]), **kwargs)


class SettingsParser(HfArgumentParser):
    """The command line of a settings dataclass; `parse_args` returns an instance of it."""

    def __init__(self, settings: type[S], **kwargs: Any):
        self.settings = settings
        groups = _groups(settings)
        super().__init__([_flag_class(group_type, prefix, f"{name} settings") for name, group_type, prefix in groups],
                         **kwargs)

    @staticmethod
    def _parse_dataclass_field(parser: argparse._ActionsContainer, source: Field) -> None:
        HfArgumentParser._parse_dataclass_field(_ExactFlags(parser, source), source)

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> S:
        values = vars(super().parse_args(args, namespace))
        return self.settings(**{name: _group_from_flags(group_type, prefix, values)
                                for name, group_type, prefix in _groups(self.settings)})


def _group_from_flags(group_type: type, prefix: str, values: Mapping[str, Any]) -> Any:
    return group_type(**{flag.field: not values[flag.name] if flag.negated else values[flag.name]
                         for flag in _flags(group_type, prefix)})


# the groups every step shares -----------------------------------------------------------------------


def trust_remote_code_field() -> Any:
    """`--trust_remote_code`, as every command line that loads a model takes it."""
    return field(default=False, metadata={
        "help": "run the code a model ships (auto_map in its config.json), which a model of a type transformers "
                "does not know loads by; only for a model whose code you trust"})


@dataclass
class RunArguments:
    """Run folder, precision and launcher plumbing (every step; `--seed` is a data flag)."""

    output_dir: str = field(metadata={
        "same_result": True, "help": "run folder: final model in <output_dir>/model, metrics, args, checkpoints"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPE_CHOICES, "resolved": "dtype_name",
        "help": ("training precision; auto = bf16 where the GPU supports it or the CPU has bf16 instructions, "
                 "else fp16 on GPU, fp32 on CPU")})
    trust_remote_code: bool = trust_remote_code_field()
    local_rank: int = field(default=-1, metadata={  # set by the deepspeed launcher
        "same_result": True, "help": argparse.SUPPRESS})

    def check_device(self) -> None:
        """Refuse a --dtype this device cannot compute in (fp16 on a CPU)."""
        resolve_dtype(self.dtype)

    @property
    def dtype_name(self) -> str:
        """`--dtype` resolved for this device, as the DeepSpeed config spells it ("bf16", "fp16", "fp32")."""
        return DTYPE_NAMES[resolve_dtype(self.dtype)]

    @property
    def final_model_dir(self) -> Path:
        return Path(self.output_dir) / FINAL_MODEL_SUBDIR


@dataclass
class ModelSource:
    """The model steps 1 and 2 start from."""

    model_name_or_path: str = field(default=EMBEDDED_MODEL_NAME, metadata={
        "help": f"hub name, local HF folder, a previous step's run folder, or '{EMBEDDED_MODEL_NAME}'"})
    disable_dropout: bool = field(default=False, metadata={"help": "set every dropout probability to 0"})


@dataclass
class ModelTrainingConfig:
    """How one trained model trains: gradient checkpointing, ZeRO, LoRA and its optimizer (steps 1 and 2
    have one, unprefixed; step 3 one per model, `--actor_*` and `--critic_*`)."""

    gradient_checkpointing: bool = field(default=False, metadata={
        "same_result": True, "help": "recompute activations in the backward pass (less memory, ~30%% slower)"})
    zero_stage: int = field(default=0, metadata={
        "choices": (0, 1, 2, 3), "help": "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters"})
    offload: bool = field(default=False, metadata={
        "help": "keep optimizer state (and at stage 3 the parameters) in CPU memory"})
    lora_dim: int = field(default=0, metadata={"help": "LoRA rank; 0 trains without LoRA"})
    lora_module_name: str = field(default="layers.", metadata={
        "help": "substring of the module paths that get adapters ('layers.' Llama, 'h.' GPT-2)"})
    only_optimize_lora: bool = field(default=False, metadata={
        "help": "freeze the base weights and train only the adapters"})
    lora_learning_rate: float | None = field(default=None, metadata={
        "resume_override": True, "help": "learning rate of the adapters (default: the model's --learning_rate)"})
    learning_rate: float = field(default=1e-5, metadata={
        "resume_override": True, "help": "peak learning rate (a resumed run takes a new one: the schedule goes on "
                                         "at its step with the new peak)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})


@dataclass
class ScheduleSettings:
    """What every optimizer of a step shares: schedule, accumulation, clipping, optimizer kind, step cap."""

    lr_scheduler_type: str = field(default="cosine", metadata={
        "choices": SCHEDULER_CHOICES,
        "help": "learning-rate schedule after the warm-up, over the run's optimizer steps"})
    num_warmup_steps: int = field(default=0, metadata={"help": "linear warm-up, in optimizer steps"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    gradient_clipping: float = field(default=1.0, metadata={
        "resume_override": True, "help": "max gradient norm (0 disables)"})
    optimizer: str = field(default="auto", metadata={
        "choices": OPTIMIZER_CHOICES,
        "help": "auto: torch's fused AdamW on CPU, DeepSpeedCPUAdam with --offload, FusedAdam on GPU"})
    max_steps: int | None = field(default=None, metadata={
        "help": "stop after this many optimizer steps (PPO steps in step 3, each of one or more optimizer steps) "
                "(for quick runs); the schedule spans them"})


# reading them -------------------------------------------------------------------------------------


def _refuse_flags(flags: Mapping[str, Any], names: Sequence[str], requirement: Callable[[float], str | None]) -> None:
    """Refuse every flag of `names` in `flags` (as `flag_values` gives them) that is set and whose value fails
    `requirement` (which says what the value must be, None where it is fine), all in one error."""
    refuse_messages([f"--{name} must be {must}, got {flags[name]}" for name in names
                     if flags[name] is not None and (must := requirement(flags[name])) is not None])


def _finite(value: float) -> str | None:
    """argparse's float reads "nan" and "inf", and every comparison with nan is False, so a range check alone lets
    them through."""
    return None if math.isfinite(value) else "a finite number"


def check_finite(flags: Mapping[str, Any], *names: str) -> None:
    """Refuse every flag of `flags` (as `flag_values` gives them) that is set but nan or infinite."""
    _refuse_flags(flags, names, _finite)


def check_positive(flags: Mapping[str, Any], *names: str) -> None:
    """Refuse every flag of `flags` (as `flag_values` gives them) that is set but not a positive finite number."""
    _refuse_flags(flags, names, lambda value: _finite(value) or (None if value > 0 else "positive"))


def check_offload_stage(flags: Mapping[str, Any], *prefixes: str) -> None:
    """Refuse optimizer offload at ZeRO stage 0 for the trained models named by their flag `prefixes` (`actor_`):
    DeepSpeed offloads the optimizer state ZeRO partitions, so at stage 0 the offload was dropped while the
    optimizer became DeepSpeedCPUAdam, which refuses parameters on a GPU."""
    refuse_messages([f"--{prefix}offload needs --{prefix}zero_stage 1, 2 or 3 (DeepSpeed offloads the optimizer "
                     f"state ZeRO partitions); add --{prefix}zero_stage 2, or drop --{prefix}offload"
                     for prefix in prefixes if flags[f"{prefix}offload"] and flags[f"{prefix}zero_stage"] == 0])


_ADAPTER_FLAG_DEFAULTS = {source.name: source.default for source in fields(ModelTrainingConfig)
                          if source.name in ("only_optimize_lora", "lora_learning_rate", "lora_module_name")}


def check_lora_flags(flags: Mapping[str, Any], *prefixes: str) -> None:
    """Refuse `--only_optimize_lora`, `--lora_learning_rate` and `--lora_module_name` without adapters (`--lora_dim`
    0) for the trained models named by their flag `prefixes` (`actor_`), before anything loads: the first froze
    nothing but was only refused once the model had loaded, the others changed nothing. Every such flag is refused
    at once. A negative --lora_dim is refused by its own check, not said again here."""
    refuse_messages([f"--{prefix}{name} needs --{prefix}lora_dim > 0 (it applies to LoRA adapters, and without "
                     f"--{prefix}lora_dim the model has none); add --{prefix}lora_dim 8, or drop --{prefix}{name}"
                     for prefix in prefixes if flags[f"{prefix}lora_dim"] == 0
                     for name, default in _ADAPTER_FLAG_DEFAULTS.items() if flags[f"{prefix}{name}"] != default])


def check_non_negative(flags: Mapping[str, Any], *names: str) -> None:
    """Refuse every flag of `flags` (as `flag_values` gives them) that is set but negative (0 turns it off) or not a
    finite number."""
    _refuse_flags(flags, names, lambda value: _finite(value) or (None if value >= 0 else "0 or positive"))


_OPTIMIZER_FLAGS = ("learning_rate", "lora_learning_rate", "weight_decay")


def warmup_outlasts_run(warmup: int, optimizer_steps: int, steps_said: str) -> str | None:
    """Why a warm-up of `warmup` optimizer steps keeps the learning rate below its peak through all of the run's
    `optimizer_steps` (which `steps_said` names), or None where it ends before: a linear warm-up over N steps gives
    step n (from 0) the rate n / N of the peak."""
    if warmup == 0 or warmup < optimizer_steps:
        return None
    return (f"--num_warmup_steps {warmup} lasts the whole run ({steps_said}), so the learning rate never reaches the "
            f"one given; give fewer warm-up steps than {optimizer_steps} (a tenth of the run is usual), or 0 for none")


def check_warmup(warmup: int, optimizer_steps: int | None, steps_said: str) -> None:
    """Refuse a --num_warmup_steps the run's `optimizer_steps` (None: not known from the flags) never finish."""
    problem = warmup_outlasts_run(warmup, optimizer_steps, steps_said) if optimizer_steps is not None else None
    if problem is not None:
        raise UserError(problem)


def warn_long_warmup(warmup: int, optimizer_steps: int, steps_said: str) -> None:
    """Warn of a --num_warmup_steps the run's `optimizer_steps`, known only once its data has loaded, never finish."""
    problem = warmup_outlasts_run(warmup, optimizer_steps, steps_said)
    if problem is not None:
        logger.warning(problem)


def check_optimizer_flags(flags: Mapping[str, Any], *prefixes: str) -> None:
    """Refuse a negative learning rate, adapter learning rate or weight decay of the trained models named by their
    flag `prefixes` (`actor_`), and a negative --gradient_clipping: torch's AdamW refused a negative --learning_rate
    only once the model had loaded, and took the others without a word (set per parameter group, or a norm that
    DeepSpeed and the master-weight optimizer apply only when positive), training away from the loss, growing the
    weights, or leaving the gradients unclipped."""
    check_non_negative(flags, "gradient_clipping", *(prefix + name for prefix in prefixes for name in _OPTIMIZER_FLAGS))


def optimization_settings(
    model: ModelTrainingConfig,
    schedule: ScheduleSettings,
    dtype: str,
    num_training_steps: int,
    micro_batch_size: int,
) -> OptimizationSettings:
    """The `OptimizationSettings` of one trained model (`dtype` as `RunArguments.dtype_name` gives it)."""
    return OptimizationSettings(
        learning_rate=model.learning_rate,
        num_training_steps=num_training_steps,
        weight_decay=model.weight_decay,
        zero_stage=model.zero_stage,
        offload=model.offload,
        dtype=dtype,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=schedule.gradient_accumulation_steps,
        gradient_clipping=schedule.gradient_clipping,
        lr_scheduler_type=schedule.lr_scheduler_type,
        num_warmup_steps=schedule.num_warmup_steps,
        lora_learning_rate=model.lora_learning_rate,
        optimizer=schedule.optimizer,
    )


def apply_model_options(
    model: torch.nn.Module, config: ModelTrainingConfig, trainable_heads: Sequence[str] = (), flag_prefix: str = ""
) -> torch.nn.Module:
    """Apply the model's gradient checkpointing and LoRA settings; returns the (possibly peft-wrapped) model.

    `trainable_heads` name freshly initialised parameters (a reward model's `v_head`) that must
    train even under `only_optimize_lora`, which otherwise freezes everything but the adapters;
    `flag_prefix` names the model's flags in errors (`actor_`).
    """
    check_lora_flags({flag_prefix + name: value for name, value in asdict(config).items()}, flag_prefix)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "config"):
            model.config.use_cache = False
    if config.lora_dim > 0:
        model = apply_lora(model, config.lora_dim, lora_module_name=config.lora_module_name,
                           only_optimize_lora=config.only_optimize_lora, flag_prefix=flag_prefix)
        for name, param in model.named_parameters():
            if any(head in name for head in trainable_heads):
                param.requires_grad_(True)
    return model
