"""Roofline estimates of one PPO step under a placement: each model call's time and each rank's peak memory.

A forward takes max(dense FLOPs / matmul rate, weight bytes / memory bandwidth), plus attention's FLOPs at the
attention kernel's rate, plus its layers' non-matmul work (per token per hidden unit per layer: norms, activations,
residuals), plus a call overhead; a backward runs twice the FLOPs at the backward rates; an optimizer step costs a
measured time per trained parameter; collectives take latency + bytes / link bandwidth (a gradient all-reduce at
its measured share of it). Every rate is measured on the machine (`calibration`) or derived from a hardware file.
A calibrated machine also scales each kind of call by how much longer it took inside a profiled real step than
these terms say, and adds the step's time outside its calls (`MachineSpec.call_time_factors`, `step_overhead_s`).
The schedule is the one the runtime follows (see `estimate_step`).
Not modelled: gradient checkpointing, offload, early-finishing answers (every answer decodes `answer_len` tokens),
and the causal mask's saving in attention (attention FLOPs are counted over the full square).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from training.core.ds_config import runs_gradient_allreduce
from training.pipeline.hardware import GIB, ModelSize, lora_trainable_parameters
from training.placement.machine import MachineSpec
from training.placement.spec import Placement
from training.placement.workload import Step3Workload

EXPERIENCE_TENSORS = 8  # per-token tensors an experience row carries (sequence, mask, log-probs, values, ...)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al.: ~34*s*h bytes per layer at 2-byte activations
LM_HEAD_ROLES = ("actor", "reference", "rollout")  # their forward makes vocabulary logits; critic/reward a value
# byte passes at the copy bandwidth (which counts the bytes read and the bytes written)
GRADIENT_REDUCE_PASSES = 6  # flatten, average and copy back: each reads and writes the gradients
INFERENCE_COPY_PASSES = 4  # the hybrid engine reads and writes the weights to copy them, then again to reorder them


def gradient_accumulate_bytes(dtype_bytes: int) -> int:
    """Bytes a backward moves per trained parameter besides its matmuls: autograd writes the gradient; under
    mixed precision DeepSpeed's hook then reads it and adds it into the fp32 gradient buffer (reads and writes
    4 + 4 bytes) before the low-precision gradient is freed."""
    return dtype_bytes if dtype_bytes >= 4 else 2 * dtype_bytes + 8


@dataclass(frozen=True)
class Call:
    """One kind of model call or collective, as one member rank of `role` runs it `count` times a step."""

    phase: str
    role: str
    kind: str
    seconds: float
    flops: float
    bytes: float
    count: int

    @property
    def total_s(self) -> float:
        return self.seconds * self.count


def in_step_call(machine: MachineSpec, phase: str, role: str, kind: str, seconds: float, flops: float,
                 moved: float, count: int) -> Call:
    """A call estimated at `seconds` from the rates, as long as it runs inside a step on `machine` (its kind's
    calibrated factor applied; `MachineSpec.in_step`)."""
    return Call(phase, role, kind, machine.in_step(kind, seconds), flops, moved, count)


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    generation_s: float
    scoring_s: float  # scoring's time beyond generation's (all of it, unless pipelined behind generation)
    training_s: float
    sync_s: float
    exchange_s: float
    other_s: float  # the step's time outside its calls (the loop's own work), as the calibration measured it
    per_rank_memory_gib: tuple[float, ...]
    calls: tuple[Call, ...]

    @property
    def peak_memory_gib(self) -> float:
        return max(self.per_rank_memory_gib)

    @property
    def phases(self) -> dict[str, float]:
        return {"generation": self.generation_s, "scoring": self.scoring_s, "training": self.training_s,
                "sync": self.sync_s, "exchange": self.exchange_s, "other": self.other_s}


# --------------------------------------------------------------------------- the terms


def forward_flops(size: ModelSize, rows: int, seq: int) -> float:
    """Dense matmuls 2*params per token plus attention's two S x S products per layer (QK^T and AV)."""
    return 2.0 * size.parameters * rows * seq + attention_flops(size, rows, seq)


def attention_flops(size: ModelSize, rows: int, seq: int) -> float:
    return 4.0 * rows * seq * seq * size.hidden_size * size.num_layers


