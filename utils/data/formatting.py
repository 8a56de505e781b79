"""Render a sample's turns as the model's prompt text (the canonical row's `prompt`).

`chat_template`: `tokenizer.apply_chat_template(turns, add_generation_prompt=True)`.
`human_assistant`: DeepSpeed-Chat's plain format " Human: ... Assistant:", with replies
prefixed by a space (" reply"), as in the Dahoas datasets. `auto` picks the chat template when
the tokenizer has one.
"""
from __future__ import annotations

from typing import Sequence

from utils.errors import UserError

from .samples import ASSISTANT, SYSTEM, Sample, SkipRow

PROMPT_FORMATS = ("auto", "chat_template", "human_assistant")
_SPEAKERS = {"user": "Human", ASSISTANT: "Assistant", SYSTEM: "System"}


def resolve_prompt_format(prompt_format: str, tokenizer=None) -> str:
    """The concrete style (`chat_template` or `human_assistant`) for `prompt_format`."""
    if prompt_format not in PROMPT_FORMATS:
        raise UserError(f"unknown prompt format '{prompt_format}'; choose one of {', '.join(PROMPT_FORMATS)}")
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat_template" and not has_template:
        raise UserError("--prompt_format chat_template needs a tokenizer with a chat template; use auto or human_assistant")
    if prompt_format == "auto":
        return "chat_template" if has_template else "human_assistant"
    return prompt_format


def render_human_assistant(turns: Sequence[dict]) -> str:
    return "".join(f" {_SPEAKERS[turn['role']]}: {turn['content']}" for turn in turns) + " Assistant:"


class PromptFormatter:
    """Turns samples into canonical rows `{"prompt", "chosen", "rejected"}` for one tokenizer."""

    def __init__(self, tokenizer=None, prompt_format: str = "auto"):
        self.tokenizer = tokenizer
        self.style = resolve_prompt_format(prompt_format, tokenizer)

    def prompt(self, turns: Sequence[dict]) -> str:
        if self.style == "human_assistant":
            return render_human_assistant(turns)
        try:
            return self.tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja templates raise their own errors (e.g. roles must alternate)
            raise SkipRow("chat_template_error") from err

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens to a rendered text: a chat template writes its own."""
        return self.style == "human_assistant"

    def answer(self, reply: str | None) -> str | None:
        if self.style == "human_assistant" and reply:
            return " " + reply
        return reply

    def row(self, sample: Sample) -> dict:
        return {"prompt": self.prompt(sample.turns), "chosen": self.answer(sample.chosen), "rejected": self.answer(sample.rejected)}
