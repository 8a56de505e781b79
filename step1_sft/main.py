"""Step 1: supervised fine-tuning of a causal LM on prompt -> answer pairs, with DeepSpeed.

The loss covers the answer tokens (and the EOS appended to each answer) only, unless
`--whole_sequence_loss`. Held-out perplexity is measured before training and after each epoch.
Example (CPU quick run on the embedded model and data):

    python step1_sft/main.py --output_dir runs/step1 --max_steps 50 --max_seq_len 256
"""
from __future__ import annotations

from step1_sft.objective import evaluate_perplexity, sft_loss, sft_loss_items
from training.core.args import SettingsParser
from training.loops.supervised_step import (
    SupervisedSettings,
    SupervisedStep,
    build_causal_lm,
    run_supervised_step,
    supervised_step_parser,
)
from training.reliability.run_records import save_summary
from utils.data import SFTCollator
from utils.errors import run_cli


def build_parser() -> SettingsParser:
    return supervised_step_parser("Step 1: supervised fine-tuning (SFT) with DeepSpeed", learning_rate=1e-5)


def parse_args(argv: list[str] | None = None) -> SupervisedSettings:
    return build_parser().parse_args(argv)


SFT_STEP = SupervisedStep(
    phase=1,
    name="step1_sft",
    build_model=build_causal_lm,
    make_collator=SFTCollator,
    loss_fn=sft_loss,
    eval_fn=evaluate_perplexity,
    count_items=sft_loss_items,
)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run step 1 and return its summary (also written to `<output_dir>/summary.json`)."""
    args = parse_args(argv)
    outcome = run_supervised_step(args, SFT_STEP)
    result = outcome.result
    counts = {"train_items": outcome.train_items, "eval_items": outcome.eval_items}
    summary = outcome.summary("step1_sft", counts, {
        "eval_perplexity_before": result.first_eval.get("perplexity"),
        "eval_perplexity_after": result.final_eval.get("perplexity"),
        "eval_loss_before": result.first_eval.get("loss"),
        "eval_loss_after": result.final_eval.get("loss"),
    })
    return save_summary(args.run.output_dir, summary)


if __name__ == "__main__":
    main()
