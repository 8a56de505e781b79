"""The hybrid engine's rollouts at positions past 500, for every rotary scaling a Llama config can name and every
family's attention (sliding windows, soft caps, q/k norms, partial and longrope rotary), on the decode path each
takes, with a left-padded row.

fp32: the log-probs equal the training forward's (1e-4). bf16, two checks of the next-token distributions:
- against an fp32 forward of the same weights, the decode's total-variation distance is within 1.25x the bf16
  training forward's own (measured 0.97-1.02x): it adds no error of its own to what bf16 costs anyway;
- against a bf16 reference that rounds alike, within the bound of `check_long_position_parity` (mean 1e-3, worst
  2e-2), which catches what the first cannot: RoPE's frequencies rounded to bf16 in the inference copy moved every
  model here 4e-3 to 1.8e-1 from it, while staying as far from fp32 as bf16 itself is (3e-3 to 4e-2 on these
  tiny models, whose weights are drawn with std 0.3). The reference is the training forward, except for the
  windowed families: there transformers' own cached decode (`generate`) is 1.6e-3 to 4.2e-3 from its full forward
  in bf16, the keys of a sliding layer's cache summed in another order, and the hybrid engine's decode equals it
  (to 1e-4), so that is the reference."""
from __future__ import annotations

import copy

import pytest
import torch
from scripts.hybrid_engine_worker import (
    LONG_POSITION_MODEL,
    LogitsRecorder,
    build_engine,
    greedy_config,
    hybrid_engine,
    train_mode_logprobs,
)
from tiny_models import RECENT_ARCHITECTURES, WINDOWED_MISTRAL

from training.core.sequences import answer_logits
from training.generation.generator import neutral_generation_config

PROMPT_LENGTH, LEFT_PADDING, NEW_TOKENS = 520, 37, 24
# `rope_scaling` of a tiny Llama (1024 positions) and the decode path it takes: the fused decoder serves the static
# scalings; dynamic (static within the positions, which step 3 never passes) and yarn (an attention factor besides
# the frequencies) decode through the transformers forward
ROPE_SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, "fused Llama"),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128}, "fused Llama"),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, "transformers forward"),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, "transformers forward"),
}
WINDOWED = ("gemma2", "gemma3", "phi3", WINDOWED_MISTRAL)  # sliding layers of 8 positions
FP32_DISTANCE_RATIO = 1.25
MEAN_BOUND, MAX_BOUND = 1e-3, 2e-2


def long_prompts(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random prompts of `PROMPT_LENGTH` columns, the second left-padded by `LEFT_PADDING`."""
    ids = torch.randint(3, len(tokenizer) - 1, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :LEFT_PADDING] = 0
    ids[1, :LEFT_PADDING] = tokenizer.pad_token_id
    return ids, mask


def total_variation(logits: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logits.float().softmax(-1) - other.float().softmax(-1)).abs().sum(-1)


def transformers_decode_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokenizer,
                               expected: torch.Tensor) -> torch.Tensor:
    """transformers' own greedy decode of the prompts: its logits [B, N, V], its tokens checked to be `expected`."""
    with torch.no_grad(), neutral_generation_config(model):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
                             output_logits=True)
    assert torch.equal(out.sequences, expected)
    return torch.stack(out.logits, dim=1)


def check_long_rollout(model_path: str, dtype: str, windowed: bool = False) -> str:
    """Greedy `NEW_TOKENS` after `long_prompts` by the hybrid engine of a ZeRO-0 engine in `dtype`, checked as the
    module doc says (`windowed`: against transformers' decode); returns the decode path."""
    engine, tokenizer = build_engine(model_path, stage=0, dtype=dtype)
    hybrid = hybrid_engine(engine)
    ids, mask = long_prompts(tokenizer)
    with hybrid.generate_mode():
        recorder = LogitsRecorder(hybrid._decoder.model)
        hybrid._decoder.model = recorder
        out = hybrid.generate(ids, mask, greedy_config(tokenizer, NEW_TOKENS, eos_token_id=-1))
    assert out.logprobs.shape == (2, NEW_TOKENS)
    if dtype == "fp32":
        torch.testing.assert_close(out.logprobs, train_mode_logprobs(engine, out), rtol=0, atol=1e-4)
        return hybrid.decode_path
    decoded = torch.stack(recorder.logits, dim=1)
    with torch.no_grad():
        trained = answer_logits(engine.module, out.sequences, out.attention_mask, out.prompt_length)
        exact = answer_logits(copy.deepcopy(engine.module).float(), out.sequences, out.attention_mask,
                              out.prompt_length)
    decode_error, train_error = total_variation(decoded, exact).mean(), total_variation(trained, exact).mean()
    assert decode_error <= FP32_DISTANCE_RATIO * train_error, (decode_error, train_error)
    reference = transformers_decode_logits(engine.module, ids, mask, tokenizer, out.sequences) if windowed else trained
    distance = total_variation(decoded, reference)
    assert distance.mean() < MEAN_BOUND and distance.max() < MAX_BOUND, distance
    return hybrid.decode_path


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_each_rope_scaling_decodes_at_parity_past_position_500(distributed, tiny_model_dir, scaling, dtype):
    rope_scaling, path = ROPE_SCALINGS[scaling]
    model = tiny_model_dir("llama", **LONG_POSITION_MODEL, config_overrides={"rope_scaling": rope_scaling})
    assert check_long_rollout(model, dtype) == path


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", [*RECENT_ARCHITECTURES, WINDOWED_MISTRAL])
def test_each_familys_decode_path_is_at_parity_past_position_500(distributed, tiny_model_dir, arch, dtype):
    """The sliding windows slide far past their start; Phi-4-mini's longrope stays on its short factors (its switch,
    original_max_position_embeddings, is at 1024)."""
    check_long_rollout(tiny_model_dir(arch, **LONG_POSITION_MODEL), dtype, windowed=arch in WINDOWED)
