"""The internal unit every reader produces: a dialogue context plus optional replies.

A `Sample` keeps the conversation as a list of turns so the prompt can be rendered with the
tokenizer's chat template (or the DeepSpeed-Chat " Human: ... Assistant:" fallback) later,
once the tokenizer is known. `SkipRow` carries the reason a raw record was unusable; reasons are
counted per source and reported in one log line.
"""
from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"

# Speaker names used by the supported formats, mapped to chat-template roles.
ROLE_ALIASES = {
    "human": USER,
    "user": USER,
    "prompter": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bing": ASSISTANT,
    "bard": ASSISTANT,
    "assistant": ASSISTANT,
    "model": ASSISTANT,
    "system": SYSTEM,
}

# What each phase needs from a sample.
KIND_SFT, KIND_PAIRS, KIND_PROMPTS = "sft", "pairs", "prompts"
KINDS = (KIND_SFT, KIND_PAIRS, KIND_PROMPTS)
PHASE_KINDS = {1: KIND_SFT, 2: KIND_PAIRS, 3: KIND_PROMPTS}


class SkipRow(Exception):
    """A raw record cannot be used; `reason` is a short key such as `empty:chosen`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class SkippedRows(Counter):
    """Rows skipped, counted per reason, with where the first few of each were (a local file's name and line), so
    the report points at rows to fix."""

    EXAMPLES = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.examples: dict[str, list[str]] = {}

    def skip(self, reason: str, where: str | None = None) -> None:
        self[reason] += 1
        places = self.examples.setdefault(reason, [])
        if where is not None and len(places) < self.EXAMPLES:
            places.append(where)

    def copy(self) -> SkippedRows:
        copied = SkippedRows(self)
        copied.examples = {reason: list(places) for reason, places in self.examples.items()}
        return copied

    def report(self) -> str:
        """ "reason=count (where, ...), ..." in reason order; "none" when nothing was skipped."""
        return ", ".join(f"{reason}={count}{self._places(reason, count)}" for reason, count in sorted(self.items())) \
            or "none"

    def _places(self, reason: str, count: int) -> str:
        places = self.examples.get(reason, [])
        return f" ({', '.join(places)}{', ...' if count > len(places) else ''})" if places else ""


@dataclass(frozen=True)
class Sample:
    """`turns`: the conversation before the assistant reply; `chosen`/`rejected`: replies (stripped;
    None when absent, "" for an explicitly empty reply).

    `group` is the index of the raw record the sample came from, so samples of one conversation
    can be told apart from samples of another (the embedded pair rule relies on it).
    `metadata` is the row's JSON-like extra data (e.g. {"answer": "42"} for a verifier); step 3's
    prompt items carry it to the trainer.
    `reply_error` is why the row's reply columns could not be read (a `SkipRow` reason; no replies then): the steps
    that train on replies skip the sample for it, step 3, which reads only the prompt, keeps it.
    """

    turns: tuple
    chosen: str | None = None
    rejected: str | None = None
    group: int = 0
    metadata: Mapping[str, Any] | None = None
    reply_error: str | None = None


def comparable_text(text: str) -> str:
    """`text` as two records or samples are compared for being the same text (a record's copy at load, a held-out
    sample the step trains on): Unicode compatibility forms folded (NFKC: a no-break or full-width space, a ligature)
    and every run of whitespace (line ends of either kind, tabs, doubled spaces) one space. Texts that differ only so
    are the same text to a model reading its tokens."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def comparable_turns(turns: tuple) -> list[dict]:
    """`turns` with each content as `comparable_text`."""
    return [{"role": turn["role"], "content": comparable_text(turn["content"])} for turn in turns]


def unusable_reason(sample: Sample, kind: str) -> str | None:
    """Why `sample` cannot serve `kind` (None when it can)."""
    if not sample.turns:
        return "no_prompt"
    if kind == KIND_PROMPTS:
        return None
    if sample.reply_error is not None:
        return sample.reply_error
    if sample.chosen is None:
        return "no_chosen"
    if kind == KIND_SFT and not sample.chosen:
        return "empty_reply"
    if kind == KIND_PAIRS:
        if sample.rejected is None:
            return "no_rejected"
        if comparable_text(sample.chosen) == comparable_text(sample.rejected):  # they differ in spacing alone
            return "identical_replies"
    return None


def text_field(record: Any, key: str) -> str:
    """The stripped, non-empty string at `record[key]`, or `SkipRow` saying what is wrong with it."""
    if not isinstance(record, dict):
        raise SkipRow("not_an_object")
    if key not in record or record[key] is None:
        raise SkipRow(f"missing:{key}")
    value = record[key]
    if not isinstance(value, str):
        raise SkipRow(f"wrong_type:{key}")
    value = value.strip()
    if not value:
        raise SkipRow(f"empty:{key}")
    return value


def optional_text_field(record: dict, key: str) -> str | None:
    """Like `text_field`, but an absent (or null) column is simply None."""
    if record.get(key) is None:
        return None
    return text_field(record, key)


def _is_plain(value: Any) -> bool:
    """JSON-like data that `torch.load(weights_only=True)` reads back: dicts with str keys, lists, scalars."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain(item) for key, item in value.items())
    return False


METADATA_COLUMN = "metadata"  # a row's dict of extra data


def metadata_field(record: Any, key: str = METADATA_COLUMN) -> dict | None:
    """The dict at `record[key]` (None when the column is absent or null), or `SkipRow` when it is not plain JSON."""
    if not isinstance(record, dict) or record.get(key) is None:
        return None
    value = record[key]
    if not isinstance(value, dict) or not _is_plain(value):
        raise SkipRow(f"wrong_type:{key}")
    return value
