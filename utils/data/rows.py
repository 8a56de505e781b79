"""Read a whole source as canonical rows `{"prompt", "chosen", "rejected"}` (no split, no tokenising)."""
from __future__ import annotations

import logging

from .formatting import PromptFormatter
from .samples import KIND_PAIRS, Sample, SkipRow, unusable_reason
from .sources import load_source, parse_source_spec

logger = logging.getLogger("utils.data")


def read_rows(path: str, tokenizer=None, prompt_format: str = "auto", evaluating: bool = False) -> list[dict]:
    """Every usable row of `path` (a `--data_path` entry), prompts rendered for `tokenizer`; of a dataset's evaluation
    splits where it has any, `evaluating` and no split named (`sources.load_source`).

    Without a tokenizer prompts use the " Human: ... Assistant:" format. Unusable records are
    skipped, counted per reason and logged in one line; a pair that step 2 drops is kept, marked (`_row`).
    """
    source = load_source(parse_source_spec(path), evaluating)
    formatter = PromptFormatter(tokenizer, prompt_format)
    skipped = source.load_skips.copy()
    rows = []
    for group, record in enumerate(source.records):
        try:
            for sample in source.parse(record, group):
                if sample.reply_error is not None:  # a prompt without its replies: no row
                    raise SkipRow(sample.reply_error)
                rows.append(_row(formatter, sample))
        except SkipRow as skip:
            skipped.skip(skip.reason, source.where(group))
    logger.log(logging.WARNING if skipped else logging.INFO, "data source '%s' (format %s): %d rows; skipped: %s",
               source.spec, source.format, len(rows), skipped.report())
    return rows


def _row(formatter: PromptFormatter, sample: Sample) -> dict:
    """`sample`'s canonical row; a pair that step 2 drops (`unusable_reason`: replies that differ in whitespace alone,
    or not at all) carries why, as `skipped`, for a scorer to skip and report."""
    row = formatter.row(sample)
    reason = unusable_reason(sample, KIND_PAIRS) if sample.rejected is not None else None
    if reason is not None:
        row["skipped"] = reason
    return row
