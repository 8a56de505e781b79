"""This machine's constants for the cost model, measured in a short profile and cached per host/dtype/threads/world.

Run with the torch threads one rank gets (a CPU run of R ranks on C cores: C // R each), so every rate is per rank;
the ranks measure at the same time (each rate is one rank's while every rank is busy, as in a co-located step).
A full calibration then runs a short real step 3 on the same ranks with every call timed (`step_profile`) and
records how much longer each kind of call takes there than the micro-benchmarks' constants estimate, and the
step's time outside its calls. `quick=True` is a profile of about ten seconds for a dry run with no saved
calibration: smaller shapes, fewer repetitions, the baseline memory read from this process, no profiled step; it is
not saved.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import psutil
import torch

from training.core.optim import uses_master_weights
from training.generation.cpu_linear import LinearWeight
from training.pipeline.hardware import GIB
from utils.cpu import cpu_model_name
from utils.paths import cache_root
from training.placement.machine import MachineSpec
from training.placement.microbench import (
    QUICK,
    REFERENCE,
    best_of,
    measure_decode_overheads,
    measure_layer,
    measure_optimizer_s_per_param,
)
from training.placement.spec import ranks_text

DECODE_ROWS = 4  # a small rollout batch
GRADIENT_NUMEL = 32 * 2**20  # the gradients all-reduced in the calibration: a small model's, past every cache
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# what a step-3 rank imports before it loads a model (torch, deepspeed, transformers' Llama, peft, datasets)
_BASELINE_SCRIPT = ("import os, torch, deepspeed, transformers, peft, datasets; "
                    "from transformers import LlamaForCausalLM; "
                    "print(os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]))")


def cache_dir() -> Path:
    """Under the project's one cache root (`utils.paths.cache_root`: `RLHF_CACHE_DIR` applies here too)."""
    return cache_root() / "calibration"


def cache_path(dtype: str, threads: int, world_size: int) -> Path:
    return cache_dir() / f"{socket.gethostname()}-{dtype}-t{threads}-w{world_size}.json"


