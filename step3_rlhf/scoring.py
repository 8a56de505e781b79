"""The score of each finished answer: the reward model's, a reward function's, or their sum.

score = reward-model score (when step 3 has a reward model) + `reward_fn_coef` * reward function
(when `--reward_fn` names one). The reward function reads the decoded prompt and answer and the
prompt row's metadata (e.g. the task's known answer); the model reads the token ids. Step 3's
`--clip_reward_value` clips the reward model's part alone (`Scores.model`): the weighted reward
function is added as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from training.core.answer_window import RowGroups
from training.rewards import RewardFunction, score_answers


@dataclass
class Scores:
    """Every field a [B] fp32 tensor (or None), so that stage fusion lays micro-batches' scores into the batch."""

    model: torch.Tensor | None  # the reward model's score (None without one): the part --clip_reward_value clips
    function: torch.Tensor | None = None  # the reward function's own value (None without one)
    weighted_function: torch.Tensor | None = None  # reward_fn_coef * function: added to the reward unclipped

    @property
    def clipped_part(self) -> torch.Tensor:
        """[B] the part of the reward --clip_reward_value clips: the reward model's score, 0 without one."""
        return self.model if self.model is not None else torch.zeros_like(self.weighted_function)

    @property
    def total(self) -> torch.Tensor:
        """[B] the score the RL objective maximises, before the reward model's clip and the no-EOS penalty."""
        return self.clipped_part if self.weighted_function is None else self.clipped_part + self.weighted_function


@dataclass
class RewardScorer:
    reward_model: torch.nn.Module | None
    reward_fn: RewardFunction | None
    reward_fn_coef: float
    tokenizer: PreTrainedTokenizerBase

    def __post_init__(self) -> None:
        if self.reward_model is None and self.reward_fn is None:
            raise ValueError("a RewardScorer needs a reward model, a reward function or both")

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                 metadata: Sequence[Mapping] | None) -> Scores:
        """Scores of B prompt+answer rows (left-padded prompts, right-padded answers); `metadata` has
        one entry per row (None: no row has any). The model reads the rows grouped by length, flush right (`RowGroups`)."""
        model = None
        if self.reward_model is not None:
            model = RowGroups.of(sequences, attention_mask, prompt_length,
                                 (self.reward_model,)).end_scores(self.reward_model)
        if self.reward_fn is None:
            return Scores(model)
        prompts = self._texts(sequences[:, :prompt_length], attention_mask[:, :prompt_length])
        answers = self._texts(sequences[:, prompt_length:], attention_mask[:, prompt_length:])
        rows = list(metadata) if metadata is not None else [{}] * len(answers)
        function = score_answers(self.reward_fn, prompts, answers, rows).to(sequences.device)
        return Scores(model, function, self.reward_fn_coef * function)

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(row[row_mask.bool()].tolist(), skip_special_tokens=True)
                for row, row_mask in zip(ids, mask)]
