"""Run the three RLHF steps (SFT, reward model, PPO) in order: `python train.py --help`.

The logic lives in `training.pipeline`; `training.pipeline.cli.run(argv)` returns the run's summary.
"""
from __future__ import annotations

from training.pipeline.cli import run
from utils.dist import run_as_program
from utils.errors import run_cli


@run_cli
def main(argv: list[str] | None = None) -> None:
    """`rlhf-train`: returns nothing, so the console script exits with status 0 on success."""
    run(argv)


if __name__ == "__main__":
    run_as_program(main)
