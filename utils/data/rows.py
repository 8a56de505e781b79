"""Read a whole source as canonical rows `{"prompt", "chosen", "rejected"}` (no split, no tokenising)."""
from __future__ import annotations

import logging

from .formatting import PromptFormatter
from .samples import SkipRow
from .sources import load_source, parse_source_spec

logger = logging.getLogger("utils.data")


def read_rows(path: str, tokenizer=None, prompt_format: str = "auto") -> list[dict]:
    """Every usable row of `path` (a `--data_path` entry), prompts rendered for `tokenizer`.

    Without a tokenizer prompts use the " Human: ... Assistant:" format. Unusable records are
    skipped, counted per reason and logged in one line.
    """
    source = load_source(parse_source_spec(path))
    formatter = PromptFormatter(tokenizer, prompt_format)
    skipped = source.load_skips.copy()
    rows = []
    for group, record in enumerate(source.records):
        try:
            for sample in source.parse(record, group):
                if sample.reply_error is not None:  # a prompt without its replies: no row
                    raise SkipRow(sample.reply_error)
                rows.append(formatter.row(sample))
        except SkipRow as skip:
            skipped.skip(skip.reason, source.where(group))
    logger.log(logging.WARNING if skipped else logging.INFO, "data source '%s' (format %s): %d rows; skipped: %s",
               source.spec, source.format, len(rows), skipped.report())
    return rows
