"""Data abstraction and blending layer: every source yields prompt/chosen/rejected rows, split into
disjoint per-step shards, blended, tokenised and cached for the three RLHF steps."""
from .args import DataArguments, UnsupervisedDataArguments
from .collators import PairwiseCollator, PromptCollator, SFTCollator
from .embedded import EMBEDDED_SOURCE
from .formatting import PROMPT_FORMATS, PromptFormatter
from .phases import PhaseData, build_phase_data, phase_splits
from .readers import FORMATS, detect_format
from .rows import read_rows
from .samples import Sample
from .sources import SourceSpec, load_source, parse_source_spec
from .split_record import write_split_record
from .tokenization import IGNORE_INDEX
from .tokenized import TokenizedDataset
from .unsupervised import build_unsupervised_dataset

__all__ = [
    "DataArguments",
    "UnsupervisedDataArguments",
    "SFTCollator",
    "PairwiseCollator",
    "PromptCollator",
    "EMBEDDED_SOURCE",
    "PROMPT_FORMATS",
    "PromptFormatter",
    "PhaseData",
    "build_phase_data",
    "phase_splits",
    "FORMATS",
    "detect_format",
    "Sample",
    "SourceSpec",
    "load_source",
    "parse_source_spec",
    "IGNORE_INDEX",
    "TokenizedDataset",
    "build_unsupervised_dataset",
    "read_rows",
    "write_split_record",
]
