"""Stage fusion (RLHFuse): a rollout's finished answers are scored in micro-batches while the rest still decode.

Answers end at different decode steps, and the slowest one sets how long generation takes. Without fusion every
scoring forward (the reference's log-probs, the reward model's score, the critic's values, and the actor's old
log-probs where they are recomputed) waits for that slowest answer. With `--enable_stage_fusion`, the generator
hands over rows the moment they end (`FinishedRowsHook`); once `--stage_fusion_micro_batch_size` of them are
waiting, they are scored as one micro-batch:
- co-located, between two decode steps on the same rank (the scoring is done by the time the last answer ends;
  on one device the work is the same, only its order changes);
- under a placement, by the ranks that hold the scoring models, while the generating ranks keep decoding
  (`step3_rlhf.placed`): there the scoring ranks would otherwise wait for the whole batch.

Each row is scored exactly as in the whole batch, so the experience is the unfused one up to the rounding of
differently shaped kernels: per-row results are laid back into the batch's rows, per-token ones into its answer
columns (zeros past each answer, as `AnswerWindow.to_answers` leaves them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from training.generation.generator import GenerationOutput
from training.placement.planner import stage_fusion_refusal
from utils.errors import UserError

ScoreRows = Callable[[torch.Tensor, GenerationOutput], dict[str, Any]]


def join_outputs(outputs: list[GenerationOutput], pad_token_id: int) -> GenerationOutput:
    """Rows of several outputs with the same prompt block as one output, answers right-padded to the widest."""
    if len(outputs) == 1:
        return outputs[0]
    width = max(output.answer_mask.shape[1] for output in outputs)

    def widened(tensor: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

    answers = torch.cat([widened(output.answers, pad_token_id) for output in outputs])
    answer_mask = torch.cat([widened(output.answer_mask, 0) for output in outputs])
    prompt_length = outputs[0].prompt_length
    prompts = torch.cat([output.sequences[:, :prompt_length] for output in outputs])
    prompt_mask = torch.cat([output.attention_mask[:, :prompt_length] for output in outputs])
    return GenerationOutput(sequences=torch.cat([prompts, answers], 1),
                            attention_mask=torch.cat([prompt_mask, answer_mask], 1),
                            logprobs=torch.cat([widened(output.logprobs, 0.0) for output in outputs]),
                            prompt_length=prompt_length, answer_mask=answer_mask)


def place_rows(pieces: list[tuple[torch.Tensor, Any]], batch: int, columns: int) -> Any:
    """Per-micro-batch results laid into the batch: each piece is (its rows' indices, a [k] or [k, n] tensor, or a
    dataclass / dict of them, or None) -> [B] / [B, N] with zeros in the columns a piece does not reach."""
    first = pieces[0][1]
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: place_rows([(rows, value[key]) for rows, value in pieces], batch, columns) for key in first}
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{
            field.name: place_rows([(rows, getattr(value, field.name)) for rows, value in pieces], batch, columns)
            for field in dataclasses.fields(first)})
    shape = (batch,) if first.dim() == 1 else (batch, columns, *first.shape[2:])
    placed = first.new_zeros(shape)
    for rows, value in pieces:
        rows = rows.to(placed.device)
        if value.dim() == 1:
            placed[rows] = value
        else:
            placed[rows, :value.shape[1]] = value
    return placed


class StageFusion:
    """A `FinishedRowsHook` that scores finished rows `micro_batch_size` (or more, when several end at once) at a
    time with `score(rows, output)`, and lays the results into the batch's layout at the end (`results`)."""

    def __init__(self, micro_batch_size: int, score: ScoreRows, pad_token_id: int):
        self.micro_batch_size = micro_batch_size
        self.score = score
        self.pad_token_id = pad_token_id
        self.waiting: list[tuple[torch.Tensor, GenerationOutput]] = []
        self.pieces: list[tuple[torch.Tensor, Any]] = []

    def __call__(self, rows: torch.Tensor, output: GenerationOutput) -> None:
        self.waiting.append((rows, output))
        if sum(len(waiting_rows) for waiting_rows, _ in self.waiting) >= self.micro_batch_size:
            self.flush()

    def flush(self) -> None:
        """Score the rows waiting, however few."""
        if not self.waiting:
            return
        rows = torch.cat([waiting_rows for waiting_rows, _ in self.waiting])
        output = join_outputs([waiting_output for _, waiting_output in self.waiting], self.pad_token_id)
        self.waiting = []
        self.pieces.append((rows, self.score(rows, output)))

    def results(self, batch: int, answer_columns: int) -> Any:
        """Every micro-batch's results in the layout of the whole batch (`place_rows`)."""
        self.flush()
        return place_rows(self.pieces, batch, answer_columns)


def check_stage_fusion(enabled: bool, micro_batch_size: int, backend: str, inference_tp_size: int,
                       actor_stage: int, critic_stage: int, offloaded: tuple[str, ...], world_size: int) -> None:
    """Stage fusion needs a generator that hands over finished rows and scoring forwards a rank runs alone (the
    planner's rule, `stage_fusion_refusal`)."""
    if not enabled:
        return
    if micro_batch_size < 1:
        raise UserError(f"--stage_fusion_micro_batch_size must be at least 1, got {micro_batch_size}")
    refusal = stage_fusion_refusal(backend == "hybrid", inference_tp_size, actor_stage, critic_stage, offloaded,
                                   world_size)
    if refusal is not None:
        raise UserError(refusal)