def measure_streaming_bandwidth(dtype: torch.dtype, quick: bool) -> float:
    """Bytes/s of decode steps' products (a few rows against each weight, through the kernel the hybrid engine's
    decoder uses: oneDNN-packed where this CPU supports it) over a weight set several times the last-level cache."""
    size = torch.finfo(dtype).bits // 8
    total = (128 if quick else 512) * 2**20
    count = max(1, total // (2048 * 2048 * size))
    matrices = [LinearWeight(torch.randn(2048, 2048, dtype=dtype)) for _ in range(count)]
    rows = torch.randn(DECODE_ROWS, 2048, dtype=dtype)

    def stream() -> None:
        for matrix in matrices:
            matrix(rows)

    return len(matrices) * 2048 * 2048 * size / best_of(2 if quick else 6, stream)


def measure_copy_bandwidth(quick: bool) -> float:
    """Bytes read plus written per second of copying a buffer several times the last-level cache."""
    numel = (32 if quick else 64) * 2**20
    source, target = torch.ones(numel), torch.empty(numel)
    return 2 * 4 * numel / best_of(2 if quick else 5, lambda: target.copy_(source))


class _Layer(torch.nn.Module):
    """The op sequence of a small decoder layer."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def measure_call_overhead(quick: bool) -> float:
    """Seconds per model call besides its layers: a 2-layer tiny model's call minus its layers."""
    layers = torch.nn.ModuleList([_Layer(), _Layer()])
    x = torch.randn(1, 1, 64)
    repeats = 20 if quick else 200

    def call() -> torch.Tensor:
        hidden = x
        for layer in layers:
            hidden = layer(hidden)
        return torch.log_softmax(hidden.float(), dim=-1)

    with torch.no_grad():
        per_layer = best_of(repeats, lambda: layers[0](x))
        per_call = best_of(repeats, call)
    return max(per_call - 2 * per_layer, per_layer)


def _rss_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * int(Path("/proc/self/statm").read_text().split()[1])


def measure_baseline_memory_gib(quick: bool) -> float:
    """A fresh process's resident memory after the imports of a step-3 rank (quick: this process's)."""
    if quick:
        return _rss_bytes() / GIB
    out = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / GIB


def measure_rank(dtype: torch.dtype, quick: bool, sync: Callable[[], object] = lambda: None) -> dict[str, float]:
    """This rank's compute constants (module doc), at the torch threads it was given; `sync` (a barrier across the
    calibrating ranks) starts each benchmark on every rank at once, so they contend as a co-located step's do."""
    shape, repeats = (QUICK, 2) if quick else (REFERENCE, 8)
    sync()
    layer = measure_layer(dtype, shape, repeats)
    sync()
    call_s = measure_call_overhead(quick)
    sync()
    bandwidth = measure_streaming_bandwidth(dtype, quick)
    sync()
    decode = measure_decode_overheads(dtype, bandwidth, quick)
    sync()
    copy_bandwidth = measure_copy_bandwidth(quick)
    sync()
    optimizer_s = measure_optimizer_s_per_param(dtype, (2 if quick else 16) * 2**20, repeats)
    return {**asdict(layer), "memory_bandwidth": bandwidth, "copy_bandwidth": copy_bandwidth,
            "optimizer_s_per_param": optimizer_s,
            "call_overhead_s": call_s, "decode_step_overhead_s": decode.per_layer_s,
            "sampling_s_per_logit": decode.per_logit_s}


def _line_fit(moved: Callable[[int], float], small: int, large: int, t_small: float,
              t_large: float) -> tuple[float, float]:
    """(bytes/s, latency s) of a collective from its times at two sizes: time = latency + moved bytes / rate."""
    bandwidth = (moved(large) - moved(small)) / max(t_large - t_small, 1e-9)
    return bandwidth, max(t_small - moved(small) / bandwidth, 1e-6)


def gradient_reduce_dtype(dtype: str) -> str:
    """The dtype of a ZeRO-0 gradient all-reduce when training in `dtype` on this machine with `--optimizer auto`:
    fp32 where `MasterWeightAdamW` updates the model (it hands DeepSpeed its fp32 gradient sums), else `dtype`."""
    return "fp32" if uses_master_weights(dtype, 0, False, "auto") else dtype


def measure_collectives(world_size: int, dtype: torch.dtype) -> dict[str, float]:
    """Link bandwidth and latency of gloo all-gather + broadcast (float32, as the experience exchange moves), and
    an all-reduce's bandwidth (in `dtype`, the gradients' as DeepSpeed reduces them: `gradient_reduce_dtype`, on a
    flat buffer of a small model's gradients) over the link's: a CPU sums with its cores."""
    import torch.distributed as dist

    n, small, large = world_size, 256, 4 * 2**20
    timings = {}
    for numel in (small, large):
        tensor, gathered = torch.ones(numel), [torch.empty(numel) for _ in range(n)]
        timings[numel] = best_of(3, lambda: (dist.all_gather(gathered, tensor), dist.broadcast(tensor, 0)))
    link, latency = _line_fit(lambda numel: 4 * numel * ((n - 1) / n + 1), small, large, timings[small],
                              timings[large])
    size, flat = torch.finfo(dtype).bits // 8, torch.ones(GRADIENT_NUMEL, dtype=dtype)
    reduce_s = best_of(2, lambda: dist.all_reduce(flat))
    reduce = 2 * size * GRADIENT_NUMEL * (n - 1) / n / max(reduce_s - latency / 2, 1e-9)
    return {"intra_node_bandwidth": link, "collective_latency_s": latency / 2, "reduce_efficiency": reduce / link}


def _rank_worker(rank: int, world_size: int, port: int, dtype: str, threads: int, quick: bool, results) -> None:
    """Every rank measures its compute constants at the same time, then the collectives; rank 0 reports."""
    import torch.distributed as dist

    from utils.dist import launcher_variables, leave_spawned_rank

    for key in launcher_variables(os.environ):  # spawned by a launched rank (`--placement auto --calibrate`)
        del os.environ[key]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.set_num_threads(threads)
    measured = measure_rank(TORCH_DTYPES[dtype], quick, dist.barrier)
    dist.barrier()
    measured |= measure_collectives(world_size, TORCH_DTYPES[gradient_reduce_dtype(dtype)])
    if rank == 0:
        results.put(measured)
    leave_spawned_rank()


def measure_ranks(dtype: str, threads: int, world_size: int, quick: bool) -> dict[str, float]:
    """The constants of rank 0 of `world_size` local processes of `threads` threads each, measured together."""
    import torch.multiprocessing as mp

    from utils.dist import free_port

    if world_size == 1:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            measured = measure_rank(TORCH_DTYPES[dtype], quick)
        finally:
            torch.set_num_threads(previous)
        return measured | {"intra_node_bandwidth": measured["memory_bandwidth"], "collective_latency_s": 0.0,
                           "reduce_efficiency": 1.0}
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_rank_worker, args=(world_size, free_port(), dtype, threads, quick, results),
                       nprocs=world_size, join=True, start_method="spawn")
    return results.get()


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


