"""Tiny models and tokenizers built from configs, so tests never touch the hub.

`make_tiny_model_dir(path, arch)` writes a complete HF model folder (config, safetensors weights,
tokenizer) that every loader in the project accepts as `--actor_model_name_or_path`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ARCHITECTURES = ("llama", "gpt2", "opt", "qwen2", "qwen3", "mistral")
# Today's families beyond those, each in the config.json fields its hub checkpoints carry, scaled down; only
# tests/test_architectures.py runs them (the suite's architecture-parameterised tests stay on ARCHITECTURES)
RECENT_ARCHITECTURES = ("gemma2", "gemma3", "phi3", "phi4_mini", "llama3_2")
# Mistral whose attention window is shorter than the tests' sequences: the hybrid engine's transformers-forward path
# for a rotary model (the fused one serves unwindowed attention only)
WINDOWED_MISTRAL = "mistral_windowed"
WINDOW = 8

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Human: What is the capital of France? Assistant: The capital of France is Paris.",
    "Human: Tell me a joke. Assistant: Why did the chicken cross the road?",
    "user assistant system hello world how are you today I am fine thank you",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 yes no maybe good bad great terrible",
    "Reinforcement learning from human feedback trains a reward model and a policy.",
] * 4

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 256, chat_template: bool = True, with_pad: bool = False,
                   with_unk: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences; eos is `<|im_end|>`. Without `with_pad` or `with_unk`
    it has no token to pad with (as Llama-3's and Phi-4-mini's), and loading adds one."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|pad|>"] if with_pad else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>" if with_unk else None,
        pad_token="<|pad|>" if with_pad else None,
    )
    if chat_template:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def make_config(arch: str, vocab_size: int, pad_token_id: int | None = None, eos_token_id: int | None = None,
                bos_token_id: int | None = None, max_positions: int = 256, initializer_range: float = 0.02,
                **overrides):
    """A 2-layer config of `arch` (one of `ARCHITECTURES`, `RECENT_ARCHITECTURES` or `WINDOWED_MISTRAL`), `overrides`
    passed to its constructor last. Qwen2 has q/k/v biases; Qwen3 per-head query/key norms and heads wider than
    hidden_size / heads.

    The recent families, shaped like google/gemma-2-2b-it, gemma-3-1b-it, microsoft/Phi-3-mini-4k-instruct,
    Phi-4-mini-instruct and meta-llama/Llama-3.2-1B: Gemma-2 with soft caps (scaled to the logits of weights drawn
    with std 0.3, so they bite), alternating `WINDOW`-position sliding layers, a query_pre_attn_scalar other than
    head_dim and tied embeddings (scaled by sqrt(hidden) inside the model); Gemma-3 text with per-head q/k norms and
    a local (sliding) layer and a global one of other rope bases; Phi-3 with fused qkv_proj and gate_up_proj and a
    window shorter than its positions (Phi-3-mini's 2047 of 4096); Phi-4-mini with grouped key/value heads, partial
    rotary (0.75), longrope switching from its short to its long factors past `max_positions` (its
    original_max_position_embeddings, 4096 of 131072 in the real model) and tied embeddings; Llama-3.2 with "llama3"
    rope scaling and tied embeddings."""
    common = dict(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                  initializer_range=initializer_range)
    rope_family = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False, **common)
    gemma = dict(rope_family, head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                 sliding_window=WINDOW, rms_norm_eps=1e-6, tie_word_embeddings=True)
    wide = dict(rope_family, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    configs = {
        "llama": (LlamaConfig, rope_family),
        "qwen2": (Qwen2Config, rope_family),
        "qwen3": (Qwen3Config, dict(rope_family, head_dim=16)),
        "mistral": (MistralConfig, dict(rope_family, sliding_window=None)),
        WINDOWED_MISTRAL: (MistralConfig, dict(rope_family, sliding_window=WINDOW)),
        "gpt2": (GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=max_positions, **common)),
        "opt": (OPTConfig, dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=max_positions, word_embed_proj_dim=32, **common)),
        "gemma2": (Gemma2Config, dict(gemma, hidden_act="gelu_pytorch_tanh", attn_logit_softcapping=2.0,
                                      final_logit_softcapping=5.0, rope_theta=10000.0)),
        "gemma3": (Gemma3TextConfig, dict(gemma, num_key_value_heads=1, sliding_window_pattern=2,
                                          rope_local_base_freq=10000.0, rope_theta=1000000.0, rope_scaling=None,
                                          attn_logit_softcapping=None, final_logit_softcapping=None)),
        "phi3": (Phi3Config, dict(rope_family, num_key_value_heads=4, sliding_window=WINDOW, rope_theta=10000.0,
                                  rope_scaling=None, original_max_position_embeddings=max_positions,
                                  rms_norm_eps=1e-5)),
        "phi4_mini": (Phi3Config, dict(wide, partial_rotary_factor=0.75, rope_theta=10000.0,
                                       rope_scaling={"type": "longrope",
                                                     "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                                                     "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0]},
                                       original_max_position_embeddings=max_positions,
                                       max_position_embeddings=32 * max_positions,
                                       sliding_window=64 * max_positions, rms_norm_eps=1e-5)),
        "llama3_2": (LlamaConfig, dict(wide, head_dim=16, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": max_positions // 16})),
    }
    if arch not in configs:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES + RECENT_ARCHITECTURES}")
    config_class, arguments = configs[arch]
    return config_class(**{**arguments, **overrides})


def make_tiny_model(arch: str = "llama", tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0,
                    **config_kwargs):
    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    config = make_config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
                         **config_kwargs)
    return AutoModelForCausalLM.from_config(config), tokenizer


def make_tiny_model_dir(path: str | os.PathLike, arch: str = "llama", seed: int = 0, max_positions: int = 256,
                        initializer_range: float = 0.02, bias_std: float = 0.0, config_overrides: dict | None = None,
                        **tokenizer_kwargs) -> str:
    """Write a loadable HF folder (weights + tokenizer) for a tiny model and return its path. `bias_std` > 0 draws
    its biases (zero as initialised) with that std, as a trained model's are (Qwen2's q/k/v biases are large);
    `config_overrides` go to `make_config`."""
    path = Path(path)
    model, tokenizer = make_tiny_model(arch, make_tokenizer(**tokenizer_kwargs), seed=seed,
                                       max_positions=max_positions, initializer_range=initializer_range,
                                       **(config_overrides or {}))
    if bias_std > 0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, bias_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_padded_vocab_model_dir(path: str | os.PathLike, arch: str = "llama", extra_rows: int = 61,
                                extra_row_scale: float = 1.0) -> str:
    """A tiny model folder whose embedding holds `extra_rows` rows beyond its tokenizer's ids, as Qwen2.5's 151,936 rows
    hold 151,665 tokens: ids the tokenizer decodes to nothing, which a draw from the whole (near uniform) distribution
    of this untrained model picks about once in six tokens. `extra_row_scale` multiplies those rows of the output
    head, so their logits spread that much wider: at 50 they hold nearly all of the whole distribution's mass."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = make_config(arch, len(tokenizer) + extra_rows, tokenizer.pad_token_id, tokenizer.eos_token_id,
                         tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer):] *= extra_row_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_scripted_llama(tokenizer, successors: dict[str, str]):
    """A one-layer Llama that writes by rule: after the token `t`, `successors[t]` (greedy), after any other token
    the pad (the tokenizer must have one). Its layer's outputs are zero, so the final norm sees the last token's
    one-hot embedding, which the head maps to the successor's one-hot logits."""
    vocab = len(tokenizer)
    config = make_config("llama", vocab, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
                         hidden_size=-(-vocab // 8) * 8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config)
    ids = tokenizer.convert_tokens_to_ids
    next_token = torch.full((vocab,), tokenizer.pad_token_id)
    for token, successor in successors.items():
        next_token[ids(token)] = ids(successor)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight[next_token, torch.arange(vocab)] = 1.0
    return model.eval()


def save_model_also_stopping_at_endoftext(folder: Path) -> Path:
    """A scripted model saved in `folder` that answers 'H', then '<|endoftext|>', then 'u' for ever, and whose
    generation_config.json stops at '<|endoftext|>' beside its tokenizer's EOS, as Qwen2.5-Instruct's stops at
    <|endoftext|> beside <|im_end|> (Llama-3.1-Instruct's at <|eom_id|> too): an answer that ends where the model's
    config says reads 'H'."""
    tokenizer = make_tokenizer(with_pad=True)
    make_scripted_llama(tokenizer, {"Ċ": "H", "H": "<|endoftext|>", "<|endoftext|>": "u", "u": "u"}).save_pretrained(
        folder)
    tokenizer.save_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids
    config_file = folder / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "eos_token_id": [ids("<|im_end|>"), ids("<|endoftext|>")]}))
    return folder


