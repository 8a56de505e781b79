"""Reward model and critic: any causal LM's transformer backbone plus a scalar value head.

A saved reward model is a Hugging Face folder:
- `config.json` + `model.safetensors` (or shards): the backbone as a base model, loadable on its
  own with `AutoModel.from_pretrained(folder)`;
- `value_head.safetensors`: the head's `v_head.weight` [1, hidden];
- `reward_model.json`: the marker that says the folder holds a trained value head.

ZeRO-3: the backbone is always built by `AutoModel.from_pretrained` inside
`training.core.model_loading.zero3_construction(ds_config)`, so transformers partitions it while it
loads. The value head (hidden_size numbers) is built unpartitioned; `deepspeed.initialize`
converts it to a ZeRO-3 parameter together with any other unpartitioned parameter. Always run a
ZeRO-3 reward model or critic through a DeepSpeed engine, and save it with
`training.core.save.save_hf_model(engine, tokenizer, folder)`, which gathers the weights and calls
`RewardModel.save_pretrained(folder, state_dict=...)`.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import AutoModel, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from training.core.model_loading import (
    asks_for_own_code,
    disable_dropout,
    load_config,
    match_tokenizer,
    no_model_error,
    resolve_model_path,
    zero3_construction,
)
from training.core.sequences import last_token_index, position_ids_from_attention_mask
from utils.errors import UserError

MARKER_FILE = "reward_model.json"
VALUE_HEAD_FILE = "value_head.safetensors"
_FORMAT = "rlhf-reward-model"


TRAIN_PY_REWARD_RUN = "step2"  # train.py's run folder of step 2 in its --output-dir


def is_reward_model_dir(path: str | os.PathLike) -> bool:
    """Whether `path` (a folder, a run folder or a hub name already resolved) holds a saved reward model."""
    return (Path(resolve_model_path(str(path))) / MARKER_FILE).is_file()


def resolve_reward_model(path: str) -> str:
    """The reward model a folder holds: a train.py output folder its `step2/` run, anything else as given."""
    step2 = Path(path) / TRAIN_PY_REWARD_RUN
    return str(step2) if not is_reward_model_dir(path) and is_reward_model_dir(step2) else path


def reward_model_folder(path: str | os.PathLike) -> Path:
    """The model folder of the reward model step 2 saved at `path` (the folder or its run folder); a `UserError`
    where it holds none (checked without loading anything)."""
    folder = Path(resolve_model_path(str(path)))
    if not folder.is_dir():
        raise UserError(f"reward model folder {folder} does not exist; pass the output folder of step 2")
    if not (folder / "config.json").is_file():
        raise no_model_error(str(path))
    if not (folder / MARKER_FILE).is_file() or not (folder / VALUE_HEAD_FILE).is_file():
        raise UserError(
            f"{folder} has no value head: it was not trained by step 2; run step 2 "
            "(step2_reward/main.py) or pass a reward model folder"
        )
    return folder


def refuse_reward_model(name_or_path: str, flag: str | None = None) -> None:
    """A `UserError` where a causal LM is wanted and `name_or_path` is a reward model: it would load with a freshly
    drawn LM head, and train or answer with it."""
    if is_reward_model_dir(name_or_path):
        given = f"{flag} {name_or_path}" if flag else name_or_path
        raise UserError(f"{given} is a reward model or critic (a backbone and a value head: step 2's model, step 3's "
                        "critic/); it has no language-model head to train or answer with: pass a causal LM (a step-1 "
                        "or step-3 run folder, a base model)")


def backbone_output_size(config) -> int:
    """Width of the backbone's last hidden state (OPT projects it to `word_embed_proj_dim`)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "word_embed_proj_dim", None) or text_config.hidden_size