def pass_s(size: ModelSize, rows: int, seq: int, weights: float, machine: MachineSpec, backward: bool = False,
           head_positions: int | None = None) -> float:
    """A forward (or a backward: twice the FLOPs) over `rows` x `seq` tokens: the dense matmuls' roofline, the
    attention kernel at its own rate and the layers' non-matmul work; no call overhead. The vocabulary head runs
    on `head_positions` positions per row (all `seq` when None); a value model (`head_positions=0`) makes no
    vocabulary logits: its embedding is a lookup, not a matmul."""
    attention = attention_flops(size, rows, seq)
    dense = forward_flops(size, rows, seq) - attention
    if head_positions is not None:
        dense -= 2.0 * size.vocab_size * size.hidden_size * rows * (seq - head_positions)
    if backward:
        math_s = max(2 * dense / machine.backward_flops, 2 * weights / machine.memory_bandwidth) + \
            2 * attention / machine.attention_backward_flops
    else:
        math_s = roofline_s(dense, weights, machine) + attention / machine.attention_flops
    return math_s + elementwise_s(size, rows * seq, machine, backward)


def roofline_s(flops: float, nbytes: float, machine: MachineSpec) -> float:
    return max(flops / machine.matmul_flops, nbytes / machine.memory_bandwidth)


def collective_s(moved_bytes: float, ranks: tuple[int, ...], machine: MachineSpec) -> float:
    """Latency plus the bytes each rank sends over the group's slowest link; nothing on one rank."""
    if len(ranks) <= 1:
        return 0.0
    return machine.collective_latency_s + moved_bytes / machine.link_bandwidth(ranks)


def all_gather_s(full_bytes: float, ranks: tuple[int, ...], machine: MachineSpec) -> float:
    n = len(ranks)
    return collective_s(full_bytes * (n - 1) / n, ranks, machine)


def all_reduce_s(full_bytes: float, ranks: tuple[int, ...], machine: MachineSpec) -> float:
    """A ring all-reduce's 2 (n-1)/n of the bytes, at the link's bandwidth times the reduce efficiency."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    moved = 2.0 * full_bytes * (n - 1) / n
    return machine.collective_latency_s + moved / (machine.link_bandwidth(ranks) * machine.reduce_efficiency)


def gradient_reduce_s(gradient_bytes: float, ranks: tuple[int, ...], machine: MachineSpec) -> float:
    """DeepSpeed's ZeRO-0/1 gradient all-reduce: the gradients flattened into a buffer, all-reduced, averaged and
    copied back; at ZeRO-1 the copies happen on one rank too (ZeRO-0 skips the call there)."""
    copies = GRADIENT_REDUCE_PASSES * gradient_bytes / machine.copy_bandwidth
    return copies + all_reduce_s(gradient_bytes, ranks, machine)


def elementwise_s(size: ModelSize, tokens: int, machine: MachineSpec, backward: bool = False) -> float:
    """A pass's non-matmul work over `tokens` tokens of every layer."""
    per_unit = machine.backward_elementwise_s if backward else machine.forward_elementwise_s
    return per_unit * tokens * size.hidden_size * size.num_layers


def _trainable(workload: Step3Workload, role: str, size: ModelSize) -> float:
    """The parameters `role` (the actor or the critic) trains: its LoRA adapters alone where only they train, else
    every one."""
    lora_dim, lora_module_name = workload.lora_adapters(role)
    if lora_dim:
        return float(lora_trainable_parameters(size, lora_dim, lora_module_name))
    return float(size.parameters)


def _gradient_bytes(workload: Step3Workload, role: str) -> int:
    """Bytes per trained parameter of the gradient a step's all-reduce sums: `MasterWeightAdamW`'s fp32 sums
    (`Step3Workload.master_weights`), else the gradient in the model's dtype."""
    return 4 if workload.master_weights(role) else workload.dtype_bytes


def _stage(workload: Step3Workload, role: str) -> int:
    """A trained model's ZeRO stage; a frozen one is sharded (stage 3) exactly when its trained partner is."""
    stage = workload.actor_zero_stage if role in ("actor", "reference") else workload.critic_zero_stage
    return stage if role in ("actor", "critic") else (3 if stage == 3 else 0)


