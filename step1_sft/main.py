"""Step 1: supervised fine-tuning of a causal LM on prompt -> answer pairs, with DeepSpeed.

The loss covers the answer tokens (and the EOS appended to each answer) only, unless
`--whole_sequence_loss`. Held-out perplexity is measured before training and after each epoch.
Example (CPU quick run on the embedded model and data):

    python step1_sft/main.py --output_dir runs/step1 --max_steps 50 --max_seq_len 256
"""
from __future__ import annotations

from typing import Any

from step1_sft.objective import evaluate_perplexity, sft_loss, sft_loss_items
from training.core.args import SettingsParser
from training.loops.supervised_step import (
    SupervisedOutcome,
    SupervisedSettings,
    SupervisedStep,
    build_causal_lm,
    run_supervised_step,
    supervised_step_parser,
)
from utils.data import SFTCollator
from utils.dist import run_as_program
from utils.errors import run_cli


def build_parser() -> SettingsParser:
    return supervised_step_parser("Step 1: supervised fine-tuning (SFT) with DeepSpeed", learning_rate=1e-5)


def parse_args(argv: list[str] | None = None) -> SupervisedSettings:
    return build_parser().parse_args(argv)


def sft_summary(outcome: SupervisedOutcome) -> dict[str, Any]:
    first, final = outcome.result.first_eval, outcome.result.final_eval
    return outcome.summary("step1_sft", {"train_items": outcome.train_items, "eval_items": outcome.eval_items}, {
        "eval_perplexity_before": first.get("perplexity"),
        "eval_perplexity_after": final.get("perplexity"),
        "eval_loss_before": first.get("loss"),
        "eval_loss_after": final.get("loss"),
    })


SFT_STEP = SupervisedStep(
    name="step1_sft",
    build_model=build_causal_lm,
    make_collator=SFTCollator,
    loss_fn=sft_loss,
    eval_fn=evaluate_perplexity,
    summarize=sft_summary,
    count_items=sft_loss_items,
)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 1 and return its summary (also written to `<output_dir>/summary.json`)."""
    return run_supervised_step(parse_args(argv), SFT_STEP)


if __name__ == "__main__":
    run_as_program(main)
