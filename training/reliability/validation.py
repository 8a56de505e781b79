"""Start-up checks of what the user passed, each ending in one `UserError` line that says what to do.

Steps call these before they write anything, so a bad argument never overwrites earlier work.
Batch sizes are checked by `training.core.args.check_positive`; `--data_split` by the data layer's
`parse_data_split` (re-exported here so every start-up check can be found in one place).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Sequence

from training.core.embedded_model import EMBEDDED_MODEL_NAME, is_embedded_name
from training.core.model_loading import (
    lora_adapter_base,
    own_code_error,
    own_code_part,
    refuse_file,
    resolve_model_path,
)
from training.reliability.run_records import ARGS_FILE, SUMMARY_FILE, read_run_args, run_dir_of
from utils.data.args import DataArguments
from utils.data.shard_match import InputRunRecord, check_same_shards
from utils.data.splits import parse_data_split
from utils.errors import UserError

__all__ = [
    "check_output_dir",
    "check_output_apart_from_inputs",
    "estimate_output_bytes",
    "check_disk_space",
    "model_max_positions",
    "rotary_switch_length",
    "generation_fits",
    "check_generation_fits",
    "check_sequence_lengths",
    "parse_data_split",
    "check_model_source",
    "check_remote_code",
    "check_reward_model_dir",
    "check_input_run_shards",
]

GB = 1024**3
_POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_OFFLINE_VALUES = {"1", "ON", "YES", "TRUE"}


# output folder and disk -------------------------------------------------------------------------


def check_folder_path(path: str | os.PathLike, flag: str = "--output_dir") -> Path:
    """Refuse a folder path that a file blocks, at it or above it, creating nothing (train.py checks its
    --output-dir so before it plans, a dry run too)."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file, not a folder; choose another {flag} (the file was left as it is)")
    blocking = next((parent for parent in folder.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{flag} {folder} cannot be created: part of that path is a file ({blocking}); choose "
                        f"another {flag}")
    return folder


def check_output_file(path: str | os.PathLike | None, flag: str = "--output_file") -> None:
    """Refuse, before any work, an output file path that is a folder or that a file blocks above it (it failed only
    once every row was scored)."""
    if path is None:
        return
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"{flag} {file} is a folder; give a file path, e.g. {file / 'results.jsonl'}")
    check_folder_path(file.parent, flag)


def check_output_dir(path: str | os.PathLike, flag: str = "--output_dir") -> Path:
    """Create the run folder (and its parents) unless something in the way is a file or unwritable."""
    folder = check_folder_path(path, flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        raise UserError(f"{flag} {folder} cannot be created: part of that path is a file; choose another {flag}") from err
    except PermissionError as err:
        raise UserError(f"{flag} {folder} cannot be created (permission denied); choose a folder you can write to") from err
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder} is not writable; choose a folder you can write to")
    return folder


def check_output_apart_from_inputs(output_dir: str | os.PathLike, inputs: dict[str, str | None],
                                   written: Sequence[str]) -> None:
    """Refuse an --output_dir that is a model folder the run reads (`inputs`: flag -> path), or whose subfolders
    the run writes (`written`: `model/`, `actor/`, `checkpoints/`, ...) hold one: the final save would land on the
    model the run starts from. A model elsewhere under --output_dir is left alone."""
    folder = Path(output_dir).expanduser().resolve()
    for flag, path in inputs.items():
        if path is None or not Path(path).expanduser().exists():  # a hub name is no folder of this machine
            continue
        model = Path(path).expanduser().resolve()
        if model == folder or any(model == folder / name or folder / name in model.parents for name in written):
            raise UserError(f"{flag} {path} lies in --output_dir {output_dir} where this run writes its model, "
                            "checkpoints and records: it would write over the model it starts from; choose another "
                            "--output_dir")


def estimate_output_bytes(
    num_params: int,
    param_bytes: int,
    trainable_params: int | None = None,
    keep_last_checkpoints: int = 0,
    checkpoints_on_disk: int = 0,
) -> int:
    """Bytes a run writes for one model: its final folder plus resume checkpoints.

    A checkpoint holds the weights in the training dtype, the Adam moments (8 bytes per trainable
    parameter) and, below fp32, an fp32 master copy; while one is written the previous
    `keep_last_checkpoints` still exist, hence one more than kept. A resumed run finds `checkpoints_on_disk` written
    already: their space is taken, and it writes the others (at least the one under way).
    """
    trainable = num_params if trainable_params is None else trainable_params
    optimizer_bytes_per_param = 8 + (4 if param_bytes < 4 else 0)
    checkpoint = num_params * param_bytes + trainable * optimizer_bytes_per_param
    checkpoints = max(keep_last_checkpoints + 1 - checkpoints_on_disk, 1) if keep_last_checkpoints > 0 else 0
    return num_params * param_bytes + checkpoints * checkpoint


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk_space(path: str | os.PathLike, needed_bytes: int, what: str = "this run") -> None:
    """Fail early when the disk under `path` has less free space than `needed_bytes`."""
    free = shutil.disk_usage(_existing_ancestor(Path(path))).free
    if free < needed_bytes:
        raise UserError(
            f"only {free / GB:.2f} GB are free on the disk of {path}, but {what} will write about "
            f"{needed_bytes / GB:.2f} GB; free some space, keep fewer checkpoints (--keep_last_checkpoints), "
            "or choose an --output_dir on another disk"
        )