def _size(workload: Step3Workload, role: str) -> ModelSize:
    size = {"actor": workload.actor, "reference": workload.actor, "rollout": workload.actor,
            "critic": workload.critic, "reward": workload.reward}[role]
    assert size is not None, f"the workload has no {role}"
    return size


def _generation_tp(workload: Step3Workload) -> int:
    return workload.inference_tp if workload.hybrid_engine else 1


# --------------------------------------------------------------------------- calls


def forward_call(workload: Step3Workload, role: str, placement: Placement, machine: MachineSpec) -> Call:
    """One scoring forward over a chunk's rows (prompt + answer); ZeRO-3 gathers the weights for it."""
    size, rows, seq = _size(workload, role), workload.rows_per_chunk, workload.seq_len
    weights = size.parameters * workload.dtype_bytes
    flops = forward_flops(size, rows, seq)
    gather = all_gather_s(weights, placement.ranks[role], machine) if _stage(workload, role) == 3 else 0.0
    seconds = pass_s(size, rows, seq, weights, machine, head_positions=_head_positions(workload, role)) + \
        machine.call_overhead_s + gather
    return in_step_call(machine, "scoring", role, "forward", seconds, flops, weights, 1)


def generation_calls(workload: Step3Workload, placement: Placement, machine: MachineSpec) -> list[Call]:
    """A generation member's passes: with inference TP a group of `tp` ranks generates its members' chunks
    together (tp x the rows, 1/tp of the weights each); a pass is one prefill per prompt, then `answer_len` decode
    steps that each stream the rank's weights and read the KV cache."""
    role = placement.generation_role
    size, tp, b = workload.actor, _generation_tp(workload), workload.dtype_bytes
    members = placement.ranks[role]
    passes = placement.chunks_per_member(role)
    rows = tp * workload.rows_per_chunk
    weights = size.parameters * b / tp
    prefill_flops = forward_flops(size, tp * workload.prompts_per_rank, workload.prompt_len) / tp
    prefill_s = pass_s(size, tp * workload.prompts_per_rank, workload.prompt_len, weights * tp, machine) / tp + \
        machine.call_overhead_s
    prefill = in_step_call(machine, "generation", role, "prefill", prefill_s, prefill_flops, weights, passes)
    context = workload.prompt_len + workload.answer_len / 2  # the mean length attended over
    kv_bytes = rows * context * 2 * size.hidden_size * size.num_layers * b / tp
    step_flops = (2.0 * size.parameters * rows + 4.0 * rows * context * size.hidden_size * size.num_layers) / tp
    overhead = machine.decode_step_overhead_s * size.num_layers + \
        machine.sampling_s_per_logit * rows * size.vocab_size  # every rank of a TP group draws its rows' tokens
    if tp > 1:  # two all-reduces of the rows' hidden states per layer
        tp_group = members[:tp]
        overhead += 2 * size.num_layers * all_reduce_s(rows * size.hidden_size * b, tp_group, machine)
    stage3 = role == "actor" and workload.actor_zero_stage == 3 and len(members) > 1
    if stage3 and not workload.hybrid_engine:  # generate() through ZeRO-3 hooks gathers every layer every token
        overhead += all_gather_s(size.parameters * b, members, machine)
    decode = in_step_call(machine, "generation", role, "decode step",
                          roofline_s(step_flops, weights + kv_bytes, machine) + overhead, step_flops,
                          weights + kv_bytes, passes * workload.answer_len)
    calls = [prefill, decode]
    if workload.hybrid_engine:  # each pass builds an inference copy: weights copied, then reordered for the kernels
        copy_bytes = INFERENCE_COPY_PASSES * weights
        calls.insert(0, in_step_call(machine, "generation", role, "enter generate mode",
                                     copy_bytes / machine.copy_bandwidth, 0.0, copy_bytes, passes))
    if stage3 and workload.hybrid_engine:  # the hybrid engine gathers (its TP shard of) the weights once a step
        shard = size.parameters * b / tp
        calls.insert(0, in_step_call(machine, "generation", role, "gather weights",
                                     all_gather_s(shard, members, machine), 0.0, shard, 1))
    return calls


