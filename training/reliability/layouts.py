"""Whether a model is asked in the conversation layout it was tuned on: the layout is what its tokenizer renders under
a --prompt_format, and a run of this project records the --prompt_format it tuned its model under (its args.json)."""
from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from training.reliability.run_records import args_of_model
from utils.data import PromptFormatter
from utils.data.tokenization import probe_tokens

logger = logging.getLogger(__name__)


def other_layout(given_by: PreTrainedTokenizerBase, given_format: str, trained_by: PreTrainedTokenizerBase,
                 trained_format: str) -> tuple[str, str] | None:
    """One probe exchange as a run trained a model on it (`trained_by`'s rendering under `trained_format`) and as a
    step gives it (`given_by`'s under `given_format`), where the two differ; None where they are alike."""
    trained = probe_tokens(PromptFormatter(trained_by, trained_format), trained_by)
    given = probe_tokens(PromptFormatter(given_by, given_format), given_by)
    return None if trained == given else (trained_by.decode(trained or []), given_by.decode(given or []))


def warn_tuned_on_other_layout(tokenizer: PreTrainedTokenizerBase, prompt_format: str, model_path: str,
                               step: str) -> None:
    """Warn where the run that tuned the model `step` starts from (step 1, DPO, or an earlier step 3: the
    --prompt_format its args.json recorded) laid conversations out otherwise than `step`'s --prompt_format does with
    the same tokenizer: `step` would ask the model in a layout it was not tuned on, and end its answers where that
    layout's turn ends (another token, under another chat template's or none). A warning: nothing is known of a model
    no run of this project tuned, and a run may mean to move the model to another layout."""
    recorded = args_of_model(model_path)
    if "prompt_format" not in recorded:
        return
    tuned_format = recorded["prompt_format"]
    layouts = other_layout(tokenizer, prompt_format, tokenizer, tuned_format)
    if layouts is not None:
        logger.warning(
            "the model %s was tuned (--prompt_format %s) on conversations laid out as %r, but %s lays them out as %r "
            "(--prompt_format %s): it starts from a model asked in a layout it was not tuned on. Pass "
            "--prompt_format %s, as its run did", model_path, tuned_format, layouts[0], step, layouts[1], prompt_format,
            tuned_format)
