"""Build each step's train/eval datasets from several sources: shard, parse, blend, tokenise, cache."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from utils.dist import is_main_process
from utils.errors import UserError, refuse_all

from .cache import build_or_load, cache_file, tokenizer_fingerprint
from .formatting import PromptFormatter
from .samples import (
    KIND_PAIRS,
    KIND_SFT,
    PHASE_KINDS,
    Sample,
    SkippedRows,
    SkipRow,
    comparable_text,
    comparable_turns,
    unusable_reason,
)
from .shard_match import InputRunRecord, check_same_record_counts
from .sources import (
    LoadedSource,
    SourceSpec,
    load_source,
    parse_source_spec,
    source_fingerprint,
    source_identity,
)
from .split_record import RECORDS_KEY
from .splits import ShardSettings, held_out_seed, holdout, parse_data_split, seeded_order
from .tokenization import TokenLimits, tokenize_samples
from .tokenized import TokenizedDataset

logger = logging.getLogger("utils.data")


@dataclass
class SourceSplit:
    """One source's usable samples for one phase and kind, and why the rest were skipped."""

    source: LoadedSource
    train: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    records: int = 0
    held_out: int = 0  # of `records`
    skipped: SkippedRows = field(default_factory=SkippedRows)

    def summary(self, phase: int, kind: str) -> str:
        """The step's line; what the load skipped is the whole source's, said apart (each step's line repeats it)."""
        loaded = f"; the whole source at load: {self.source.load_skips.report()}" if self.source.load_skips else ""
        return (
            f"data source '{self.source.spec}' (format {self.source.format}), step {phase} {kind}: "
            f"{self.records} records -> {len(self.train)} train / {len(self.eval)} eval samples; "
            f"skipped: {self.skipped.report()}{loaded}"
        )


def _usable_samples(source: LoadedSource, indices: np.ndarray, kind: str, seed: int,
                    skipped: SkippedRows) -> list[Sample]:
    """The samples of the records at `indices` that `kind` can use (a sample's `group` is its record's index)."""
    samples: list[Sample] = []
    for group, record in zip(indices.tolist(), source.take(indices.tolist())):
        try:
            samples.extend(source.parse(record, group))
        except SkipRow as skip:
            skipped.skip(skip.reason, source.where(group))
    if kind == "pairs" and source.add_rejections is not None:
        samples = source.add_rejections(samples, seed)
    usable = []
    for sample in samples:
        reason = unusable_reason(sample, kind)
        if reason is None:
            usable.append(sample)
        else:
            skipped.skip(reason, source.where(sample.group))
    return usable


def split_source(
    source: LoadedSource, phase: int, kind: str, data_split: str, seed: int, eval_fraction: float, whole: bool = False
) -> SourceSplit:
    """`source`'s samples for `phase`: its shard of the records (all of them when `whole`), train and eval."""
    if whole:
        train_indices, eval_indices = holdout(seeded_order(len(source), seed), eval_fraction)
    else:
        train_indices, eval_indices = ShardSettings(data_split, seed, eval_fraction).records(len(source), phase)
    result = SourceSplit(source, records=len(train_indices) + len(eval_indices), held_out=len(eval_indices))
    result.train = _usable_samples(source, train_indices, kind, seed, result.skipped)
    result.eval = _usable_samples(source, eval_indices, kind, held_out_seed(seed), result.skipped)
    return result


HELD_OUT_IN_TRAINING = "held_out_in_training"


def _trained_text(sample: Sample, kind: str) -> str:
    """What `kind` reads of `sample`, as comparable text (`comparable_text`): its prompt's turns, and the replies
    step 1 learns or step 2 compares. A pair's two replies are taken in either order: swapped (the opposite label),
    they ask the comparison the model trained on."""
    if kind == KIND_SFT:
        replies = [comparable_text(sample.chosen)]
    elif kind == KIND_PAIRS:
        replies = sorted(comparable_text(reply) for reply in (sample.chosen, sample.rejected))
    else:
        replies = []
    return json.dumps([comparable_turns(sample.turns), *replies], sort_keys=True)