def training_calls(workload: Step3Workload, role: str, placement: Placement, machine: MachineSpec) -> list[Call]:
    """A member trains on its chunks: per PPO epoch, ceil(rows / micro) optimizer steps, each accumulating one
    micro-batch from each of its chunks (so the optimizer steps equal the co-located run's). A micro-batch is a
    forward, then a backward at twice its FLOPs (input and weight gradients) that also writes and accumulates
    every trained parameter's gradient."""
    size, b, members = _size(workload, role), workload.dtype_bytes, placement.ranks[role]
    n, stage, micro = len(members), _stage(workload, role), workload.train_micro_batch
    trainable = _trainable(workload, role, size)
    steps = workload.ppo_epochs * math.ceil(workload.rows_per_chunk / micro)
    micro_batches = steps * placement.chunks_per_member(role)
    flops, weights = forward_flops(size, micro, workload.seq_len), size.parameters * b
    head = _head_positions(workload, role)
    forward = pass_s(size, micro, workload.seq_len, weights, machine, head_positions=head) + machine.call_overhead_s
    backward = pass_s(size, micro, workload.seq_len, weights, machine, True, head) + machine.call_overhead_s + \
        trainable * gradient_accumulate_bytes(b) / machine.copy_bandwidth
    if stage == 3:  # weights gathered for the forward and again for the backward, gradients reduce-scattered
        forward += all_gather_s(weights, members, machine)
        backward += all_gather_s(weights, members, machine) + all_gather_s(trainable * b, members, machine)
    calls = [in_step_call(machine, "training", role, "train forward", forward, flops, weights, micro_batches),
             in_step_call(machine, "training", role, "backward", backward, 2 * flops, 2 * weights, micro_batches)]
    if stage < 3 and runs_gradient_allreduce(stage, len(members)):
        reduced = trainable * _gradient_bytes(workload, role)
        calls.append(in_step_call(machine, "training", role, "gradient all-reduce",
                                  gradient_reduce_s(reduced, members, machine), 0.0, 2 * reduced, steps))
    updated = trainable / (n if stage >= 1 else 1)
    calls.append(in_step_call(machine, "training", role, "optimizer step", updated * machine.optimizer_s_per_param,
                              0.0, updated * (2 * (12 + b)), steps))
    return calls


# --------------------------------------------------------------------------- memory


def _persistent_bytes(workload: Step3Workload, role: str, placement: Placement) -> float:
    size, b, n = _size(workload, role), workload.dtype_bytes, len(placement.ranks[role])
    stage = _stage(workload, role)
    if role == "rollout":
        return size.parameters * b / _generation_tp(workload)
    weights = size.parameters * b / (n if stage == 3 else 1)
    if role not in ("actor", "critic"):
        return weights
    trainable = _trainable(workload, role, size)
    optimizer = 12 if b < 4 else 8  # fp32 master + Adam's two moments; fp32 training keeps no master copy
    grads = trainable * _persistent_gradient_bytes(workload, role) / (n if stage >= 2 else 1)
    return weights + grads + trainable * optimizer / (n if stage >= 1 else 1)


def _persistent_gradient_bytes(workload: Step3Workload, role: str) -> int:
    """Gradient bytes held per trained parameter: `MasterWeightAdamW`'s fp32 sums alone (its hook releases each
    low-precision gradient once added); under DeepSpeed's mixed precision the low-precision gradient and the fp32
    master's; in fp32 the one gradient."""
    b = workload.dtype_bytes
    if workload.master_weights(role):
        return 4
    return b + (4 if b < 4 else 0)


def _inference_copy_bytes(workload: Step3Workload, placement: Placement) -> float:
    """The hybrid engine's inference copy of the actor (its tensor-parallel shard)."""
    if not workload.hybrid_engine or placement.generation_role != "actor":
        return 0.0
    return workload.actor.parameters * workload.dtype_bytes / _generation_tp(workload)


def _generation_bytes(workload: Step3Workload, placement: Placement) -> float:
    """The KV cache of a chunk (tp x rows, 1/tp of the heads), and the hybrid engine's inference copy unless it is
    kept (then it is held throughout: `rank_memory_gib`)."""
    size, b = workload.actor, workload.dtype_bytes
    kv = workload.rows_per_chunk * workload.seq_len * 2 * size.hidden_size * size.num_layers * b
    return kv + (0.0 if workload.keep_inference_copy else _inference_copy_bytes(workload, placement))


