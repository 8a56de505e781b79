"""DPO: train the step-1 model directly on step 2's preference pairs, in place of steps 2 and 3.

The policy (a copy of `--model_name_or_path` that trains) is compared with a frozen reference (the
same model, eval mode, no gradients) on each pair's chosen and rejected answers; `--dpo_loss` picks
the preference loss (`training/algorithms/preference.py`), `--dpo_beta` its strength. Held-out
implicit-reward accuracy, mean chosen/rejected rewards, margin and loss are reported before training
and after each epoch. The policy is saved as an HF model folder in `<output_dir>/model`.

The policy trains with dropout off, whatever `--disable_dropout` says: the reference has none (eval mode), so
with dropout the log-ratio of two equal models would be noise rather than 0, and the loss would push on that noise
from the first step (TRL turns dropout off for DPO likewise; step 3 does for its actor).

The default learning rate, 1e-6, is DPO's usual one (TRL's default; larger models use 5e-7): the
loss pulls on the whole answer's summed log-probability, so steps of SFT size (1e-5) soon drive
both answers' likelihoods down and the model off its step-1 behaviour, even at 135M parameters.
Example (CPU quick run on the embedded model and data, from step 1's run folder):

    python step2_reward/dpo/main.py --model_name_or_path runs/step1 --output_dir runs/dpo --max_steps 50 \\
        --max_seq_len 256
"""
from __future__ import annotations

from functools import partial
from typing import Any

from step2_reward.dpo.objective import DPOObjective
from step2_reward.dpo.settings import DPOArguments, DPOSettings
from training.core.args import SettingsParser
from training.loops.supervised_step import (
    SupervisedOutcome,
    SupervisedStep,
    build_causal_lm,
    run_supervised_step,
    supervised_step_parser,
)
from utils.data import PairwiseCollator
from utils.dist import run_as_program
from utils.errors import run_cli

STEP_NAME = "dpo"


def build_parser() -> SettingsParser:
    return supervised_step_parser("DPO: direct preference optimisation of the step-1 model with DeepSpeed",
                                  learning_rate=1e-6, settings=DPOSettings)


def parse_args(argv: list[str] | None = None) -> DPOSettings:
    return build_parser().parse_args(argv)


def dpo_summary(settings: DPOArguments, outcome: SupervisedOutcome) -> dict[str, Any]:
    before, after = outcome.result.first_eval, outcome.result.final_eval
    counts = {"train_pairs": outcome.train_items, "eval_pairs": after.get("num_pairs")}
    return outcome.summary(STEP_NAME, counts, {
        "dpo_loss": settings.loss,
        "dpo_beta": settings.beta,
        "eval_loss_before": before.get("loss"),
        "eval_loss_after": after.get("loss"),
        "eval_accuracy_before": before.get("accuracy"),
        "eval_accuracy_after": after.get("accuracy"),
        "eval_margin_before": before.get("margin"),
        "eval_margin_after": after.get("margin"),
        "eval_chosen_reward_after": after.get("chosen_reward"),
        "eval_rejected_reward_after": after.get("rejected_reward"),
    })


def dpo_step(objective: DPOObjective) -> SupervisedStep:
    """The supervised-loop step that trains the policy with `objective` (which holds the reference)."""
    return SupervisedStep(
        name=STEP_NAME,
        build_model=partial(build_causal_lm, disable_dropout=True),
        make_collator=PairwiseCollator,
        loss_fn=objective.loss,
        eval_fn=objective.evaluate,
        summarize=partial(dpo_summary, objective.settings),
        frozen_models=objective.reference_model,
    )


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Run the DPO step and return its summary (also written to `<output_dir>/summary.json`)."""
    args = parse_args(argv)
    return run_supervised_step(args, dpo_step(DPOObjective(args.dpo)))


if __name__ == "__main__":
    run_as_program(main)
