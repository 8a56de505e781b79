"""Deployment types and the settings each one picks for the models' sizes and the hardware.

GPU deployments size ZeRO stage, offload, LoRA and batch sizes from a memory model (mixed-precision
Adam keeps 16 bytes per trained parameter; ZeRO partitions them across the ranks) and the
accelerator memory. The `cpu` deployment is a quick run: it sizes each step's number of optimizer
steps so that the three steps finish within a time budget on this machine's cores.
"""
from __future__ import annotations

import enum
import math
from argparse import ArgumentTypeError
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from transformers.hf_argparser import string_to_bool

from training.placement.spec import AUTO, MODEL_ROLES, build_placement, parse_placement_ratio
from utils.errors import UserError

from .hardware import GIB, Hardware, ModelSize, lora_trainable_parameters
from .hostfile import Host
from .plans import DPOPlan, RLHFPlan, StepPlan, SupervisedPlan


class DeploymentType(str, enum.Enum):
    SINGLE_GPU = "single_gpu"
    SINGLE_NODE = "single_node"
    MULTI_NODE = "multi_node"
    CPU = "cpu"


def detect_deployment(hardware: Hardware, hostfile_given: bool) -> DeploymentType:
    """multi_node when a hostfile is named, else by the local GPU count."""
    if hostfile_given:
        return DeploymentType.MULTI_NODE
    if hardware.num_gpus == 0:
        return DeploymentType.CPU
    return DeploymentType.SINGLE_GPU if hardware.num_gpus == 1 else DeploymentType.SINGLE_NODE


@dataclass
class DeploymentPlan:
    """Every registered step's planned settings, by step number."""

    deployment: DeploymentType
    world_size: int
    steps: dict[int, StepPlan]
    notes: list[str] = field(default_factory=list)
    # the models whose offload each step's host need counts, by step number, and the nodes that share it: the need
    # of the flags a step runs with, the user's or the plan's (`planning._host_need`, `host_memory_short_now`)
    host_models: dict[int, tuple[HostModel | HostEMA, ...]] = field(default_factory=dict)
    nodes: int = 1
    # the step flags train.py's --actor-zero-stage/--reward-zero-stage set otherwise than planned, by step number
    # (`planning.apply_zero_overrides`): the host need as planned counts their planned values
    stage_flags_set: dict[int, dict[str, StageFlagSet]] = field(default_factory=dict)


@dataclass(frozen=True)
class StageFlagSet:
    """A step flag that one of train.py's ZeRO stage flags set otherwise than planned."""

    given: str  # train.py's flag: --actor-zero-stage
    planned: Any  # the step flag's planned value


class Model(str, enum.Enum):
    """The two models train.py is given (--actor-model, --reward-model) and the steps train on."""

    ACTOR = "actor"
    REWARD = "reward"


@dataclass(frozen=True)
class ModelSizes:
    actor: ModelSize
    reward: ModelSize


@dataclass(frozen=True)
class Workload:
    """What step 3 holds besides the actor and its reference, from `--algorithm` and `--reward_fn`: a trained
    critic, a frozen reward model, and the answers sampled per prompt."""

    critic: bool = True
    reward_model: bool = True
    samples_per_prompt: int = 1
    verifiable_task: bool = False  # the embedded task (short prompts and answers, scored by a built-in verifier)


# --------------------------------------------------------------------------- GPU memory model

_STATE_BUDGET = 0.55  # share of accelerator memory for weights/gradients/optimizer; the rest is activations
_ADAM_BYTES = 12  # fp32 master weights and two Adam moments per trained parameter
_EMA_BYTES = 4  # step 3's EMA of the actor: an fp32 copy of each trained parameter (step3_rlhf/ema.py)
_GPU_LORA_DIM = 128
_HOST_OFFLOAD_SHARE = 0.7  # share of a node's memory that offload may fill (the rest: the processes, the OS)
DPO_STEP = 4  # DPO's number in the step registry (`steps.STEPS`), by which train.py runs, plans and names it
DPO_SAID = f"DPO (step {DPO_STEP})"  # how train.py's messages name it
_STEPS_SAID = {DPO_STEP: DPO_SAID}  # a step train.py's messages name otherwise than "step N"


@dataclass(frozen=True)
class MemoryChoice:
    zero_stage: int
    offload: bool = False
    lora: bool = False
    lora_dim: int = _GPU_LORA_DIM  # the adapters' rank where `lora` (only they train)
    lora_module_name: str | None = None  # layers they wrap (`training.core.lora.is_lora_target`); None: every block's


def _ladder(world: int) -> list[MemoryChoice]:
    """Choices from the cheapest in communication to the most memory-frugal."""
    first = [MemoryChoice(0)] if world == 1 else [MemoryChoice(2), MemoryChoice(3)]
    return first + [MemoryChoice(2, offload=True), MemoryChoice(3, offload=True),
                    MemoryChoice(3, lora=True), MemoryChoice(3, offload=True, lora=True)]