def _head_positions(workload: Step3Workload, role: str) -> int:
    """Positions per row a scoring or training forward of `role` computes vocabulary logits for: the answer's
    (and the one before it; `training.core.answer_window`), none for a value model."""
    return workload.answer_len + 1 if role in LM_HEAD_ROLES else 0


def _forward_bytes(workload: Step3Workload, role: str, rows: int) -> float:
    size = _size(workload, role)
    logits = rows * _head_positions(workload, role) * size.vocab_size * workload.dtype_bytes
    return logits + 4.0 * rows * workload.seq_len * size.hidden_size * workload.dtype_bytes


def _training_bytes(workload: Step3Workload, role: str) -> float:
    size, micro, seq = _size(workload, role), workload.train_micro_batch, workload.seq_len
    activations = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * micro * seq * size.hidden_size * size.num_layers
    return activations * workload.dtype_bytes / 2 + _forward_bytes(workload, role, micro)


def _optimizer_step_bytes(workload: Step3Workload, role: str, placement: Placement) -> float:
    """DeepSpeed's mixed precision: the optimizer step casts every gradient to fp32 before flattening them into the
    master's gradient buffer, so the casts and the buffer are alive together (the buffer is counted as persistent).
    `MasterWeightAdamW` steps on the fp32 sums it holds, casting nothing."""
    if workload.dtype_bytes >= 4 or workload.master_weights(role):
        return 0.0
    sharded = len(placement.ranks[role]) if _stage(workload, role) >= 2 else 1
    return _trainable(workload, role, _size(workload, role)) * 4 / sharded


def rank_memory_gib(workload: Step3Workload, placement: Placement, machine: MachineSpec, rank: int) -> float:
    """Baseline + every held model's persistent states + the largest phase's transient memory."""
    held = [role for role in placement.ranks if placement.holds(role, rank)]
    persistent = sum(_persistent_bytes(workload, role, placement) for role in held)
    transient = [0.0]
    scoring = [role for role in held if role != "rollout"]
    transient += [_forward_bytes(workload, role, workload.rows_per_chunk) for role in scoring]
    if placement.generation_role in held:
        if workload.keep_inference_copy:
            persistent += _inference_copy_bytes(workload, placement)
        # stage fusion scores a micro-batch of finished rows while the KV cache of the rows still decoding is alive
        rows = min(workload.stage_fusion_micro_batch, workload.rows_per_chunk)
        fused = max((_forward_bytes(workload, role, rows) for role in scoring), default=0.0) \
            if workload.stage_fusion else 0.0
        transient.append(_generation_bytes(workload, placement) + fused)
    transient += [max(_training_bytes(workload, role), _optimizer_step_bytes(workload, role, placement))
                  for role in held if role in ("actor", "critic")]
    return machine.baseline_memory_gib + (persistent + max(transient)) / GIB


def models_on(placement: Placement, rank: int) -> list[str]:
    return [role for role in placement.ranks if placement.holds(role, rank)]


# --------------------------------------------------------------------------- the schedule


def _scoring_end(workload: Step3Workload, placement: Placement, machine: MachineSpec,
                 pieces: list[tuple[float, int]], generating_until: float) -> tuple[float, list[Call]]:
    """Each rank runs the scoring calls of the (ready time, chunk) `pieces` it owns in the order they are ready,
    none before it is, and on a rank that generates, after its own generation. A call covers
    `workload.rows_per_chunk` rows."""
    calls = {role: forward_call(workload, role, placement, machine)
             for role in ("actor", "reference", "reward", "critic") if placement.has(role)}
    generating = placement.generation_role
    free = [generating_until if placement.holds(generating, rank) else 0.0 for rank in range(placement.world_size)]
    for ready, chunk in sorted(pieces):
        for role, call in calls.items():
            rank = placement.owner(role, chunk)
            free[rank] = max(free[rank], ready) + call.seconds
    per_chunk = len(pieces) // placement.world_size
    per_member = [replace(call, count=placement.chunks_per_member(call.role) * per_chunk) for call in calls.values()]
    return max(free), per_member


