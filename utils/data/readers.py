"""One parser per supported row format; each maps a raw record to `Sample`s or raises `SkipRow`.

Formats (state one as `PATH:FORMAT`, or let `detect_format` pick it from the columns and their values' types):
- `deepspeed_chat`: `prompt` [+ `chosen`, `response` or `completion`] [+ `rejected`] (Dahoas/rm-static,
  Dahoas/full-hh-rlhf, Dahoas/synthetic-instruct-gptj-pairwise; TRL's standard prompt-only, prompt-completion and
  explicit-prompt preference rows, and its unpaired preference rows, whose completion labelled false is no reply to
  learn, its prompt kept); a prompt holding
  "Human:/Assistant:" markers is parsed into turns; a blank reply is "", as in `hh_rlhf`.
- `hh_rlhf`: `chosen`/`rejected` full transcripts (Anthropic/hh-rlhf); split at the last
  Assistant turn, the shared prompt is everything before it. An empty last Assistant turn is
  kept as the reply "" (usable in pairs, not for SFT). A row one side of which does not read (no `chosen`) gives step 3
  the prompt of the other.
- `shp`: `history`, `human_ref_A`, `human_ref_B`, `labels` (stanfordnlp/SHP; label 1 = A preferred; a row without
  a 0/1 label gives step 3 its prompt).
- `webgpt`: `question.full_text`, `answer_0/1`, `score_0/1` (openai/webgpt_comparisons; a tie is no pair,
  its prompt kept for step 3).
- `sharegpt`: `conversations` of {from, value}; `messages`: `messages` of {role, content}.
  A conversation gives one sample: the turns before its last assistant reply, and that reply
  (a conversation that ends on a user turn gives a prompt only).
- `chat_preference`: `chosen` [+ `rejected`] lists of {role, content} messages, each read after the `prompt`
  message list where there is one (TRL's conversational preference, explicit prompt) or holding the whole
  conversation (TRL's implicit prompt; HuggingFaceH4/ultrafeedback_binarized, whose string `prompt` copies the first
  user turn and is not read). Each side's reply is its last assistant message (an empty one is "", as in `hh_rlhf`),
  the turns before it the context, which must be the same on both sides.
- `chat_prompt`: a `prompt` message list [+ a `completion` message list ending on the assistant's reply] (TRL's
  conversational prompt-only and prompt-completion; in its unpaired preference rows a completion labelled false is
  no reply to learn); a prompt alone is read as a `messages` conversation.

`with_row_metadata` wraps any of them so a row's dict column `metadata` (e.g. {"answer": "42"})
reaches its samples.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from .samples import Sample, SkipRow, metadata_field, optional_text_field, text_field
from .turns import BLANK_LINE, UNKNOWN_ROLE, is_empty_reply, parse_messages, parse_transcript, split_last_reply

Parser = Callable[[Any, int], list]
_EMPTY_LAST_REPLY = re.compile(rf"(?:\A|{BLANK_LINE})Assistant:\s*\Z")
_REPLY_KEYS = ("chosen", "response", "completion")  # the preferred (or only) reply's column, in the order looked for
PROMPT_MISMATCH = "prompt_mismatch"  # a pair's two sides hold other contexts: no prompt of the row's


def _with_replies(prompt: list[dict], group: int, read: Callable[[], list[Sample]]) -> list[Sample]:
    """The samples `read` makes of a row whose prompt (`prompt`, read already) is usable; where its reply columns are
    not (`read` raises `SkipRow`), the prompt alone with that reason: step 3 reads only the prompt."""
    try:
        return read()
    except SkipRow as skip:
        return [Sample(tuple(prompt), group=group, reply_error=skip.reason)]


def parse_deepspeed_chat(record: Any, group: int) -> list[Sample]:
    turns = parse_transcript(text_field(record, "prompt"))

    def read() -> list[Sample]:
        chosen_key = next((key for key in _REPLY_KEYS if record.get(key) is not None), "chosen")
        chosen = _reply_field(record, chosen_key)
        if chosen_key == "completion":
            chosen = _desirable(record, chosen)
        return [Sample(tuple(turns), chosen, _reply_field(record, "rejected"), group)]

    return _with_replies(turns, group, read)


def _desirable(record: dict, completion: str | None) -> str | None:
    """A completion as the reply to learn, or None where the row's `label` marks it undesirable (TRL's unpaired
    preference rows, as KTO trains on: false labels the answer one not to give); the row's prompt stays usable."""
    label = record.get("label")
    return None if isinstance(label, (bool, int)) and not label else completion


