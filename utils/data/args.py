"""The data settings the three steps share: each field is one command-line flag (names follow DeepSpeed-Chat)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from utils.errors import UserError, refuse_all
from utils.paths import cache_root

from .embedded import EMBEDDED_SOURCE
from .formatting import PROMPT_FORMATS
from .phases import PhaseData, build_phase_data, check_sample_caps
from .readers import FORMATS
from .shard_match import InputRunRecord, shared_sources
from .sources import resolved_source
from .splits import ShardSettings, check_eval_fraction, check_seed, parse_data_split
from .tokenization import PROMPT_OVERFLOW, check_token_limits


def default_data_output_path() -> str:
    return str(cache_root() / "data_files")


# Local paths in these are made absolute as they are parsed, so a run's records (args.json, its checkpoints' flags)
# name the files it read wherever a later step, resume or pipeline rerun starts from.
SOURCE_FLAGS = ("data_path", "sft_only_data_path")
# Read by step 1 alone, each with why another step refuses it (`DataArguments.check_flags`); train.py gives them to
# step 1 only.
STEP1_ONLY_FLAGS = {
    "sft_only_data_path": "names sources step 1 alone trains on, and this step reads only its shard of --data_path",
    "whole_sequence_loss": "sets step 1's loss alone, which this step does not compute",
}


def flags_another_step_reads(step: int) -> frozenset[str]:
    """The flags step `step` (its number, or its shard: both 1 for step 1 alone) records but another step alone reads
    (`STEP1_ONLY_FLAGS`): train.py gave them to every step before they were step 1's, so a later step's args.json and
    checkpoints may hold them; they are not compared when that step is run again or resumed."""
    return frozenset() if step == 1 else frozenset(STEP1_ONLY_FLAGS)


def with_resolved_sources(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Recorded flags with the data sources resolved as `DataArguments` resolves them (records written before it
    did, or by hand, compare equal to a run's own when they read the same files from here)."""
    return {name: [resolved_source(path) for path in value] if name in SOURCE_FLAGS and isinstance(value, list)
            else value for name, value in flags.items()}


