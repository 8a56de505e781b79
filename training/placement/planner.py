"""Search placements x ZeRO stages x inference TP x micro-batch x stage fusion with the cost model; keep what fits,
fastest first."""
from __future__ import annotations

import io
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Iterable, Iterator

from utils.errors import UserError

from .cost_model import StepEstimate, estimate_step, models_on
from .machine import MachineSpec
from .spec import PRESETS, Placement, build_placement, ranks_text, zero3_on_part_of_the_ranks
from .workload import Step3Workload, ppo_micro_batches

ROLLOUT_SHARES = (0.0, 0.25, 0.5, 0.75)
# (reference, reward) shares of the ranks left beside the rollout: together, halves, quarter splits
SCORING_SPLITS = ((1.0, 1.0), (0.5, 0.5), (0.25, 0.75), (0.75, 0.25))
TRAINING_SPLITS = ((1.0, 1.0), (0.5, 0.5))  # (actor, critic): co-located, or FlexRLHF's Interleave2
MICRO_BATCHES = 4  # the largest few power-of-two divisors of a generation batch's rows (and its rows) tried


@dataclass(frozen=True)
class PlanChoice:
    """What a plan sets: the ranks' layout as a preset and shares, the ZeRO stages, inference TP, training
    micro-batch and stage fusion (what `--placement auto` applies, and keeps in its run folder)."""

    base: str  # the --placement preset the shares apply to
    shares: dict[str, float]
    actor_zero_stage: int
    critic_zero_stage: int
    inference_tp: int
    micro_batch: int
    stage_fusion: bool

    @property
    def flags(self) -> list[str]:
        """The step-3 flags this plan stands for."""
        ratio = ",".join(f"{role}={share:g}" for role, share in self.shares.items())
        return ["--placement", self.base, "--placement_ratio", ratio,
                "--actor_zero_stage", str(self.actor_zero_stage), "--critic_zero_stage", str(self.critic_zero_stage),
                "--inference_tp_size", str(self.inference_tp), "--per_device_training_batch_size", str(self.micro_batch),
                *(["--enable_stage_fusion"] if self.stage_fusion else [])]

    def choice(self) -> "PlanChoice":
        """The choice alone (a ranked plan's without its layout and estimate)."""
        return PlanChoice(**{f.name: getattr(self, f.name) for f in fields(PlanChoice)})


@dataclass(frozen=True)
class RankedPlan(PlanChoice):
    """One candidate: its choice, where that puts the models, and its predicted step."""

    placement: Placement
    estimate: StepEstimate


def candidate_shares(roles: Iterable[str]) -> Iterator[tuple[str, dict[str, float]]]:
    """(preset, shares) of every layout tried: rollout 0-3/4, actor/critic together or halved, reference/reward
    together, halved or quartered; shares of roles the run lacks are left out."""
    present = set(roles)
    for rollout in ROLLOUT_SHARES:
        left = 1.0 - rollout
        for actor, critic in TRAINING_SPLITS:
            for reference, reward in SCORING_SPLITS:
                shares = {"actor": actor * left, "critic": critic * left, "reference": reference * left,
                          "reward": reward * left, "rollout": rollout}
                base = "disaggregate" if rollout else "colocate"
                yield base, {role: share for role, share in shares.items() if role in present or role == "rollout"}


def _placements(world_size: int, roles: tuple[str, ...]) -> Iterator[tuple[str, dict[str, float], Placement]]:
    seen: set[tuple] = set()
    for base, shares in candidate_shares(roles):
        try:
            placement = build_placement(base, world_size, roles, shares)
        except UserError:
            continue  # a layout the rule refuses (fractional ranks, a share that leaves a model without one)
        key = tuple(sorted(placement.ranks.items()))
        if key not in seen:
            seen.add(key)
            yield base, shares, _named(placement, base, shares)


def _named(placement: Placement, base: str, shares: dict[str, float]) -> Placement:
    """The preset's own name when the shares are exactly a preset's."""
    for name, preset in PRESETS.items():
        if all(Fraction(preset[role]).limit_denominator(1000) == Fraction(share).limit_denominator(1000)
               for role, share in shares.items()):
            return replace(placement, name=name)
    return replace(placement, name=f"{base}+ratio")


def _micro_batches(rows: int, own: int) -> list[int]:
    """The training micro-batches tried: the largest few power-of-two divisors of a generation batch's `rows` (and
    the rows themselves), the run's `own` micro-batch and 1 (the ones most likely to make whole optimizer steps)."""
    divisors = [d for d in range(1, rows + 1) if rows % d == 0 and (d & (d - 1) == 0 or d == rows)]
    return sorted({*sorted(divisors)[-MICRO_BATCHES:], own, 1})


