"""Step 3's placement flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from training.placement.spec import PLACEMENTS


@dataclass
class PlacementSettings:
    """Which ranks hold each model (see `training.placement.spec`), and what the planner knows of the machine."""

    placement: str = field(default="colocate", metadata={
        "choices": PLACEMENTS,
        "help": "colocate: every model on every rank, one call after another; interleave: reference and reward "
                "score on two halves at the same time; disaggregate: a shadow actor generates on its own half; "
                "auto: the planner's fastest plan that fits"})
    placement_ratio: str | None = field(default=None, metadata={
        "help": "per-model share of the ranks on top of --placement, e.g. 'reference=0.5,reward=0.5' or FlexRLHF's "
                "'[1,1,0.5,0.5]' (actor, critic, reference, reward[, rollout])"})
    hardware_file: str | None = field(default=None, metadata={
        "help": "YAML/JSON description of the machine to plan for (GPUs per node, nodes, memory, FLOP/s, memory and "
                "link bandwidth); default: this machine, with its calibrated constants"})
    calibrate: bool = field(default=False, metadata={
        "help": "measure this machine's constants (matmul FLOP/s, weight streaming, collectives) before planning, "
                "then profile a short real step 3 on random weights to correct each kind of call (about 90 s in "
                "all); saved and reused by later runs"})
    enable_stage_fusion: bool = field(default=False, metadata={
        "help": "score finished answers (reference, reward model, critic; the actor where its old log-probs are "
                "recomputed) in micro-batches while the rest of the batch still decodes (RLHFuse's stage fusion): "
                "between decode steps when co-located, on the scoring ranks at the same time under a placement; "
                "needs the hybrid engine"})
    stage_fusion_micro_batch_size: int = field(default=2, metadata={
        "help": "finished answers scored together under --enable_stage_fusion"})
    profile_calls: bool = field(default=False, metadata={
        "same_result": True,
        "help": "time every model call, the experience exchange and the weight broadcast on each rank and write "
                "them per PPO step to call_times.jsonl in the run folder (bench/placement.py --breakdown)"})
