"""Autoregressive decoding with one preallocated KV cache, kept across calls while it fits.

`KVCacheDecoder` runs the token loop over a `StepModel`, the forward passes of one model over its cache:
- `FusedCachedModel`: Llama-family models through `FusedLlama` (fused projections, own K/V buffers);
- `HFCachedModel`: any transformers causal LM through its own forward and a `StaticCache`.
Either cache is allocated at the first prefill and reused by every later call that fits (batch and
length), so a rollout of several batches allocates it once; a call that does not fit allocates one that covers it
and every earlier call (the larger row count and length of the two), so the cache only grows. Rows whose sequence
has emitted a stop token (`GenerationConfig.stop_token_ids`: the EOS, or a chat template's end-of-turn token) leave
the running batch: their cache rows are compacted in place (the remaining rows are copied to the
front of the same buffers), so later steps compute only live rows.

K continuations per prompt (`GenerationConfig.num_return_sequences`) share one prefill: the cache is
allocated for B*K rows, the B prompts are prefilled into its first B rows, and `repeat_rows(K)` copies
each prompt's cached columns into K consecutive rows in place (prompt-major, row i*K + j continues
prompt i) before the first token is drawn; then the B*K rows decode as any batch does.

On CUDA, with `cuda_graph=True`, decode steps replay CUDA graphs. `FusedCachedModel` captures its own
(`decode_graphs.BucketedDecodeSteps`: one graph per batch bucket, so the batch still shrinks, holding the step's
token choice and log-prob too: a step is one replay). `HFCachedModel`
runs them through `torch.compile` (`compiled_step`: CUDA graphs, eager's half-precision roundings kept); that
needs static shapes, so the batch then does
not shrink (finished rows keep decoding and their tokens are discarded), and every step runs over the whole
allocation, whose length is rounded up to `COMPILED_LENGTH_MULTIPLE`: torch.compile compiles anew for each new
shape, and after `torch._dynamo.config.recompile_limit` (8) shapes it runs the step eagerly for the rest of the
process, so the shapes it sees are those of the allocations (a rollout's batches of other prompt lengths and a
smaller last batch reuse one). Prefills are never captured, and the
decode steps of K continuations see B*K rows from their first step on, so group sampling takes both paths
unchanged. Neither has run on a GPU yet (none in the build environment).

`on_finished` (a `FinishedRowsHook`) receives the rows that ended at each step, while the others go on decoding:
step 3's stage fusion scores them in the meantime. It runs outside inference mode on copies of the rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from transformers import StaticCache

from training.core.sequences import position_ids_from_attention_mask
from training.generation.compiled_step import CompiledStep, compile_failure
from training.generation.cpu_linear import repack_linear_layers
from training.generation.decode_graphs import BucketedDecodeSteps
from training.generation.fused_llama import FusedKVBuffers, FusedLlama
from training.generation.generator import (
    FinishedRowsHook,
    GenerationConfig,
    GenerationOutput,
    TokenChoice,
    TokenSync,
    answer_mask_from_tokens,
    assemble_output,
    repeat_per_prompt,
    sampling_generator,
)

DoneSync = Callable[[bool], bool]


class RolloutKVCache:
    """KV storage kept across `decode` calls (and rollouts) while it fits the batch and length.

    `cache` is whatever the step model allocated (`_StaticStorage` or `FusedKVBuffers`)."""

    def __init__(self) -> None:
        self.cache: object | None = None
        self.rows = 0
        self.length = 0

    def release(self) -> None:
        self.cache = None
        self.rows = 0
        self.length = 0

    def fit(self, kind: type, batch: int, length: int, allocate: Callable[[int, int], object],
            length_multiple: int = 1) -> None:
        """Keep the cache if it is a `kind` of at least `batch` rows and `length` columns; else release it and keep
        `allocate(rows, length)` for an allocation that holds this call and the released one's, its length rounded
        up to `length_multiple`."""
        if isinstance(self.cache, kind) and batch <= self.rows and length <= self.length:
            return
        rows, length = max(batch, self.rows), max(length, self.length)
        length = -(-length // length_multiple) * length_multiple
        self.release()
        self.keep(allocate(rows, length), rows, length)

    def keep(self, cache: object, rows: int, length: int) -> None:
        self.cache, self.rows, self.length = cache, rows, length


class StepModel(Protocol):
    """One model's forward passes over its cache.

    `prefill` returns the logits [B, V] of the last position; `step` goes on to choose the next tokens from its
    logits with `choose` at `uniforms` and returns them with their log-probs (`TokenChoice`: a step captured as a
    graph holds the choice too). `mask` [B, T] marks the filled, non-pad cache columns (T = prompt + answer
    length); `column` is the cache column of the step's token. `prefill` allocates (or reuses) a cache of at
    least `rows` rows and fills its first B; `repeat_rows(k)` then makes it B*k rows, row i copied to rows
    i*k .. i*k + k-1."""

    shrinks: bool  # finished rows may leave the batch

    @property
    def description(self) -> str:
        """The decode path, e.g. "fused Llama (CUDA graphs)"."""

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
        ...

    def repeat_rows(self, k: int) -> None: ...

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, column: int,
             choose: TokenChoice, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def keep_rows(self, keep: torch.Tensor) -> None: ...

    def refresh(self) -> None:
        """Take up new weights loaded into the model in place (a kept inference copy's next rollout)."""

    def forget_cache(self) -> None:
        """Drop every reference to the KV cache (and to what was captured over it), so that releasing it frees it."""


def repeat_filled_rows(full: torch.Tensor, batch: int, k: int, filled: int) -> None:
    """In a [rows, heads, length, dim] buffer, copy the first `filled` columns of rows 0..batch-1 to rows
    0..batch*k-1, each row k times in a row (the later rows' other columns are left as they are)."""
    full[:batch * k, :, :filled] = full[:batch, :, :filled].repeat_interleave(k, dim=0)


@dataclass
class _StaticStorage:
    """A StaticCache allocated for `rows` rows, whose layers work on views of the rows in use.

    transformers sizes a StaticCache layer by the batch of the first update it sees (its lazy
    allocation); each layer's allocation is wrapped so that it allocates all `rows` rows instead (kept
    in `full_buffers`) and hands the layer the prefill's first rows of them.

    transformers marks the buffers it allocates as static addresses for torch.compile: without the mark, the
    compiled step's CUDA graphs are skipped (the cache is written in place, a mutated input) and it runs without
    them. The mark is an attribute of the tensor object, which a view does not inherit, so every view handed to a
    layer is marked too."""

    cache: StaticCache
    rows: int
    full_buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for layer in self.cache.layers:
            layer.lazy_initialization = self._allocate_all_rows(layer, layer.lazy_initialization)

    def _allocate_all_rows(self, layer, allocate: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable:
        def allocate_all_rows(keys: torch.Tensor, values: torch.Tensor) -> None:
            # zero-length probes of the full row count: the layer allocates from their shape, dtype and device
            allocate(keys.new_empty(self.rows, keys.shape[1], 0, keys.shape[-1]),
                     values.new_empty(self.rows, values.shape[1], 0, values.shape[-1]))
            self.full_buffers.append((layer.keys, layer.values))
            _point_at_rows(layer, layer.keys, layer.values, keys.shape[0])

        return allocate_all_rows

    def use_rows(self, count: int) -> None:
        """Point every allocated layer at the first `count` rows of its buffers."""
        for layer, (keys, values) in zip(self.cache.layers, self.full_buffers):
            _point_at_rows(layer, keys, values, count)


def _point_at_rows(layer, keys: torch.Tensor, values: torch.Tensor, count: int) -> None:
    """Hand a StaticCache layer the first `count` rows of `keys` and `values`, as static addresses (see
    `_StaticStorage`)."""
    layer.keys, layer.values = keys[:count], values[:count]
    torch._dynamo.mark_static_address(layer.keys)
    torch._dynamo.mark_static_address(layer.values)


COMPILED_LENGTH_MULTIPLE = 128  # a compiled step's cache length is rounded up to this (see the module doc)


class HFCachedModel:
    """A transformers causal LM whose forward accepts `past_key_values` and `position_ids`; with `compiled`, its decode
    steps run through `torch.compile` (`CompiledStep`: CUDA graphs on a GPU) over every allocated row, unless the
    compiler already failed in this process (`compile_failure`): the eager, shrinking step then."""

    def __init__(self, model: torch.nn.Module, kv_cache: RolloutKVCache, compiled: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.compiled = compiled  # asked for; the step decodes eagerly once the compiler failed in this process
        self.shrinks = not compiled or compile_failure() is not None
        self._step = model if self.shrinks else CompiledStep(model)
        self._storage: _StaticStorage | None = None
        self._prefilled = (0, 0)  # rows and columns of the last prefill

    @property
    def description(self) -> str:
        if self.compiled and compile_failure() is not None:
            return "transformers forward (eager: torch.compile failed)"
        return "transformers forward" if self.shrinks else "transformers forward (CUDA graphs)"

    def _cache_wide(self, mask: torch.Tensor) -> torch.Tensor:
        """The mask widened to the cache length, as a StaticCache forward expects."""
        wide = mask.new_zeros(mask.shape[0], self.kv_cache.length)
        wide[:, :mask.shape[1]] = mask
        return wide

    def _forward(self, model, input_ids, mask, positions, **kwargs) -> torch.Tensor:
        out = model(input_ids=input_ids, attention_mask=self._cache_wide(mask), position_ids=positions,
                    past_key_values=self._storage.cache, use_cache=True, **kwargs)
        return out.logits[:, -1]

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
        batch, length = mask.shape
        self.kv_cache.fit(_StaticStorage, rows, length, self._allocate,
                          length_multiple=1 if self.shrinks else COMPILED_LENGTH_MULTIPLE)
        self._storage = self.kv_cache.cache
        self._storage.use_rows(batch)
        self._storage.cache.reset()
        self._prefilled = tuple(input_ids.shape)
        return self._forward(self.model, input_ids, mask, positions, logits_to_keep=1)

    def _allocate(self, rows: int, length: int) -> _StaticStorage:
        return _StaticStorage(StaticCache(config=self.model.config, max_cache_len=length), rows)

    def repeat_rows(self, k: int) -> None:
        batch, filled = self._prefilled
        for keys, values in self._storage.full_buffers:
            repeat_filled_rows(keys, batch, k, filled)
            repeat_filled_rows(values, batch, k, filled)
        self._storage.use_rows(batch * k)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, column: int,
             choose: TokenChoice, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shrinks:
            logits = self._forward(self._step, tokens[:, None], mask, positions)
        else:
            logits = self._step_every_row(tokens, mask, positions)
        return choose(logits, uniforms)

    def _step_every_row(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The compiled step over all allocated rows, one shape per allocation: a batch of fewer rows is padded with
        rows that attend to their first column only (never to nothing: NaN), whose logits are dropped."""
        live, rows = tokens.shape[0], self.kv_cache.rows
        if live < rows:
            padding = rows - live
            tokens = torch.cat([tokens, tokens.new_zeros(padding)])
            mask = torch.cat([mask, torch.nn.functional.pad(mask.new_ones(padding, 1), (0, mask.shape[1] - 1))])
            positions = torch.cat([positions, positions.new_zeros(padding, 1)])
            self._storage.use_rows(rows)
        return self._forward(self._step, tokens[:, None], mask, positions)[:live]

    def keep_rows(self, keep: torch.Tensor) -> None:
        count = keep.numel()
        for layer in self._storage.cache.layers:
            layer.keys[:count] = layer.keys[keep]
            layer.values[:count] = layer.values[keep]
            _point_at_rows(layer, layer.keys, layer.values, count)

    def refresh(self) -> None:
        repack_linear_layers(self.model)

    def forget_cache(self) -> None:
        self._storage = None


class FusedCachedModel:
    """`FusedLlama` over `FusedKVBuffers`; with `cuda_graph`, its decode steps run as `BucketedDecodeSteps`
    (CUDA graphs on a GPU; the same static steps, eagerly, elsewhere)."""

    shrinks = True

    def __init__(self, fused: FusedLlama, kv_cache: RolloutKVCache, cuda_graph: bool = False):
        self.fused = fused
        self.kv_cache = kv_cache
        self.cuda_graph = cuda_graph
        self.graphed_steps: BucketedDecodeSteps | None = None
        self._buffers: FusedKVBuffers | None = None
        self._prefilled = (0, 0)  # rows and columns of the last prefill

    @property
    def description(self) -> str:
        return "fused Llama (CUDA graphs)" if self.cuda_graph else "fused Llama"

    def _use_rows(self, count: int) -> None:
        full = self.kv_cache.cache
        self._buffers = FusedKVBuffers(full.keys[:, :count], full.values[:, :count])

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
        batch, length = mask.shape
        self.kv_cache.fit(FusedKVBuffers, rows, length, self.fused.allocate)
        self._use_rows(batch)
        self._prefilled = tuple(input_ids.shape)
        if self.cuda_graph:
            full = self.kv_cache.cache
            if self.graphed_steps is None or self.graphed_steps.buffers is not full:
                self.graphed_steps = BucketedDecodeSteps(self.fused, full, capture=full.keys.is_cuda)
            self.graphed_steps.reset()
        prompt_len = input_ids.shape[1]
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=mask.device).tril()
        # a pad query also sees itself, so that no row of the attention is empty (NaN)
        attend = causal & mask[:, None, :prompt_len].bool() | torch.eye(prompt_len, dtype=torch.bool, device=mask.device)
        return self.fused.forward(input_ids, positions, self._buffers, 0, attend[:, None])

    def repeat_rows(self, k: int) -> None:
        full, (batch, filled) = self.kv_cache.cache, self._prefilled
        for layer in range(full.keys.shape[0]):  # one layer at a time bounds the temporary copy
            repeat_filled_rows(full.keys[layer], batch, k, filled)
            repeat_filled_rows(full.values[layer], batch, k, filled)
        self._use_rows(batch * k)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, column: int,
             choose: TokenChoice, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphed_steps is not None:
            return self.graphed_steps(tokens, positions, mask, column, choose, uniforms)
        attend = mask[:, None, None, :column + 1].bool()
        return choose(self.fused.forward(tokens[:, None], positions, self._buffers, column, attend), uniforms)

    def keep_rows(self, keep: torch.Tensor) -> None:
        count = keep.numel()
        keys, values = self._buffers.keys, self._buffers.values
        keys[:, :count] = keys[:, keep]
        values[:, :count] = values[:, keep]
        self._buffers = FusedKVBuffers(keys[:, :count], values[:, :count])

    def refresh(self) -> None:
        self.fused.refresh()

    def forget_cache(self) -> None:
        self._buffers = self.graphed_steps = None


def live_row_uniforms(choose: TokenChoice, alive: torch.Tensor, live: int,
                      generator: torch.Generator | None) -> torch.Tensor | None:
    """A step's uniform numbers for the running rows `alive` (`live` of them still going), None when greedy: `live`
    numbers, the k-th going to the k-th live row. A path whose batch shrinks runs exactly its live rows, in their
    order; one that keeps finished rows (the compiled step's fixed shape) gets them spread over its live rows (a
    finished row's number is never read). Either way each row draws what it would on the other path, so a decode
    with or without CUDA graphs samples the same tokens."""
    drawn = choose.uniforms(live, alive.device, generator)
    if drawn is None or live == alive.numel():
        return drawn
    rank_among_live = (alive.cumsum(0) - 1).clamp(min=0)
    return torch.cat([drawn, drawn.new_zeros(alive.numel() - live, 1)])[rank_among_live]


class KVCacheDecoder:
    """The token loop over a `StepModel`.

    `sync_tokens` makes ranks that decode the same batch (a tensor-parallel group) agree on each
    drawn token; `sync_done` makes ranks whose forward passes are collective (ZeRO-3 hooks) keep
    stepping until every rank has finished. `no_grad_only` uses no_grad instead of inference_mode
    (for a model whose parameters ZeRO-3 gathers during the forward).
    """

    def __init__(
        self,
        model: StepModel,
        device: torch.device,
        sync_tokens: TokenSync | None = None,
        sync_done: DoneSync | None = None,
        no_grad_only: bool = False,
    ):
        self.model = model
        self.device = device
        self.sync_tokens = sync_tokens
        self.sync_done = sync_done
        self.no_grad_only = no_grad_only

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig,
               on_finished: FinishedRowsHook | None = None) -> GenerationOutput:
        grad_mode = torch.no_grad() if self.no_grad_only else torch.inference_mode()
        with grad_mode:
            return self._decode(input_ids.to(self.device), attention_mask.to(self.device), config, on_finished)

    def _decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig,
                on_finished: FinishedRowsHook | None) -> GenerationOutput:
        prompts, prompt_len = input_ids.shape
        group = config.num_return_sequences
        new_tokens = config.max_new_tokens
        mask = torch.zeros(prompts, prompt_len + new_tokens, dtype=attention_mask.dtype, device=self.device)
        mask[:, :prompt_len] = attention_mask
        positions = position_ids_from_attention_mask(attention_mask)
        logits = self.model.prefill(input_ids, mask, positions, prompts * group)
        if group > 1:
            self.model.repeat_rows(group)
            input_ids, attention_mask, mask, positions, logits = (
                repeat_per_prompt(t, group) for t in (input_ids, attention_mask, mask, positions, logits))
        batch = prompts * group
        next_position = positions[:, -1:] + 1

        choose = TokenChoice.of(config, self.sync_tokens)
        stops = torch.tensor(config.stop_token_ids, dtype=input_ids.dtype, device=self.device)
        generator = sampling_generator(config, self.device)
        tokens, token_logprobs = choose(logits, choose.uniforms(batch, self.device, generator))
        answers = torch.full((batch, new_tokens), config.pad_token_id, dtype=input_ids.dtype, device=self.device)
        logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=self.device)
        rows = torch.arange(batch, device=self.device)  # original row of each running row
        alive = torch.ones(batch, dtype=torch.bool, device=self.device)
        live = batch  # rows still going: the one number a step reads back from the device
        for step in range(new_tokens):
            # every running row is written (a finished one's pad and 0 again): a boolean-mask index would wait for
            # the device to count the rows
            answers[rows, step] = torch.where(alive, tokens, config.pad_token_id)
            logprobs[rows, step] = torch.where(alive, token_logprobs, 0.0)
            running = alive.clone() if on_finished is not None else alive
            alive &= ~torch.isin(tokens, stops)
            were_live, live = live, int(alive.sum())
            done = step == new_tokens - 1 or live == 0
            if self.sync_done is not None:
                done = self.sync_done(done)
            if on_finished is not None and (were_live if done else were_live - live) > 0:
                ended = running if done else running & ~alive
                self._hand_over(on_finished, rows[ended], input_ids, attention_mask, answers[:, :step + 1],
                                logprobs[:, :step + 1], config)
            if done:
                break
            if self.model.shrinks and live < alive.numel():
                keep = alive.nonzero().squeeze(-1) if live else alive.new_zeros(1, dtype=torch.long)
                rows, alive, tokens, next_position, mask = rows[keep], alive[keep], tokens[keep], next_position[keep], mask[keep]
                self.model.keep_rows(keep)
            column = prompt_len + step
            mask[:, column] = 1
            tokens, token_logprobs = self.model.step(tokens, mask, next_position, column, choose,
                                                     live_row_uniforms(choose, alive, live, generator))
            next_position = next_position + 1
        return assemble_output(
            input_ids,
            attention_mask,
            answers,
            logprobs,
            answer_mask_from_tokens(answers, config.eos_token_id),
            config.pad_token_id,
        )

    @staticmethod
    def _hand_over(on_finished: FinishedRowsHook, ended: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, answers: torch.Tensor, logprobs: torch.Tensor,
                   config: GenerationConfig) -> None:
        """The rows `ended` (original indices) to `on_finished`, as ordinary tensors outside inference mode."""
        with torch.inference_mode(False):
            ended = ended.clone()
            rows_answers = answers[ended].clone()
            output = assemble_output(input_ids[ended].clone(), attention_mask[ended].clone(), rows_answers,
                                     logprobs[ended].clone(), answer_mask_from_tokens(rows_answers, config.eos_token_id),
                                     config.pad_token_id)
            on_finished(ended, output)
