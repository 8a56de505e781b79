"""Two calibration ranks (`training.placement.calibration._rank_worker`) with stand-in measurements; each rank asks
that the interpreter's exit handlers create MARKER_DIR/rank<N> (they run only where the rank's interpreter
finalizes). Prints the keys rank 0 reported.

    calibration_teardown_worker.py MARKER_DIR
"""
import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.placement import calibration
from utils.dist import free_port


def stand_in_rank(dtype: torch.dtype, quick: bool, sync=lambda: None) -> dict[str, float]:
    return {}


def stand_in_collectives(markers: Path, world_size: int, dtype: torch.dtype) -> dict[str, float]:
    dist.all_reduce(torch.ones(4))
    atexit.register((markers / f"rank{dist.get_rank()}").touch)
    return {"collectives": 1.0}


def rank(index: int, markers: Path, *args: object) -> None:
    calibration.measure_rank = stand_in_rank
    calibration.measure_collectives = lambda *shape: stand_in_collectives(markers, *shape)
    calibration._rank_worker(index, *args)


if __name__ == "__main__":
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank, args=(Path(sys.argv[1]), 2, free_port(), "fp32", 1, True, results), nprocs=2,
                       join=True, start_method="spawn")
    print(sorted(results.get()))
