"""Print how much data each step gets: `python -m training.pipeline.inspect_data --data_path embedded [--tokenizer PATH]`.

For each phase shard (train and eval) it counts the SFT pairs, preference pairs and prompts the
sources yield, then, per source and step, its row format and the rows the step skips with why (the steps' own data
lines). With `--tokenizer` it also builds (or loads from the cache) the phase's tokenised datasets and prints how many
items survive the length limits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from training.core.args import SettingsParser, trust_remote_code_field
from training.core.model_loading import load_tokenizer
from utils.data.args import DataArguments
from utils.data.phases import SourceSplit, gives_step_data, phase_splits, warn_repeated_sources
from utils.data.samples import KINDS, PHASE_KINDS
from utils.data.sources import load_source
from utils.errors import run_cli
from utils.log import setup_logging

_KIND_LABELS = {"sft": "SFT pairs", "pairs": "preference pairs", "prompts": "prompts"}


def shard_splits(data: DataArguments) -> dict[int, dict[str, list[SourceSplit]]]:
    """{phase: {kind: each source's split}} before tokenisation (every source read once)."""
    load = functools.lru_cache(maxsize=None)(load_source)
    return {phase: {kind: phase_splits(phase, data.data_path, data.data_split, data.seed, data.eval_fraction,
                                       data.sft_only_data_path, kind=kind, load=load) for kind in KINDS}
            for phase in PHASE_KINDS}


def raw_counts(splits: dict[int, dict[str, list[SourceSplit]]]) -> dict:
    """{phase: {kind: {"train": n, "eval": n}}} of `shard_splits`."""
    return {phase: {kind: {"train": sum(len(s.train) for s in by_source), "eval": sum(len(s.eval) for s in by_source)}
                    for kind, by_source in by_kind.items()} for phase, by_kind in splits.items()}


def source_lines(splits: dict[int, dict[str, list[SourceSplit]]]) -> list[str]:
    """Each source's line for each step, of the kind the step trains on: its format, records and skipped rows."""
    return [split.summary(phase, PHASE_KINDS[phase]) for phase, by_kind in splits.items()
            for split in by_kind[PHASE_KINDS[phase]]]


def _table(counts: dict, tokenized: dict) -> str:
    header = f"{'step':<5}{'split':<7}" + "".join(f"{_KIND_LABELS[k]:>18}" for k in KINDS)
    if tokenized:
        header += f"{'tokenised items':>18}"
    lines = [header]
    for phase, by_kind in counts.items():
        for split in ("train", "eval"):
            line = f"{phase:<5}{split:<7}" + "".join(f"{by_kind[k][split]:>18,}" for k in KINDS)
            if tokenized:
                line += f"{tokenized[phase][split]:>18,}"
            lines.append(line)
    return "\n".join(lines)


@dataclass
class TokenizerArguments:
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer (model name or folder) to count tokenised items with"})
    trust_remote_code: bool = trust_remote_code_field()


@dataclass
class InspectSettings:
    data: DataArguments
    counting: TokenizerArguments


@run_cli
def main(argv: list[str] | None = None) -> dict:
    settings = SettingsParser(InspectSettings, description=__doc__.splitlines()[0]).parse_args(argv)
    data = settings.data
    # the steps' data checks as step 1 runs them: the step-1-only sources go to step 1 alone, as train.py gives them
    data.check_flags(phase=1)
    setup_logging()  # the info lines too: which splits of a source are read and which left out
    warn_repeated_sources(data.data_path, data.sft_only_data_path)
    splits = shard_splits(data)
    counts = raw_counts(splits)
    tokenized = {}
    if settings.counting.tokenizer:
        tokenizer = load_tokenizer(settings.counting.tokenizer, settings.counting.trust_remote_code)
        for phase in PHASE_KINDS:
            tokenized[phase] = {"train": 0, "eval": 0}
            # a step given no share (1,0,1: steps 1 and 3 with a reward function) has none
            if gives_step_data(phase, data.data_split, data.sft_only_data_path):
                built = data.build(phase, tokenizer)
                tokenized[phase] = {"train": len(built.train), "eval": len(built.eval)}
    print(f"data: {' '.join(data.data_path)}  split {data.data_split}  seed {data.seed}  eval_fraction {data.eval_fraction}"
          + (f"  sft_only: {' '.join(data.sft_only_data_path)}" if data.sft_only_data_path else ""))
    print("samples per step shard (each step trains on its own shard: step 1 SFT pairs, step 2 preference pairs, step 3 prompts)")
    print(_table(counts, tokenized))
    print("\n".join(source_lines(splits)))
    return {"raw": counts, "tokenized": tokenized}


if __name__ == "__main__":
    main()
