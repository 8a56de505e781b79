"""Parse dialogues into `{role, content}` turns: hh-rlhf transcripts and chat message lists."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .samples import ASSISTANT, ROLE_ALIASES, USER, SkipRow

# a blank line is "\n\n" or, in a transcript written with Windows line ends, "\r\n\r\n"
BLANK_LINE = r"\r?\n\r?\n"
_BLANK_LINE_MARKER = re.compile(rf"(?:\A\s*|{BLANK_LINE})(Human|Assistant):")
_MARKER_AFTER_BLANK_LINE = re.compile(rf"{BLANK_LINE}(?:Human|Assistant):")
_INLINE_MARKER = re.compile(r"(?:^|\s)(Human|Assistant):")
_MARKER_ROLES = {"Human": USER, "Assistant": ASSISTANT}
# speakers of a tool call and its result, which a skip reason names: any other speaker is text of a data set's own
# (a role-play character), and naming each would grow the report without bound
TOOL_SPEAKERS = frozenset({"tool", "function", "function_call", "ipython", "observation"})
UNKNOWN_ROLE = "unknown_role"  # the skip reason of a speaker no prompt format has a turn for


def parse_transcript(text: str) -> list[dict]:
    """Split "\\n\\nHuman: ...\\n\\nAssistant: ..." (or " Human: ... Assistant: ...") into turns; its blank lines may
    be Windows' "\\r\\n\\r\\n".

    Text without speaker markers is one user turn. A trailing empty "Assistant:" (the
    DeepSpeed-Chat prompt ending) yields no turn. Empty turns are dropped.
    """
    if _MARKER_AFTER_BLANK_LINE.search(text):
        pattern = _BLANK_LINE_MARKER
    elif text.lstrip().startswith(("Human:", "Assistant:")):
        pattern = _INLINE_MARKER
    else:
        return clean_turns([{"role": USER, "content": text}])
    pieces = pattern.split(text)
    turns = []
    if pieces[0].strip():
        turns.append({"role": USER, "content": pieces[0]})
    for speaker, content in zip(pieces[1::2], pieces[2::2]):
        turns.append({"role": _MARKER_ROLES[speaker], "content": content})
    return clean_turns(turns)


def message_text(content: Any, content_key: str) -> str | None:
    """The text of a message's content (`content_key` names its column): a string, or the text parts of a multimodal
    part list; None where it holds no text (null, or only other parts: an image). Content of another type (a number,
    an object, a list of bare strings) is `SkipRow`: dropped as no text, it merged the turns around it (a question, an
    unreadable answer, a question: one question) or left the row's reply out under another reason."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(_is_content_part(part) for part in content):
        raise SkipRow(f"wrong_type:{content_key}")
    texts = [part["text"] for part in content if _is_text_part(part)]
    return "\n".join(texts) if texts else None


def _is_text_part(part: dict) -> bool:
    return part.get("type", "text") == "text"


def _is_content_part(part: Any) -> bool:
    """A part of a multimodal content list: an object, with a string `text` where it is a text part."""
    return isinstance(part, dict) and (not _is_text_part(part) or isinstance(part.get("text"), str))


def parse_messages(messages: Any, role_key: str, content_key: str, context: Sequence[dict] = ()) -> list[dict]:
    """Turn a list of message dicts (ShareGPT from/value, or role/content) into clean turns.

    Messages without text (an image) and empty ones are dropped; an unknown speaker, or content of a type that holds
    no text, makes the whole row unusable. `context`: the turns
    parsed already of messages that come before these (a chat row's prompt), which are not read again: the result
    is that of parsing those messages and these together.
    """
    if not isinstance(messages, list):
        raise SkipRow("wrong_type:messages")
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            raise SkipRow("wrong_type:message")
        role = _role(message, role_key)
        if role is None:
            raise SkipRow(_unknown_role(message.get(role_key)))
        text = message_text(message.get(content_key), content_key)
        if text is not None:
            turns.append({"role": role, "content": text})
    return clean_turns([*context, *turns])


def _unknown_role(speaker: Any) -> str:
    """The skip reason of a message whose speaker is no role the prompt formats have a turn for: a tool call or its
    result (`unknown_role:tool`, `:function`, `:function_call`, `:ipython`, `:observation`) is not trained on, and
    its row not read in part (the reply would answer a tool output the prompt leaves out). Other speakers are
    `unknown_role` alone."""
    named = speaker.strip().lower() if isinstance(speaker, str) else None
    return f"{UNKNOWN_ROLE}:{named}" if named in TOOL_SPEAKERS else UNKNOWN_ROLE


def _role(message: dict, role_key: str) -> str | None:
    speaker = message.get(role_key)
    return ROLE_ALIASES.get(speaker.lower()) if isinstance(speaker, str) else None


def is_empty_reply(message: Any, role_key: str, content_key: str) -> bool:
    """Whether `message` is an assistant message with blank text: an empty answer, which can be the preferred one
    (`parse_messages` drops it as an empty turn)."""
    if not isinstance(message, dict) or _role(message, role_key) != ASSISTANT:
        return False
    text = message_text(message.get(content_key), content_key)
    return text is not None and not text.strip()


def clean_turns(turns: list[dict]) -> list[dict]:
    """Strip contents, drop empty turns and leading assistant turns, merge consecutive same-role turns."""
    cleaned: list[dict] = []
    for turn in turns:
        content = turn["content"].strip()
        if not content:
            continue
        if not cleaned and turn["role"] == ASSISTANT:
            continue
        if cleaned and cleaned[-1]["role"] == turn["role"]:
            cleaned[-1] = {"role": turn["role"], "content": cleaned[-1]["content"] + "\n\n" + content}
        else:
            cleaned.append({"role": turn["role"], "content": content})
    return cleaned


def split_last_reply(turns: list[dict]) -> tuple[list[dict], str | None]:
    """(context, reply): the reply is the last turn when it is the assistant's, else None."""
    if turns and turns[-1]["role"] == ASSISTANT:
        return turns[:-1], turns[-1]["content"]
    return turns, None
