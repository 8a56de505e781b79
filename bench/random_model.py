"""Write a model folder with random weights, for timing an architecture whose real weights are not here.

    python bench/random_model.py --arch gpt2 --output /tmp/gpt2-random
    python bench/generation.py --model /tmp/gpt2-random --ignore_eos ...

Shapes: `gpt2` is GPT-2 small (12 layers, 768 wide), `opt` is OPT-125m, `smollm2` the embedded
SmolLM2-135M's own config, `llama-1b` TinyLlama-1.1B's (22 layers, 2048 wide, 4 key/value heads; 1.17B
parameters with SmolLM2's vocabulary, embeddings not tied), `llama-7b` Llama-2-7B's (32 layers, 4096 wide, 11008
in the MLP, 32 heads and as many key/value heads, 4096 positions; 6.88B parameters with SmolLM2's vocabulary,
embeddings not tied), `qwen2.5-0.5b` Qwen2.5-0.5B's (24 layers, 896 wide, 14 heads and 2 key/value heads, q/k/v
biases, tied embeddings; 0.40B parameters with SmolLM2's vocabulary instead of its own 151,936 tokens),
`qwen3-0.6b` Qwen3-0.6B's (28 layers, 1024 wide, 16 heads of 128 and 8 key/value heads, per-head q/k norms, tied
embeddings; 0.49B parameters with SmolLM2's vocabulary). Every folder gets the embedded tokenizer
(vocabulary resized to it), so no hub download is needed; `--reference_dir` takes the tokenizer and SmolLM2's
config from a folder instead (one with SmolLM2's config.json and tokenizer files, no weights needed: what
`python -m bench.gpu.prepare` carries to a GPU machine before the model itself has arrived). Random weights
give nearly flat logits: time with `--ignore_eos`, and expect greedy tokens to part at near-ties between
backends (parity is what the tests check on real shapes).

`--dtype` and `--device` build the weights in that dtype straight on that device (no fp32 copy on the CPU first),
which is what makes the 7B shape practical on a GPU machine (12.8 GiB in bf16, written as safetensors):

    python bench/random_model.py --arch llama-7b --dtype bf16 --device cuda --output /tmp/llama-7b-random
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
)

from training.core.embedded_model import embedded_model_path
from training.core.model_loading import load_tokenizer, resolve_dtype
from utils.atomic import atomic_directory

SHAPES = {  # architecture -> its config, given the reference folder (SmolLM2's)
    "gpt2": lambda _: GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    "opt": lambda _: OPTConfig(hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
                             word_embed_proj_dim=768, max_position_embeddings=2048),
    "smollm2": lambda reference: AutoConfig.from_pretrained(reference),
    "llama-1b": lambda _: LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                      tie_word_embeddings=False),
    "llama-7b": lambda _: LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-0.5b": lambda _: Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                          rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-0.6b": lambda _: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                        max_position_embeddings=40960,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                        rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def build_model(config, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """Random weights of `config`, allocated and initialised in `dtype` on `device` (a device context rather than
    the meta device and `to_empty`: transformers initialises every weight, and the non-persistent buffers such as
    RoPE's frequencies, where the model is made)."""
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(SHAPES), required=True)
    parser.add_argument("--output", required=True, help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="dtype of the weights")
    parser.add_argument("--device", default="cpu", help="where the weights are made (e.g. cuda): no CPU copy first")
    parser.add_argument("--reference_dir", default=None,
                        help="folder with SmolLM2's config and tokenizer (default: the embedded model)")
    args = parser.parse_args(argv)
    reference = args.reference_dir or embedded_model_path()
    tokenizer = load_tokenizer(reference)
    config = SHAPES[args.arch](reference)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = build_model(config, resolve_dtype(args.dtype), args.device)
    output = Path(args.output)
    with atomic_directory(output) as staged:  # a killed write leaves no folder that looks finished
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
    print(f"{args.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random {args.dtype} parameters made "
          f"on {args.device} -> {output}")
    return output


if __name__ == "__main__":
    main()
