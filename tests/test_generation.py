"""Shared generation pieces: token selection, output assembly, positions, and the `hf` backend."""
from dataclasses import dataclass

import pytest
import torch
from tiny_models import make_padded_vocab_model_dir, make_tiny_model

from training.core.args import SettingsParser
from training.core.sequences import (
    answer_logprobs,
    position_ids_from_attention_mask,
    token_logprobs,
)
from training.generation.generator import (
    BeyondTokenizerBan,
    GenerationConfig,
    HFGenerator,
    RepetitionPenaltySparingStops,
    TokenChoice,
    answer_mask_from_tokens,
    assemble_output,
)
from training.generation.hybrid_engine import HybridEngineSettings


def _config(**kwargs) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": 4, "eos_token_id": 2, "pad_token_id": 0, **kwargs})


def select_next_tokens(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None):
    choice = TokenChoice.of(config)
    return choice.select(logits, choice.uniforms(logits.shape[0], logits.device, generator))


def test_positions_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_attention_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(16, 50)
    best = logits.argmax(-1)
    assert torch.equal(select_next_tokens(logits, _config(do_sample=False), None), best)
    assert torch.equal(select_next_tokens(logits, _config(top_k=1), None), best)
    assert torch.equal(select_next_tokens(logits, _config(top_p=1e-6), None), best)


def test_top_k_and_top_p_draw_only_from_the_kept_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    generator = torch.Generator().manual_seed(0)
    top_k = select_next_tokens(logits, _config(top_k=2), generator)
    assert set(top_k.tolist()) == {0, 1}
    top_p = select_next_tokens(logits, _config(top_p=0.7), generator)  # 0.5 < 0.7 <= 0.8: keep tokens 0 and 1
    assert set(top_p.tolist()) == {0, 1}
    frequencies = torch.bincount(top_p, minlength=4).float() / len(top_p)
    assert abs(frequencies[0] - 0.625) < 0.05  # renormalised 0.5 / 0.8
    cold = select_next_tokens(logits, _config(temperature=0.05), generator)
    assert (cold == 0).float().mean() > 0.99


@pytest.mark.parametrize("settings", [{"do_sample": False}, {}, {"temperature": 3.0, "top_k": 40, "top_p": 0.95}])
def test_no_token_beyond_the_tokenizer_is_chosen_and_log_probs_are_those_of_its_ids(settings):
    """Columns from `tokenizer_size` on are embedding rows the tokenizer has no token for (Qwen2.5's padding):
    never chosen, greedy or drawn, even where they are the most likely; the log-probs are those of the distribution
    over the tokenizer's ids that the tokens are drawn from (they were of every column: off by the mass there)."""
    logits = torch.randn(4000, 50)
    logits[:, 40:] += 3.0
    choice = TokenChoice.of(_config(**settings, tokenizer_size=40))
    tokens, logprobs = choice(logits, choice.uniforms(4000, logits.device, torch.Generator().manual_seed(0)))
    assert tokens.max() < 40
    drawn_from = torch.log_softmax(logits[:, :40] / choice.temperature, -1)
    torch.testing.assert_close(logprobs, drawn_from.gather(-1, tokens[:, None]).squeeze(-1))
    if not choice.do_sample:
        assert torch.equal(tokens, logits[:, :40].argmax(-1))


def test_transformers_generate_is_kept_to_the_tokenizers_ids_without_touching_its_raw_logits():
    scores = torch.randn(3, 50)
    kept = scores.clone()
    banned = BeyondTokenizerBan(40)(None, scores)
    assert torch.equal(scores, kept)  # `generate` reports these as the step's logits
    assert torch.equal(banned[:, :40], kept[:, :40]) and torch.isneginf(banned[:, 40:]).all()
    assert BeyondTokenizerBan(50)(None, scores) is scores