def state_bytes_per_gpu(size: ModelSize, world: int, choice: MemoryChoice, trained: bool = True) -> float:
    """Weights + gradients + optimizer states on one accelerator (2-byte weights)."""
    params = size.parameters
    if not trained:
        weights = 0.0 if choice.offload else 2 * params / (world if choice.zero_stage == 3 else 1)
        return weights
    trainable = trained_parameters([size], choice)
    weights = 0.0 if (choice.offload and choice.zero_stage == 3) else 2 * params / (world if choice.zero_stage == 3 else 1)
    grads = 2 * trainable / (world if choice.zero_stage >= 2 else 1)
    optimizer = 0.0 if choice.offload else _ADAM_BYTES * trainable / (world if choice.zero_stage >= 1 else 1)
    return weights + grads + optimizer


def activation_bytes_per_sequence(size: ModelSize, seq_len: int, checkpointing: bool) -> float:
    """Training activations of one sequence (Korthikanti et al.: ~34*s*h bytes per layer at 2 bytes,
    flash attention), plus the logits with their fp32 copy and gradient."""
    per_layer = 34 * seq_len * size.hidden_size
    layers = (2 * seq_len * size.hidden_size * size.num_layers + per_layer) if checkpointing else per_layer * size.num_layers
    return layers + seq_len * size.vocab_size * 10


def _pow2_floor(value: float, cap: int) -> int:
    if value < 1:
        return 0
    return min(cap, 2 ** int(math.log2(value)))


def host_bytes_per_node(trained: list[ModelSize], frozen: list[ModelSize], choice: MemoryChoice, nodes: int) -> float:
    """What an offload choice keeps in one node's CPU memory, all models together: the trained weights' optimizer
    states and gradients, their 2-byte weights at ZeRO-3 (parameter offload), and the frozen models' weights (offloaded
    through ZeRO-3 at any stage). Nothing without offload."""
    if not choice.offload:
        return 0.0
    trainable = trained_parameters(trained, choice)
    weights = sum(m.parameters for m in trained) if choice.zero_stage == 3 else 0
    weights += sum(m.parameters for m in frozen)
    return ((_ADAM_BYTES + 2) * trainable + 2 * weights) / nodes


def trained_parameters(trained: list[ModelSize], choice: MemoryChoice) -> float:
    """The parameters a memory choice trains of the models `trained`: under LoRA, its adapters' (rank
    `choice.lora_dim` on the layers `choice.lora_module_name` selects, by default each model's decoder blocks, where
    the plan puts them: `lora_trainable_parameters`)."""
    if not choice.lora:
        return sum(m.parameters for m in trained)
    return sum(lora_trainable_parameters(m, choice.lora_dim, choice.lora_module_name) for m in trained)


@dataclass(frozen=True)
class HostModel:
    """A model of a step as its offload's host need counts it, and the step's flags that set its memory choice: a
    trained model's `{prefix}zero_stage`, `{prefix}offload`, `{prefix}lora_dim`, `{prefix}only_optimize_lora` and
    `{prefix}lora_module_name`; a frozen model's one offload flag (`frozen_offload`), which moves its weights at any
    stage."""

    size: ModelSize
    prefix: str = ""
    frozen_offload: str | None = None

    @property
    def trained(self) -> bool:
        return self.frozen_offload is None

    @property
    def flag_names(self) -> tuple[str, ...]:
        if not self.trained:
            return (self.frozen_offload,)
        return tuple(f"{self.prefix}{name}"
                     for name in ("zero_stage", "offload", "lora_dim", "only_optimize_lora", "lora_module_name"))

    def choice(self, flags: Mapping[str, Any]) -> MemoryChoice:
        """The memory choice that a step's flag values `flags` make for this model (a plain argparse step gives them
        as text; a flag left out is off)."""
        if not self.trained:
            return MemoryChoice(0, offload=_switched_on(flags.get(self.frozen_offload)))
        stage, offload, lora_dim, only_lora, module_name = (flags.get(name) for name in self.flag_names)
        rank = int(lora_dim or 0)
        return MemoryChoice(int(stage or 0), _switched_on(offload), rank > 0 and _switched_on(only_lora), rank,
                            module_name)

    def host_bytes(self, flags: Mapping[str, Any], world: int, nodes: int) -> float:
        """What this model's offload puts in one node's memory with a step's flag values `flags` (its state partitioned
        over the `world` ranks, whatever their number)."""
        trained, frozen = ([self.size], []) if self.trained else ([], [self.size])
        return host_bytes_per_node(trained, frozen, self.choice(flags), nodes)


