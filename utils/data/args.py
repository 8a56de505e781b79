"""The data command-line options the three steps share (names follow DeepSpeed-Chat)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from utils.paths import cache_root

from .embedded import EMBEDDED_SOURCE
from .formatting import PROMPT_FORMATS
from .phases import build_phase_datasets
from .splits import ShardSettings
from .tokenization import PROMPT_OVERFLOW
from .tokenized import TokenizedDataset


def default_data_output_path() -> str:
    return str(cache_root() / "data_files")


@dataclass
class DataArguments:
    data_path: list[str] = field(default_factory=lambda: [EMBEDDED_SOURCE])
    data_split: str = "2,4,4"
    sft_only_data_path: list[str] = field(default_factory=list)
    data_output_path: str = field(default_factory=default_data_output_path)
    seed: int = 1234
    max_seq_len: int = 512
    max_prompt_seq_len: int = 256
    prompt_format: str = "auto"
    prompt_overflow: str = "drop"
    whole_sequence_loss: bool = False
    eval_fraction: float = 0.1
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    rebuild_data_cache: bool = False

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "DataArguments":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def shard_settings(self) -> ShardSettings:
        return ShardSettings(self.data_split, self.seed, self.eval_fraction)

    def build(self, phase: int, tokenizer) -> tuple[TokenizedDataset, TokenizedDataset]:
        """`build_phase_datasets` with these options."""
        return build_phase_datasets(
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
        )


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the shared data flags (including --seed, --max_seq_len and --max_prompt_seq_len)."""
    defaults = DataArguments()
    group = parser.add_argument_group("data")
    group.add_argument("--data_path", nargs="*", default=defaults.data_path,
                       help="data sources: 'embedded', hub names, or local json/jsonl/parquet files or folders; "
                            "append :FORMAT to state the row format (deepspeed_chat, hh_rlhf, shp, webgpt, sharegpt, messages)")
    group.add_argument("--data_split", default=defaults.data_split,
                       help="comma-separated weights of the three steps' disjoint shards of each source, e.g. 2,4,4")
    group.add_argument("--sft_only_data_path", nargs="*", default=[], help="sources used entirely by step 1 only")
    group.add_argument("--data_output_path", default=defaults.data_output_path, help="folder of the tokenised data cache")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed for shuffling, splits and training")
    group.add_argument("--max_seq_len", type=int, default=defaults.max_seq_len,
                       help="maximum tokens of prompt + answer (steps 1 and 2)")
    group.add_argument("--max_prompt_seq_len", type=int, default=defaults.max_prompt_seq_len,
                       help="maximum prompt tokens (step 3)")
    group.add_argument("--prompt_format", choices=PROMPT_FORMATS, default=defaults.prompt_format,
                       help="render prompts with the tokenizer's chat template, DeepSpeed-Chat's ' Human: ... Assistant:', "
                            "or auto (the chat template when the tokenizer has one)")
    group.add_argument("--prompt_overflow", choices=PROMPT_OVERFLOW, default=defaults.prompt_overflow,
                       help="step 3 prompts over --max_prompt_seq_len: drop them (counted) or keep their last tokens")
    group.add_argument("--whole_sequence_loss", action="store_true",
                       help="step 1: compute the loss on the prompt tokens too, not only on the answer")
    group.add_argument("--eval_fraction", type=float, default=defaults.eval_fraction,
                       help="fraction of each step's shard held out for evaluation")
    group.add_argument("--max_train_samples", type=int, default=None, help="use at most this many training items")
    group.add_argument("--max_eval_samples", type=int, default=None, help="use at most this many evaluation items")
    group.add_argument("--rebuild_data_cache", action="store_true", help="rebuild the tokenised data cache")
    return parser


def add_unsupervised_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Step 3's pretraining-mixture source (`build_unsupervised_dataset`)."""
    group = parser.add_argument_group("unsupervised data")
    group.add_argument("--unsupervised_dataset_name", default=None,
                       help="text for the pretraining mixture: hub name, local .txt/.jsonl/.json/.parquet, or 'embedded' "
                            "(the replies of the embedded conversations in step 3's training shard)")
    group.add_argument("--unsupervised_dataset_config_name", default=None, help="the hub dataset's config name")
    return parser
