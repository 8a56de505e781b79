"""Run the three RLHF steps (SFT, reward model, PPO) in order: `python train.py --help`.

The logic lives in `training.pipeline`; `training.pipeline.cli.run(argv)` returns the run's summary.
"""
from __future__ import annotations

from typing import NoReturn

from training.pipeline.cli import run
from utils.dist import run_as_program
from utils.errors import run_cli


@run_cli
def main(argv: list[str] | None = None) -> None:
    """train.py's command line; returns nothing (status 0 on success)."""
    run(argv)


def program() -> NoReturn:
    """`rlhf-train` and `python train.py`: `main` as this process's program (`run_as_program`; on the cpu
    deployment the steps' engines live in this process)."""
    run_as_program(main)


if __name__ == "__main__":
    program()