def _scoring_pieces(workload: Step3Workload, placement: Placement, start: float,
                    pass_s: float) -> tuple[Step3Workload, list[tuple[float, int]]]:
    """What scoring calls cover and when each is ready: a whole chunk once every chunk is generated; with stage
    fusion, micro-batches of `stage_fusion_micro_batch` rows, the answers taken to end evenly over their
    chunk's pass (each generation member's chunks one after another from `start`)."""
    role = placement.generation_role
    if not workload.stage_fusion:
        end = start + pass_s * placement.chunks_per_member(role)
        return workload, [(end, chunk) for chunk in range(placement.world_size)]
    rows = min(workload.stage_fusion_micro_batch, workload.rows_per_chunk)
    count = -(-workload.rows_per_chunk // rows)
    pieces = [(start + pass_s * (position + (index + 1) / count), chunk)
              for member in placement.ranks[role]
              for position, chunk in enumerate(placement.chunks(role, member))
              for index in range(count)]
    return replace(workload, prompts_per_rank=rows, samples_per_prompt=1), pieces


def _exchange_s(workload: Step3Workload, placement: Placement, machine: MachineSpec) -> float:
    """Two all-gathers of the experience rows over the world (after generation, after scoring) when the models
    are not all on every rank; none when co-located."""
    if placement.is_colocated:
        return 0.0
    chunk_bytes = workload.rows_per_chunk * workload.seq_len * EXPERIENCE_TENSORS * 4
    world = tuple(range(placement.world_size))
    return 2 * all_gather_s(chunk_bytes * placement.world_size, world, machine)


def _sync_s(workload: Step3Workload, placement: Placement, machine: MachineSpec) -> float:
    """Disaggregated only: the actor's new weights broadcast from its first rank to the rollout ranks (gathered
    first under ZeRO-3); the rollout ranks wait for them."""
    if not placement.has("rollout"):
        return 0.0
    weights = workload.actor.parameters * workload.dtype_bytes
    actor = placement.ranks["actor"]
    gather = all_gather_s(weights, actor, machine) if workload.actor_zero_stage == 3 else 0.0
    return gather + collective_s(weights, (actor[0], *placement.ranks["rollout"]), machine)


def estimate_step(workload: Step3Workload, placement: Placement, machine: MachineSpec) -> StepEstimate:
    """One PPO step: generation (each generation member's chunks one after another), scoring (per chunk: actor,
    reference, reward, critic forwards on their owners; ranks in parallel), the exchanges, training (actor and
    critic overlap when on disjoint ranks), then the weight sync of a disaggregated placement.

    Scoring starts once the whole generation has ended, or with stage fusion micro-batch by micro-batch as the
    answers end (`_scoring_pieces`); the work of every answer is counted at the length limit."""
    role = placement.generation_role
    generation = generation_calls(workload, placement, machine)
    gather = sum(call.total_s for call in generation if call.kind == "gather weights")
    pass_s = sum(call.seconds * (call.count // placement.chunks_per_member(role))
                 for call in generation if call.kind != "gather weights")
    generation_end = gather + pass_s * placement.chunks_per_member(role)
    scored, pieces = _scoring_pieces(workload, placement, gather, pass_s)
    scoring_end, scoring = _scoring_end(scored, placement, machine, pieces, generation_end)
    trained = {r: training_calls(workload, r, placement, machine) for r in ("actor", "critic") if placement.has(r)}
    times = [sum(call.total_s for call in calls) for calls in trained.values()]
    training_s = max(times) if placement.concurrent("actor", "critic") else sum(times)
    exchange_s, sync_s = _exchange_s(workload, placement, machine), _sync_s(workload, placement, machine)
    generation_s = generation_end
    scoring_s = max(0.0, scoring_end - generation_end)
    by_models: dict[tuple[str, ...], float] = {}  # a rank's memory depends only on the models it holds
    for rank in range(placement.world_size):
        held = tuple(models_on(placement, rank))
        if held not in by_models:
            by_models[held] = rank_memory_gib(workload, placement, machine, rank)
    memory = tuple(by_models[tuple(models_on(placement, rank))] for rank in range(placement.world_size))
    calls = tuple(generation + scoring + [call for calls in trained.values() for call in calls])
    other_s = machine.step_overhead_s
    return StepEstimate(generation_s + scoring_s + training_s + sync_s + exchange_s + other_s, generation_s,
                        scoring_s, training_s, sync_s, exchange_s, other_s, memory, calls)