CUSTOM_MODEL_TYPE = "custom_llama"  # a model type transformers does not know: only the folder's own code loads it
_CUSTOM_CONFIG_CODE = f"""from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = {CUSTOM_MODEL_TYPE!r}
"""
_CUSTOM_MODELING_CODE = """from transformers import LlamaForCausalLM, LlamaModel

from .configuration_custom import CustomConfig


class CustomModel(LlamaModel):
    config_class = CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""
_CUSTOM_TOKENIZATION_CODE = """from transformers import PreTrainedTokenizerFast


class CustomTokenizerFast(PreTrainedTokenizerFast):
    pass
"""


def make_custom_code_model_dir(path: str | os.PathLike, **kwargs) -> str:
    """`make_tiny_model_dir`'s Llama as a hub model with custom code ships it: its own configuration, modeling and
    tokenizer modules in the folder, named by the `auto_map` of config.json and tokenizer_config.json, under a model
    type transformers does not know, so it and its tokenizer load only with trust_remote_code."""
    folder = Path(make_tiny_model_dir(path, "llama", **kwargs))
    (folder / "configuration_custom.py").write_text(_CUSTOM_CONFIG_CODE)
    (folder / "modeling_custom.py").write_text(_CUSTOM_MODELING_CODE)
    (folder / "tokenization_custom.py").write_text(_CUSTOM_TOKENIZATION_CODE)
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({
        **json.loads(tokenizer_config.read_text()), "tokenizer_class": "CustomTokenizerFast",
        "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}}))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type=CUSTOM_MODEL_TYPE, architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModel": "modeling_custom.CustomModel",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    config_file.write_text(json.dumps(config))
    return str(folder)