@dataclass(frozen=True)
class HostEMA:
    """Step 3's EMA of a trained model (the actor), switched on by `--enable_ema`: an fp32 copy of its trained
    parameters, in CPU memory where the model is offloaded, else on the accelerators (`step3_rlhf.ema.ModelEMA`). Each
    rank that holds the actor holds its ZeRO-3 partition of it, or at ZeRO 0-2 a whole copy. The plan leaves it off.
    `roles`: the models the step holds, which a named --placement lays out."""

    of: HostModel
    switch: str = "enable_ema"
    roles: tuple[str, ...] = MODEL_ROLES

    @property
    def flag_names(self) -> tuple[str, ...]:
        return (*self.of.flag_names, self.switch)

    def host_bytes(self, flags: Mapping[str, Any], world: int, nodes: int) -> float:
        """What the EMA puts in one node's memory with a step's flag values `flags` on `world` ranks."""
        choice = self.of.choice(flags)
        if not (choice.offload and _switched_on(flags.get(self.switch))):
            return 0.0
        whole = _EMA_BYTES * trained_parameters([self.of.size], choice)
        if choice.zero_stage == 3:  # partitioned over every rank: step 3 refuses ZeRO-3 on part of them
            return whole / nodes
        return whole * self._actor_ranks_on_a_node(flags, world, nodes)

    def _actor_ranks_on_a_node(self, flags: Mapping[str, Any], world: int, nodes: int) -> int:
        """The most ranks of one node that hold the actor: every one co-located or under --placement auto (the most
        it may pick), the actor's alone under a named --placement (disaggregate gives it the first half) and
        --placement_ratio; a layout the step refuses counts every one."""
        per_node = world // nodes
        name, ratio = flags.get("placement") or "colocate", flags.get("placement_ratio")
        if name == AUTO:
            return per_node
        try:
            placement = build_placement(name, world, self.roles, parse_placement_ratio(ratio) if ratio else None)
        except UserError:
            return per_node
        return max(sum(1 for rank in placement.ranks["actor"] if rank // per_node == node) for node in range(nodes))


def _switched_on(value: Any) -> bool:
    """Whether a switch's value is on: a settings step gives a bool, a plain argparse step its text, read in every
    spelling the settings parser takes (transformers' `string_to_bool`: true, yes, 1, ...); other text is off."""
    if value is None:
        return False
    try:
        return string_to_bool(value if isinstance(value, bool) else str(value))
    except ArgumentTypeError:
        return False


@dataclass(frozen=True)
class HostNeed:
    """What a step's offload puts in one node's memory with the flags it runs with and with the planned ones, and
    the flags that moved it, as the user gave them: those that raised it (`raised_by`), those that lowered it
    (`lowered_by`)."""

    as_run: float
    as_planned: float
    raised_by: tuple[str, ...] = ()
    lowered_by: tuple[str, ...] = ()
    at_most: bool = False  # as_run is the most of what the step may pick as it starts (step 3's --placement auto)


@dataclass(frozen=True)
class _Fit:
    choice: MemoryChoice
    micro_batch: int
    checkpointing: bool


def _fit_on_accelerators(
    target: Target, trained: list[ModelSize], frozen: list[ModelSize], choice: MemoryChoice, seq_len: int,
    seqs_per_sample: int, cap: int, extra_per_sample: float,
) -> _Fit | None:
    """`choice` with the largest power-of-two micro batch its states leave room for; None where the states, or one
    sample's activations beside them, do not fit an accelerator."""
    world, hardware = target.world, target.hardware
    memory = _accelerator_bytes(hardware)
    states = sum(state_bytes_per_gpu(m, world, choice) for m in trained)
    states += sum(state_bytes_per_gpu(m, world, choice, trained=False) for m in frozen)
    if states > _STATE_BUDGET * memory:
        return None
    free = memory * 0.9 - states
    for checkpointing in (False, True):
        per_sample = seqs_per_sample * max(activation_bytes_per_sequence(m, seq_len, checkpointing) for m in trained)
        micro = _pow2_floor(free / (per_sample + extra_per_sample), cap)
        if micro >= 1:
            return _Fit(choice, micro, checkpointing)
    return None


def _accelerator_bytes(hardware: Hardware) -> float:
    """One accelerator's memory; planned where no GPU is, this machine's RAM (see `gpu_target`'s note)."""
    return (hardware.gpu_memory_gib or hardware.cpu_memory_gib) * GIB


def _host_budget(hardware: Hardware) -> float:
    """What offload may put in one node's CPU memory."""
    return _HOST_OFFLOAD_SHARE * hardware.cpu_memory_gib * GIB


def host_memory_short_now(hardware: Hardware, needs: Mapping[int, HostNeed]) -> list[str]:
    """Warnings for the steps in `needs` (step: what its offload puts in host memory) that this machine's memory
    available now does not hold, at the share the plan gives offload of the memory installed, naming the flags that
    raised the need. The plan is not changed: it depends on the machine, not on what other
    jobs hold at the moment (a rerun would plan other flags and refuse the finished steps and checkpoints)."""
    available = hardware.cpu_memory_available_gib
    if available is None:
        return []
    budget = _HOST_OFFLOAD_SHARE * available * GIB
    return [f"{_STEPS_SAID.get(step, f'step {step}')}'s offload{_as_your_flags_set_it(need.raised_by)} puts "
            f"{'up to ' if need.at_most else ''}{need.as_run / GIB:.1f} GiB in host memory, more than "
            f"{_HOST_OFFLOAD_SHARE:.0%} of the {available:.0f} GiB available on this machine now ({budget / GIB:.1f} "
            f"GiB; the plan counts its {hardware.cpu_memory_said}, other processes hold the rest), so the step may run "
            f"out of host memory once it loads; free memory here before it starts (other jobs), or "
            f"{_less_offload(need)}"
            for step, need in sorted(needs.items()) if need.as_run > budget]


def _as_your_flags_set_it(flags: tuple[str, ...]) -> str:
    return f", as your {', '.join(flags)} set it," if flags else ""


def _less_offload(need: HostNeed) -> str:
    """What lowers the need: the plan's values back for the flags that raised it, also where others lowered the total
    as much or more; else a smaller run. Where the flags a step runs with lowered the total below the plan's, it says
    so."""
    smaller = "a smaller model, more GPUs or nodes"
    advice = f"offload less: leave those flags to the plan, or {smaller}" if need.raised_by else \
        f"plan less offload: {smaller}"
    if need.as_run < need.as_planned:
        lowered = ", ".join(need.lowered_by)
        return f"{advice} (your {lowered} lowered it from the plan's {need.as_planned / GIB:.1f} GiB)"
    return advice


def _fit_training(
    target: Target, held: tuple[HostModel, ...], seq_len: int, seqs_per_sample: int, cap: int,
    step: int, what: str, models: tuple[Model, ...], extra_per_sample: float = 0.0,
    unplanned: tuple[HostEMA, ...] = (),
) -> _Fit:
    """The first ladder choice whose states fit the accelerators and whose offload fits host memory, and the largest
    power-of-two micro batch beside them, for the models the step holds (`held`); else a refusal naming the limit
    that failed (`models`: whose size counts). What the plan leaves off (`unplanned`: step 3's EMA) is not sized for,
    only counted in the host need of the flags a step runs with."""
    trained = [model.size for model in held if model.trained]
    frozen = [model.size for model in held if not model.trained]
    target.host_models[step] = (*held, *unplanned)
    host_bound = []  # choices that fit the accelerators but offload more than host memory holds
    for choice in _ladder(target.world):
        fit = _fit_on_accelerators(target, trained, frozen, choice, seq_len, seqs_per_sample, cap, extra_per_sample)
        if fit is None:
            continue
        host_bytes = host_bytes_per_node(trained, frozen, choice, target.nodes)
        if host_bytes <= _host_budget(target.hardware):
            return fit
        host_bound.append(choice)
    raise _not_fitting(target, trained, frozen, what, models, host_bound)


def _not_fitting(target: Target, trained: list[ModelSize], frozen: list[ModelSize], what: str,
                 models: tuple[Model, ...], host_bound: list[MemoryChoice]) -> UserError:
    """The refusal of a step no choice fits, naming the limit: host memory where some choice fits the accelerators
    (more of it would do), else the accelerators' memory (more host memory would not help)."""
    hardware = target.hardware
    total = sum(m.parameters for m in trained + frozen) / 1e9
    accelerators = f"{target.world} accelerator(s) of {_accelerator_bytes(hardware) / GIB:.0f} GiB"
    smaller = f"a smaller {' or '.join(model.value for model in models)} model, or leave {what} out (--step)"
    if not host_bound:
        return UserError(
            f"{what}: {total:.1f}B parameters do not fit the memory of {accelerators}, even with ZeRO-3, offload and "
            f"LoRA (more host memory would not help); use more GPUs (--deployment-type single_node, or multi_node "
            f"with a --hostfile), {smaller}")
    needed = min(host_bytes_per_node(trained, frozen, choice, target.nodes) for choice in host_bound)
    node, machine = ("each node's", "nodes") if target.nodes > 1 else ("this machine's", "a machine")
    return UserError(
        f"{what}: {total:.1f}B parameters fit {accelerators} only with offload, which puts {needed / GIB:.1f} GiB in "
        f"host memory, more than {_HOST_OFFLOAD_SHARE:.0%} of {node} {hardware.cpu_memory_gib:.0f} GiB "
        f"({_host_budget(hardware) / GIB:.1f} GiB); use {machine} with {math.ceil(needed / _HOST_OFFLOAD_SHARE / GIB)} "
        f"GiB of memory or more, more GPUs (ZeRO-3 across them may need no offload) or nodes (each holds its share: "
        f"--deployment-type multi_node with a --hostfile), {smaller}")


def fit_length(wanted: int, *sizes: ModelSize) -> int:
    """`wanted` tokens, or fewer when a model takes no more positions."""
    limits = [size.max_positions for size in sizes if size.max_positions]
    return min([wanted, *limits])


def fit_prompt_and_answer(prompt: int, answer: int, *sizes: ModelSize) -> tuple[int, int]:
    """Step 3's prompt and answer lengths, shrunk in proportion when their sum exceeds a model's positions."""
    total = fit_length(prompt + answer, *sizes)
    if total == prompt + answer:
        return prompt, answer
    fitted_prompt = max(1, total * prompt // (prompt + answer))
    return fitted_prompt, total - fitted_prompt


def _global_batch(target_global: int, micro: int, world: int) -> tuple[int, int]:
    """The micro-batch (at most `micro`, what fits memory) and accumulation whose global batch over `world` ranks
    comes closest to `target_global` samples without passing it (the largest micro-batch among equals). Where the
    ranks outnumber `target_global`, each still takes one sample: the global batch is `world`, past the target."""
    def samples(candidate: int) -> tuple[int, int]:
        return candidate * world * (target_global // (candidate * world)), candidate

    chosen = max(range(1, max(1, min(micro, target_global // world)) + 1), key=samples)
    return chosen, max(1, target_global // (chosen * world))


_SEQ_LEN = 512
_PROMPT_LEN = 256
_ANSWER_LEN = 256


# --------------------------------------------------------------------------- CPU quick run


@dataclass(frozen=True)
class CpuQuickRun:
    """Time budget, shapes and learning rates of the `cpu` deployment's quick run.

    Step times are measured seconds per optimizer step of SmolLM2-135M in bf16 on 2 cores (alone on
    the machine), scaled linearly with the trained parameters, with 2 / cores, and by
    `fp32_slowdown` where the CPU has no native bf16: step 1 8.6 s (8 x 256 tokens); step 2 ~9 s
    (8 pairs at 192 tokens: 6.2 s for 4 pairs at 256, scaled by the padded tokens); a PPO step ~10 s
    (4 prompts, 48 new tokens; ~20 s at 8). On a 2-core AVX2-only CPU (fp32) the same steps took
    21-23 s, 19-23 s and ~30 s, and a run planned with 2x overshot 30 minutes: hence 2.5.
    `step_overhead_s` covers loading, tokenising, the evaluations before and after, and saving.

    Step 2's settings come from sweeps of this recipe on the embedded pairs (bf16, batch 8, cosine
    with 10% warm-up): held-out accuracy grows with the pairs seen (~0.75 after 300; after 640,
    0.66-0.97 depending on the data order, mostly 0.85-0.95), and 2e-4 did better than 5e-5, 1e-4 and
    5e-4; so step 2 gets the largest share of the budget. Its `max_seq_len` 192 holds step 3's
    prompt + answer (128 + 48), the texts the reward model scores there.

    Step 3's actor learning rate 3e-5 comes from a 60-step run on the step-1/step-2 models of the
    quick run: the held-out reward-model score rose 0.583 -> 0.624 in 45 steps with KL to the
    reference below 0.7; an earlier quick run at 1e-5 ended its 36 steps below where it began
    (0.583 -> 0.535).

    On the embedded task (a built-in verifier, `Workload.verifiable_task`) step 3 answers 32 prompts x
    samples a step with short prompts and answers (64 / 32 tokens): GRPO took 9.4-9.9 s a step (0.3 s an
    answer), PPO with its critic 16.1 s (the 1.5 factor), at actor lr 1e-5 (bench/algorithms.py: 2e-5
    on a near-deterministic step-1 model moved it away from its reward). DPO (step 4) pairs are step 2's;
    a step of 8 pairs took 8.3 s at 192 tokens (embedded) and 11-13 s at 256 (hh-rlhf), policy and
    reference on both answers; it is planned at 13 s, so the step ends early rather than late, and 5e-6
    is the learning rate bench/dpo.py uses.
    """

    step_budget_s: tuple[float, ...] = (200.0, 810.0, 480.0, 600.0)  # steps 1, 2, 3 and 4 (DPO)
    step_overhead_s: tuple[float, ...] = (50.0, 75.0, 120.0, 90.0)
    reference_params: float = 135e6
    reference_cores: int = 2
    fp32_slowdown: float = 2.5
    sft_step_s: float = 8.6
    reward_step_s: float = 9.2
    ppo_step_s: float = 10.0
    sft_max_seq_len: int = 256
    reward_max_seq_len: int = 192
    sft_batch: int = 8
    reward_batch: int = 8
    sft_learning_rate: float = 3e-5
    reward_learning_rate: float = 2e-4
    warmup_fraction: float = 0.1
    sft_eval_samples: int = 32
    reward_eval_samples: int = 64
    max_prompt_seq_len: int = 128
    max_answer_seq_len: int = 48
    ppo_batch: int = 4
    ppo_actor_learning_rate: float = 3e-5
    critic_free_step_share: float = 0.6
    task_rows_per_step: int = 32
    task_training_batch: int = 16
    task_answer_s: float = 0.3
    task_critic_factor: float = 1.5
    task_max_prompt_seq_len: int = 64
    task_max_answer_seq_len: int = 32
    task_actor_learning_rate: float = 1e-5
    task_eval_samples: int = 80
    dpo_step_s: float = 13.0
    dpo_batch: int = 8
    dpo_max_seq_len: int = 192
    dpo_learning_rate: float = 5e-6
    min_steps: int = 4
    max_steps: int = 500

    def steps_within(self, step: int, seconds_per_step: float) -> int:
        usable = self.step_budget_s[step - 1] - self.step_overhead_s[step - 1]
        return max(self.min_steps, min(self.max_steps, int(usable / seconds_per_step)))


# --------------------------------------------------------------------------- what the planners size for


@dataclass(frozen=True)
class Target:
    """The machine a deployment runs the steps on, as each step's planner sees it.

    `quick` is the `cpu` deployment's quick run: set, the planners size a run by time on this CPU;
    None (GPU deployments), by accelerator memory.
    """

    hardware: Hardware
    world: int
    nodes: int
    dtype: str
    quick: CpuQuickRun | None = None
    # the models whose offload each step's host need counts, by step number, filled as it is planned
    host_models: dict[int, tuple[HostModel | HostEMA, ...]] = field(default_factory=dict, compare=False)

    def cpu_cost(self, size: ModelSize) -> float:
        """A quick-run step's time for a model of `size`, relative to the reference model on the reference cores."""
        assert self.quick is not None, "only the cpu deployment has a quick run"
        quick, hardware = self.quick, self.hardware
        slowdown = (quick.reference_cores / hardware.cpu_cores) * (1.0 if hardware.bf16 else quick.fp32_slowdown)
        return size.parameters / quick.reference_params * slowdown


def gpu_target(deployment: DeploymentType, hardware: Hardware, hosts: list[Host] | None) -> tuple[Target, list[str]]:
    """single_gpu, single_node and multi_node (nodes assumed alike to this one), with notes for the table."""
    if deployment is DeploymentType.MULTI_NODE:
        assert hosts, "multi_node needs the validated hostfile"
        world, nodes = sum(h.slots for h in hosts), len(hosts)
    else:
        world, nodes = (1 if deployment is DeploymentType.SINGLE_GPU else max(1, hardware.num_gpus)), 1
    # planned where no GPU is (a login node): each step's processes take their own GPU's precision (bf16, else fp16)
    dtype = ("bf16" if hardware.bf16 else "fp16") if hardware.num_gpus else "auto"
    notes = []
    if hardware.num_gpus == 0:
        notes.append("no GPU found here: sizes assume accelerators with this machine's RAM, precision as each GPU "
                     "allows (--dtype auto)")
    elif deployment is DeploymentType.MULTI_NODE:
        notes.append(f"{nodes} nodes, {world} GPUs; each assumed like this one ({hardware.gpu_memory_gib:.0f} GiB)")
    return Target(hardware, world, nodes, dtype), notes


def cpu_target(hardware: Hardware, quick: CpuQuickRun) -> tuple[Target, list[str]]:
    """The `cpu` deployment: one process in this one."""
    minutes = ", ".join(f"{budget / 60:.0f}" for budget in quick.step_budget_s)
    notes = [(f"quick run sized for {hardware.cpu_cores} CPU cores: about {minutes} min for steps 1, 2, 3 and 4 (DPO); "
              "pass --max_steps etc. to change")]
    return Target(hardware, 1, 1, "bf16" if hardware.bf16 else "fp32", quick), notes


# --------------------------------------------------------------------------- each step's planner


def _gpu_supervised(target: Target, fit: _Fit, shape: _SupervisedShape, seq_len: int,
                    size: ModelSize) -> SupervisedPlan:
    micro, accumulation = _global_batch(shape.global_batch, fit.micro_batch, target.world)
    return SupervisedPlan(
        zero_stage=fit.choice.zero_stage,
        offload=fit.choice.offload,
        lora_dim=_GPU_LORA_DIM if fit.choice.lora else 0,
        lora_module_name=size.blocks_name if fit.choice.lora else None,
        only_optimize_lora=fit.choice.lora,
        gradient_checkpointing=fit.checkpointing,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=fit.micro_batch,
        gradient_accumulation_steps=accumulation,
        max_seq_len=seq_len,
        dtype=target.dtype,
    )


def _quick_supervised(quick: CpuQuickRun, dtype: str, steps: int, batch: int, seq_len: int, learning_rate: float,
                      eval_samples: int) -> SupervisedPlan:
    return SupervisedPlan(
        zero_stage=0, offload=False, lora_dim=0, dtype=dtype, gradient_accumulation_steps=1,
        max_seq_len=seq_len, per_device_train_batch_size=batch, per_device_eval_batch_size=batch * 2,
        learning_rate=learning_rate, num_warmup_steps=max(1, int(steps * quick.warmup_fraction)),
        max_steps=steps, max_train_samples=steps * batch, max_eval_samples=eval_samples,
    )


@dataclass(frozen=True)
class _SupervisedShape:
    """What sizes a supervised step: the model it trains (and a frozen copy beside it, DPO's reference),
    the sequences per sample (2 for pairs), the micro-batch cap and the global batch on GPUs."""

    step: int
    what: str
    model: Model
    seqs_per_sample: int
    micro_batch_cap: int
    global_batch: int
    frozen_copy: bool = False


@dataclass(frozen=True)
class _QuickRecipe:
    """A supervised step's quick-run recipe (values of `CpuQuickRun`)."""

    step_s: float
    batch: int
    max_seq_len: int
    learning_rate: float
    eval_samples: int


def _plan_supervised(target: Target, size: ModelSize, shape: _SupervisedShape,
                     recipe: _QuickRecipe | None) -> SupervisedPlan:
    """The quick run's plan by time on this CPU (`recipe`, when the target has a quick run), else by memory."""
    quick = target.quick
    if quick is not None:
        steps = quick.steps_within(shape.step, recipe.step_s * target.cpu_cost(size))
        return _quick_supervised(quick, target.dtype, steps, recipe.batch, fit_length(recipe.max_seq_len, size),
                                 recipe.learning_rate, recipe.eval_samples)
    seq_len = fit_length(_SEQ_LEN, size)
    frozen_copy = (HostModel(size, frozen_offload="offload_reference_model"),) if shape.frozen_copy else ()  # DPO's
    fit = _fit_training(target, (HostModel(size), *frozen_copy), seq_len, shape.seqs_per_sample,
                        shape.micro_batch_cap, shape.step, shape.what, (shape.model,))
    return _gpu_supervised(target, fit, shape, seq_len, size)


def plan_sft(target: Target, sizes: ModelSizes, workload: Workload = Workload()) -> SupervisedPlan:
    """Step 1 trains the actor: one sequence a sample, 64 samples an optimizer step on GPUs."""
    quick = target.quick
    recipe = None if quick is None else _QuickRecipe(quick.sft_step_s, quick.sft_batch, quick.sft_max_seq_len,
                                                     quick.sft_learning_rate, quick.sft_eval_samples)
    return _plan_supervised(target, sizes.actor, _SupervisedShape(1, "step 1", Model.ACTOR, 1, 16, 64), recipe)


def plan_reward(target: Target, sizes: ModelSizes, workload: Workload = Workload()) -> SupervisedPlan:
    """Step 2 trains the reward model: two sequences (chosen, rejected) a sample, 32 pairs an optimizer step on GPUs."""
    quick = target.quick
    recipe = None if quick is None else _QuickRecipe(quick.reward_step_s, quick.reward_batch, quick.reward_max_seq_len,
                                                     quick.reward_learning_rate, quick.reward_eval_samples)
    return _plan_supervised(target, sizes.reward, _SupervisedShape(2, "step 2", Model.REWARD, 2, 8, 32), recipe)


def plan_rlhf(target: Target, sizes: ModelSizes, workload: Workload = Workload()) -> RLHFPlan:
    """Step 3 trains the actor (and a critic, if the algorithm has one) beside the frozen reference (and
    reward model, if one scores the answers); each prompt is answered `samples_per_prompt` times."""
    quick = target.quick
    samples = workload.samples_per_prompt
    critic_sizes = [sizes.reward] if workload.critic else []
    reward_sizes = [sizes.reward] if workload.reward_model else []
    if quick is not None and workload.verifiable_task:
        return _quick_task_rlhf(quick, target, sizes, workload)
    if quick is not None:
        prompt_len, answer_len = fit_prompt_and_answer(
            quick.max_prompt_seq_len, quick.max_answer_seq_len, sizes.actor, *reward_sizes)
        share = 1.0 if workload.critic else quick.critic_free_step_share
        step_s = quick.ppo_step_s * samples * share * (
            target.cpu_cost(sizes.actor) + target.cpu_cost(sizes.reward if workload.reward_model else sizes.actor)) / 2
        steps = quick.steps_within(3, step_s)
        return RLHFPlan(
            actor_zero_stage=0, critic_zero_stage=_critic_zero_stage(workload, 0), dtype=target.dtype,
            per_device_generation_batch_size=quick.ppo_batch, per_device_training_batch_size=quick.ppo_batch * samples,
            gradient_accumulation_steps=1, max_prompt_seq_len=prompt_len, max_answer_seq_len=answer_len,
            enable_hybrid_engine=True, actor_learning_rate=quick.ppo_actor_learning_rate,
            max_steps=steps, max_train_samples=steps * quick.ppo_batch,
        )
    prompt_len, answer_len = fit_prompt_and_answer(_PROMPT_LEN, _ANSWER_LEN, sizes.actor, *reward_sizes)
    rl_seq = prompt_len + answer_len
    kv_cache = 4 * rl_seq * sizes.actor.hidden_size * sizes.actor.num_layers
    models = (Model.ACTOR, Model.REWARD) if critic_sizes or reward_sizes else (Model.ACTOR,)
    actor = HostModel(sizes.actor, "actor_")
    roles = ("actor", *(["critic"] if critic_sizes else []), "reference", *(["reward"] if reward_sizes else []))
    held = (actor, *(HostModel(size, "critic_") for size in critic_sizes),
            HostModel(sizes.actor, frozen_offload="offload_reference_model"),
            *(HostModel(size, frozen_offload="offload_reward_model") for size in reward_sizes))
    fit = _fit_training(target, held, rl_seq, 1, 16, 3, "step 3", models, extra_per_sample=kv_cache,
                        unplanned=(HostEMA(actor, roles=roles),))
    lora_dim = _GPU_LORA_DIM if fit.choice.lora else 0
    critic_blocks = (sizes.reward if workload.reward_model else sizes.actor).blocks_name  # what the critic starts from
    # the critic's flags only for a critic, which a critic-free step 3 refuses as doing nothing
    critic = {"critic_offload": fit.choice.offload, "critic_lora_dim": lora_dim,
              "critic_lora_module_name": critic_blocks if lora_dim else None,
              "critic_only_optimize_lora": fit.choice.lora,
              "critic_gradient_checkpointing": fit.checkpointing} if workload.critic else {}
    return RLHFPlan(
        actor_zero_stage=fit.choice.zero_stage,
        critic_zero_stage=_critic_zero_stage(workload, fit.choice.zero_stage),
        actor_offload=fit.choice.offload,
        offload_reference_model=fit.choice.offload,
        offload_reward_model=fit.choice.offload if workload.reward_model else None,
        actor_lora_dim=lora_dim,
        actor_lora_module_name=sizes.actor.blocks_name if lora_dim else None,
        actor_only_optimize_lora=fit.choice.lora,
        actor_gradient_checkpointing=fit.checkpointing,
        **critic,
        per_device_generation_batch_size=max(1, fit.micro_batch // samples),
        per_device_training_batch_size=fit.micro_batch,
        gradient_accumulation_steps=1,
        max_prompt_seq_len=prompt_len,
        max_answer_seq_len=answer_len,
        enable_hybrid_engine=True,
        dtype=target.dtype,
    )


def _critic_zero_stage(workload: Workload, stage: int) -> int | None:
    """Step 3's --critic_zero_stage: the critic's stage, and the reward model's (ZeRO-3 at 3, as DeepSpeed-Chat's);
    not planned for a run with neither, where step 3 refuses it as a flag that does nothing."""
    return stage if workload.critic or workload.reward_model else None


def _quick_task_rlhf(quick: CpuQuickRun, target: Target, sizes: ModelSizes, workload: Workload) -> RLHFPlan:
    """Step 3 of the quick run on the embedded verifiable task: `task_rows_per_step` answers a step (prompts x
    samples per prompt), steps sized from the measured time per answer (GRPO, 32 answers a step: 9.4 s)."""
    prompts = max(1, quick.task_rows_per_step // workload.samples_per_prompt)
    rows = prompts * workload.samples_per_prompt
    step_s = rows * quick.task_answer_s * (quick.task_critic_factor if workload.critic else 1.0)
    steps = quick.steps_within(3, step_s * target.cpu_cost(sizes.actor))
    prompt_len, answer_len = fit_prompt_and_answer(quick.task_max_prompt_seq_len, quick.task_max_answer_seq_len,
                                                   sizes.actor)
    return RLHFPlan(
        actor_zero_stage=0, critic_zero_stage=_critic_zero_stage(workload, 0), dtype=target.dtype,
        per_device_generation_batch_size=prompts,
        per_device_training_batch_size=min(rows, quick.task_training_batch), gradient_accumulation_steps=1,
        max_prompt_seq_len=prompt_len, max_answer_seq_len=answer_len, enable_hybrid_engine=True,
        actor_learning_rate=quick.task_actor_learning_rate, max_steps=steps, max_train_samples=steps * prompts,
        eval_samples=quick.task_eval_samples,
    )


def plan_dpo(target: Target, sizes: ModelSizes, workload: Workload = Workload()) -> DPOPlan:
    """DPO trains the actor on pairs (two sequences a sample) beside its frozen reference, 32 pairs an optimizer
    step on GPUs; on GPUs the reference is offloaded with the actor, as the memory model holds it."""
    quick = target.quick
    recipe = None if quick is None else _QuickRecipe(quick.dpo_step_s, quick.dpo_batch, quick.dpo_max_seq_len,
                                                     quick.dpo_learning_rate, quick.reward_eval_samples)
    shape = _SupervisedShape(DPO_STEP, "DPO", Model.ACTOR, 2, 8, 32, frozen_copy=True)
    plan = _plan_supervised(target, sizes.actor, shape, recipe)
    return DPOPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)},
                   offload_reference_model=plan.offload if quick is None else None)
