"""Autoregressive decoding on a Hugging Face causal LM with one preallocated KV cache.

The cache is a transformers `StaticCache`, allocated at the first prefill and reused by every later
call that fits (batch and length), so a rollout of several batches allocates it once. Rows whose
sequence has emitted EOS leave the running batch: their cache rows are compacted in place (the
remaining rows are copied to the front of the same buffers), so later steps compute only live rows.

On CUDA, with `cuda_graph=True`, decode steps run through `torch.compile(mode="reduce-overhead")`,
which captures them as CUDA graphs; that needs static shapes, so the batch then does not shrink
(finished rows keep decoding and their tokens are discarded). This path has not been run here (no
GPU in the build environment).
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import StaticCache

from .generation import (
    GenerationConfig,
    GenerationOutput,
    answer_mask_from_tokens,
    assemble_output,
    position_ids_from_attention_mask,
    sampling_generator,
    select_next_tokens,
    token_logprobs,
)

TokenSync = Callable[[torch.Tensor], torch.Tensor]
DoneSync = Callable[[bool], bool]


class RolloutKVCache:
    """A StaticCache kept across `decode` calls (and rollouts) while it fits the batch and length."""

    def __init__(self) -> None:
        self.cache: StaticCache | None = None
        self.rows = 0
        self.length = 0
        self._full_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def release(self) -> None:
        self.cache = None
        self.rows = 0
        self.length = 0
        self._full_buffers = []

    def prepare(self, config, batch: int, length: int) -> StaticCache:
        """Reuse the cache when it fits; otherwise allocate one for this batch and length.

        The buffers themselves are allocated at the first prefill (StaticCache does it lazily)."""
        if self.cache is None or batch > self.rows or length > self.length:
            self.release()
            self.cache = StaticCache(config=config, max_cache_len=length)
            self.rows, self.length = batch, length
            return self.cache
        for layer, (keys, values) in zip(self.cache.layers, self._full_buffers):
            layer.keys, layer.values = keys[:batch], values[:batch]
        self.cache.reset()
        return self.cache

    def after_prefill(self) -> None:
        if not self._full_buffers:
            self._full_buffers = [(layer.keys, layer.values) for layer in self.cache.layers]

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Move the rows `keep` to the front of the same buffers and run on those only."""
        count = keep.numel()
        for layer in self.cache.layers:
            layer.keys[:count] = layer.keys[keep]
            layer.values[:count] = layer.values[keep]
            layer.keys, layer.values = layer.keys[:count], layer.values[:count]


class KVCacheDecoder:
    """Decode with `model` (a causal LM whose forward accepts `past_key_values` and `position_ids`).

    `sync_tokens` makes ranks that decode the same batch (a tensor-parallel group) agree on each
    drawn token; `sync_done` makes ranks whose forward passes are collective (ZeRO-3 hooks) keep
    stepping until every rank has finished. `no_grad_only` uses no_grad instead of inference_mode
    (for a model whose parameters ZeRO-3 gathers during the forward).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: RolloutKVCache,
        cuda_graph: bool = False,
        sync_tokens: TokenSync | None = None,
        sync_done: DoneSync | None = None,
        no_grad_only: bool = False,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sync_tokens = sync_tokens
        self.sync_done = sync_done
        self.no_grad_only = no_grad_only
        self.device = next(model.parameters()).device
        self.static_batch = cuda_graph and torch.cuda.is_available() and self.device.type == "cuda"
        self._step = torch.compile(model, mode="reduce-overhead", dynamic=False) if self.static_batch else model

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig) -> GenerationOutput:
        grad_mode = torch.no_grad() if self.no_grad_only else torch.inference_mode()
        with grad_mode:
            return self._decode(input_ids.to(self.device), attention_mask.to(self.device), config)

    def _forward(self, step, input_ids, mask, positions, cache, **kwargs) -> torch.Tensor:
        out = step(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, **kwargs)
        return out.logits[:, -1]

    def _decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig) -> GenerationOutput:
        batch, prompt_len = input_ids.shape
        new_tokens = config.max_new_tokens
        cache = self.kv_cache.prepare(self.model.config, batch, prompt_len + new_tokens)
        mask = torch.zeros(batch, self.kv_cache.length, dtype=attention_mask.dtype, device=self.device)
        mask[:, :prompt_len] = attention_mask
        positions = position_ids_from_attention_mask(attention_mask)
        logits = self._forward(self.model, input_ids, mask, positions, cache, logits_to_keep=1)
        self.kv_cache.after_prefill()
        next_position = positions[:, -1:] + 1

        generator = sampling_generator(config, self.device)
        answers = torch.full((batch, new_tokens), config.pad_token_id, dtype=input_ids.dtype, device=self.device)
        logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=self.device)
        rows = torch.arange(batch, device=self.device)  # original row of each running row
        alive = torch.ones(batch, dtype=torch.bool, device=self.device)
        for step in range(new_tokens):
            tokens = select_next_tokens(logits, config, generator)
            if self.sync_tokens is not None:
                tokens = self.sync_tokens(tokens)
            answers[rows[alive], step] = tokens[alive]
            logprobs[rows[alive], step] = token_logprobs(logits[alive], tokens[alive])
            alive &= tokens != config.eos_token_id
            done = step == new_tokens - 1 or not bool(alive.any())
            if self.sync_done is not None:
                done = self.sync_done(done)
            if done:
                break
            if not self.static_batch and not bool(alive.all()):
                keep = alive.nonzero().squeeze(-1) if bool(alive.any()) else alive.new_zeros(1, dtype=torch.long)
                rows, alive, tokens, next_position, mask = rows[keep], alive[keep], tokens[keep], next_position[keep], mask[keep]
                self.kv_cache.keep_rows(keep)
            mask[:, prompt_len + step] = 1
            logits = self._forward(self._step, tokens[:, None], mask, next_position, cache)
            next_position = next_position + 1
        return assemble_output(
            input_ids,
            attention_mask,
            answers,
            logprobs,
            answer_mask_from_tokens(answers, config.eos_token_id),
            config.pad_token_id,
        )
