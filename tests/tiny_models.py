"""Tiny models and tokenizers built from configs, so tests never touch the hub.

`make_tiny_model_dir(path, arch)` writes a complete HF model folder (config, safetensors weights,
tokenizer) that every loader in the project accepts as `--actor_model_name_or_path`.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ARCHITECTURES = ("llama", "gpt2", "opt", "qwen2", "qwen3", "mistral")
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


def make_tokenizer(vocab_size: int = 256, chat_template: bool = True, with_pad: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences; eos is `<|im_end|>`."""
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
        unk_token="<|endoftext|>",
        pad_token="<|pad|>" if with_pad else None,
    )
    if chat_template:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def make_config(arch: str, vocab_size: int, pad_token_id: int | None = None, eos_token_id: int | None = None,
                bos_token_id: int | None = None, max_positions: int = 256, initializer_range: float = 0.02,
                **overrides):
    """A 2-layer config of `arch` (one of `ARCHITECTURES`, or `WINDOWED_MISTRAL`), `overrides` passed to its
    constructor last. Qwen2 has q/k/v biases; Qwen3 per-head query/key norms and heads wider than hidden_size /
    heads."""
    common = dict(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                  initializer_range=initializer_range)
    rope_family = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False, **common)
    configs = {
        "llama": (LlamaConfig, rope_family),
        "qwen2": (Qwen2Config, rope_family),
        "qwen3": (Qwen3Config, dict(rope_family, head_dim=16)),
        "mistral": (MistralConfig, dict(rope_family, sliding_window=None)),
        WINDOWED_MISTRAL: (MistralConfig, dict(rope_family, sliding_window=WINDOW)),
        "gpt2": (GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=max_positions, **common)),
        "opt": (OPTConfig, dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=max_positions, word_embed_proj_dim=32, **common)),
    }
    if arch not in configs:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
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
                        initializer_range: float = 0.02, bias_std: float = 0.0, **tokenizer_kwargs) -> str:
    """Write a loadable HF folder (weights + tokenizer) for a tiny model and return its path. `bias_std` > 0 draws
    its biases (zero as initialised) with that std, as a trained model's are (Qwen2's q/k/v biases are large)."""
    path = Path(path)
    model, tokenizer = make_tiny_model(arch, make_tokenizer(**tokenizer_kwargs), seed=seed,
                                       max_positions=max_positions, initializer_range=initializer_range)
    if bias_std > 0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, bias_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
