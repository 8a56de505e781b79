"""Unsupervised text for step 3's pretraining mixture: documents tokenised (each begun as the tokenizer begins a text:
its BOS where it adds one), joined with EOS and cut
into fixed-length blocks (`input_ids` = `labels`), shuffled with the seed and cached on disk.

Sources: a hub name (with an optional config) through `datasets`, a local .txt file (documents
separated by blank lines, not a line each: a hard-wrapped paragraph is one) or folder of .txt files (each read so, in
name order: a file's end ends a document; a README.txt or LICENSE.txt among them warned of), a
local .json/.jsonl/.parquet file or folder with a text column (`text`, or the one `--unsupervised_text_column` names),
or
`embedded`: the assistant replies of the embedded ShareGPT conversations that step 3 trains on (its
shard less the held-out part, as `ShardSettings` cuts them), so the text never holds a reply that
another step trains on or that step 3's evaluation compares against.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from utils.errors import UserError

from . import embedded
from .cache import build_or_load, cache_file, tokenizer_fingerprint
from .jsonio import utf8_text
from .local_files import RecordOrigins, local_files, local_text_files, read_local_files
from .samples import ASSISTANT, ROLE_ALIASES, SkippedRows, SkipRow, text_field
from .sources import (
    file_fingerprint,
    load_hub_dataset,
    load_source,
    looks_local,
    parse_source_spec,
)
from .splits import ShardSettings
from .tokenized import TokenizedDataset

logger = logging.getLogger("utils.data")
_BATCH_DOCS = 512


EMBEDDED_PHASE = 3  # the step whose training conversations give the embedded text


def _embedded_texts(shard: ShardSettings | None) -> list[str]:
    if shard is None:
        raise ValueError("the embedded unsupervised text is cut from step 3's shard: pass its ShardSettings")
    conversations = load_source(parse_source_spec(embedded.EMBEDDED_SOURCE)).records  # as the steps shard them
    train, _ = shard.records(len(conversations), EMBEDDED_PHASE)
    return [
        message["value"].strip()
        for index in train.tolist()
        for message in conversations[index].get("conversations", [])
        if ROLE_ALIASES.get(str(message.get("from")).lower()) == ASSISTANT
        and isinstance(message.get("value"), str) and message["value"].strip()
    ]


def _column_texts(records, text_column: str, skipped: SkippedRows, origins: RecordOrigins | None = None) -> list[str]:
    """The text of each record's `text_column`; a record without one is counted in `skipped`, where it was read
    (`origins`) named."""
    texts = []
    for index, record in enumerate(records):
        try:
            texts.append(text_field(record, text_column))
        except SkipRow as skip:
            skipped.skip(skip.reason, origins(index) if origins is not None else None)
    return texts


def _check_local_column(records: list, text_column: str, source: str) -> None:
    """Refuse a file none of whose rows has the text column: every row would be skipped, and the run would
    stop later on 'no block' with the cause only in a warning."""
    rows = [record for record in records if isinstance(record, dict)]
    if rows and not any(text_column in row for row in rows):
        columns = sorted({key for row in rows for key in row})
        raise UserError(f"unsupervised data '{source}' has no '{text_column}' column in any row (its rows have "
                        f"{columns}); the pretraining mixture reads each document from --unsupervised_text_column "
                        f"'{text_column}'")


def _text_file_documents(path: Path) -> list[str]:
    """The documents of a .txt file: its text between blank lines."""
    paragraphs = re.split(r"\n\s*\n", utf8_text(path.read_bytes(), path))
    return [p.strip() for p in paragraphs if p.strip()]


# The names (before the first ".", any case) a folder's notes, licence or change log go by: read as text to train on
# like any .txt file of the folder, so warned of, not left out by a guess at what they hold.
_NOTES_NAMES = frozenset({"README", "LICENSE", "LICENCE", "COPYING", "NOTICE", "CHANGELOG", "CHANGES", "AUTHORS",
                          "CONTRIBUTING", "CITATION"})


def _text_files_documents(source: str, files: list[Path]) -> list[str]:
    """The documents of a source's .txt files, each file read as one .txt file is; said in the log with how many
    files gave them, and a folder's files named as its notes or licence are (README.txt, LICENSE.txt) warned of."""
    documents = [document for file in files for document in _text_file_documents(file)]
    logger.info("unsupervised source '%s': %d documents (text between blank lines) from %d .txt file%s", source,
                len(documents), len(files), "" if len(files) == 1 else "s")
    notes = _notes_files(Path(source).expanduser(), files)
    if notes:
        many = len(notes) > 1
        logger.warning("unsupervised source '%s' reads %s as pretraining text, as it reads every .txt file of the "
                       "folder; move %s out of it if %s not text to train on", source, ", ".join(notes),
                       "them" if many else "it", "they are" if many else "it is")
    return documents