class OthersBusyCores:
    """The cores other processes kept busy while the code inside ran: the CPU time of the cores this process may
    run on (psutil, per core; time the hypervisor gave other guests counted) less this process's and its finished
    children's, over the wall time. Other cores of the host (a container pinned to a few) are not counted."""

    cores: float = 0.0

    @staticmethod
    def _cpu_seconds() -> tuple[float, float, float]:
        per_core, own = psutil.cpu_times(percpu=True), os.times()
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(len(per_core))
        busy = sum(sum(core) - core.idle - getattr(core, "iowait", 0.0) - getattr(core, "guest", 0.0)
                   - getattr(core, "guest_nice", 0.0)  # guest time is counted in user time too
                   for index, core in enumerate(per_core) if index in usable)
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def __enter__(self) -> "OthersBusyCores":
        self._start = self._cpu_seconds()
        return self

    def __exit__(self, *exc_info: object) -> None:
        (wall0, busy0, own0), (wall1, busy1, own1) = self._start, self._cpu_seconds()
        self.cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)


def calibrate(dtype: str, threads: int, world_size: int, quick: bool = False) -> MachineSpec:
    """Measure this machine as `world_size` ranks of `threads` torch threads each (one node), all busy at once;
    unless `quick`, correct the constants by a profiled real step. The machine records how many cores other
    processes kept busy meanwhile (`MachineSpec.others_busy_cores`)."""
    from training.placement.step_profile import profile_corrections

    with OthersBusyCores() as others:
        measured = measure_ranks(dtype, threads, world_size, quick)
        machine = MachineSpec(
            name=f"{socket.gethostname()} (calibrated{', quick' if quick else ''}: {dtype}, {threads} thread(s), "
                 f"{ranks_text(world_size)})",
            nodes=1, devices_per_node=world_size, memory_gib=host_memory_gib() / world_size,
            inter_node_bandwidth=measured["intra_node_bandwidth"],
            baseline_memory_gib=measure_baseline_memory_gib(quick), **measured)
        if not quick:
            machine = replace(machine, **profile_corrections(machine, dtype, threads, world_size))
    return replace(machine, others_busy_cores=round(others.cores, 2))


def save_calibration(machine: MachineSpec, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": asdict(machine), "cpu_model": cpu_model_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(path)


def load_calibration(path: Path) -> MachineSpec | None:
    """A saved calibration, or None when there is none (or it is unreadable: measured again)."""
    try:
        return MachineSpec(**json.loads(path.read_text())["machine"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_calibrate(dtype: str, threads: int, world_size: int, recalibrate: bool = False) -> MachineSpec:
    """The saved calibration for this host, dtype, threads and world size; measured and saved when absent or
    when `recalibrate`."""
    path = cache_path(dtype, threads, world_size)
    saved = None if recalibrate else load_calibration(path)
    if saved is not None:
        return saved
    machine = calibrate(dtype, threads, world_size)
    save_calibration(machine, path)
    return machine