@dataclass
class DataArguments:
    """The data flags the three steps share (including --seed, --max_seq_len and --max_prompt_seq_len)."""

    data_path: list[str] = field(default_factory=lambda: [EMBEDDED_SOURCE], metadata={
        "nargs": "*",
        "help": "data sources: 'embedded', a generated task with checkable answers (task:arithmetic, options as in "
                "task:arithmetic?difficulty=3&size=2000&seed=0), hub names, or local json/jsonl/parquet files or folders "
                "(a dict column 'metadata', e.g. {\"answer\": \"42\"}, is kept for step 3's reward functions); "
                f"append :FORMAT to state the row format ({', '.join(FORMATS)})"})
    data_split: str = field(default="2,4,4", metadata={
        "help": "comma-separated weights of the three steps' disjoint shards of each source, e.g. 2,4,4"})
    sft_only_data_path: list[str] = field(default_factory=list, metadata={
        "nargs": "*", "help": "sources used entirely by step 1 only"})
    data_output_path: str = field(default_factory=default_data_output_path, metadata={
        "same_result": True, "help": "folder of the tokenised data cache"})
    seed: int = field(default=1234, metadata={"help": "seed for shuffling, splits and training"})
    max_seq_len: int = field(default=512, metadata={"help": "maximum tokens of prompt + answer (steps 1 and 2)"})
    max_prompt_seq_len: int = field(default=256, metadata={"help": "maximum prompt tokens (step 3)"})
    prompt_format: str = field(default="auto", metadata={
        "choices": PROMPT_FORMATS,
        "help": "render prompts with the tokenizer's chat template, DeepSpeed-Chat's ' Human: ... Assistant:', "
                "or auto (the chat template when the tokenizer has one)"})
    prompt_overflow: str = field(default="drop", metadata={
        "choices": PROMPT_OVERFLOW,
        "help": "step 3 prompts over --max_prompt_seq_len: drop them (counted) or keep their last tokens"})
    whole_sequence_loss: bool = field(default=False, metadata={
        "help": "step 1: compute the loss on the prompt tokens too, not only on the answer "
                "(the other steps refuse it)"})
    eval_fraction: float = field(default=0.1, metadata={"help": "fraction of each step's shard held out for evaluation"})
    max_train_samples: int | None = field(default=None, metadata={"help": "use at most this many training items"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use at most this many evaluation items"})
    rebuild_data_cache: bool = field(default=False, metadata={
        "same_result": True, "help": "rebuild the tokenised data cache"})

    def __post_init__(self) -> None:
        check_seed(self.seed)
        for flag in SOURCE_FLAGS:
            setattr(self, flag, [resolved_source(path) for path in getattr(self, flag)])

    def check_flags(self, phase: int) -> None:
        """Refuse a --data_split or --eval_fraction no shard can be cut with, token limits or sample caps the build
        refuses, and step 1's own flags in a step that trains on shard `phase` > 1 (which ignored them), before the
        step reads any data (the steps' `check_flags`, which train.py runs before its first step, call it); every
        refusal at once, as the steps report theirs."""
        refuse_all(partial(parse_data_split, self.data_split), partial(check_eval_fraction, self.eval_fraction),
                   partial(check_token_limits, self.max_seq_len, self.max_prompt_seq_len),
                   partial(check_sample_caps, self.max_train_samples, self.max_eval_samples),
                   partial(self._check_step1_only_flags, phase), partial(self._check_whole_sources_unsharded, phase))

    def _check_step1_only_flags(self, phase: int) -> None:
        given = [f"--{flag} {why}" for flag, why in STEP1_ONLY_FLAGS.items() if getattr(self, flag)]
        if phase != 1 and given:
            raise UserError(f"{'; '.join(given)}: drop {'it' if len(given) == 1 else 'them'} (train.py gives "
                            f"{'it' if len(given) == 1 else 'them'} to step 1 only)")

    def _check_whole_sources_unsharded(self, phase: int) -> None:
        """Step 1 trains on a step-1-only source whole, so it cannot also be cut into the steps' shards (the later
        steps refuse the flag itself)."""
        sharded = shared_sources(self.sft_only_data_path, self.data_path)
        if phase == 1 and sharded:
            raise UserError(f"--sft_only_data_path {', '.join(sharded)} is in --data_path too: step 1 would train on "
                            "its step-1 shard twice and on the shards of steps 2 and 3 (which then refuse step 1's "
                            "model); name each source in one of the two")

    def shard_settings(self) -> ShardSettings:
        return ShardSettings(self.data_split, self.seed, self.eval_fraction)

    def build(self, phase: int, tokenizer, input_runs: Sequence[InputRunRecord] = ()) -> PhaseData:
        """`build_phase_data` with these options: the step's train and eval data, and the records each source was cut
        from (for `write_split_record`), checked against those of `input_runs` (`check_input_run_shards`)."""
        return build_phase_data(
            phase,
            self.data_path,
            self.data_split,
            tokenizer,
            self.max_seq_len,
            self.seed,
            self.data_output_path,
            sft_only_data_paths=self.sft_only_data_path,
            rebuild_cache=self.rebuild_data_cache,
            eval_fraction=self.eval_fraction,
            max_train_samples=self.max_train_samples,
            max_eval_samples=self.max_eval_samples,
            max_prompt_seq_len=self.max_prompt_seq_len,
            prompt_format=self.prompt_format,
            prompt_overflow=self.prompt_overflow,
            whole_sequence_loss=self.whole_sequence_loss,
            input_runs=input_runs,
        )


@dataclass
class UnsupervisedDataArguments:
    """Step 3's pretraining-mixture source (`build_unsupervised_dataset`)."""

    unsupervised_dataset_name: str | None = field(default=None, metadata={
        "help": "text for the pretraining mixture: hub name, local .txt/.jsonl/.json/.parquet, or 'embedded' "
                "(the replies of the embedded conversations in step 3's training shard)"})
    unsupervised_dataset_config_name: str | None = field(default=None, metadata={
        "help": "the hub dataset's config name"})
    unsupervised_text_column: str = field(default="text", metadata={
        "help": "the column each document is read from, in a hub dataset or a local .json/.jsonl/.parquet source "
                "('content' in some code and web corpora)"})