def _notes_files(folder: Path, files: list[Path]) -> list[str]:
    """The files of `folder` (none where it is a file) named as a folder's notes or licence are, by their path in it."""
    if not folder.is_dir():
        return []
    return [str(file.relative_to(folder)) for file in files if file.name.split(".")[0].upper() in _NOTES_NAMES]


def load_texts(
    source: str, text_column: str = "text", config_name: str | None = None, shard: ShardSettings | None = None
) -> tuple[list[str], SkippedRows]:
    """The source's documents, and counts of rows skipped per reason; `shard` cuts the embedded source."""
    skipped = SkippedRows()
    if source == embedded.EMBEDDED_SOURCE:
        return _embedded_texts(shard), skipped
    if looks_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"unsupervised data path {source} does not exist")
        text_files = local_text_files(path)
        if text_files:
            return _text_files_documents(source, text_files), skipped
        files = read_local_files(path, skipped)
        records = [record for file in files for record in file.records]
        _check_local_column(records, text_column, source)
        return _column_texts(records, text_column, skipped, RecordOrigins.of(files)), skipped
    dataset, origins = load_hub_dataset(source, config_name, split="train")
    if text_column not in dataset.column_names:
        raise UserError(f"unsupervised dataset '{source}' has no '{text_column}' column (it has {dataset.column_names}); "
                        "name the one to read with --unsupervised_text_column")
    return _column_texts(({text_column: text} for text in dataset[text_column]), text_column, skipped, origins), skipped


def text_source_fingerprint(source: str, config_name: str | None = None, shard: ShardSettings | None = None) -> dict:
    """What identifies the text source's content, without reading it (part of the cache key)."""
    if source == embedded.EMBEDDED_SOURCE:
        shard_key = shard.key() if shard is not None else None
        return {"source": source, "files": file_fingerprint([embedded.embedded_data_file()]), "shard": shard_key}
    if looks_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"unsupervised data path {source} does not exist")
        # the files `load_texts` reads: a folder's (hidden and "_" names left out), a file itself
        files = local_text_files(path) or (local_files(path) if path.is_dir() else [path])
        return {"source": source, "files": file_fingerprint(files)}
    return {"source": source, "config": config_name, "hub": True}


def _blocks(texts: list[str], tokenizer, block_size: int, seed: int, max_blocks: int | None) -> list[list[int]]:
    """Tokenise documents in seeded order until `max_blocks` blocks are filled (all when None).

    Each document begins as the tokenizer begins a text (its special tokens: a Llama-style BOS, which the model read
    at the start of every pretraining document; none for GPT-2's or SmolLM2's) and ends in EOS. `load_tokenizer`
    turns off a tokenizer's own EOS appending, which would end each document in two."""
    order = np.random.RandomState(seed).permutation(len(texts))
    stream: list[int] = []
    needed = None if max_blocks is None else max_blocks * block_size
    for start in range(0, len(order), _BATCH_DOCS):
        batch = [texts[i] for i in order[start : start + _BATCH_DOCS]]
        for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
            stream.extend(ids + [tokenizer.eos_token_id])
        if needed is not None and len(stream) >= needed:
            break
    count = len(stream) // block_size if max_blocks is None else min(max_blocks, len(stream) // block_size)
    return [stream[i * block_size : (i + 1) * block_size] for i in range(count)]


def build_unsupervised_dataset(
    source: str,
    tokenizer,
    block_size: int,
    seed: int,
    data_output_path: str,
    rebuild_cache: bool = False,
    config_name: str | None = None,
    text_column: str = "text",
    max_blocks: int | None = None,
    shard: ShardSettings | None = None,
) -> TokenizedDataset:
    """Blocks of `block_size` tokens with `input_ids`, `attention_mask` and `labels` (= input_ids).

    `shard`: the run's data settings, which pick the embedded source's conversations (see the module docstring).
    """
    if block_size < 2:
        raise UserError("the unsupervised block size must be at least 2 tokens")

    def build() -> dict:
        texts, skipped = load_texts(source, text_column, config_name, shard)
        logger.log(logging.WARNING if skipped else logging.INFO,
                   "unsupervised source '%s': %d documents; skipped: %s", source, len(texts), skipped.report())
        blocks = _blocks(texts, tokenizer, block_size, seed, max_blocks)
        if not blocks:
            raise UserError(
                f"unsupervised source '{source}' gives no block of {block_size} tokens "
                f"({len(texts)} usable documents); give it more text or a smaller block size"
            )
        stats = {"documents": len(texts), "blocks": len(blocks), **{f"skipped:{k}": v for k, v in skipped.items()}}
        return TokenizedDataset.from_lists({"input_ids": blocks, "labels": blocks}, stats).state()

    key_inputs = {
        "source": text_source_fingerprint(source, config_name, shard),
        "text_column": text_column,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "block_size": block_size,
        "seed": seed,
        "max_blocks": max_blocks,
    }
    path = cache_file(data_output_path, "unsupervised", key_inputs)
    state, _ = build_or_load(path, build, rebuild=rebuild_cache)
    return TokenizedDataset.from_state(state)
