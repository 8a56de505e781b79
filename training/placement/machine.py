"""The machine a placement is planned for: per-rank rates and capacities, from a hardware file or a calibration.

A hardware file (YAML or JSON) states datasheet peaks; the achieved rates the cost model needs are the peaks times
efficiency factors (each optional in the file, defaults below). Presets for published clusters live in
`machines/` and are named by their file stem (`--hardware_file a100-80gb`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from training.placement.workload import DTYPE_BYTES
from utils.errors import UserError

PRESET_DIR = Path(__file__).resolve().parent / "machines"


@dataclass(frozen=True)
class MachineSpec:
    """Achieved rates per device (GPU) or per rank (CPU: one process with its share of the cores).

    `decode_step_overhead_s` is per decoder layer per generated-token step: the launch and Python cost of one
    layer that a small decode batch cannot hide (a step of an L-layer model pays L of it).
    `call_overhead_s` is per model call (a forward, or a backward), besides its layers' work.
    `backward_flops` is the rate of a backward's matmuls (input and weight gradients), which on a CPU differs
    from the forward's; `attention_flops` / `attention_backward_flops` are the attention kernel's (its FLOPs
    counted over the full square). `forward_elementwise_s` / `backward_elementwise_s` are a pass's seconds per
    token per hidden unit per layer beyond its matmuls and attention (norms, activations, residual adds).
    `optimizer_s_per_param` is one optimizer step per trained parameter, mixed-precision master copies included.
    `reduce_efficiency` is a gradient all-reduce's bandwidth over the link's (a CPU sums and copies with its cores).
    `copy_bandwidth` is the bytes read plus written per second of a large tensor copy (gradient flattening, the
    inference copy), slower on a CPU than `memory_bandwidth`'s weight streaming.
    `sampling_s_per_logit` is a decode step's cost per row per vocabulary entry of drawing the next token and its
    log-probability (softmax, sampling, log-softmax over the vocabulary).
    `call_time_factors` (call kind -> factor) and `step_overhead_s` come from a calibration's profiled real step
    (`step_profile`): each kind of call's time inside a step over its estimate from the other constants, and the
    step's time outside its calls; a hardware file has neither (factors of 1, no overhead).
    `others_busy_cores` is a calibration's: the cores other processes kept busy while it measured, which slow every
    rate it took (None: a hardware file, or a calibration saved before it was recorded).
    """

    name: str
    nodes: int
    devices_per_node: int
    memory_gib: float
    matmul_flops: float
    memory_bandwidth: float
    copy_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    collective_latency_s: float
    call_overhead_s: float
    decode_step_overhead_s: float
    baseline_memory_gib: float
    backward_flops: float
    attention_flops: float
    attention_backward_flops: float
    forward_elementwise_s: float
    backward_elementwise_s: float
    optimizer_s_per_param: float
    reduce_efficiency: float
    sampling_s_per_logit: float
    usable_memory_fraction: float = 0.92  # allocator fragmentation and workspace leave the rest unusable
    call_time_factors: dict[str, float] = field(default_factory=dict)
    step_overhead_s: float = 0.0
    others_busy_cores: float | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_gib(self) -> float:
        return self.memory_gib * self.usable_memory_fraction

    def in_step(self, kind: str, seconds: float) -> float:
        """A call of `kind` estimated at `seconds` from the rates, as long as it runs inside a step."""
        return seconds * self.call_time_factors.get(kind, 1.0)

    def link_bandwidth(self, ranks: tuple[int, ...] | list[int]) -> float:
        """Bytes/s per rank of a collective over `ranks` (node-major numbering): NVLink-class inside one node,
        the network once the group spans nodes."""
        nodes = {rank // self.devices_per_node for rank in ranks}
        return self.intra_node_bandwidth if len(nodes) <= 1 else self.inter_node_bandwidth


# Efficiencies applied to a hardware file's datasheet peaks. Large bf16 GEMMs reach ~70% of the dense peak, but
# transformer layers at RLHF shapes (short micro-batches, attention, norms) sit nearer 50%; HBM streaming reaches
# ~80% of its peak; NCCL's bus bandwidth on NVLink / InfiniBand ~75-80%.
FILE_DEFAULTS: dict[str, float] = {
    "matmul_efficiency": 0.5,
    "memory_efficiency": 0.8,
    "link_efficiency": 0.75,
    "collective_latency_s": 30e-6,  # NCCL all-reduce latency at small sizes, 8-64 GPUs
    "call_overhead_s": 2e-3,  # a Hugging Face model call's Python and launch cost
    "decode_step_overhead_s": 30e-6,  # one decoder layer's kernel launches at batch ~8-64, no CUDA graph
    "baseline_memory_gib": 1.5,  # CUDA context + NCCL buffers + allocator slack
    "backward_efficiency": 0.5,  # the backward's matmuls, of the dense peak (as the forward's)
    "elementwise_passes": 12,  # a layer's non-matmul reads and writes of its [tokens x hidden] activations
    "optimizer_bytes_per_param": 40,  # AdamW's fp32 state (28 B) and the mixed-precision master copies
    "reduce_efficiency": 1.0,  # NCCL sums on the GPU at the link's speed
    "sampling_bytes_per_logit": 40,  # softmax, sampling and log-softmax: ~10 passes over fp32 logits
    "usable_memory_fraction": 0.92,
}
# the factors that are shares of a peak: one above 1 would plan a rate above the peak (or more memory than there is)
FRACTION_KEYS = ("matmul_efficiency", "memory_efficiency", "link_efficiency", "backward_efficiency",
                 "reduce_efficiency", "usable_memory_fraction")
REQUIRED_KEYS = ("nodes", "gpus_per_node", "memory_gib", "peak_flops", "memory_bandwidth",
                 "intra_node_bandwidth", "inter_node_bandwidth")
OPTIONAL_KEYS = ("name", "description", *FILE_DEFAULTS)


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def resolve_machine_file(name_or_path: str) -> Path:
    """A path to a hardware file, or the name of a preset in `machines/`."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if preset.is_file():
        return preset
    raise UserError(f"--hardware_file {name_or_path}: no such file, nor a preset; the presets are "
                    f"{', '.join(preset_names())}, or give the path of a YAML/JSON file with "
                    f"{', '.join(REQUIRED_KEYS)}")


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as error:  # json.JSONDecodeError and yaml.YAMLError's parse errors
        raise UserError(f"hardware file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {error}") from None
    if not isinstance(data, dict):
        raise UserError(f"hardware file {path} must hold a mapping of keys to numbers, e.g. nodes: 1")
    return data


