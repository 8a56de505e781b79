"""The fused Llama path's bucketed static decode steps (`BucketedDecodeSteps`, captured as CUDA graphs on a GPU,
with the token choice inside) run eagerly on CPU: the dynamic steps' tokens and log-probs as rows finish and the
batch moves down the buckets, with K continuations per prompt, after a longer decode on the same cache, under
each sampling setting, and in bf16 past position 500 against the train forward. The graphs themselves are checked by `pytest -m gpu` (tests/test_gpu.py)."""
import pytest
import torch
from scripts.hybrid_engine_worker import LONG_POSITION_MODEL, PROMPTS, check_long_position_parity, prompt_batch
from transformers import AutoModelForCausalLM

from training.core.model_loading import load_tokenizer
from training.generation import hybrid_engine
from training.generation.decode_graphs import bucket_sizes
from training.generation.fast_decoder import FusedCachedModel, KVCacheDecoder, RolloutKVCache
from training.generation.fused_llama import FusedLlama
from training.generation.generator import GenerationConfig
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings


def test_buckets_are_powers_of_two_and_the_full_row_count():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def _decoders(model_dir: str, dtype: torch.dtype) -> tuple[KVCacheDecoder, KVCacheDecoder, object]:
    """A dynamic-step decoder and a bucketed-step one over the same weights, whose EOS is made likely so that
    rows end at scattered steps."""
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 40.0
    decoders = [KVCacheDecoder(FusedCachedModel(FusedLlama(model), RolloutKVCache(), cuda_graph=graphs),
                               torch.device("cpu")) for graphs in (False, True)]
    return decoders[0], decoders[1], tokenizer


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("samples", [1, 3])
def test_bucketed_steps_decode_as_the_dynamic_steps_while_the_batch_shrinks(tiny_model_dir, dtype, atol, samples):
    dynamic, bucketed, tokenizer = _decoders(tiny_model_dir("llama"), dtype)
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = GenerationConfig(max_new_tokens=16, do_sample=True, seed=0, num_return_sequences=samples,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected, out = dynamic.decode(ids, mask, config), bucketed.decode(ids, mask, config)
    lengths = expected.answer_mask.sum(-1)
    assert lengths.min() < lengths.max(), "rows should end at different steps"
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=0, atol=atol)
    used = bucketed.model.graphed_steps.buckets_used
    assert len(used) > 1 and used[-1] == len(PROMPTS) * samples, f"the batch never moved down a bucket: {used}"


def test_a_shorter_decode_after_a_longer_one_on_the_same_cache(tiny_model_dir):
    """The second decode reuses the first one's buffers (and graphs): masks of the longer prompt's columns must
    not leak into it."""
    dynamic, bucketed, tokenizer = _decoders(tiny_model_dir("llama"), torch.float32)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    bucketed.decode(*prompt_batch(tokenizer, [p + " and so on and so forth" for p in PROMPTS]), config)
    steps = bucketed.model.graphed_steps
    ids, mask = prompt_batch(tokenizer, PROMPTS[:4])
    out = bucketed.decode(ids, mask, config)
    assert bucketed.model.graphed_steps is steps, "the cache (and its steps) should have been reused"
    expected = dynamic.decode(ids, mask, config)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=0, atol=1e-5)


def test_each_token_choice_gets_its_own_steps(tiny_model_dir):
    """The token choice (greedy, temperature, top-k, top-p) runs inside the bucketed step, as in its graph: decodes
    with other settings on the same cache draw as the dynamic steps do, each through steps of its own (steps kept
    per bucket alone would choose every later decode's tokens the first one's way)."""
    dynamic, bucketed, tokenizer = _decoders(tiny_model_dir("llama"), torch.float32)
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    common = dict(max_new_tokens=12, seed=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    configs = [GenerationConfig(do_sample=False, **common), GenerationConfig(temperature=0.7, top_k=5, **common),
               GenerationConfig(top_p=0.8, **common)]
    for config in configs:
        expected, out = dynamic.decode(ids, mask, config), bucketed.decode(ids, mask, config)
        assert torch.equal(out.sequences, expected.sequences), config
        torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=0, atol=1e-5)
    assert len({choice for _, choice in bucketed.model.graphed_steps.runners}) == len(configs)


def test_bf16_bucketed_steps_sample_from_the_trained_distribution_past_position_500(distributed, tiny_model_dir,
                                                                                    monkeypatch):
    """The hybrid engine with its fused path's steps bucketed, as a GPU runs them, against the train forward."""
    made: list[FusedCachedModel] = []

    def bucketed(fused, kv_cache, cuda_graph):
        made.append(FusedCachedModel(fused, kv_cache, cuda_graph=True))
        return made[-1]

    monkeypatch.setattr(hybrid_engine, "FusedCachedModel", bucketed)
    check_long_position_parity(tiny_model_dir("llama", **LONG_POSITION_MODEL), "bf16",
                               lambda engine: HybridEngine(engine, HybridEngineSettings(enable=True)))
    assert len(made) == 1 and made[0].graphed_steps.runners, "the bucketed steps did not run"
