"""Steps that feed each other must cut their shared data sources alike.

Step N trains on shard N of every source: `--seed` permutes a source's records and the fractions of
`--data_split` cut the permutation. A step that starts from an earlier step's model but has other
values cuts a shared source differently, so its shard overlaps the rows that model trained on
(seeds 1234 and 7 put 68 of step 1's 200 records of 1,000 into step 2's shard). Only those
two settings decide the shards; a stated format (`PATH:FORMAT`) changes how rows parse, not which rows a shard holds.
`--eval_fraction` splits a shard within one step: a step started from a run of the same step (its `data_split.json`
says which shard that run trained on; a record written before it said so is not checked for this) holds out the
first records of the same shard, so it must hold out no more than that run did, which trained on the rest; step 1's
`--sft_only_data_path` sources are held out alike, cut by `--seed` alone over their record counts (recorded and
compared as the sharded sources' are), and one that run sharded (its `--data_path`) would be held out otherwise.
A source the earlier step trained on whole (step 1's `--sft_only_data_path`) overlaps any shard of it, whatever the
settings. A source whose record count changed between the runs (a malformed line fixed, a row added, a hub copy
updated) is permuted anew too: the earlier run's folder records the counts its build cut (`split_record`), which
this step's build compares with the counts it cuts (`check_same_record_counts`; the check before the build reads no
source); a run folder written before that record is not checked for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from utils.errors import UserError

from .eval_splits import EVAL_SPLITS_NOTE
from .sources import parse_source_spec, source_identity
from .split_record import read_split_phase, read_split_record
from .splits import same_shards

RUN_DATA_KEYS = ("data_path", "seed", "data_split")


@dataclass(frozen=True)
class InputRunRecord:
    """The record counts the run that trained an input model cut the sources this step shares with it from."""

    name: str  # where the input came from: its flag and value
    run: str  # its run folder
    records: Mapping[str, int]  # {source identity: records}
    named: Mapping[str, str]  # {source identity: the --data_path entry as that run named it}


def shared_sources(data_paths: Sequence[str], other_data_paths: Sequence[str]) -> list[str]:
    """The entries of `data_paths` that read a source `other_data_paths` reads too."""
    others = {source_identity(path) for path in other_data_paths}
    return [path for path in data_paths if source_identity(path) in others]


def check_same_shards(current: Mapping[str, Any], earlier: Mapping[str, Any], earlier_name: str,
                      earlier_run: str, phase: int) -> InputRunRecord | None:
    """Refuse a step whose shards, or held-out part, would overlap the rows the run that trained its input model
    trained on, as far as the settings tell; return the record counts that run cut the shared sources from, for the
    step's build to compare with the counts it cuts (`check_same_record_counts`), or None where it recorded none. No
    source is read.

    `current` and `earlier` are run arguments (a step's parsed flags; the input run's `args.json`);
    `earlier_name` says where the input came from (its flag and value), `earlier_run` is its run
    folder, `phase` the shard this step trains on. Arguments that hold no data settings (not this project's) and runs
    that share no data source with this step are not checked.
    """
    if not all(key in earlier for key in RUN_DATA_KEYS) or not isinstance(earlier["data_path"], list):
        return None
    trained_whole = shared_sources(current["data_path"], earlier.get("sft_only_data_path") or [])
    if trained_whole:
        raise UserError(
            f"{earlier_name} was trained on all of {', '.join(trained_whole)} (--sft_only_data_path), so any shard "
            f"of it this step trains or evaluates on holds rows that model trained on; drop it from --data_path, "
            f"or retrain {earlier_run} with it in --data_path instead")
    same_step = read_split_phase(earlier_run) == phase
    shared_whole = (_check_same_whole_cut(current, earlier, earlier_name, earlier_run) if same_step and phase == 1
                    else [])
    shared = shared_sources(current["data_path"], earlier["data_path"])
    if shared:
        _check_same_cut(shared, current, earlier, earlier_name, earlier_run)
        if same_step:
            _check_held_out_within(shared, current, earlier, earlier_name, earlier_run)
    return _recorded_counts(earlier_name, earlier_run, [*shared, *shared_whole])


def _check_same_cut(shared: Sequence[str], current: Mapping[str, Any], earlier: Mapping[str, Any], earlier_name: str,
                    earlier_run: str) -> None:
    """The sources both runs shard must be cut by the same --seed and --data_split proportions."""
    seed, data_split = int(current["seed"]), str(current["data_split"])
    earlier_seed, earlier_split = int(earlier["seed"]), str(earlier["data_split"])
    if not same_shards(seed, data_split, earlier_seed, earlier_split):
        theirs = f"--seed {earlier_seed} --data_split {earlier_split}"
        ours = f"--seed {seed} --data_split {data_split}"
        raise UserError(
            f"{earlier_name} was trained on {', '.join(shared)} cut with {theirs}, but this step cuts it with {ours}, "
            f"so its shard would overlap the rows that model trained on; rerun with {theirs} to match {earlier_run}, "
            f"or retrain {earlier_run} with {ours}"
        )


def _recorded_counts(earlier_name: str, earlier_run: str, shared: Sequence[str]) -> InputRunRecord | None:
    """The record counts the earlier run recorded for the `shared` sources; None where it shares none or recorded
    none."""
    recorded = read_split_record(earlier_run) if shared else None
    if recorded is None:
        return None
    identities = {source_identity(path) for path in shared}
    kept = [(source_identity(path), path, count) for path, count in recorded if source_identity(path) in identities]
    return InputRunRecord(earlier_name, earlier_run, {source: count for source, _, count in kept},
                          {source: path for source, path, _ in kept})


def _check_same_whole_cut(current: Mapping[str, Any], earlier: Mapping[str, Any], earlier_name: str,
                          earlier_run: str) -> list[str]:
    """Step 1 started from a step-1 run: a step-1-only source both read is permuted by `--seed` alone before its
    held-out part is taken, so another seed holds out records that run trained on; one that run sharded (its
    --data_path) is held out otherwise too. Returns the step-1-only sources both read, whose counts are compared."""
    moved = shared_sources(current.get("sft_only_data_path") or [], earlier["data_path"])
    if moved:
        raise UserError(
            f"{earlier_name} is a step-1 run that cut {', '.join(moved)} into shards (--data_path), trained on shard "
            f"1 and held out a part of it; this step reads it whole (--sft_only_data_path), its held-out part cut by "
            f"--seed alone, which would hold records that model trained on; keep it in --data_path to continue "
            f"{earlier_run}, or train from that run's input model")
    shared = shared_sources(current.get("sft_only_data_path") or [], earlier.get("sft_only_data_path") or [])
    if shared and int(current["seed"]) != int(earlier["seed"]):
        raise UserError(
            f"{earlier_name} is a step-1 run that held out a part of {', '.join(shared)} (--sft_only_data_path) cut "
            f"with --seed {earlier['seed']}, and trained on the rest; this step cuts it with --seed {current['seed']}, "
            f"so its held-out part would hold records that model trained on; rerun with --seed {earlier['seed']}")
    if shared:
        _check_held_out_within(shared, current, earlier, earlier_name, earlier_run)
    return shared


def _check_held_out_within(shared: Sequence[str], current: Mapping[str, Any], earlier: Mapping[str, Any],
                           earlier_name: str, earlier_run: str) -> None:
    """A run of the same step, cut alike, held out the first `--eval_fraction` of each shared source's records and
    trained on the rest: this step may hold out as many or fewer (a part of those), not more."""
    if earlier.get("eval_fraction") is None:
        return
    fraction, earlier_fraction = float(current["eval_fraction"]), float(earlier["eval_fraction"])
    if fraction > earlier_fraction:
        raise UserError(
            f"{earlier_name} was trained on this step's shard (a run of this step, or of DPO for step 2: they share "
            f"one) and held out --eval_fraction {earlier_fraction:g} of "
            f"{', '.join(shared)} and trained on the rest; this step's --eval_fraction {fraction:g} would hold out "
            f"records that model trained on and score it on them; rerun with --eval_fraction {earlier_fraction:g} "
            f"or less to continue {earlier_run}")


_EVAL_SPLITS_RETRAIN = f". {EVAL_SPLITS_NOTE}: retrain that run on the data as this version reads it"


def check_same_record_counts(cut: Sequence[tuple[str, int]], input_runs: Sequence[InputRunRecord]) -> None:
    """Refuse a source whose record count, as this step's build cut it (`cut`: `(--data_path entry, count)`), differs
    from the one an input run recorded when it cut it: the same settings permute another count, and the shards
    overlap."""
    for run in input_runs:
        for path, now in cut:
            source = source_identity(path)
            then = run.records.get(source)
            if then is None or then == now:
                continue
            named_then = run.named[source]
            if _named_splits_differ(named_then, path):
                raise UserError(
                    f"{run.name} was trained on a shard of {named_then} ({then} records: {_split_read(named_then)}); "
                    f"this step's {path} reads {now} records ({_split_read(path)}), so its shard, cut from another "
                    f"count, would overlap the rows that model trained on; name the source as {run.run} did "
                    f"({named_then})")
            raise UserError(
                f"{run.name} was trained on a shard of {path} cut from its {then} records, but it holds {now} "
                f"now (a record fixed, added or removed): cut anew, this step's shard would overlap the rows "
                f"that model trained on; restore the data as {run.run} read it, or retrain {run.run} on the "
                f"data as it is now{_EVAL_SPLITS_RETRAIN if now < then else ''}")


def _named_splits_differ(entry: str, other: str) -> bool:
    """Whether two entries of one source (`source_identity`) differ in the split they name: one names its train
    split (`X[train]`), the other none (`X`, all its training splits)."""
    return parse_source_spec(entry).split != parse_source_spec(other).split


def _split_read(entry: str) -> str:
    """What an entry of a source reads, of the splits it names."""
    return "all its training splits" if parse_source_spec(entry).split is None else "its train split alone"