def drop_held_out_copies(splits: Sequence[SourceSplit], kind: str) -> None:
    """Drop from each split's held-out samples those that a split of the step trains on (the same text up to
    whitespace and Unicode compatibility forms: `comparable_text`), counted as skipped `HELD_OUT_IN_TRAINING`. Records are held out, not samples: records that differ can give one sample (rows
    of one prompt with other replies give step 3 the same prompt; SHP's pairs of one post share a preferred reply for
    step 1), as can two sources, and the step would be scored on what it trained on. Its training samples stay. A
    pair is compared whole, its replies in either order: one sharing its prompt and one reply with a training pair asks
    another comparison."""
    trained = {_trained_text(sample, kind) for split in splits for sample in split.train}
    for split in splits:
        held_out = []
        for sample in split.eval:
            if _trained_text(sample, kind) in trained:
                split.skipped.skip(HELD_OUT_IN_TRAINING, split.source.where(sample.group))
            else:
                held_out.append(sample)
        split.eval = held_out


def blend(parts: Sequence[list], seed: int) -> list:
    """Concatenate the sources' samples, then shuffle them with the seed."""
    combined = [sample for part in parts for sample in part]
    return [combined[i] for i in seeded_order(len(combined), seed)]


def phase_splits(
    phase: int, data_paths: Sequence[str], data_split: str, seed: int, eval_fraction: float,
    sft_only_data_paths: Sequence[str] = (), kind: str | None = None,
    load: Callable[[SourceSpec], LoadedSource] = load_source,
) -> list[SourceSplit]:
    """Per source, the samples `phase` uses; step-1-only sources join phase 1 entirely. No held-out sample is one
    the step trains on (`drop_held_out_copies`).

    `load` reads a source; pass a memoised one to reuse loaded sources across calls.
    """
    kind = kind or PHASE_KINDS[phase]
    parse_data_split(data_split)
    splits = [
        split_source(load(parse_source_spec(path)), phase, kind, data_split, seed, eval_fraction)
        for path in data_paths
    ]
    if phase == 1:
        splits += [
            split_source(load(parse_source_spec(path)), phase, kind, data_split, seed, eval_fraction, whole=True)
            for path in sft_only_data_paths
        ]
    drop_held_out_copies(splits, kind)
    return splits


def repeated_sources(paths: Sequence[str]) -> dict[str, int]:
    """{entry: times named} of the sources `paths` names more than once (by `source_identity`: a stated format or a
    relative path alike), each under the entry that first names it."""
    entries: dict[str, list[str]] = {}
    for path in paths:
        entries.setdefault(source_identity(path), []).append(path)
    return {named[0]: len(named) for named in entries.values() if len(named) > 1}


def warn_repeated_sources(data_paths: Sequence[str], sft_only_data_paths: Sequence[str] = ()) -> None:
    """Warn of a source a flag names more than once: each entry is cut and read on its own, so every step trains and
    evaluates on that source's records as many times over. Nothing else weighs one source against another
    (--data_split weighs the steps' shards), so it may be meant, but named twice by mistake it was doubled unsaid."""
    for flag, paths in (("data_path", data_paths), ("sft_only_data_path", sft_only_data_paths)):
        for source, times in repeated_sources(paths).items():
            logger.warning("--%s names '%s' %d times: each step that reads it trains and evaluates on each of its "
                           "records %d times over (no flag weighs a source otherwise); name it once unless that "
                           "weight is meant", flag, source, times, times)


def gives_step_data(phase: int, data_split: str, sft_only_data_paths: Sequence[str] = ()) -> bool:
    """Whether step `phase` has data to build: a positive --data_split weight, or for step 1 step-1-only sources (with
    a zero weight, as 0,1,1, it trains on them alone, as in DeepSpeed-Chat)."""
    return parse_data_split(data_split)[phase - 1] > 0 or (phase == 1 and bool(sft_only_data_paths))


def _no_usable_rows(split: SourceSplit, phase: int, kind: str, data_split: str) -> UserError:
    if split.records == 0:
        return UserError(
            f"data source '{split.source.spec}' gives step {phase} nothing: its step-{phase} shard holds 0 of its "
            f"{len(split.source)} records (--data_split {data_split}); give step {phase} a larger share or the source "
            "more records")
    return UserError(
        f"data source '{split.source.spec}' has no usable rows for step {phase} ({kind}); "
        f"skipped: {split.skipped.report()}. Check the source, its format (PATH:FORMAT) and --data_split")


def _no_training_items(phase: int, splits: Sequence[SourceSplit], train_stats: dict, eval_fraction: float,
                       template_error: str | None) -> UserError:
    """The error for a step left without training items, saying what took them: the held-out part, skipped rows, or
    the drops its stats count (each with the flag that changes it for this step)."""
    if not any(split.records > split.held_out for split in splits):
        return UserError(f"no step-{phase} training items: --eval_fraction {eval_fraction} holds out every record of "
                         f"the step's shard; lower it, or give the step more data")
    if not any(split.train for split in splits):
        return UserError(f"no step-{phase} training items: every record left for training was skipped (see the data "
                         "source lines above); check the sources and their format (PATH:FORMAT)")
    return UserError(f"no step-{phase} training items are left after tokenisation ({train_stats}); "
                     f"{_drop_hints(phase, train_stats, template_error)}")