def _positive(path: Path, key: str, value: Any) -> float:
    """A positive, finite number; YAML reads `2.0e12` (no exponent sign) as text, so numeric text counts too (an
    infinite rate or memory would plan every call as free)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UserError(f"hardware file {path}: {key} must be a positive, finite number, got {value!r}")
    return float(value)


def _peak_flops(path: Path, value: Any, dtype: str) -> float:
    """`peak_flops` is one number, or one per dtype ({bf16: 312e12, fp32: 19.5e12})."""
    if isinstance(value, Mapping):
        if dtype not in value:
            raise UserError(f"hardware file {path}: peak_flops names {', '.join(map(str, value))} but not {dtype}, "
                            "the dtype planned for; add it")
        return _positive(path, f"peak_flops.{dtype}", value[dtype])
    return _positive(path, "peak_flops", value)


def _check_fractions(path: Path, value: Mapping[str, float]) -> None:
    """Refuse a share of a peak (`FRACTION_KEYS`) above 1: two were capped at 1 without a word, and the others planned
    rates above the datasheet's."""
    over = [key for key in FRACTION_KEYS if value[key] > 1.0]
    if over:
        raise UserError(f"hardware file {path}: {', '.join(f'{key} {value[key]:g}' for key in over)} above 1; each "
                        "is the share of a peak a run reaches, at most 1: give the measured share (e.g. 0.5 of the "
                        "dense FLOP/s), or raise the peak itself where the datasheet's is too low")