# sequence lengths -------------------------------------------------------------------------------


def model_max_positions(config) -> tuple[int, str] | None:
    """The number of positions a model config supports, and the attribute that says so."""
    for attribute in _POSITION_ATTRIBUTES:
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value, attribute
    return None


def rotary_switch_length(config) -> int | None:
    """The sequence length past which the model's rotary embedding rotates every sequence of a batch with other
    frequencies, or None where they never depend on the length within its positions. longrope (Phi-3's 128k
    models, Phi-3.5, Phi-4-mini) takes its long factors for a whole batch once the batch's longest sequence passes
    original_max_position_embeddings (4096 of their 131072); dynamic NTK scaling starts past the positions only."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer_type = [value for value in parameters.values() if isinstance(value, dict)]
    lengths = [
        rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for rope in per_layer_type or [parameters]
        if (rope.get("rope_type") or rope.get("type")) == "longrope"
    ]
    return min((length for length in lengths if length), default=None)


def generation_fits(config, prompt_tokens: int, max_new_tokens: int) -> bool:
    """Whether a prompt of `prompt_tokens` and `max_new_tokens` generated after it fit the model's positions."""
    positions = model_max_positions(config)
    return positions is None or prompt_tokens + max_new_tokens <= positions[0]


def check_generation_fits(config, prompt_tokens: int, max_new_tokens: int, what: str) -> None:
    """Refuse a prompt (`what`, for the message) that, with `max_new_tokens` generated after it, passes the model's
    positions: generate would index past the position table, or a prompt cut to fit would lose its question."""
    if not generation_fits(config, prompt_tokens, max_new_tokens):
        positions = model_max_positions(config)
        raise UserError(f"{what} is {prompt_tokens} tokens; with --max_new_tokens {max_new_tokens} that passes the "
                        f"model's {positions[0]} positions ({positions[1]}): shorten it or lower --max_new_tokens")


def check_sequence_lengths(
    config,
    *,
    max_seq_len: int | None = None,
    max_prompt_seq_len: int | None = None,
    max_answer_seq_len: int | None = None,
    model: str = "the model",
) -> None:
    """Lengths must be positive, and a whole sequence must fit the model's position embeddings; a step-3 rollout
    (prompt + answer) must also stay short of a rotary switch (`rotary_switch_length`): decoded across it, its
    tokens would be drawn under other frequencies than its training forward uses, and an answer's log-probs would
    depend on the other answers in its batch (PPO's ratios off from the first update)."""
    named = {"--max_seq_len": max_seq_len, "--max_prompt_seq_len": max_prompt_seq_len,
             "--max_answer_seq_len": max_answer_seq_len}
    for flag, value in named.items():
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive number of tokens, got {value}")
    switch = rotary_switch_length(config)
    if switch is not None and max_prompt_seq_len is not None and max_answer_seq_len is not None \
            and max_prompt_seq_len + max_answer_seq_len > switch:
        raise UserError(
            f"--max_prompt_seq_len {max_prompt_seq_len} + --max_answer_seq_len {max_answer_seq_len} = "
            f"{max_prompt_seq_len + max_answer_seq_len} tokens pass the {switch} positions after which the rotary "
            f"embedding of {model} (longrope) switches to its long factors for every sequence of a batch "
            "(original_max_position_embeddings): what it computes for an answer (log-probs, values, scores) would depend "
            "on the other answers in its batch, and an actor would sample under other frequencies than its training "
            f"forward uses; lower them so they sum to at most {switch}"
        )
    limit = model_max_positions(config)
    if limit is None:
        return
    positions, attribute = limit
    if max_seq_len is not None and max_seq_len > positions:
        raise UserError(
            f"--max_seq_len {max_seq_len} exceeds the {positions} positions of {model} ({attribute}); "
            f"pass --max_seq_len {positions} or less"
        )
    if max_prompt_seq_len is not None and max_answer_seq_len is not None:
        total = max_prompt_seq_len + max_answer_seq_len
        if total > positions:
            raise UserError(
                f"--max_prompt_seq_len {max_prompt_seq_len} + --max_answer_seq_len {max_answer_seq_len} = {total} "
                f"tokens exceed the {positions} positions of {model} ({attribute}); lower them so they sum to "
                f"at most {positions}"
            )


# models -----------------------------------------------------------------------------------------


