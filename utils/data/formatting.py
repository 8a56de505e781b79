"""Render a sample's turns as the model's prompt text (the canonical row's `prompt`).

`chat_template`: `tokenizer.apply_chat_template(turns, add_generation_prompt=True)`.
`human_assistant`: DeepSpeed-Chat's plain format " Human: ... Assistant:", with replies
prefixed by a space (" reply"), as in the Dahoas datasets. `auto` picks the chat template when
the tokenizer has one.

A `PromptFormatter` also says which tokens end the model's turn (`stop_token_ids`), for everything that trains
on answers or generates them: the tokenizer's EOS, and under a chat template whose turns end in another special
token (Gemma's <end_of_turn>, Phi-3's <|end|>, Llama-3-Instruct's <|eot_id|> as first released) that token too.
"""
from __future__ import annotations

from functools import cached_property
from typing import Sequence

from utils.errors import UserError

from .samples import ASSISTANT, SYSTEM, Sample, SkipRow

PROMPT_FORMATS = ("auto", "chat_template", "human_assistant")
_SPEAKERS = {"user": "Human", ASSISTANT: "Assistant", SYSTEM: "System"}
# a conversation and a reply any template renders, to find what it writes after a reply
PROBE_TURNS = ({"role": "user", "content": "Hi"},)
PROBE_REPLY = "OK"


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

    @cached_property
    def end_of_turn_token(self) -> str | None:
        """The special token the chat template writes right after a reply where that is not the EOS (Gemma's
        <end_of_turn>); None without one (ChatML's <|im_end|> is the EOS of SmolLM2-Instruct's and Qwen-Instruct's
        tokenizers) and under `human_assistant`, whose answers end in the EOS. Not the model folder's
        generation_config.json eos_token_id list: the data, built from a tokenizer alone, could not end its answers
        where such a token stops generation. The other way round, the steps add `stop_token_ids` to the generation
        config of the model they tune (`match_tokenizer`), so it stops at them wherever it is served."""
        if self.style != "chat_template":
            return None
        try:
            prompt = self.tokenizer.apply_chat_template(list(PROBE_TURNS), tokenize=False, add_generation_prompt=True)
        except Exception:  # jinja templates raise their own errors: the rows will say so
            return None
        written = self._written_after(PROBE_TURNS, PROBE_REPLY, prompt)
        reply_start = written.find(PROBE_REPLY) if written is not None else -1
        if reply_start < 0:
            return None
        after = self.tokenizer(written[reply_start + len(PROBE_REPLY):], add_special_tokens=False)["input_ids"]
        if not after or after[0] == self.tokenizer.eos_token_id or not _is_special(self.tokenizer, after[0]):
            return None
        return self.tokenizer.convert_ids_to_tokens(after[0])

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end the model's turn, at any of which generation stops: the EOS, then the template's
        end-of-turn token where it is another. A model tuned on this formatter's rows ends its answers in the
        latter; one served as its authors made it (an instruct model as step 3's actor) stops there, and would go
        on with a made-up next turn."""
        eos = [self.tokenizer.eos_token_id]
        if self.end_of_turn_token is None:
            return eos
        return eos + [self.tokenizer.convert_tokens_to_ids(self.end_of_turn_token)]

    @property
    def answer_suffix_ids(self) -> list[int]:
        """What the tokenisation appends to an answer's text: the EOS, or nothing where the text ends in the
        template's own end-of-turn token (`answer`)."""
        return [] if self.end_of_turn_token is not None else [self.tokenizer.eos_token_id]

    def _written_after(self, turns: Sequence[dict], reply: str, prompt: str) -> str | None:
        """What the chat template writes after `prompt` (its rendering of `turns`) when `reply` follows; None where
        it raises, or renders the conversation otherwise than prompt + reply (a template that rewrites earlier
        turns)."""
        try:
            written = self.tokenizer.apply_chat_template([*turns, {"role": ASSISTANT, "content": reply}],
                                                         tokenize=False)
        except Exception:  # jinja templates raise their own errors; the prompt rendered, so the reply is kept
            return None
        return written[len(prompt):] if written.startswith(prompt) else None

    def answer(self, turns: Sequence[dict], reply: str | None, prompt: str | None = None) -> str | None:
        """`reply` to the conversation `turns` (rendered: `prompt`) as the text that follows the prompt, up to where
        the model's turn ends; the tokenisation appends `answer_suffix_ids` after it.

        Under a chat template that is what the template writes for the reply after the generation prompt: some
        decorate a reply (Llama-2's " reply "). It runs up to the EOS text the template writes after the reply
        (not one the reply quotes, as HTML's </s>), which the tokenisation appends as the EOS token; or, for a
        template whose turns end in another special token (`end_of_turn_token`: Gemma's <end_of_turn>), up to and
        including that token, and what follows it (a newline, the EOS) is left out. So the model learns to end its
        turn as it is served, and step 2 scores each answer at the token where step 3's answers end. A template
        that renders the conversation otherwise than prompt + reply gets the reply as it is (and the end-of-turn
        token)."""
        if reply is None:
            return None
        if self.style == "human_assistant":
            return " " + reply if reply else reply
        prompt = self.prompt(turns) if prompt is None else prompt
        written = self._written_after(turns, reply, prompt)
        written = reply if written is None else written
        reply_start = written.find(reply)
        reply_end = reply_start + len(reply) if reply_start >= 0 else 0
        end_of_turn = self.end_of_turn_token
        if end_of_turn is None:
            end = written.find(self.tokenizer.eos_token, reply_end)  # not an EOS text the reply quotes
            return written[:end] if end >= 0 else written
        end = written.find(end_of_turn, reply_end)
        return written[:end + len(end_of_turn)] if end >= 0 else written + end_of_turn

    def row(self, sample: Sample) -> dict:
        prompt = self.prompt(sample.turns)
        return {"prompt": prompt, "chosen": self.answer(sample.turns, sample.chosen, prompt),
                "rejected": self.answer(sample.turns, sample.rejected, prompt)}


def _is_special(tokenizer, token_id: int) -> bool:
    """Whether `token_id` is one of the tokenizer's special tokens (which a decoded reply leaves out)."""
    added = tokenizer.added_tokens_decoder.get(token_id)
    return token_id in tokenizer.all_special_ids or bool(added is not None and added.special)
