"""Tokenise samples into the items each phase trains on, dropping and counting what cannot fit.

- sft (phase 1): prompt + reply + EOS; labels are -100 on the prompt unless whole-sequence loss.
  Too long: the reply is truncated (the prompt kept); a prompt that alone fills `max_seq_len` is dropped.
  Under a chat template whose turns end in another special token than the EOS (Gemma's <end_of_turn>) the reply's
  text ends in that token and no EOS follows it (`PromptFormatter.answer_suffix_ids`): the answer ends where the
  model's turn does, at one of the tokens step 3 stops generating at (`PromptFormatter.stop_token_ids`).
- pairs (phase 2): prompt + chosen + EOS and prompt + rejected + EOS (ending as sft does), each cut to `max_seq_len`,
  with the shared prompt's length (`prompt_length`, one element: where the answers start, what DPO
  needs); pairs whose two sides are identical after the cut (nothing to compare) are dropped.
- prompts (phase 3): the prompt alone; over `max_prompt_seq_len` it is dropped, or left-truncated
  (its most recent tokens kept, after its BOS token if it began with its only one) with
  `prompt_overflow="left_truncate"`. When any sample has metadata, every item keeps its sample's (or {}).
Prompt and reply are tokenised as one text, as the model reads it: a SentencePiece tokenizer that prepends a
word boundary to every text it is given (Llama-2's, Mistral's) would otherwise begin each reply with a stray
'▁' token. The answer starts after the tokens the joint text shares with the prompt tokenised alone
(`answer_start`): all of the prompt's, unless a token spans the boundary.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Sequence

from tqdm.auto import tqdm

from utils.dist import is_main_process
from utils.errors import UserError, refuse_all

from .formatting import PROBE_REPLY, PROBE_TURNS, PromptFormatter
from .samples import KIND_PAIRS, KIND_PROMPTS, KIND_SFT, Sample, SkipRow
from .tokenized import ANSWER_TRUNCATED, TokenizedDataset

IGNORE_INDEX = -100
PROMPT_OVERFLOW = ("drop", "left_truncate")
_PROGRESS_MIN_ITEMS = 2000
_EMPTY_COLUMNS = {
    KIND_SFT: ("input_ids", "labels"),
    KIND_PAIRS: ("chosen_input_ids", "rejected_input_ids", "prompt_length"),
    KIND_PROMPTS: ("input_ids",),
}


def check_max_seq_len(max_seq_len: int) -> None:
    """A sequence holds a prompt token and a reply token at least."""
    if max_seq_len < 2:
        raise UserError(f"--max_seq_len must be at least 2 (a prompt token and a reply token), got {max_seq_len}")


def check_max_prompt_seq_len(max_prompt_seq_len: int) -> None:
    """A prompt holds one token at least."""
    if max_prompt_seq_len < 1:
        raise UserError(f"--max_prompt_seq_len must be at least 1, got {max_prompt_seq_len}")


def check_token_limits(max_seq_len: int, max_prompt_seq_len: int) -> None:
    """`check_max_seq_len` and `check_max_prompt_seq_len`, both refusals at once (every step's data build checks
    them, and so do the steps' flag checks, before anything loads)."""
    refuse_all(partial(check_max_seq_len, max_seq_len), partial(check_max_prompt_seq_len, max_prompt_seq_len))


@dataclass(frozen=True)
class TokenLimits:
    max_seq_len: int = 512
    max_prompt_seq_len: int = 256
    prompt_overflow: str = "drop"
    whole_sequence_loss: bool = False

    def __post_init__(self):
        if self.prompt_overflow not in PROMPT_OVERFLOW:
            raise UserError(f"--prompt_overflow must be one of {', '.join(PROMPT_OVERFLOW)}, not '{self.prompt_overflow}'")
        check_token_limits(self.max_seq_len, self.max_prompt_seq_len)

    def key(self, kind: str) -> dict:
        """The limits that change `kind`'s items (for the cache key)."""
        if kind == KIND_SFT:
            return {"max_seq_len": self.max_seq_len, "whole_sequence_loss": self.whole_sequence_loss}
        if kind == KIND_PAIRS:
            return {"max_seq_len": self.max_seq_len}
        return {"max_prompt_seq_len": self.max_prompt_seq_len, "prompt_overflow": self.prompt_overflow}


def _token_ids(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def answer_start(prompt: list[int], *joint: list[int]) -> int:
    """How many leading tokens the prompt tokenised alone shares with every prompt + reply tokenised as one text:
    where the replies start."""
    start = 0
    while start < len(prompt) and all(start < len(ids) and ids[start] == prompt[start] for ids in joint):
        start += 1
    return start


def _sft_item(prompt: list[int], answer: list[int], limits: TokenLimits) -> dict | str:
    if len(prompt) >= limits.max_seq_len:
        return "prompt_too_long"
    input_ids = (prompt + answer)[: limits.max_seq_len]
    labels = list(input_ids) if limits.whole_sequence_loss else [IGNORE_INDEX] * len(prompt) + input_ids[len(prompt) :]
    return {"input_ids": input_ids, "labels": labels}


def _pair_item(prompt: list[int], chosen: list[int], rejected: list[int], limits: TokenLimits) -> dict | str:
    if len(prompt) >= limits.max_seq_len:
        return "prompt_too_long"
    chosen_ids, rejected_ids = (prompt + chosen)[: limits.max_seq_len], (prompt + rejected)[: limits.max_seq_len]
    if chosen_ids == rejected_ids:
        return "identical_after_truncation"
    return {"chosen_input_ids": chosen_ids, "rejected_input_ids": rejected_ids, "prompt_length": [len(prompt)]}


def sft_sequence(prompt: list[int], joint: list[int], suffix: Sequence[int], limits: TokenLimits) -> dict | str:
    """The sft item of a prompt (tokenised alone) and prompt + reply (tokenised as one text), then `suffix` (the
    formatter's `answer_suffix_ids`), or why it is dropped."""
    start = answer_start(prompt, joint)
    return _sft_item(joint[:start], joint[start:] + list(suffix), limits)


def pair_sequences(prompt: list[int], chosen: list[int], rejected: list[int], suffix: Sequence[int],
                   limits: TokenLimits) -> dict | str:
    """The pairs item of a prompt (tokenised alone) and prompt + chosen, prompt + rejected (each tokenised as one
    text), each then `suffix` (the formatter's `answer_suffix_ids`), or why it is dropped."""
    start = answer_start(prompt, chosen, rejected)
    return _pair_item(chosen[:start], chosen[start:] + list(suffix), rejected[start:] + list(suffix), limits)


def _answer_cut(limits: TokenLimits, suffix: Sequence[int], *joints: list[int]) -> bool:
    """Whether a kept item holds an answer only in part: a prompt + answer (+ `suffix`) longer than --max_seq_len is
    cut there, its end-of-turn token or EOS with it, so the model learns (or a pair is scored on) an unfinished
    answer."""
    return any(len(joint) + len(suffix) > limits.max_seq_len for joint in joints)


def _prompt_item(prompt: list[int], bos: int | None, limits: TokenLimits, counts: Counter) -> dict | str:
    """The prompts item, left-truncated or dropped when too long. A truncated prompt that begins with the BOS token
    keeps it in front of its most recent tokens: a model trained with BOS first (Llama's, Mistral's) reads a text
    without it off its training distribution. Not where that token recurs in the prompt: a template that opens every
    turn with the token its tokenizer names BOS (SmolLM2's <|im_start|>) would put a turn marker before a fragment."""
    if len(prompt) > limits.max_prompt_seq_len:
        if limits.prompt_overflow == "drop":
            return "prompt_too_long"
        counts["left_truncated"] += 1
        keep_bos = bos is not None and prompt[0] == bos and prompt.count(bos) == 1 and limits.max_prompt_seq_len > 1
        prompt = prompt[:keep_bos] + prompt[len(prompt) - limits.max_prompt_seq_len + keep_bos:]
    return {"input_ids": prompt}


def tokenize_samples(
    samples: list[Sample], kind: str, formatter: PromptFormatter, tokenizer, limits: TokenLimits
) -> TokenizedDataset:
    """Items for `kind` from `samples` (order kept); `stats` counts items and drops per reason."""
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token; set eos_token in its tokenizer_config.json")
    counts: Counter = Counter()
    rows, row_metadata = [], []
    for sample in tqdm(samples, desc=f"formatting {kind}", disable=not is_main_process() or len(samples) < _PROGRESS_MIN_ITEMS):
        try:
            rows.append(formatter.row(sample))
        except SkipRow as skip:
            counts[f"dropped:{skip.reason}"] += 1
            continue
        row_metadata.append(dict(sample.metadata or {}))
    keep_metadata = kind == KIND_PROMPTS and any(sample.metadata is not None for sample in samples)
    metadata: list[dict] = []
    special, suffix = formatter.adds_special_tokens, formatter.answer_suffix_ids
    prompts = _token_ids(tokenizer, [row["prompt"] for row in rows], special)
    chosen = _token_ids(tokenizer, [row["prompt"] + row["chosen"] for row in rows], special) \
        if kind != KIND_PROMPTS else []
    rejected = _token_ids(tokenizer, [row["prompt"] + row["rejected"] for row in rows], special) \
        if kind == KIND_PAIRS else []
    columns: dict[str, list] = {}
    answer_cut_items: list[int] = []
    for index, prompt in enumerate(prompts):
        if kind == KIND_SFT:
            item = sft_sequence(prompt, chosen[index], suffix, limits)
        elif kind == KIND_PAIRS:
            item = pair_sequences(prompt, chosen[index], rejected[index], suffix, limits)
        else:
            item = _prompt_item(prompt, tokenizer.bos_token_id, limits, counts)
        if isinstance(item, str):
            counts[f"dropped:{item}"] += 1
            continue
        if kind != KIND_PROMPTS and _answer_cut(limits, suffix, chosen[index], *rejected[index:index + 1]):
            counts[ANSWER_TRUNCATED] += 1
            answer_cut_items.append(len(next(iter(columns.values()), [])))
        for name, ids in item.items():
            columns.setdefault(name, []).append(ids)
        if keep_metadata:
            metadata.append(row_metadata[index])
    counts["items"] = len(next(iter(columns.values()), []))
    if not columns:
        columns = {name: [] for name in _EMPTY_COLUMNS[kind]}
    return TokenizedDataset.from_lists(columns, dict(counts), metadata if keep_metadata else None, answer_cut_items)


def probe_tokens(formatter: PromptFormatter, tokenizer) -> list[int] | None:
    """A short prompt and reply (`PROBE_TURNS`, `PROBE_REPLY`) as the steps lay them out for `formatter` and
    `tokenizer` (prompt + reply + the end of the model's turn): where two give other tokens, a model trained on one's
    rows reads the other's unlike anything it was trained on. None where the chat template refuses the exchange."""
    items = tokenize_samples([Sample(PROBE_TURNS, PROBE_REPLY)], KIND_SFT, formatter, tokenizer, TokenLimits())
    return items[0]["input_ids"].tolist() if len(items) else None