def _drop_hints(phase: int, stats: Mapping[str, int], template_error: str | None = None) -> str:
    """What to change for the items tokenisation dropped, as `stats` counts them (`dropped:<reason>`), for `phase`."""
    failed = f"the chat template failed ({template_error})" if template_error else "the chat template failed"
    hints = {
        "prompt_too_long": "raise --max_prompt_seq_len or use --prompt_overflow left_truncate" if phase == 3
                           else "raise --max_seq_len (it must hold a prompt and the start of its reply)",
        "identical_after_truncation": "raise --max_seq_len (the two replies differ only after it)",
        "chat_template_error": f"{failed}; use --prompt_format human_assistant, or change the rows it refuses",
    }
    return "; ".join(hint for reason, hint in hints.items() if stats.get(f"dropped:{reason}"))


def no_eval_items_note(phase: int, eval_fraction: float, eval_stats: Mapping[str, int]) -> str:
    """The warning for a step with no held-out item, from its held-out data's stats: the items tokenisation dropped
    (each reason, and what to change), or, with none dropped, no usable record held out (a small --eval_fraction, or
    held-out rows skipped before tokenisation, held_out_in_training among them, as the data source lines count)."""
    dropped = {key: count for key, count in eval_stats.items() if key.startswith("dropped:")}
    if dropped:
        said = ", ".join(f"{key}={count}" for key, count in dropped.items())
        return (f"every held-out item of step {phase} was dropped in tokenisation ({said}): the run reports no "
                f"held-out metrics; {_drop_hints(phase, dropped)}")
    return (f"--eval_fraction {eval_fraction:g} held out no usable item of step {phase}: the run reports no held-out "
            "metrics; the data source lines above count held-out rows skipped (held_out_in_training: the same text "
            "as a training item); give the step more data or a larger --eval_fraction")


def _build(phase: int, kind: str, splits_args: dict, tokenizer, formatter: PromptFormatter, limits: TokenLimits,
           seed: int) -> dict:
    splits = phase_splits(phase, kind=kind, seed=seed, **splits_args)
    has_share = parse_data_split(splits_args["data_split"])[phase - 1] > 0
    # the records each source was cut from (step-1-only sources follow the sharded ones in `splits`), kept with the items
    paths = (*splits_args["data_paths"], *splits_args["sft_only_data_paths"])
    records = [[path, len(split.source)] for path, split in zip(paths, splits, strict=True)]
    for split in splits:
        logger.log(logging.WARNING if split.skipped or split.source.load_skips else logging.INFO, split.summary(phase, kind))
        if not split.train and not split.eval and (split.records or has_share):  # a zero share: nothing, as asked
            raise _no_usable_rows(split, phase, kind, splits_args["data_split"])
    train = tokenize_samples(blend([s.train for s in splits], seed), kind, formatter, tokenizer, limits)
    evaluation = tokenize_samples(blend([s.eval for s in splits], seed), kind, formatter, tokenizer, limits)
    logger.info("step %d %s data: train %s; eval %s", phase, kind, train.stats, evaluation.stats)
    if formatter.template_error:
        logger.warning("step %d %s data: the chat template failed on rows (dropped:chat_template_error); the first "
                       "error: %s", phase, kind, formatter.template_error)
    if len(train) == 0:
        raise _no_training_items(phase, splits, train.stats, splits_args["eval_fraction"],
                                 formatter.template_error)
    return {"train": train.state(), "eval": evaluation.state(), RECORDS_KEY: records}


def cut_answers_note(phase: int, train: TokenizedDataset, evaluation: TokenizedDataset, max_seq_len: int) -> str | None:
    """The warning for the step's items whose answer --max_seq_len cut (marked when they were built, kept with the
    cached items; counted among those the step uses); None where no answer was cut."""
    parts = [f"{data.answers_cut} of the {len(data)} {name} items"
             for name, data in (("training", train), ("held-out", evaluation)) if data.answers_cut]
    if not parts:
        return None
    return (f"step {phase} data: {' and '.join(parts)} end inside their answer at --max_seq_len {max_seq_len} (its EOS "
            "or end-of-turn token cut off, answer_truncated): the step learns or scores unfinished answers; raise "
            "--max_seq_len to keep them whole")


