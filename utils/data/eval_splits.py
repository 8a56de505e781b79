"""A dataset's own evaluation splits: the rows its authors held out (Anthropic/hh-rlhf's and Dahoas/rm-static's
`test`), which no step trains on. DeepSpeed-Chat trains on a dataset's train split; this pipeline reads every split
but these and cuts its own shards and held-out parts (`splits`) from them."""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence

# The words that name a held-out split ("test", "validation", "test_prefs", "dev").
EVAL_SPLIT_WORDS = frozenset({"test", "validation", "valid", "val", "dev", "eval", "evaluation"})

logger = logging.getLogger("utils.data")


def is_eval_split(split: str) -> bool:
    """Whether a split's name says it holds a dataset's held-out rows (`EVAL_SPLIT_WORDS`: "test", "test_prefs")."""
    return any(word in EVAL_SPLIT_WORDS for word in re.split(r"[^a-z]+", split.lower()))


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
