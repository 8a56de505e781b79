"""A dataset's own evaluation splits: the rows its authors held out (Anthropic/hh-rlhf's and Dahoas/rm-static's
`test`), which no step trains on. DeepSpeed-Chat trains on a dataset's train split; this pipeline reads every split
but these and cuts its own shards and held-out parts (`splits`) from them."""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from utils.errors import UserError

# The words that name a split, by the split `datasets` reads a data folder's file naming one into (its data_files.py
# SPLIT_KEYWORDS: `dev.jsonl` is validation's, `testing/0.jsonl` test's).
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
TRAIN_SPLIT = "train"
# The words that name a held-out split ("test", "validation", "test_prefs", "dev").
EVAL_SPLIT_WORDS = frozenset(SPLIT_KEYWORDS["validation"] + SPLIT_KEYWORDS["test"])

logger = logging.getLogger("utils.data")

# Said where a run's data count dropped: a run cut before this version (763e8ef, 2079559) counted the rows of
# evaluation splits that are now left out. A sentence, followed by ": " and the way out.
EVAL_SPLITS_NOTE = ("If a source has evaluation splits (test, validation: a hub dataset, a save_to_disk DatasetDict, "
                    "a .json object of lists, a folder of per-split files), this version leaves them out, and a run "
                    "cut before it counted them")


def name_words(name: str) -> list[str]:
    """The words of a split's or file's name, lower-cased: its runs of letters. `datasets` separates a file name's
    words by -, _, ., space and digits alone, and case-sensitively, so it reads `hh+test.jsonl`, `train(1).jsonl` and
    `TEST.jsonl` as naming no split; here they name the split a reader sees in them."""
    return re.findall(r"[^\W\d_]+", name.lower())


def is_eval_split(split: str) -> bool:
    """Whether a split's name says it holds a dataset's held-out rows (`EVAL_SPLIT_WORDS`: "test", "test_prefs")."""
    return any(word in EVAL_SPLIT_WORDS for word in name_words(split))


def training_splits(dataset: str, splits: Sequence[str]) -> list[str]:
    """The splits of `dataset` the steps read: all but its evaluation splits (`is_eval_split`), whose rows its authors
    held out (Anthropic/hh-rlhf's and Dahoas/rm-static's `test`); all of them where every one is an evaluation split,
    nothing else to read, with a warning."""
    kept = [split for split in splits if not is_eval_split(split)]
    left_out = [split for split in splits if is_eval_split(split)]
    if not kept:
        logger.warning("data source '%s' holds evaluation splits alone (%s): the steps train on them", dataset,
                       ", ".join(splits))
        return list(splits)
    if left_out:
        logger.info("data source '%s': its splits %s are read, its evaluation splits %s left out (no step trains on "
                    "them; --eval_fraction holds out part of the rest)", dataset, ", ".join(kept), ", ".join(left_out))
    return kept


def evaluation_splits(dataset: str, splits: Sequence[str]) -> list[str]:
    """The splits of `dataset` an evaluation tool reads (rw_eval): its evaluation splits (`is_eval_split`), said in an
    info line; all of them where it has none."""
    chosen = [split for split in splits if is_eval_split(split)]
    if not chosen:
        return list(splits)
    logger.info("data source '%s': its evaluation splits %s are read (name another split to read as NAME[split])",
                dataset, ", ".join(chosen))
    return chosen


@dataclass(frozen=True)
class SplitChoice:
    """Which splits of a dataset a source reads: the one its spec names (`NAME[split]`, read even if an evaluation
    split: the user asked for it), else the steps' `training_splits`, or an evaluation tool's `evaluation_splits`."""

    named: str | None = None
    evaluating: bool = False

    def of(self, dataset: str, splits: Sequence[str]) -> list[str]:
        if self.named is None:
            return evaluation_splits(dataset, splits) if self.evaluating else training_splits(dataset, splits)
        if self.named not in splits:
            raise UserError(f"data source '{dataset}' has no split '{self.named}': its splits are "
                            f"{', '.join(splits)}; name one of them as {dataset}[SPLIT], or none")
        return [self.named]

    def refuse_named(self, source: str) -> None:
        """Refuse a named split for a source that holds no splits (one file of records, one saved `Dataset`)."""
        if self.named is not None:
            raise UserError(f"data source '{source}' holds no splits, so it has no split '{self.named}' to read: drop "
                            f"[{self.named}] from its entry")


TRAINING = SplitChoice()