def _reply_field(record: dict, key: str) -> str | None:
    """A reply column: None where absent, "" where blank (Dahoas' copy of hh-rlhf writes the empty preferred answer
    to a harmful request as " ", which `hh_rlhf` reads as "" too: usable in pairs, not for SFT)."""
    value = record.get(key)
    if isinstance(value, str) and not value.strip():
        return ""
    return optional_text_field(record, key)


def _dialogue_reply(record: dict, key: str) -> tuple[list[dict], str]:
    """(context, reply) of a transcript; a transcript ending on an empty "Assistant:" turn has the
    reply "" (in hh-rlhf an empty answer can be the preferred one, e.g. to a harmful request)."""
    transcript = text_field(record, key)
    if _EMPTY_LAST_REPLY.search(transcript):
        return parse_transcript(transcript), ""
    context, reply = split_last_reply(parse_transcript(transcript))
    if reply is None:
        raise SkipRow(f"no_assistant_reply:{key}")
    return context, reply


def _paired_replies(record: dict, group: int, reply_of: Callable[[str], tuple[list[dict], str]]) -> list[Sample]:
    """The sample of a row whose `chosen` and optional `rejected` each hold their context: `reply_of(key)` gives
    (context, reply), and the two contexts must be the same."""
    chosen_context, chosen = reply_of("chosen")
    if record.get("rejected") is None:
        return [Sample(tuple(chosen_context), chosen, None, group)]
    rejected_context, rejected = reply_of("rejected")
    if rejected_context != chosen_context:
        raise SkipRow(PROMPT_MISMATCH)
    return [Sample(tuple(chosen_context), chosen, rejected, group)]


def _paired_replies_or_prompt(record: dict, group: int,
                              reply_of: Callable[[str], tuple[list[dict], str]]) -> list[Sample]:
    """`_paired_replies`, or where one side does not read (a missing or empty `chosen`, a `rejected` without an
    assistant reply), the context of the side that does, alone with that reason: step 3 reads only the prompt, which
    each side carries. Sides whose contexts differ, or a speaker the prompt formats have no turn for, give none; nor
    does a side holding no context (a bare empty assistant turn): the row is skipped for the other side's reason,
    which names the column that holds, or should hold, the conversation, not as `no_prompt`."""
    try:
        return _paired_replies(record, group, reply_of)
    except SkipRow as skip:
        if skip.reason == PROMPT_MISMATCH or skip.reason.startswith(UNKNOWN_ROLE):  # the row's, not one reply's
            raise
        for key in ("chosen", "rejected"):
            try:
                context, _ = reply_of(key)
            except SkipRow:
                continue
            if context:
                return [Sample(tuple(context), group=group, reply_error=skip.reason)]
        raise


def parse_hh_rlhf(record: Any, group: int) -> list[Sample]:
    return _paired_replies_or_prompt(record, group, lambda key: _dialogue_reply(record, key))


def _message_list(record: dict, key: str) -> list:
    value = record.get(key)
    if not isinstance(value, list):
        raise SkipRow(f"wrong_type:{key}" if value is not None else f"missing:{key}")
    return value


def _chat_reply(record: dict, prompt: list, prompt_turns: list[dict], key: str) -> tuple[list[dict], str]:
    """(context, reply) of the `prompt` messages (parsed already: `prompt_turns`) followed by the message list at
    `record[key]`, which must end on an assistant message; an empty one is the reply "" (as an empty last
    "Assistant:" turn of a transcript is)."""
    messages = _message_list(record, key)
    conversation = prompt + messages
    if conversation and is_empty_reply(conversation[-1], "role", "content"):
        return parse_messages(messages[:-1], "role", "content", prompt_turns), ""
    context, reply = split_last_reply(parse_messages(messages, "role", "content", prompt_turns))
    if reply is None:
        raise SkipRow(f"no_assistant_reply:{key}")
    return context, reply


def parse_chat_preference(record: Any, group: int) -> list[Sample]:
    if not isinstance(record, dict):
        raise SkipRow("not_an_object")
    if isinstance(record.get("prompt"), (str, type(None))):  # each side holds the whole conversation
        return _paired_replies_or_prompt(record, group, lambda key: _chat_reply(record, [], [], key))
    prompt = _message_list(record, "prompt")
    turns = parse_messages(prompt, "role", "content")
    return _with_replies(turns, group,
                         lambda: _paired_replies(record, group, lambda key: _chat_reply(record, prompt, turns, key)))


