"""Prompt + answer rows re-laid flush right, so scoring and training forwards compute nothing for padding that
no row needs, and the LM head only where an answer token is predicted.

A rollout's rows are a left-padded prompt block [B, P] followed by a right-padded answer block [B, N]: a row
with a long prompt and a short answer pads both blocks, so the batch is P + N wide although its longest real
sequence may be much shorter. Shifting every row right by its trailing padding makes each row
[pads | prompt | answer] with its last real token in the last column; the batch is then exactly as wide as its
longest real sequence (`flush_right`). Positions come from the attention mask, so a real token's output does
not change (up to float rounding of differently shaped kernels).

Every row's answer now ends in the last column, so the logits predicting answer tokens all lie in the last
W + 1 positions (W: the longest answer); `AnswerWindow` asks the model for just those (`logits_to_keep`) and
maps per-token results back to the [B, N] answer layout the PPO math uses.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from training.core.sequences import (
    last_token_index,
    position_ids_from_attention_mask,
    token_entropies,
    token_logprobs,
)
from training.core.save import unwrap
from training.core.zero import is_zero3_module
from utils.dist import get_world_size


def flush_right(attention_mask: torch.Tensor, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows shifted right by their trailing padding and cut to the widest row's span of real tokens (at least
    `min_width` columns): the [B, L] column of the [B, T] rows each new column takes (`gather(1, source)` lays out
    ids, or embeddings, alike) and the new [B, L] attention mask. Columns that receive no token are masked (what a
    gather puts there is arbitrary)."""
    width = attention_mask.shape[1]
    columns = torch.arange(width, device=attention_mask.device)
    real = attention_mask.bool()
    last = last_token_index(attention_mask)
    first = torch.where(real, columns, torch.full_like(columns, width)).amin(-1).clamp(max=width - 1)
    span = int((last - first + 1).max().item()) if attention_mask.shape[0] else 0
    kept = min(max(span, min_width), width)
    source = columns[width - kept:] - (width - 1 - last)[:, None]  # [B, L]: the column each new column reads
    valid = source >= 0
    source = source.clamp(min=0)
    return source, attention_mask.gather(1, source) * valid


