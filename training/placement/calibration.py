"""This machine's constants for the cost model, measured in a short profile and cached per host/dtype/threads/world.

Run with the torch threads one rank gets (a CPU run of R ranks on C cores: C // R each), so every rate is per rank.
`quick=True` is a profile of a few seconds for a dry run with no saved calibration: smaller shapes, fewer
repetitions, the baseline memory read from this process; it is not saved.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from training.pipeline.hardware import GIB
from training.placement.machine import MachineSpec

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BASELINE_SCRIPT = ("import os, torch, deepspeed; "
                    "print(os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]))")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "rlhf-pipeline" / "calibration"


def cache_path(dtype: str, threads: int, world_size: int) -> Path:
    return cache_dir() / f"{socket.gethostname()}-{dtype}-t{threads}-w{world_size}.json"


def _best_of(repeats: int, run: Callable[[], object]) -> float:
    run()  # warm-up: first-call allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure_matmul_flops(dtype: torch.dtype, quick: bool) -> float:
    """FLOP/s of [tokens x hidden] @ [hidden x 4 hidden], an MLP's up-projection at a training micro-batch."""
    tokens, hidden = (256, 512) if quick else (1024, 1024)
    a = torch.randn(tokens, hidden, dtype=dtype)
    b = torch.randn(hidden, 4 * hidden, dtype=dtype)
    return 2 * tokens * hidden * 4 * hidden / _best_of(2 if quick else 5, lambda: a @ b)


def measure_streaming_bandwidth(dtype: torch.dtype, quick: bool) -> float:
    """Bytes/s of decode-like matrix-vector products over a weight set several times the last-level cache."""
    size = torch.finfo(dtype).bits // 8
    total = (128 if quick else 512) * 2**20
    matrices = [torch.randn(2048, 2048, dtype=dtype) for _ in range(max(1, total // (2048 * 2048 * size)))]
    row = torch.randn(1, 2048, dtype=dtype)

    def stream() -> None:
        for matrix in matrices:
            row @ matrix

    return len(matrices) * 2048 * 2048 * size / _best_of(2 if quick else 4, stream)


class _Layer(torch.nn.Module):
    """The op sequence of a small decoder layer: what one decode step pays per layer besides its math."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def measure_overheads(quick: bool) -> tuple[float, float]:
    """(per-call, per-layer decode-step) seconds: a 2-layer tiny model's call minus its layers, and one layer."""
    layers = torch.nn.ModuleList([_Layer(), _Layer()])
    x = torch.randn(1, 1, 64)
    repeats = 20 if quick else 200

    def call() -> torch.Tensor:
        hidden = x
        for layer in layers:
            hidden = layer(hidden)
        return torch.log_softmax(hidden.float(), dim=-1)

    with torch.no_grad():
        per_layer = _best_of(repeats, lambda: layers[0](x))
        per_call = _best_of(repeats, call)
    return max(per_call - 2 * per_layer, per_layer), per_layer


def _rss_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * int(Path("/proc/self/statm").read_text().split()[1])


def measure_baseline_memory_gib(quick: bool) -> float:
    """A fresh process's resident memory after importing torch and deepspeed (quick: this process's)."""
    if quick:
        return _rss_bytes() / GIB
    out = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / GIB


def _collective_worker(rank: int, world_size: int, port: int, sizes: list[int], results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    timings = []
    for numel in sizes:
        tensor = torch.ones(numel)
        gathered = [torch.empty(numel) for _ in range(world_size)]
        timings.append(_best_of(3, lambda: (dist.all_gather(gathered, tensor), dist.broadcast(tensor, 0))))
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def measure_collectives(world_size: int) -> tuple[float, float]:
    """(bytes/s per rank, latency s) of gloo all-gather + broadcast between `world_size` local processes:
    a small and a large message fix the line time = latency + moved bytes / bandwidth."""
    import torch.multiprocessing as mp

    from utils.dist import free_port

    small, large = 256, 4 * 2**20
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_collective_worker, args=(world_size, free_port(), [small, large], results),
                       nprocs=world_size, join=True, start_method="spawn")
    t_small, t_large = results.get()
    moved = lambda numel: 4 * numel * ((world_size - 1) / world_size + 1)  # all-gather's share + the broadcast
    bandwidth = (moved(large) - moved(small)) / max(t_large - t_small, 1e-9)
    return bandwidth, max(t_small - moved(small) / bandwidth, 1e-6) / 2


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def calibrate(dtype: str, threads: int, world_size: int, quick: bool = False) -> MachineSpec:
    """Measure this machine as `world_size` ranks of `threads` torch threads each (one node)."""
    torch_dtype = TORCH_DTYPES[dtype]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_matmul_flops(torch_dtype, quick)
        bandwidth = measure_streaming_bandwidth(torch_dtype, quick)
        call_s, layer_s = measure_overheads(quick)
    finally:
        torch.set_num_threads(previous)
    link, latency = measure_collectives(world_size) if world_size > 1 else (bandwidth, 0.0)
    return MachineSpec(
        name=f"{socket.gethostname()} (calibrated{', quick' if quick else ''}: {dtype}, {threads} thread(s), "
             f"{world_size} rank(s))",
        nodes=1, devices_per_node=world_size, memory_gib=host_memory_gib() / world_size, matmul_flops=flops,
        memory_bandwidth=bandwidth, intra_node_bandwidth=link, inter_node_bandwidth=link,
        collective_latency_s=latency, call_overhead_s=call_s, decode_step_overhead_s=layer_s,
        baseline_memory_gib=measure_baseline_memory_gib(quick))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def save_calibration(machine: MachineSpec, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": asdict(machine), "cpu_model": cpu_model(), "torch": torch.__version__,
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
