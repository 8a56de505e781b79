"""Step 2: train a reward model (any causal LM's backbone + a scalar head) on preference pairs.

Loss: -log sigmoid(r_chosen - r_rejected) on the score at each sequence's last real token.
Held-out accuracy, mean chosen/rejected scores and mean margin are reported before training and
after each epoch. The model is saved in `<output_dir>/model`, loadable with
`RewardModel.from_pretrained(<output_dir>)` (step 3 uses it as reward model and critic).
Example (CPU quick run on the embedded model and data):

    python step2_reward/main.py --output_dir runs/step2 --max_steps 50 --max_seq_len 256
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Mapping

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from step2_reward.reward_model import RewardModel, evaluate_pairs, pairwise_loss, split_chosen_rejected  # noqa: E402
from training.errors import run_cli  # noqa: E402
from training.metrics import save_summary  # noqa: E402
from training.supervised_step import SupervisedStep, run_supervised_step, supervised_step_parser  # noqa: E402
from utils.data import PairwiseCollator  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return supervised_step_parser("Step 2: reward model training on preference pairs with DeepSpeed", learning_rate=2e-5).parse_args(argv)


def build_reward_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, ds_config: dict,
                       dtype: torch.dtype) -> RewardModel:
    return RewardModel.from_causal_lm(args.model_name_or_path, tokenizer, dtype=dtype, ds_config=ds_config,
                                      disable_dropout_layers=args.disable_dropout,
                                      trust_remote_code=args.trust_remote_code)


def reward_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Pairwise loss of a `PairwiseCollator` batch (B chosen rows stacked above B rejected rows)."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["end_scores"]
    return pairwise_loss(*split_chosen_rejected(scores))


def evaluate_reward(model: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    return asdict(evaluate_pairs(model, batches))


REWARD_STEP = SupervisedStep(
    phase=2,
    name="step2_reward",
    build_model=build_reward_model,
    make_collator=PairwiseCollator,
    loss_fn=reward_loss,
    eval_fn=evaluate_reward,
    trainable_heads=("v_head",),
)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 2 and return its summary (also written to `<output_dir>/summary.json`)."""
    args = parse_args(argv)
    outcome = run_supervised_step(args, REWARD_STEP)
    result = outcome.result
    before, after = result.first_eval, result.final_eval
    summary = {
        "step": "step2_reward",
        "model_dir": str(outcome.model_dir),
        "optimizer_steps": result.steps,
        "epochs_completed": result.epochs_completed,
        "train_pairs": outcome.train_items,
        "eval_pairs": after.get("num_pairs"),
        "dtype": outcome.dtype,
        "final_train_loss": result.train_loss,
        "eval_accuracy_before": before.get("accuracy"),
        "eval_accuracy_after": after.get("accuracy"),
        "eval_margin_before": before.get("margin_mean"),
        "eval_margin_after": after.get("margin_mean"),
        "eval_chosen_mean_after": after.get("chosen_mean"),
        "eval_rejected_mean_after": after.get("rejected_mean"),
        "wall_time_s": round(result.wall_time_s, 1),
    }
    save_summary(args.output_dir, summary)
    return summary


if __name__ == "__main__":
    main()