def machine_from_mapping(data: Mapping[str, Any], path: Path, dtype: str = "bf16") -> MachineSpec:
    unknown = sorted(set(data) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise UserError(f"hardware file {path}: unknown key(s) {', '.join(unknown)}; the keys are "
                        f"{', '.join(REQUIRED_KEYS)} and optionally {', '.join(OPTIONAL_KEYS)}")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise UserError(f"hardware file {path} lacks {', '.join(missing)}")
    value = {key: _positive(path, key, data[key]) for key in REQUIRED_KEYS if key != "peak_flops"}
    value |= {key: _positive(path, key, data.get(key, default)) for key, default in FILE_DEFAULTS.items()}
    for key in ("nodes", "gpus_per_node"):
        if value[key] != int(value[key]):
            raise UserError(f"hardware file {path}: {key} must be a whole number, got {data[key]!r}")
    _check_fractions(path, value)
    link, bandwidth = value["link_efficiency"], value["memory_bandwidth"] * value["memory_efficiency"]
    elementwise_s = value["elementwise_passes"] * DTYPE_BYTES.get(dtype, 2) / bandwidth
    return MachineSpec(
        name=str(data.get("name", path.stem)), nodes=int(value["nodes"]), devices_per_node=int(value["gpus_per_node"]),
        memory_gib=value["memory_gib"],
        matmul_flops=_peak_flops(path, data["peak_flops"], dtype) * value["matmul_efficiency"],
        memory_bandwidth=bandwidth, copy_bandwidth=bandwidth,
        intra_node_bandwidth=value["intra_node_bandwidth"] * link,
        inter_node_bandwidth=value["inter_node_bandwidth"] * link,
        collective_latency_s=value["collective_latency_s"], call_overhead_s=value["call_overhead_s"],
        decode_step_overhead_s=value["decode_step_overhead_s"], baseline_memory_gib=value["baseline_memory_gib"],
        backward_flops=_peak_flops(path, data["peak_flops"], dtype) * value["backward_efficiency"],
        attention_flops=_peak_flops(path, data["peak_flops"], dtype) * value["matmul_efficiency"],
        attention_backward_flops=_peak_flops(path, data["peak_flops"], dtype) * value["backward_efficiency"],
        forward_elementwise_s=elementwise_s, backward_elementwise_s=2 * elementwise_s,
        optimizer_s_per_param=value["optimizer_bytes_per_param"] / bandwidth,
        reduce_efficiency=value["reduce_efficiency"],
        sampling_s_per_logit=value["sampling_bytes_per_logit"] / bandwidth,
        usable_memory_fraction=value["usable_memory_fraction"])


def load_machine_file(path: str | Path, dtype: str = "bf16") -> MachineSpec:
    """Read a hardware file (or a preset's name) into the rates the cost model uses, for `dtype`."""
    resolved = resolve_machine_file(str(path))
    return machine_from_mapping(_read(resolved), resolved, dtype)


def check_gpus_per_node(hardware_file: str, node_sizes: Iterable[int], given: str, instead: str) -> None:
    """Step 3's --placement auto plans the run's ranks laid out in nodes as `hardware_file` describes them: which ranks
    share a node's links, how far tensor parallelism reaches. Refuse a file whose GPUs per node are not the run's nodes'
    (`node_sizes`, as `given` says them: "the hostfile gives its nodes ... slots"): it would plan for another machine
    than the run's, unsaid. `instead`: the other way out, with `{per_node}` for the file's GPUs per node."""
    per_node = load_machine_file(hardware_file).devices_per_node
    sizes = sorted({size for size in node_sizes if size != per_node})
    if sizes:
        raise UserError(
            f"--hardware_file {hardware_file} describes nodes of {per_node} GPUs, but "
            f"{given.format(sizes=', '.join(map(str, sizes)))}: --placement auto would plan step 3's collectives and "
            f"tensor parallelism for {per_node}-GPU nodes; give a hardware file of these nodes (a copy of it with "
            f"gpus_per_node: {sizes[0]}), or {instead.format(per_node=per_node)}")


def with_nodes(machine: MachineSpec, nodes: int) -> MachineSpec:
    """The same machine with another node count (a preset describes a node; a run may use several)."""
    values = {f.name: getattr(machine, f.name) for f in fields(machine)}
    return MachineSpec(**{**values, "nodes": nodes, "name": f"{machine.name} x{nodes}"})