class PhaseData(NamedTuple):
    """A step's tokenised data, and the records each source was cut from (`(entry, count)`, in order: the `--data_path`
    sources, then step 1's `--sft_only_data_path` sources)."""

    train: TokenizedDataset
    eval: TokenizedDataset
    records: list[tuple[str, int]]


def check_sample_caps(max_train_samples: int | None, max_eval_samples: int | None) -> None:
    """--max_train_samples 1 or more (0 leaves the step nothing to train on), --max_eval_samples 0 or more (0: no
    evaluation); None: no cap."""
    refuse_all(partial(_check_sample_cap, "max_train_samples", max_train_samples, 1),
               partial(_check_sample_cap, "max_eval_samples", max_eval_samples, 0))


def _check_sample_cap(flag: str, count: int | None, least: int) -> None:
    if count is not None and count < least:
        raise UserError(f"--{flag} must be {least} or more, not {count}")


def build_phase_data(
    phase: int,
    data_paths: Sequence[str],
    data_split: str,
    tokenizer,
    max_seq_len: int,
    seed: int,
    data_output_path: str,
    sft_only_data_paths: Sequence[str] = (),
    rebuild_cache: bool = False,
    eval_fraction: float = 0.1,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    max_prompt_seq_len: int = 256,
    prompt_format: str = "auto",
    prompt_overflow: str = "drop",
    whole_sequence_loss: bool = False,
    input_runs: Sequence[InputRunRecord] = (),
) -> PhaseData:
    """Tokenised train and eval datasets for step `phase` (1 SFT, 2 reward pairs, 3 PPO prompts), and the records
    each source was cut from.

    Built once and cached under `data_output_path`; `max_*_samples` cap the loaded data (the
    first items of the seeded blend), so changing them never rebuilds the cache. A source cut from another record
    count than one of `input_runs` (the runs that trained this step's input models) recorded is refused, on every rank
    (each holds the cached state; a cache hit counts as the build its items were cut in).
    """
    if phase not in PHASE_KINDS:
        raise UserError(f"phase must be 1, 2 or 3, not {phase}")
    if not data_paths and not (phase == 1 and sft_only_data_paths):
        raise UserError("no data sources given: pass --data_path (e.g. --data_path embedded)")
    check_sample_caps(max_train_samples, max_eval_samples)
    kind = PHASE_KINDS[phase]
    weights = parse_data_split(data_split)
    if not gives_step_data(phase, data_split, sft_only_data_paths):
        raise UserError(f"--data_split {data_split} gives step {phase} no share of the data; give it a positive weight"
                        + (" (or step-1-only sources, --sft_only_data_path)" if phase == 1 else ""))
    formatter = PromptFormatter(tokenizer, prompt_format)
    limits = TokenLimits(max_seq_len, max_prompt_seq_len, prompt_overflow, whole_sequence_loss)
    whole_sources = tuple(sft_only_data_paths) if phase == 1 else ()
    if is_main_process():  # once a step, also where its items come from the cache
        warn_repeated_sources(data_paths, whole_sources)
    splits_args = dict(
        data_paths=tuple(data_paths), data_split=data_split, eval_fraction=eval_fraction, sft_only_data_paths=whole_sources
    )
    key_inputs = {
        "phase": phase,
        "sources": [source_fingerprint(parse_source_spec(p)) for p in data_paths],
        "sft_only_sources": [source_fingerprint(parse_source_spec(p)) for p in whole_sources],
        "data_split": weights,
        "seed": seed,
        "eval_fraction": eval_fraction,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "prompt_format": formatter.style,
        "limits": limits.key(kind),
    }
    path = cache_file(data_output_path, f"step{phase}_{kind}", key_inputs)
    state, built = build_or_load(
        path, lambda: _build(phase, kind, splits_args, tokenizer, formatter, limits, seed), rebuild=rebuild_cache
    )
    records = [(path, int(count)) for path, (_, count) in zip((*data_paths, *whole_sources), state[RECORDS_KEY],
                                                               strict=True)]
    check_same_record_counts(records, input_runs)
    train = TokenizedDataset.from_state(state["train"]).head(max_train_samples)
    evaluation = TokenizedDataset.from_state(state["eval"]).head(max_eval_samples)
    note = cut_answers_note(phase, train, evaluation, max_seq_len)
    if note is not None and is_main_process():  # once a step, also where its items come from the cache
        logger.warning(note)
    logger.info(
        "step %d data %s %s: %d train / %d eval items", phase, "built into" if built else "loaded from cache", path,
        len(train), len(evaluation),
    )
    return PhaseData(train, evaluation, records)
