"""The score of each finished answer: the reward model's, a reward function's, or their sum.

score = reward-model score (when step 3 has a reward model) + `reward_fn_coef` * reward function
(when `--reward_fn` names one). The reward function reads the decoded prompt and answer and the
prompt row's metadata (e.g. the task's known answer); the model reads the token ids, each answer ending in the token
step 2's sequences end in (`trained_end_id`), whichever stop token the actor ended it at. Step 3's
`--clip_reward_value` clips the reward model's part alone (`Scores.model`): the weighted reward
function is added as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from training.core.answer_window import RowGroups
from training.generation.generator import is_stop_token
from training.rewards import RewardFunction, score_answers
from utils.data.formatting import PromptFormatter


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


def trained_end_id(formatter: PromptFormatter) -> int:
    """The token step 2's sequences under `formatter` end in: the EOS it appends to an answer, or where it appends
    none (`PromptFormatter.answer_suffix_ids`), the chat template's end-of-turn token that ends the answer's text."""
    suffix = formatter.answer_suffix_ids
    return suffix[-1] if suffix else formatter.tokenizer.convert_tokens_to_ids(formatter.end_of_turn_token)


@dataclass
class RewardScorer:
    reward_model: torch.nn.Module | None
    reward_fn: RewardFunction | None
    reward_fn_coef: float
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: Sequence[int] = ()  # the ids an answer ends at (`PPOTrainer.stop_token_ids`)
    end_id: int | None = None  # the one of them step 2's sequences end in (`trained_end_id`); None: as generated

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
            model = RowGroups.of(self.ending_as_trained(sequences, attention_mask, prompt_length), attention_mask,
                                 prompt_length, (self.reward_model,)).end_scores(self.reward_model)
        if self.reward_fn is None:
            return Scores(model)
        prompts = self._texts(sequences[:, :prompt_length], attention_mask[:, :prompt_length])
        answers = self._texts(sequences[:, prompt_length:], attention_mask[:, prompt_length:])
        rows = list(metadata) if metadata is not None else [{}] * len(answers)
        function = score_answers(self.reward_fn, prompts, answers, rows).to(sequences.device)
        return Scores(model, function, self.reward_fn_coef * function)

    def ending_as_trained(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_length: int) -> torch.Tensor:
        """`sequences` with each answer that ended at another stop token than `end_id` ending in `end_id` instead (an
        EOS where the chat template ends a turn in its own token, an id the actor's generation config adds: Qwen2.5-
        Instruct's <|endoftext|>). The reward model scores an answer at its last token, and step 2 trained it to
        score there at `end_id` alone: at another token the score was one no training shaped."""
        other_stops = [token for token in self.stop_token_ids if token != self.end_id]
        if self.end_id is None or not other_stops:
            return sequences
        lengths = attention_mask[:, prompt_length:].sum(-1)
        last = (prompt_length + lengths - 1).clamp(min=0)
        rows = torch.arange(sequences.shape[0], device=sequences.device)
        elsewhere = (lengths > 0) & is_stop_token(sequences[rows, last], other_stops)
        if not elsewhere.any():
            return sequences
        ended = sequences.clone()
        ended[rows[elsewhere], last[elsewhere]] = self.end_id
        return ended

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(row[row_mask.bool()].tolist(), skip_special_tokens=True)
                for row, row_mask in zip(ids, mask)]
