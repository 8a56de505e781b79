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
        self.template_error: str | None = None  # the first the chat template raised: the report says why rows dropped

    def prompt(self, turns: Sequence[dict]) -> str:
        if self.style == "human_assistant":
            return render_human_assistant(turns)
        try:
            return self.tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja templates raise their own errors (e.g. roles must alternate)
            self.template_error = self.template_error or f"{type(err).__name__}: {err}"
            raise SkipRow("chat_template_error") from err

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens to a rendered text: a chat template writes its own."""
        return self.style == "human_assistant"

    def answer(self, turns: Sequence[dict], reply: str | None, prompt: str | None = None) -> str | None:
        """`reply` to the conversation `turns` (rendered: `prompt`) as the text that follows the prompt; the
        tokenisation appends the EOS token after it.

        Under a chat template that is what the template writes for the reply after the generation prompt, up to
        the EOS text it writes after the reply (the reply itself may quote that text, as HTML's </s> does): some
        decorate a reply (Llama-2's " reply "), and one whose turns end in another token than the EOS (Gemma's
        <end_of_turn>) keeps it, so the model learns the format it is served in. A template that renders the
        conversation otherwise than prompt + reply (one that rewrites earlier turns) gets the reply as it is."""
        if reply is None:
            return None
        if self.style == "human_assistant":
            return " " + reply if reply else reply
        prompt = self.prompt(turns) if prompt is None else prompt
        try:
            written = self.tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": reply}],
                                                         tokenize=False)
        except Exception:  # jinja templates raise their own errors; the prompt rendered, so keep the reply
            return reply
        if not written.startswith(prompt):
            return reply
        written = written[len(prompt):]
        reply_start = written.find(reply)
        reply_end = reply_start + len(reply) if reply_start >= 0 else 0
        end = written.find(self.tokenizer.eos_token, reply_end)  # not an EOS text the reply quotes
        return written[:end] if end >= 0 else written

    def row(self, sample: Sample) -> dict:
        prompt = self.prompt(sample.turns)
        return {"prompt": prompt, "chosen": self.answer(sample.turns, sample.chosen, prompt),
                "rejected": self.answer(sample.turns, sample.rejected, prompt)}