def whole_step_micro_batches(workload: Step3Workload) -> list[int]:
    """The micro-batches tried that make whole optimizer steps of the accumulation in a PPO step."""
    return [micro for micro in _micro_batches(workload.rows_per_generation_batch, workload.train_micro_batch)
            if workload.whole_optimizer_steps(micro)]


def _zero_stages(workload: Step3Workload, role: str, world_size: int) -> tuple[int, ...]:
    own = workload.actor_zero_stage if role == "actor" else workload.critic_zero_stage
    return zero_stages_tried(role in workload.optimizer_offloaded, own, world_size)


def zero_stages_tried(offloaded: bool, own_stage: int, world_size: int) -> tuple[int, ...]:
    """The ZeRO stages tried for a trained model whose optimizer state is `offloaded` or not: any on several ranks
    (one rank shards nothing: stage 0, or the run's `own_stage` where its optimizer state is offloaded), and never
    stage 0 with an offloaded optimizer."""
    if world_size == 1:
        return (own_stage,) if offloaded else (0,)
    return (1, 2, 3) if offloaded else (0, 1, 2, 3)


def _tp_sizes(workload: Step3Workload, machine: MachineSpec, generation_ranks: int) -> list[int]:
    if not workload.hybrid_engine:
        return [1]
    sizes, tp = [], 1
    while tp <= machine.devices_per_node and generation_ranks % tp == 0:
        sizes.append(tp)
        tp *= 2
    return sizes


def search(workload: Step3Workload, machine: MachineSpec, world_size: int,
           roles: Iterable[str] | None = None) -> list[RankedPlan]:
    """Every candidate plan whose peak memory fits every rank, fastest predicted step first (of two equally fast,
    the one without stage fusion). A workload that asks for stage fusion keeps it; otherwise plans with and
    without it are tried where it can run."""
    roles = tuple(roles or workload.roles())
    actor_stages = _zero_stages(workload, "actor", world_size)
    critic_stages = _zero_stages(workload, "critic", world_size) if "critic" in roles else (workload.critic_zero_stage,)
    fusion_choices = (True,) if workload.stage_fusion else (False, True)
    micro_batches = whole_step_micro_batches(workload)
    plans = []
    for base, shares, placement in _placements(world_size, roles):
        for tp in _tp_sizes(workload, machine, len(placement.ranks[placement.generation_role])):
            for micro in micro_batches:
                for actor_stage in actor_stages:
                    for critic_stage in critic_stages:
                        if not runnable(placement, actor_stage, critic_stage, tp, workload.offloaded):
                            continue
                        for fusion in fusion_choices:
                            if fusion and not fusion_runnable(workload, actor_stage, critic_stage, tp, world_size):
                                continue
                            planned = replace(workload, actor_zero_stage=actor_stage, critic_zero_stage=critic_stage,
                                              inference_tp=tp, train_micro_batch=micro, stage_fusion=fusion)
                            estimate = estimate_step(planned, placement, machine)
                            if estimate.peak_memory_gib <= machine.usable_memory_gib:
                                plans.append(RankedPlan(base, shares, actor_stage, critic_stage, tp, micro, fusion,
                                                        placement, estimate))
    return sorted(plans, key=lambda plan: plan.estimate.step_s)


def fusion_runnable(workload: Step3Workload, actor_stage: int, critic_stage: int, tp: int, world_size: int) -> bool:
    """Whether step 3 runs stage fusion with these settings (`stage_fusion_refusal`)."""
    return stage_fusion_refusal(workload.hybrid_engine, tp, actor_stage, critic_stage, workload.offloaded,
                                world_size) is None


def stage_fusion_refusal(hybrid_engine: bool, inference_tp: int, actor_stage: int, critic_stage: int,
                         offloaded: tuple[str, ...], world_size: int) -> str | None:
    """Why `--enable_stage_fusion` cannot run, or None: it needs the hybrid engine decoding alone (it hands over
    finished rows between steps), and no ZeRO-3 forward collective over several ranks (an offloaded frozen model
    is ZeRO-3), since each rank's answers finish at their own steps."""
    if not hybrid_engine:
        return ("--enable_stage_fusion scores answers as the hybrid engine finishes them; add --enable_hybrid_engine "
                "(plain generate() returns the whole batch at once)")
    if inference_tp > 1:
        return ("--enable_stage_fusion with --inference_tp_size > 1: tensor-parallel ranks decode their batches "
                "together and cannot score between steps; use one of the two")
    partitioned = [role for role, stage in (("actor", actor_stage), ("critic", critic_stage)) if stage == 3]
    partitioned += [f"offloaded {role} model" for role in offloaded]
    if partitioned and world_size > 1:
        return (f"--enable_stage_fusion with ZeRO-3 for the {' and '.join(partitioned)} on {world_size} ranks: a "
                "ZeRO-3 forward gathers weights with every rank, but each rank's answers finish at their own steps, "
                "so the ranks' scoring forwards would not meet; use ZeRO stage 2 or lower for them, or drop "
                "--enable_stage_fusion")
    return None


