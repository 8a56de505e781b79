"""Whether a model is asked in the conversation layout it was tuned on: the layout is what its tokenizer renders under
a --prompt_format, and a run of this project records the --prompt_format it tuned its model under (its args.json)."""
from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from training.reliability.run_records import args_of_model
from utils.data import PromptFormatter
from utils.data.tokenization import probe_tokens
from utils.errors import UserError

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
    warning = tuned_layout_warning(tokenizer, prompt_format, recorded["prompt_format"], model_path, step)
    if warning is not None:
        logger.warning("%s", warning)


def tuned_layout_warning(tokenizer: PreTrainedTokenizerBase, prompt_format: str, tuned_format: str, model_path: str,
                         step: str, to_be_tuned: bool = False, passing: str | None = None) -> str | None:
    """What `warn_tuned_on_other_layout` says where the model in `model_path`, tuned under `tuned_format` (or, with
    `to_be_tuned`, to be tuned by a step 1 that train.py plans), is given conversations laid out under
    `prompt_format` otherwise; None where the tokenizer lays both out alike (`auto` and `chat_template` under a chat
    template). `passing`: how the user gives `step` that format (train.py's `--step3-args "--prompt_format X"`); by
    default the step's own flag."""
    layouts = other_layout(tokenizer, prompt_format, tokenizer, tuned_format)
    if layouts is None:
        return None
    tuned = "will be tuned" if to_be_tuned else "was tuned"
    return (f"the model {model_path} {tuned} (--prompt_format {tuned_format}) on conversations laid out as "
            f"{layouts[0]!r}, but {step} lays them out as {layouts[1]!r} (--prompt_format {prompt_format}), asking "
            f"it in a layout it is not tuned on. Pass {passing or f'--prompt_format {tuned_format}'}, the format it "
            f"{tuned} under")


def scored_layout_warning(actor_tokenizer: PreTrainedTokenizerBase, prompt_format: str,
                          reward_tokenizer: PreTrainedTokenizerBase, trained_format: str, reward_path: str,
                          to_be_trained: bool = False) -> str | None:
    """What step 3 warns of where the reward model in `reward_path`, trained by step 2 on conversations its own
    tokenizer renders under `trained_format` (or, with `to_be_trained`, to be trained by a step 2 that train.py
    plans), is given the actor's tokens, rendered by the actor's tokenizer under step 3's `prompt_format`, laid out
    otherwise; None where both lay them out alike."""
    layouts = other_layout(actor_tokenizer, prompt_format, reward_tokenizer, trained_format)
    if layouts is None:
        return None
    trained = "will be trained" if to_be_trained else "was trained"
    return (f"the reward model {reward_path} {trained} (--prompt_format {trained_format}) on conversations laid out as "
            f"{layouts[0]!r}, but step 3 gives it the actor's answers laid out as {layouts[1]!r} (--prompt_format "
            f"{prompt_format}): its scores may not carry over. Train the reward model from a model whose tokenizer "
            "renders conversations as the actor's does, or with the --prompt_format under which both render them "
            "alike")


def check_same_vocabulary(actor_tokenizer: PreTrainedTokenizerBase, critic_tokenizer: PreTrainedTokenizerBase,
                          critic_path: str) -> None:
    """The critic scores the actor's tokens one by one, so both must read token ids the same way: step 3 refuses
    another vocabulary as it starts, and train.py while it plans."""
    if actor_tokenizer.get_vocab() != critic_tokenizer.get_vocab():
        raise UserError(
            f"the reward/critic model {critic_path} uses a different tokenizer from the actor; train the "
            "reward model (step 2) from the same base model family as the actor"
        )
