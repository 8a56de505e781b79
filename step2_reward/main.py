"""Step 2: train a reward model (any causal LM's backbone + a scalar head) on preference pairs.

Loss: -log sigmoid(r_chosen - r_rejected) on the score at each sequence's last real token.
Held-out accuracy, mean chosen/rejected scores and mean margin are reported before training and
after each epoch. The model is saved in `<output_dir>/model`, loadable with
`RewardModel.from_pretrained(<output_dir>)` (step 3 uses it as reward model and critic).
Example (CPU quick run on the embedded model and data):

    python step2_reward/main.py --output_dir runs/step2 --max_steps 50 --max_seq_len 256
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping

import torch
from transformers import PreTrainedTokenizerBase

from step2_reward.objective import evaluate_pairs, pairwise_loss, split_chosen_rejected
from training.core.args import SettingsParser
from training.core.reward_model import RewardModel, is_reward_model_dir
from training.loops.supervised_step import (
    PreferenceSettings,
    SupervisedOutcome,
    SupervisedSettings,
    SupervisedStep,
    run_supervised_step,
    supervised_step_parser,
)
from utils.data import PairwiseCollator
from utils.dist import run_as_program
from utils.errors import run_cli


def build_parser() -> SettingsParser:
    return supervised_step_parser("Step 2: reward model training on preference pairs with DeepSpeed", learning_rate=2e-5,
                                  settings=PreferenceSettings)


def parse_args(argv: list[str] | None = None) -> PreferenceSettings:
    return build_parser().parse_args(argv)


def build_reward_model(args: SupervisedSettings, tokenizer: PreTrainedTokenizerBase, ds_config: dict,
                       dtype: torch.dtype) -> RewardModel:
    """A new value head on a causal LM's backbone; a reward model step 2 saved trains on from its own value head (a
    freshly drawn one would throw away what it learnt)."""
    path = args.model.model_name_or_path
    options = {"dtype": dtype, "ds_config": ds_config, "disable_dropout_layers": args.model.disable_dropout,
               "trust_remote_code": args.run.trust_remote_code}
    if is_reward_model_dir(path):
        return RewardModel.from_pretrained(path, tokenizer=tokenizer, **options)
    return RewardModel.from_causal_lm(path, tokenizer, **options)


def reward_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Pairwise loss of a `PairwiseCollator` batch (B chosen rows stacked above B rejected rows)."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["end_scores"]
    return pairwise_loss(*split_chosen_rejected(scores))


def evaluate_reward(model: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    return asdict(evaluate_pairs(model, batches))


def reward_summary(outcome: SupervisedOutcome) -> dict[str, Any]:
    before, after = outcome.result.first_eval, outcome.result.final_eval
    counts = {"train_pairs": outcome.train_items, "eval_pairs": after.get("num_pairs")}
    return outcome.summary("step2_reward", counts, {
        "eval_accuracy_before": before.get("accuracy"),
        "eval_accuracy_after": after.get("accuracy"),
        "eval_margin_before": before.get("margin_mean"),
        "eval_margin_after": after.get("margin_mean"),
        "eval_chosen_mean_after": after.get("chosen_mean"),
        "eval_rejected_mean_after": after.get("rejected_mean"),
    })


REWARD_STEP = SupervisedStep(
    name="step2_reward",
    build_model=build_reward_model,
    make_collator=PairwiseCollator,
    loss_fn=reward_loss,
    eval_fn=evaluate_reward,
    summarize=reward_summary,
    trainable_heads=("v_head",),
)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 2 and return its summary (also written to `<output_dir>/summary.json`)."""
    return run_supervised_step(parse_args(argv), REWARD_STEP)


if __name__ == "__main__":
    run_as_program(main)