class RewardModel(nn.Module):
    """`forward(input_ids, attention_mask)` -> {"values": [B, T], "end_scores": [B]}.

    `values` are per-token scalars (the critic's value estimates; 0 on padding); `end_scores` is the
    value at each sequence's last real token (the reward). Sequences may be left- or right-padded.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        dtype = next(backbone.parameters()).dtype
        self.v_head = nn.Linear(backbone_output_size(backbone.config), 1, bias=False, dtype=dtype)
        self._takes_position_ids = "position_ids" in inspect.signature(backbone.forward).parameters

    @classmethod
    def from_causal_lm(
        cls,
        model_or_path: str | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        dtype: torch.dtype = torch.float32,
        ds_config: dict | None = None,
        disable_dropout_layers: bool = False,
        trust_remote_code: bool = False,
    ) -> "RewardModel":
        """A reward model with a freshly initialised head on a causal LM's backbone (step-1 output or a base model).

        Given a folder, only the backbone is loaded (ZeRO-3 partitioned when `ds_config` is stage 3);
        given a model object, its backbone is reused without a copy. With `tokenizer`, the embeddings
        grow to fit it and the pad id is recorded in the config.
        """
        if isinstance(model_or_path, nn.Module):
            backbone = model_or_path.base_model  # the causal LM minus its LM head
            if tokenizer is not None:
                match_tokenizer(backbone, tokenizer)
        else:
            backbone = _load_backbone(model_or_path, dtype, ds_config, trust_remote_code, tokenizer)
        model = cls(backbone)
        if disable_dropout_layers:
            disable_dropout(model)
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        ds_config: dict | None = None,
        disable_dropout_layers: bool = False,
        trust_remote_code: bool = False,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> "RewardModel":
        """Load a reward model saved by step 2 (as the frozen reward model, to initialise the critic, or to train it
        further in step 2). With `tokenizer`, the embeddings grow to fit it and the pad id is recorded in the config."""
        folder = reward_model_folder(path)
        backbone = _load_backbone(str(folder), dtype, ds_config, trust_remote_code, tokenizer)
        head_weight = load_file(str(folder / VALUE_HEAD_FILE))["v_head.weight"]
        model = cls(backbone)
        if tuple(head_weight.shape) != tuple(model.v_head.weight.shape):
            raise UserError(
                f"the value head in {folder} has shape {tuple(head_weight.shape)} but the backbone needs "
                f"{tuple(model.v_head.weight.shape)}; the folder is damaged, re-run step 2"
            )
        with torch.no_grad():
            model.v_head.weight.copy_(head_weight.to(model.v_head.weight.dtype))
        if disable_dropout_layers:
            disable_dropout(model)
        return model

    def save_pretrained(
        self, path: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | None = None, **kwargs
    ) -> None:
        """Write the folder described in the module docstring.

        `state_dict` (keys `backbone.*` and `v_head.weight`) is what `training.core.save.save_hf_model`
        passes after gathering ZeRO-3 partitions; without it the module's own tensors are used.
        """
        state = dict(state_dict) if state_dict is not None else self.state_dict()
        prefix = "backbone."
        backbone_state = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        path = Path(path)
        self.backbone.save_pretrained(path, state_dict=backbone_state, **kwargs)
        save_file({"v_head.weight": state["v_head.weight"].detach().cpu().contiguous()}, str(path / VALUE_HEAD_FILE))
        marker = {
            "format": _FORMAT,
            "version": 1,
            "value_head_file": VALUE_HEAD_FILE,
            "backbone_class": type(self.backbone).__name__,
            "hidden_size": int(self.v_head.in_features),
            "score": "value head output at the last token whose attention_mask is 1",
        }
        (path / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        """`input_ids` [B, T], or None with `inputs_embeds` [B, T, H] in kwargs, and the [B, T] `attention_mask`."""
        if self._takes_position_ids and "position_ids" not in kwargs:
            kwargs["position_ids"] = position_ids_from_attention_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)[0]
        values = self.v_head(hidden).squeeze(-1)
        values = torch.where(attention_mask.bool(), values, torch.zeros_like(values))
        rows = torch.arange(values.shape[0], device=values.device)
        end_scores = values[rows, last_token_index(attention_mask)]
        return {"values": values, "end_scores": end_scores}


def _check_backbone_code(path: str, config: PretrainedConfig) -> None:
    """A model that loads only by its own code is built without its LM head by the class its auto_map names for
    AutoModel; where it names none, transformers' error listed every model type it knows, as a traceback."""
    if asks_for_own_code(path) and "AutoModel" not in (getattr(config, "auto_map", None) or {}):
        raise UserError(f"{path} ships its own model code, and it names no AutoModel class (auto_map in its "
                        "config.json): the model without its LM head, which a reward model and a critic are built on; "
                        "choose a model whose code names one, or a model type transformers knows")


def _load_backbone(path: str, dtype: torch.dtype, ds_config: dict | None, trust_remote_code: bool,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """`AutoModel.from_pretrained` (causal-LM folders load without their LM head), ZeRO-3 partitioned on request,
    its embeddings grown to `tokenizer` inside the ZeRO-3 context (as `load_causal_lm` does)."""
    config = load_config(path, trust_remote_code)  # a missing folder or unreachable hub name becomes a UserError
    _check_backbone_code(path, config)
    with zero3_construction(ds_config):
        backbone = AutoModel.from_pretrained(
            resolve_model_path(path), config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
        if tokenizer is not None:
            match_tokenizer(backbone, tokenizer)
    return backbone