def _hub_offline() -> bool:
    return any(os.environ.get(name, "").upper() in _OFFLINE_VALUES for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached_on_hub(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def models_inside(folder: Path) -> list[str]:
    """The model folders (with a config.json) one or two levels inside `folder`, relative to it, where `folder` is a
    run folder of this project (its args.json or summary.json): a step-3 run folder's `actor`, `actor_ema` and
    `critic`, a train.py output folder's `step1/model`, ...; none for any other folder."""
    if not any((folder / record).is_file() for record in (ARGS_FILE, SUMMARY_FILE)):
        return []
    return sorted(config.parent.relative_to(folder).as_posix()
                  for pattern in ("*/config.json", "*/*/config.json") for config in folder.glob(pattern))


def check_model_source(name_or_path: str, flag: str = "--model_name_or_path") -> None:
    """The model must be the embedded default, a local model/run folder, or a hub name that can be fetched."""
    if is_embedded_name(name_or_path):
        return
    alternatives = f"a Hugging Face model folder, a previous step's run folder, or '{EMBEDDED_MODEL_NAME}'"
    path = Path(name_or_path).expanduser()
    if path.exists():
        refuse_file(name_or_path, flag)
        folder = Path(resolve_model_path(str(path)))
        base = lora_adapter_base(folder)
        if base is not None:
            raise UserError(f"{flag} {name_or_path} holds a LoRA adapter, not a whole model (its base model: {base!r}, "
                            "adapter_config.json); merge the adapter into its base model and pass that folder")
        if not (folder / "config.json").is_file():
            inside = models_inside(path)
            if inside:
                raise UserError(f"{flag} {name_or_path} is a folder of models ({', '.join(inside)}), not a model; pass "
                                f"the one to start from, e.g. {path / inside[0]}")
            raise UserError(f"{flag} {name_or_path} holds no config.json (nor model/config.json); pass {alternatives}")
        return
    if not _HUB_ID.match(name_or_path) or ".." in name_or_path:
        raise UserError(f"{flag} {name_or_path}: no such folder; check the path, or pass {alternatives}")
    if _hub_offline() and not _cached_on_hub(name_or_path):
        raise UserError(
            f"{flag} {name_or_path} is not a local folder and the Hugging Face hub is offline (HF_HUB_OFFLINE) "
            "with no cached copy; download the model on a connected machine and pass its local folder, "
            f"or use '{EMBEDDED_MODEL_NAME}'"
        )


def check_remote_code(name_or_path: str, trust_remote_code: bool, flag: str = "--model_name_or_path") -> None:
    """A model, or its tokenizer, that loads only by running its own code (`own_code_part`) runs only with
    `--trust_remote_code`."""
    part = None if trust_remote_code else own_code_part(name_or_path)
    if part is not None:
        raise own_code_error(name_or_path, flag, part)


def check_reward_model_dir(
    name_or_path: str,
    has_value_head: Callable[[Path], bool] | Sequence[str],
    flag: str = "--critic_model_name_or_path",
) -> Path:
    """The folder of a trained reward model (a step-2 run folder or its `model/`); returns the model folder.

    `has_value_head` is either a predicate on the folder or the file names that must all be present
    (the reward-model module owns which files mark a value head).
    """
    hint = "pass the run folder (or model folder) written by step 2"
    if is_embedded_name(name_or_path):
        raise UserError(f"{flag} {name_or_path} is a base language model with no value head; {hint}")
    folder = Path(resolve_model_path(name_or_path))
    if not folder.is_dir():
        raise UserError(f"{flag} {name_or_path}: no such folder; {hint}")
    if callable(has_value_head):
        present, missing = has_value_head(folder), "a value head"
    else:
        absent = [name for name in has_value_head if not (folder / name).is_file()]
        present, missing = not absent, ", ".join(absent)
    if not present:
        raise UserError(f"{flag} {name_or_path} is not a reward model (missing {missing}); {hint}")
    return folder


def check_input_run_shards(name_or_path: str, data: DataArguments, phase: int,
                           flag: str = "--model_name_or_path") -> InputRunRecord | None:
    """A model an earlier step of this project trained must come from the same data shards as this step's.

    Its run folder's args.json says how it cut the data (`utils.data.shard_match`); a model without
    one (the embedded default, a hub name, a plain HF folder) is not checked; `phase` is the shard this step trains
    on. Returns the record counts the run cut
    the sources it shares with this step from (its data_split.json), for this step's data build to compare with the
    counts it cuts (`DataArguments.build`): no source is read here.
    """
    if is_embedded_name(name_or_path):
        return None
    run_dir = run_dir_of(name_or_path)
    earlier = read_run_args(run_dir) if run_dir is not None else None
    if earlier is None:
        return None
    return check_same_shards(vars(data), earlier, f"{flag} {name_or_path}", str(run_dir), phase)
