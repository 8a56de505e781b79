"""A reward-model folder (the step-2 layout: backbone + value head) made from a causal LM folder, for benchmarks
whose reward model and critic only need the right shape: the head is freshly initialised.

    python -m bench.gpu.value_model ACTOR_DIR OUTPUT_DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from training.core.model_loading import load_tokenizer
from training.core.reward_model import RewardModel
from utils.atomic import atomic_directory


def write_value_model(actor: str, output: Path, seed: int = 0) -> Path:
    tokenizer = load_tokenizer(actor)
    torch.manual_seed(seed)
    with atomic_directory(output) as staged:  # a killed write leaves no folder that looks finished
        RewardModel.from_causal_lm(actor, tokenizer).save_pretrained(staged)
        tokenizer.save_pretrained(staged)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("actor", help="causal LM folder whose backbone the value model starts from")
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"value model -> {write_value_model(args.actor, args.output, args.seed)}")


if __name__ == "__main__":
    main()