@dataclass
class AnswerWindow:
    """Rows flush right (`flush_right`) plus where their answers sit: a row's answer is its last
    `answer_lengths[i]` real tokens; `width` W is the longest answer and `answer_columns` N the width of the
    [B, N] answer layout results are returned in."""

    sequences: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    answer_lengths: torch.Tensor  # [B] long
    answer_columns: int  # N
    source: torch.Tensor  # [B, L]: the rollout-layout column each window column holds

    @classmethod
    def of(cls, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> "AnswerWindow":
        """The window of prompt + answer rows in the rollout layout (answer mask = attention_mask[:, P:])."""
        answer_lengths = attention_mask[:, prompt_length:].sum(-1).long()
        width = max(int(answer_lengths.max().item()) if answer_lengths.numel() else 0, 1)
        source, aligned_mask = flush_right(attention_mask, min_width=width + 1)
        return cls(sequences.gather(1, source), aligned_mask, answer_lengths, sequences.shape[1] - prompt_length,
                   source)

    def align(self, per_column: torch.Tensor) -> torch.Tensor:
        """[B, T, H] in the rollout layout -> [B, L, H] in the window's (as its token ids were laid out)."""
        return per_column.gather(1, self.source[..., None].expand(-1, -1, per_column.shape[-1]))

    @property
    def width(self) -> int:
        return max(int(self.answer_lengths.max().item()) if self.answer_lengths.numel() else 0, 1)

    def answer_tokens(self) -> torch.Tensor:
        """The tokens the window's logits predict: the last W columns [B, W]."""
        return self.sequences[:, -self.width:]

    def answer_mask(self) -> torch.Tensor:
        """[B, W]: 1 on each row's answer tokens (its last `answer_lengths` columns)."""
        columns = torch.arange(self.width, device=self.sequences.device)
        return (columns[None, :] >= (self.width - self.answer_lengths)[:, None]).long()

    def to_answers(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, W, ...] in window columns -> [B, N, ...] in answer columns (answer token j of row i is window column
        W - n_i + j), zero after each row's answer."""
        width, lengths = self.width, self.answer_lengths.to(per_token.device)
        columns = torch.arange(self.answer_columns, device=per_token.device)
        source = (columns[None, :] + (width - lengths)[:, None]).clamp(max=width - 1)
        inside = columns[None, :] < lengths[:, None]
        for _ in per_token.shape[2:]:
            source, inside = source.unsqueeze(-1), inside.unsqueeze(-1)
        gathered = per_token.gather(1, source.expand(-1, -1, *per_token.shape[2:]))
        return torch.where(inside, gathered, torch.zeros_like(gathered))

    def logits(self, module: torch.nn.Module, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The causal LM's logits predicting the window's answer tokens: [B, W, V] (module dtype, raw). The LM
        head runs on those W positions only, where the model supports `logits_to_keep`.

        The positions go as an index tensor, not a count: indexing copies the selected hidden states into a
        contiguous tensor, while a count's slice is a strided view, which PyTorch multiplies with a frozen
        (no-gradient) head as a batched product over a copy of the whole head per row (the bf16 reference
        forward took 2.3x the actor's on CPU). `inputs_embeds` ([B, L, H], the window's token embeddings)
        replaces the token ids where given."""
        width, length = self.width, self.sequences.shape[1]
        positions = torch.arange(length - width - 1, length - 1, device=self.sequences.device)
        keep = accepts_logits_to_keep(module)
        logits = module(**self._inputs(inputs_embeds), attention_mask=self.attention_mask,
                        position_ids=position_ids_from_attention_mask(self.attention_mask), use_cache=False,
                        **({"logits_to_keep": positions} if keep else {})).logits
        return logits if keep else logits[:, -width - 1:-1]

    def values(self, critic: torch.nn.Module, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """A value model's estimate of the state before each answer token: [B, W] fp32 (the preceding position)."""
        values = critic(**self._inputs(inputs_embeds), attention_mask=self.attention_mask)["values"]
        return values[:, -self.width - 1:-1].float()

    def _inputs(self, inputs_embeds: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if inputs_embeds is None:
            return {"input_ids": self.sequences}
        return {"input_ids": None, "inputs_embeds": inputs_embeds}


def accepts_logits_to_keep(module: torch.nn.Module) -> bool:
    """Whether the transformers model under a DeepSpeed engine / peft wrapper takes `logits_to_keep`."""
    model = unwrap(module)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return _forward_takes_logits_to_keep(type(model))


@functools.lru_cache(maxsize=None)
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


# What one more forward costs, in padded tokens' worth of work: its fixed per-call overhead (kernel launches,
# Python) and the lower efficiency of smaller matrix products. A GPU needs far larger products to stay busy.
GROUP_COST_TOKENS = {"cpu": 64, "cuda": 4096}


@dataclass
class RowGroups:
    """A batch's rows split into groups of similar length, each laid out as its own `AnswerWindow`, so a forward
    over a group pads little; `merge` puts per-group results back in the batch's row order.

    Rows sorted by width (a row needs max(real tokens, answer + 1) columns) are cut into consecutive groups that
    minimise the padded tokens plus `GROUP_COST_TOKENS` per group (an exact dynamic programme over the sorted rows):
    one group when the rows are alike, several when a few long rows would pad many short ones.

    A ZeRO-3 model gathers its weights in every forward with a collective over all ranks, so every rank must run
    as many forwards as the others: when one of `models` is partitioned over several ranks, the ranks agree on
    the smallest of their best group counts (one all-reduce) and each cuts its rows into exactly that many groups.
    A data-dependent count per rank made the ranks' gathers of different models meet (DeepSpeed: "disagreement
    on list length") as soon as their batches' lengths differed."""

    rows: list[torch.Tensor]  # each group's row indices
    windows: list[AnswerWindow]
    sequences: torch.Tensor  # the batch's rows in the rollout layout [B, T]

    @classmethod
    def of(cls, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
           models: tuple[torch.nn.Module | None, ...] = (), group_cost_tokens: int | None = None) -> "RowGroups":
        """The groups of a batch whose forwards will run through `models` (those None are skipped)."""
        if group_cost_tokens is None:
            group_cost_tokens = GROUP_COST_TOKENS.get(sequences.device.type, GROUP_COST_TOKENS["cuda"])
        answer_lengths = attention_mask[:, prompt_length:].sum(-1)
        widths = torch.maximum(attention_mask.sum(-1), answer_lengths + 1).tolist()
        order = sorted(range(len(widths)), key=widths.__getitem__)
        sorted_widths = [widths[row] for row in order]
        cuts = _cheapest_cuts(sorted_widths, group_cost_tokens)
        if forwards_are_collective(models):
            agreed = torch.tensor([len(cuts) - 1], device=sequences.device)  # NCCL reduces device tensors only
            torch_dist.all_reduce(agreed, op=torch_dist.ReduceOp.MIN)
            cuts = _cheapest_cuts(sorted_widths, group_cost_tokens, int(agreed.item()))
        rows = [torch.tensor(order[start:end], device=sequences.device) for start, end in zip(cuts, cuts[1:])]
        return cls(rows, [AnswerWindow.of(sequences[group], attention_mask[group], prompt_length) for group in rows],
                   sequences)

    def shared_embeddings(self, module: torch.nn.Module) -> list[torch.Tensor | None]:
        """Per group, its rows' token embeddings from ONE lookup over the whole batch, where that saves work: a
        forward that will train the embedding table, over several groups, of a model whose weights are whole on
        this rank. Its backward then builds the table's dense gradient ([vocab, hidden], 113 MB for SmolLM2 in
        fp32) once instead of once per group plus their sum (~0.1 s each on CPU: fresh memory). None per group
        elsewhere: the forwards take token ids (the embeddings are the same values either way)."""
        embedding = input_embedding(module)
        weight = getattr(embedding, "weight", None)
        if (len(self.windows) == 1 or weight is None or not weight.requires_grad or not torch.is_grad_enabled()
                or is_zero3_module(module)):
            return [None] * len(self.windows)
        embeddings = embedding(self.sequences)
        return [window.align(embeddings[rows.to(embeddings.device)]) for window, rows in zip(self.windows, self.rows)]

    def merge(self, per_group: list[torch.Tensor]) -> torch.Tensor:
        """Per-group results [b_g, ...] -> the batch's [B, ...] in its row order (differentiable)."""
        if len(per_group) == 1:
            return per_group[0].index_select(0, torch.argsort(self.rows[0].to(per_group[0].device)))
        device = per_group[0].device
        return torch.cat(per_group).index_select(0, torch.argsort(torch.cat(self.rows).to(device)))

    def answer_logprobs(self, module: torch.nn.Module, temperature: float,
                        tokenizer_size: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The answer tokens' log-probs [B, N] (fp32, over the tokenizer's `tokenizer_size` ids: `token_logprobs`;
        no default: None, every row of the model, is said outright) and each group's window logits [b_g, W_g, V]
        (every column)."""
        logits = [window.logits(module, embeds)
                  for window, embeds in zip(self.windows, self.shared_embeddings(module))]
        logprobs = [window.to_answers(token_logprobs(group_logits, window.answer_tokens(), temperature,
                                                     tokenizer_size=tokenizer_size))
                    for window, group_logits in zip(self.windows, logits)]
        return self.merge(logprobs), logits

    def answer_values(self, critic: torch.nn.Module) -> torch.Tensor:
        """A value model's estimate of the state before each answer token: [B, N] fp32."""
        return self.merge([window.to_answers(window.values(critic, embeds))
                           for window, embeds in zip(self.windows, self.shared_embeddings(critic))])

    def answer_entropies(self, logits: list[torch.Tensor], temperature: float,
                         tokenizer_size: int | None) -> torch.Tensor:
        """The entropy of each answer position's distribution over the tokenizer's ids from the groups' logits:
        [B, N] fp32 (no gradient)."""
        return self.merge([window.to_answers(token_entropies(group_logits, temperature, tokenizer_size=tokenizer_size))
                           for window, group_logits in zip(self.windows, logits)])

    def end_scores(self, reward_model: torch.nn.Module) -> torch.Tensor:
        """A reward model's score of each row's last token: [B] fp32."""
        return self.merge([reward_model(input_ids=window.sequences, attention_mask=window.attention_mask)
                           ["end_scores"].float() for window in self.windows])


def input_embedding(module: torch.nn.Module) -> torch.nn.Module | None:
    """The token-embedding layer of the model under a DeepSpeed engine / peft wrapper (None if it has none)."""
    getter = getattr(unwrap(module), "get_input_embeddings", None)
    return getter() if getter is not None else None


def forwards_are_collective(models: tuple[torch.nn.Module | None, ...]) -> bool:
    """Whether a forward of one of `models` is a collective of every rank (ZeRO-3 over more than one rank)."""
    return get_world_size() > 1 and any(model is not None and is_zero3_module(model) for model in models)


def _cheapest_cuts(widths: list[int], group_cost: int, groups: int | None = None) -> list[int]:
    """Boundaries [0, ..., n] of consecutive groups of ascending `widths` minimising sum(group size * its widest)
    + group_cost per group; with `groups`, the cheapest cut into exactly that many groups (at most one per row)."""
    rows = len(widths)
    if groups is None:
        best, cut_before = [0.0] + [float("inf")] * rows, [0] * (rows + 1)
        for end in range(1, rows + 1):
            for start in range(end):
                cost = best[start] + (end - start) * widths[end - 1] + group_cost
                if cost < best[end]:
                    best[end], cut_before[end] = cost, start
        cuts = [rows]
        while cuts[-1] > 0:
            cuts.append(cut_before[cuts[-1]])
        return cuts[::-1]
    count = min(groups, rows)
    # padded[k][end]: the fewest padded tokens of the first `end` rows in k groups; last_start[k][end]: where its
    # last group starts
    padded = [[0.0] + [float("inf")] * rows]
    last_start = [[0] * (rows + 1)]
    for k in range(1, count + 1):
        padded.append([float("inf")] * (rows + 1))
        last_start.append([0] * (rows + 1))
        for end in range(k, rows + 1):
            for start in range(k - 1, end):
                cost = padded[k - 1][start] + (end - start) * widths[end - 1]
                if cost < padded[k][end]:
                    padded[k][end], last_start[k][end] = cost, start
    cuts = [rows]
    for k in range(count, 0, -1):
        cuts.append(last_start[k][cuts[-1]])
    return cuts[::-1]