def parse_chat_prompt(record: Any, group: int) -> list[Sample]:
    if not isinstance(record, dict):
        raise SkipRow("not_an_object")
    prompt = _message_list(record, "prompt")
    turns = parse_messages(prompt, "role", "content")
    if record.get("completion") is None:
        context, reply = split_last_reply(turns)
        return [Sample(tuple(context), reply, None, group)]

    def read() -> list[Sample]:
        context, reply = _chat_reply(record, prompt, turns, "completion")
        return [Sample(tuple(context), _desirable(record, reply), None, group)]

    return _with_replies(turns, group, read)


def parse_shp(record: Any, group: int) -> list[Sample]:
    prompt = [{"role": "user", "content": text_field(record, "history")}]

    def read() -> list[Sample]:
        reply_a, reply_b = text_field(record, "human_ref_A"), text_field(record, "human_ref_B")
        label = record.get("labels")
        if isinstance(label, bool) or label not in (0, 1):
            raise SkipRow("wrong_type:labels" if label is not None else "missing:labels")
        chosen, rejected = (reply_a, reply_b) if label == 1 else (reply_b, reply_a)
        return [Sample(tuple(prompt), chosen, rejected, group)]

    return _with_replies(prompt, group, read)


def parse_webgpt(record: Any, group: int) -> list[Sample]:
    if not isinstance(record, dict):
        raise SkipRow("not_an_object")
    question = record.get("question")
    question_text = text_field(question, "full_text") if isinstance(question, dict) else text_field(record, "question")
    prompt = [{"role": "user", "content": question_text}]

    def read() -> list[Sample]:
        answers = [text_field(record, "answer_0"), text_field(record, "answer_1")]
        scores = [record.get("score_0"), record.get("score_1")]
        for index, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise SkipRow(f"wrong_type:score_{index}" if score is not None else f"missing:score_{index}")
        if scores[0] == scores[1]:
            raise SkipRow("tie")
        best = 0 if scores[0] > scores[1] else 1
        return [Sample(tuple(prompt), answers[best], answers[1 - best], group)]

    return _with_replies(prompt, group, read)


def _conversation_parser(column: str, role_key: str, content_key: str) -> Parser:
    def parse(record: Any, group: int) -> list[Sample]:
        if not isinstance(record, dict):
            raise SkipRow("not_an_object")
        if record.get(column) is None:
            raise SkipRow(f"missing:{column}")
        context, reply = split_last_reply(parse_messages(record[column], role_key, content_key))
        if not context and reply is None:
            raise SkipRow(f"empty:{column}")
        return [Sample(tuple(context), reply, None, group)]

    return parse


PARSERS: dict[str, Parser] = {
    "deepspeed_chat": parse_deepspeed_chat,
    "hh_rlhf": parse_hh_rlhf,
    "shp": parse_shp,
    "webgpt": parse_webgpt,
    "sharegpt": _conversation_parser("conversations", "from", "value"),
    "messages": _conversation_parser("messages", "role", "content"),
    "chat_preference": parse_chat_preference,
    "chat_prompt": parse_chat_prompt,
}
FORMATS = tuple(PARSERS)


def with_row_metadata(parse: Parser) -> Parser:
    """`parse`, with the record's `metadata` dict attached to every sample it gives."""

    def parse_with_metadata(record: Any, group: int) -> list[Sample]:
        metadata = metadata_field(record)
        samples = parse(record, group)
        return samples if metadata is None else [replace(sample, metadata=metadata) for sample in samples]

    return parse_with_metadata


def detect_format(columns: Mapping[str, Any]) -> str | None:
    """Pick a format from a record (or each column's name and a value of it); None when nothing matches.

    Names alone are ambiguous where a column may hold a string or a message list: ultrafeedback_binarized has
    `messages` besides its `chosen`/`rejected` lists, and a TRL `prompt` may be either."""
    names = set(columns)
    if isinstance(columns.get("chosen"), list):
        return "chat_preference"
    if "conversations" in names:
        return "sharegpt"
    if "messages" in names:
        return "messages"
    if {"history", "human_ref_A", "human_ref_B"} <= names:
        return "shp"
    if {"question", "answer_0", "answer_1"} <= names:
        return "webgpt"
    if isinstance(columns.get("prompt"), list):
        return "chat_prompt"
    if "prompt" in names:
        return "deepspeed_chat"
    if {"chosen", "rejected"} <= names:
        return "hh_rlhf"
    return None