@pytest.mark.parametrize("beams", [1, 2])
def test_the_repetition_penalty_of_a_left_padded_batch_leaves_the_padding_out(beams):
    """prompt_eval answers left-padded batches: transformers' own penalty left the padding out (from the attention
    mask), RepetitionPenaltySparingStops penalised the pad id in the shorter prompts' rows alone, so an answer
    depended on which prompts shared its batch. Each row's scores are now those of its prompt alone, with the
    generated part penalised and the stop id spared; `generate` holds each prompt's beams in consecutive rows."""
    pad, stop, vocab = 0, 9, 10
    long_prompt, short_prompt = [5, stop, 6, 4], [7, stop]
    batch = torch.tensor([long_prompt, [pad, pad, *short_prompt]]).repeat_interleave(beams, dim=0)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    generated = torch.tensor([[3], [8]]).repeat_interleave(beams, dim=0)
    scores = torch.linspace(-2.0, 2.0, vocab).abs().add(0.5).expand(2 * beams, vocab).clone()
    penalised = RepetitionPenaltySparingStops(1.5, [stop], mask)(torch.cat([batch, generated], dim=1), scores.clone())
    for row, prompt in enumerate((long_prompt, short_prompt)):
        alone = RepetitionPenaltySparingStops(1.5, [stop])(torch.tensor([[*prompt, *generated[row * beams]]]),
                                                           scores[:1].clone())
        for beam in range(beams):
            assert torch.equal(penalised[row * beams + beam], alone[0]), (row, beam)
    assert (penalised[:, [pad, stop]] == scores[:, [pad, stop]]).all()
    assert (penalised[:, [3, 6]] < scores[:, [3, 6]]).tolist() == [[True, True]] * beams + [[False, False]] * beams


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_hf_backend_never_draws_an_id_beyond_the_tokenizer_and_its_log_probs_are_the_train_forwards(
        tmp_path, dtype, atol):
    """The rows beyond the tokenizer hold nearly all of the whole distribution's mass here (their logits made large
    on purpose): the rollout's log-probs and the training forward's over the tokenizer's ids agree (bf16: within its
    cached decode's rounding), far from those over every row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_padded_vocab_model_dir(tmp_path / "padded", extra_row_scale=50.0)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.randint(3, len(tokenizer), (6, 5), generator=torch.Generator().manual_seed(0))
    config = _config(max_new_tokens=30, seed=0, eos_token_id=-1, tokenizer_size=len(tokenizer), temperature=0.8)
    out = HFGenerator(model).generate(ids, torch.ones_like(ids), config)
    assert out.answers.max() < len(tokenizer)
    with torch.no_grad():
        expected = answer_logprobs(model, out.sequences, out.attention_mask, out.prompt_length, 0.8,
                                   tokenizer_size=len(tokenizer))
        every_row = answer_logprobs(model, out.sequences, out.attention_mask, out.prompt_length, 0.8,
                                    tokenizer_size=None)
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=atol)
    assert (expected - every_row).min() > 1.0


def test_the_chatbot_and_prompt_eval_never_choose_an_id_beyond_the_tokenizer(tmp_path, monkeypatch):
    """Their answers read as text, which had the ids beyond the tokenizer dropped without a word."""
    from inference.chatbot import ChatSession, SamplingOptions
    from step1_sft.prompt_eval import GenerationSettings, generate_answers, load_for_generation

    model, tokenizer = load_for_generation(make_padded_vocab_model_dir(tmp_path / "padded"), torch.float32)
    generate, outputs = model.generate, []
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: outputs.append(generate(*args, **kwargs)) or
                        outputs[-1])
    torch.manual_seed(0)
    generate_answers(model, tokenizer, ["hello", "a"], GenerationSettings(max_new_tokens=40, do_sample=True, top_k=0))
    ChatSession(model, tokenizer, SamplingOptions(max_new_tokens=40, temperature=1.0, top_p=1.0)).reply("hello")
    assert [int(output.max()) < len(tokenizer) for output in outputs] == [True, True]


def test_full_distribution_draws_match_the_probabilities_over_a_large_vocabulary():
    """The inverse-CDF draw: each row's frequencies follow its own softmax, over a vocabulary of SmolLM2's size
    where most of the mass sits on a few tokens and a token masked to -inf is never drawn."""
    vocabulary, draws, batch = 49152, 10000, 500
    logits = torch.full((2, vocabulary), -4.0)
    logits[0, [3, 7, 40000]] = torch.tensor([2.0, 1.0, 0.0])
    logits[1, [5, 49151]] = torch.tensor([1.0, 1.5])
    logits[:, 11] = float("-inf")
    probs = logits.softmax(-1)
    generator = torch.Generator().manual_seed(1)
    for row in range(2):
        drawn = torch.cat([select_next_tokens(logits[row].expand(batch, -1), _config(), generator)
                           for _ in range(draws // batch)])
        frequencies = torch.bincount(drawn, minlength=vocabulary).double() / draws
        for token in (3, 7, 40000, 5, 49151):
            expected = probs[row, token].item()
            assert abs(frequencies[token].item() - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5 + 1e-3
        assert frequencies[11] == 0
        tail = 1 - sum(probs[row, token].item() for token in (3, 7, 40000, 5, 49151))
        assert abs(1 - sum(frequencies[token].item() for token in (3, 7, 40000, 5, 49151)) - tail) < 0.02


def test_seeded_sampling_repeats():
    logits = torch.randn(8, 30)
    draws = [select_next_tokens(logits, _config(), torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(*draws)


def test_answer_mask_covers_tokens_through_the_first_eos():
    answers = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    assert answer_mask_from_tokens(answers, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_assembled_output_pads_after_eos_and_trims_unused_columns():
    prompt = torch.tensor([[0, 4, 5], [3, 4, 5]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    answers = torch.tensor([[7, 2, 9, 9], [2, 8, 8, 8]])
    mask = answer_mask_from_tokens(answers, 2)
    out = assemble_output(prompt, prompt_mask, answers, torch.full((2, 4), -1.0), mask, pad_token_id=0)
    assert out.sequences.tolist() == [[0, 4, 5, 7, 2], [3, 4, 5, 2, 0]]
    assert out.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert out.logprobs.tolist() == [[-1.0, -1.0], [-1.0, 0.0]]
    assert out.prompt_length == 3 and out.answers.tolist() == [[7, 2], [2, 0]]


def test_token_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens, tokenizer_size=None), expected)


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError):
        _config(max_new_tokens=0)
    with pytest.raises(ValueError):
        _config(temperature=0.0)
    with pytest.raises(ValueError):
        _config(top_p=0.0)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_hf_backend_reports_train_forward_logprobs_and_pads_after_eos(arch):
    model, tokenizer = make_tiny_model(arch)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "left"
    enc = tokenizer(["Human: hi", "The quick brown fox jumps"], return_tensors="pt", padding=True)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    model.train()
    probe = HFGenerator(model).generate(enc["input_ids"], enc["attention_mask"], config)
    eos = int(probe.answers[0, 1])
    config = GenerationConfig(**{**config.__dict__, "eos_token_id": eos})
    out = HFGenerator(model).generate(enc["input_ids"], enc["attention_mask"], config)
    assert out.answer_mask[0].sum() <= 2 and out.answers[0, int(out.answer_mask[0].sum()) - 1] == eos
    assert (out.answers[out.answer_mask == 0] == tokenizer.pad_token_id).all()
    assert model.training  # the generator restores the module's mode
    model.eval()  # the reference forward without dropout (OPT's tiny config has some), as RLHF trains
    with torch.no_grad():
        expected = answer_logprobs(model, out.sequences, out.attention_mask, out.prompt_length,
                                   tokenizer_size=None) * out.answer_mask
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True])
def test_hf_backend_draws_from_the_plain_distribution_whatever_the_models_generation_config(lora):
    """A model folder's generation_config.json (here a repetition penalty, a ban on any repeated token and a
    minimum length that holds back the EOS) must not shape the draw: the reported log-probabilities are the plain
    distribution's. Greedy answers equal those of the same model with a default config, and the module keeps its
    own config afterwards; under a peft wrapper too (it forwards the attribute to the model that holds it)."""
    from transformers import GenerationConfig as TransformersGenerationConfig

    from training.core.lora import apply_lora

    model, tokenizer = make_tiny_model("llama")
    if lora:
        model = apply_lora(model, 4, lora_module_name="layers.")
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "left"
    enc = tokenizer(["Human: hi", "The quick brown fox jumps"], return_tensors="pt", padding=True)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    plain = HFGenerator(model).generate(enc["input_ids"], enc["attention_mask"], config)
    assert any(len(set(row.tolist())) < len(row) for row in plain.answers)  # the ban would change these answers
    own = TransformersGenerationConfig(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=12,
                                       num_beams=1)
    holder = model.get_base_model() if lora else model
    holder.generation_config = own
    shaped = HFGenerator(model).generate(enc["input_ids"], enc["attention_mask"], config)
    assert holder.generation_config is own and model.generation_config is own
    torch.testing.assert_close(shaped.answers, plain.answers, rtol=0, atol=0)
    torch.testing.assert_close(shaped.logprobs, plain.logprobs, rtol=0, atol=0)


@dataclass
class _HybridCLI:
    hybrid: HybridEngineSettings


def test_cli_flags_mirror_deepspeed_chat():
    parser = SettingsParser(_HybridCLI)
    settings = parser.parse_args(["--enable_hybrid_engine", "--inference_tp_size", "2", "--tp_gather_partition_size",
                                  "4", "--release_inference_cache", "--unpin_actor_parameters"]).hybrid
    assert settings.enable and settings.inference_tp_size == 2 and settings.tp_gather_partition_size == 4
    assert settings.release_inference_cache and settings.unpin_actor_parameters and settings.cuda_graph
    assert settings.onednn_packing
    assert not parser.parse_args(["--disable_onednn_packing"]).hybrid.onednn_packing
    assert parser.parse_args([]).hybrid.fused_decode
    assert not parser.parse_args(["--disable_fused_decode"]).hybrid.fused_decode
    assert settings.backend == "hybrid"
    assert parser.parse_args([]).hybrid.backend == "hf"
    assert parser.parse_args(["--enable_hybrid_engine", "--generation_backend", "hf"]).hybrid.backend == "hf"


def test_the_static_cache_rows_a_compiled_step_writes_are_marked_static_addresses(tiny_model_dir):
    """torch.compile's CUDA graphs are skipped for a step that writes an input not marked as a static address, and
    the transformers-forward path hands its StaticCache layers views of larger buffers (which do not inherit
    transformers' mark): every view a layer holds, after the prefill, K continuations and rows leaving, is marked."""
    from scripts.hybrid_engine_worker import PROMPTS, prompt_batch
    from transformers import AutoModelForCausalLM

    from training.core.model_loading import load_tokenizer
    from training.generation.fast_decoder import HFCachedModel, KVCacheDecoder, RolloutKVCache

    model_dir = tiny_model_dir("gpt2")
    tokenizer = load_tokenizer(model_dir)
    step_model = HFCachedModel(AutoModelForCausalLM.from_pretrained(model_dir).eval(), RolloutKVCache())
    probe = KVCacheDecoder(step_model, torch.device("cpu"))
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = GenerationConfig(max_new_tokens=8, seed=0, num_return_sequences=2, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    out = probe.decode(ids, mask, config)
    config.eos_token_id = int(out.answers[0, 1])  # a token the model emits early: rows then leave the batch
    lengths = probe.decode(ids, mask, config).answer_mask.sum(-1)
    assert lengths.min() < lengths.max()
    for layer in step_model._storage.cache.layers:
        assert layer.keys.shape[0] < len(PROMPTS) * 2, "the rows in use are a view of the allocation"
        for rows in (layer.keys, layer.values):
            assert getattr(rows, "_dynamo_static_input_type", None) is not None, "not a static address"


def test_a_compiled_step_samples_the_tokens_the_eager_one_does_while_rows_finish(tiny_model_dir):
    """The compiled transformers step keeps finished rows (a fixed shape), the eager one drops them; each live row
    still gets the uniform number it would get on the other path, so sampled decodes whose rows end at different
    steps are the same on both (drawn per row of the whole batch, the compiled path's draws parted from the eager
    path's at the first row that ended)."""
    from scripts.hybrid_engine_worker import PROMPTS, frequent_token, prompt_batch
    from transformers import AutoModelForCausalLM

    from training.core.model_loading import load_tokenizer
    from training.generation.fast_decoder import HFCachedModel, KVCacheDecoder, RolloutKVCache

    model_dir = tiny_model_dir("gpt2")
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    compiled = KVCacheDecoder(HFCachedModel(model, RolloutKVCache(), compiled=True), torch.device("cpu"))
    eager = KVCacheDecoder(HFCachedModel(model, RolloutKVCache()), torch.device("cpu"))
    ids, mask = prompt_batch(tokenizer, PROMPTS)
    config = GenerationConfig(max_new_tokens=12, seed=0, temperature=1.5, eos_token_id=-1,
                              pad_token_id=tokenizer.pad_token_id)
    probe = eager.decode(ids, mask, config)
    config.eos_token_id = frequent_token(probe.sequences, probe.prompt_length)  # rows then end at different steps
    torch._dynamo.reset()
    fast, slow = compiled.decode(ids, mask, config), eager.decode(ids, mask, config)
    lengths = slow.answer_mask.sum(-1)
    assert lengths.min() < lengths.max(), lengths
    assert torch.equal(fast.sequences, slow.sequences)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_a_compiled_transformers_step_compiles_once_per_allocation_not_per_batch_shape(tiny_model_dir):
    """torch.compile compiles the step anew for each shape it sees, and after 8 runs it eagerly for the rest of the
    process: batches of other prompt lengths and a smaller last batch reuse the allocation's shape (the cache grows
    to cover every call, its length rounded up to 128 columns), and decode as the eager step does."""
    from scripts.hybrid_engine_worker import PROMPTS, prompt_batch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from training.core.model_loading import load_tokenizer
    from training.generation.fast_decoder import COMPILED_LENGTH_MULTIPLE, HFCachedModel, KVCacheDecoder, RolloutKVCache

    model_dir = tiny_model_dir("gpt2")
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    compiled_cache = RolloutKVCache()
    compiled = KVCacheDecoder(HFCachedModel(model, compiled_cache, compiled=True), torch.device("cpu"))
    eager = KVCacheDecoder(HFCachedModel(model, RolloutKVCache()), torch.device("cpu"))
    config = GenerationConfig(max_new_tokens=6, seed=0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    torch._dynamo.reset()
    counters.clear()
    batches = [PROMPTS, PROMPTS[1:4], PROMPTS[2:], PROMPTS[:2], [" ".join(PROMPTS)]]
    for texts in batches:
        ids, mask = prompt_batch(tokenizer, texts)
        fast, slow = compiled.decode(ids, mask, config), eager.decode(ids, mask, config)
        assert torch.equal(fast.sequences, slow.sequences)
        torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)
        assert compiled_cache.rows == len(PROMPTS) and compiled_cache.length % COMPILED_LENGTH_MULTIPLE == 0
    assert compiled_cache.length > COMPILED_LENGTH_MULTIPLE, "the last batch needs a longer allocation"
    assert counters["stats"]["unique_graphs"] == 2, "one compiled step per allocation"


def test_a_compiled_step_raises_an_error_of_the_forward_itself(monkeypatch):
    """Only the compiler's own failures make a compiled step fall back to eager: any other error is the caller's."""
    import training.generation.compiled_step as compiled_step

    def broken_forward(**inputs):
        raise ValueError("input_ids out of range")

    monkeypatch.setattr(compiled_step, "_failure", None)
    monkeypatch.setattr(compiled_step, "compile_model", lambda model: broken_forward)
    step = compiled_step.CompiledStep(torch.nn.Identity())
    with pytest.raises(ValueError, match="out of range"):
        step(input=torch.zeros(1))
    assert compiled_step.compile_failure() is None  # not taken for a compiler failure
