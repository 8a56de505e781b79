"""K continuations per prompt (`num_return_sequences`): prompt-major rows, one prefill on the B prompts
shared by their K continuations, greedy answers repeated K times, sampled log-probs equal to the train
forward's, in the hybrid engine's two decode paths and the `hf` backend."""
import dataclasses

import pytest
import torch
from scripts.hybrid_engine_worker import (
    PROMPTS,
    build_engine,
    check_group_repeats,
    frequent_token,
    greedy_config,
    prompt_batch,
    train_mode_logprobs,
)

from training.generation.fast_decoder import repeat_filled_rows
from training.generation.generator import GenerationConfig, HFGenerator
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings

TEXTS = PROMPTS[:3]  # three prompt lengths, so two of them are left-padded
PATHS = ["llama", "qwen2"]  # the fused decode path and the transformers-forward one


class PrefillCounter:
    """Stands in for a decoder's step model and records the rows of every prefill and decode step."""

    def __init__(self, inner):
        self.inner, self.shrinks = inner, inner.shrinks
        self.prefill_shapes: list[tuple[int, int]] = []
        self.step_rows: list[int] = []

    def prefill(self, input_ids, mask, positions, rows) -> torch.Tensor:
        self.prefill_shapes.append(tuple(input_ids.shape))
        return self.inner.prefill(input_ids, mask, positions, rows)

    def repeat_rows(self, k: int) -> None:
        self.inner.repeat_rows(k)

    def step(self, tokens, *args) -> tuple[torch.Tensor, torch.Tensor]:
        self.step_rows.append(tokens.shape[0])
        return self.inner.step(tokens, *args)

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.inner.keep_rows(keep)


def _hybrid(engine) -> HybridEngine:
    return HybridEngine(engine, HybridEngineSettings(enable=True))


def _sampling(tokenizer, per_prompt: int, temperature: float = 0.7) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=12, temperature=temperature, seed=3, num_return_sequences=per_prompt,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _cache_rows(hybrid: HybridEngine) -> int:
    """Rows the kept KV cache's buffers were allocated with."""
    cache = hybrid.kv_cache.cache
    if hasattr(cache, "full_buffers"):
        return cache.full_buffers[0][0].shape[0]
    return cache.keys.shape[1]


def test_a_group_size_below_one_is_refused():
    with pytest.raises(ValueError, match="num_return_sequences"):
        GenerationConfig(max_new_tokens=4, eos_token_id=2, pad_token_id=0, num_return_sequences=0)


def test_filled_columns_of_each_row_are_copied_to_k_consecutive_rows_in_place():
    buffer = torch.arange(4 * 3, dtype=torch.float32).view(4, 1, 3, 1)  # rows 0..3, columns 0..2
    repeat_filled_rows(buffer, batch=2, k=2, filled=2)
    assert buffer[:, 0, :, 0].tolist() == [[0, 1, 2], [0, 1, 5], [3, 4, 8], [3, 4, 11]]


@pytest.mark.parametrize("arch", PATHS)
def test_greedy_group_repeats_each_prompts_answer_from_one_prefill_on_the_prompts(distributed, tiny_model_dir, arch):
    engine, tokenizer = build_engine(tiny_model_dir(arch), stage=0)
    hybrid = _hybrid(engine)
    ids, mask = prompt_batch(tokenizer, TEXTS)
    probe = hybrid.generate(ids, mask, greedy_config(tokenizer))
    config = greedy_config(tokenizer, eos_token_id=frequent_token(probe.sequences, probe.prompt_length))
    single = hybrid.generate(ids, mask, config)
    lengths = single.answer_mask.sum(-1)
    assert lengths.min() < lengths.max(), "rows should finish at different steps (batch shrinking exercised)"
    with hybrid.generate_mode():
        counter = PrefillCounter(hybrid._decoder.model)
        hybrid._decoder.model = counter
        group = check_group_repeats(hybrid, ids, mask, config, single, per_prompt=3)
    assert counter.prefill_shapes == [tuple(ids.shape)], "one prefill, on the 3 prompts only"
    assert counter.step_rows[0] == 9, "the first decode step runs the 3 x 3 continuations"
    assert hybrid.kv_cache.rows == 9 and _cache_rows(hybrid) == 9, "the cache is allocated for B*K rows"
    assert torch.equal(group.sequences[:, : group.prompt_length], ids.repeat_interleave(3, 0))
    assert torch.equal(HFGenerator(engine).generate(ids, mask, dataclasses.replace(config, num_return_sequences=3))
                       .sequences, group.sequences)


@pytest.mark.parametrize("arch", PATHS)
def test_sampled_group_reports_train_forward_logprobs_and_its_continuations_differ(distributed, tiny_model_dir, arch):
    engine, tokenizer = build_engine(tiny_model_dir(arch), stage=0)
    hybrid = _hybrid(engine)
    ids, mask = prompt_batch(tokenizer, TEXTS)
    for generator in (hybrid, HFGenerator(engine)):
        out = generator.generate(ids, mask, _sampling(tokenizer, per_prompt=4))
        assert out.sequences.shape[0] == 12
        assert torch.equal(out.sequences[:, : out.prompt_length], ids.repeat_interleave(4, 0))
        assert torch.equal(out.attention_mask[:, : out.prompt_length], mask.repeat_interleave(4, 0))
        expected = train_mode_logprobs(engine, out, temperature=0.7) * out.answer_mask
        torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-4)
        for prompt in range(len(TEXTS)):
            answers = {tuple(row.tolist()) for row in out.answers[prompt * 4: prompt * 4 + 4]}
            assert len(answers) == 4, f"prompt {prompt}'s four continuations should all differ"


def test_one_continuation_per_prompt_is_unchanged_and_reuses_the_group_sized_cache(distributed, tiny_model_dir):
    engine, tokenizer = build_engine(tiny_model_dir("llama"), stage=0)
    hybrid = _hybrid(engine)
    ids, mask = prompt_batch(tokenizer, TEXTS)
    config = _sampling(tokenizer, per_prompt=1)
    alone = hybrid.generate(ids, mask, config)
    hybrid.generate(ids, mask, _sampling(tokenizer, per_prompt=2))
    cache = hybrid.kv_cache.cache
    after_group = hybrid.generate(ids, mask, config)
    assert hybrid.kv_cache.cache is cache, "B prompts fit the B*K-row cache"
    assert torch.equal(after_group.sequences, alone.sequences)
    assert torch.equal(after_group.logprobs, alone.logprobs)
    hybrid.generate(ids[:2], mask[:2], _sampling(tokenizer, per_prompt=3))
    assert hybrid.kv_cache.cache is cache, "2 x 3 continuations fit the 3 x 2-row cache"