def runnable(placement: Placement, actor_stage: int, critic_stage: int, tp: int,
             offloaded: tuple[str, ...] = ()) -> bool:
    """What step 3 runs (`step3_rlhf.placement_setup.check_placement_args`): ZeRO-3 (and an offloaded frozen
    model, which is ZeRO-3) only where every model it partitions is on every rank, and inference tensor
    parallelism only co-located."""
    if zero3_on_part_of_the_ranks(placement, actor_stage, critic_stage, offloaded) is not None:
        return False
    return tp == 1 or placement.is_colocated


def check_fits(workload: Step3Workload, placement: Placement, machine: MachineSpec) -> None:
    """Raise one `UserError` for the first rank whose models do not fit, before anything loads."""
    estimate = estimate_step(workload, placement, machine)
    for rank, needed in enumerate(estimate.per_rank_memory_gib):
        if needed > machine.usable_memory_gib:
            models = ", ".join(models_on(placement, rank))
            raise UserError(
                f"a model that cannot fit: rank {rank} holds the {models} and needs {needed:.1f} GiB, but "
                f"{machine.name} has {machine.usable_memory_gib:.1f} GiB usable per rank ({machine.memory_gib:g} GiB); "
                f"{', '.join(_memory_advice(workload))}, or use LoRA")


def _memory_advice(workload: Step3Workload) -> list[str]:
    """What lowers a rank's memory, less raising the ZeRO stages where both are at 3 already."""
    zero = [] if workload.actor_zero_stage == workload.critic_zero_stage == 3 else \
        ["raise the ZeRO stages (--actor_zero_stage/--critic_zero_stage 3)"]
    return [*zero, "give the models more ranks (--placement_ratio)", "lower --per_device_generation_batch_size"]


def choose_placement(workload: Step3Workload, machine: MachineSpec, world_size: int,
                     roles: Iterable[str] | None = None) -> RankedPlan:
    """`--placement auto`: the fastest plan that fits; none fitting is the co-located ZeRO-3 plan's error (at the
    smallest micro-batch tried), or, where no micro-batch makes whole optimizer steps, that one."""
    plans = search(workload, machine, world_size, roles)
    if plans:
        return plans[0]
    micro_batches = whole_step_micro_batches(workload)
    if not micro_batches:
        raise _no_whole_optimizer_steps(workload)
    frugal = replace(workload, actor_zero_stage=3, critic_zero_stage=3, train_micro_batch=micro_batches[0])
    check_fits(frugal, build_placement("colocate", world_size, roles or workload.roles()), machine)
    raise UserError(f"no placement of step 3's models fits {ranks_text(world_size)} of {machine.name}; use more ranks")


def _no_whole_optimizer_steps(workload: Step3Workload) -> UserError:
    tried = _micro_batches(workload.rows_per_generation_batch, workload.train_micro_batch)
    counts = [ppo_micro_batches(workload.ppo_epochs, workload.generation_batches, workload.rows_per_generation_batch,
                                micro) for micro in tried]
    return UserError(f"no training micro-batch the planner tries ({', '.join(map(str, tried))} rows) makes whole "
                     f"optimizer steps of --gradient_accumulation_steps {workload.accumulation}: a PPO step then has "
                     f"{', '.join(map(str, counts))} micro-batches; use a --gradient_accumulation_steps that divides "
                     "one of those")


def _phase_split(estimate: StepEstimate) -> str:
    return " / ".join(f"{value:.2f}" for value in estimate.phases.values())


def format_plans(plans: list[RankedPlan], top: int = 10) -> str:
    """The best `top` plans as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step 3 placements, fastest first ({len(plans)} fit)")
    for column in ("#", "placement", "layout", "ZeRO a/c", "TP", "micro", "fusion", "step s",
                   "gen / score / train / sync / exch / other s", "peak GiB"):
        table.add_column(column, overflow="fold")
    for index, plan in enumerate(plans[:top], start=1):
        estimate = plan.estimate
        table.add_row(str(index), plan.placement.name, plan.placement.describe(),
                      f"{plan.actor_zero_stage}/{plan.critic_zero_stage}", str(plan.inference_tp),
                      str(plan.micro_batch), "yes" if plan.stage_fusion else "no", f"{estimate.step_s:.2f}",
                      _phase_split(estimate),
                      f"{estimate.peak_memory_gib:.1f}")
    buffer = io.StringIO()
    Console(file=buffer, width=160, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue()
