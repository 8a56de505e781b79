"""Compare a base model and its fine-tuned version side by side on a set of prompts.

    python step1_sft/prompt_eval.py --model_name_or_path_baseline smollm2-135m \\
        --model_name_or_path_finetune runs/step1 --prompts "How do I boil an egg?"

Prompts are rendered the way training rendered them (chat template, or " Human: ... Assistant:").
Decoding is greedy unless `--do_sample`; `--output_file` also writes the answers as JSONL.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, set_seed

from training.core.model_loading import (
    EMBEDDED_MODEL_NAME,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
)
from utils.data import PROMPT_FORMATS, PromptFormatter
from utils.errors import UserError, run_cli

DEFAULT_PROMPTS = (
    "How do I make a cup of tea?",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a neural network is in one paragraph.",
    "Give me three tips for learning a new language.",
)


@dataclass
class GenerationSettings:
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    num_beams: int = 1
    repetition_penalty: float = 1.0
    batch_size: int = 8

    def generate_kwargs(self) -> dict:
        kwargs = dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, num_beams=self.num_beams,
                      repetition_penalty=self.repetition_penalty)
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return kwargs


def render_prompt(formatter: PromptFormatter, text: str) -> str:
    """A single user turn, rendered as training rendered prompts."""
    return formatter.prompt([{"role": "user", "content": text}])


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], settings: GenerationSettings,
    prompt_format: str = "auto",
) -> list[str]:
    """The model's answer to each user prompt (batched, left-padded; special tokens stripped)."""
    formatter = PromptFormatter(tokenizer, prompt_format)
    add_special_tokens = formatter.style == "human_assistant"  # a chat template writes its own special tokens
    tokenizer.padding_side = "left"
    answers: list[str] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), settings.batch_size):
        texts = [render_prompt(formatter, p) for p in prompts[start : start + settings.batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
        output = model.generate(**batch, **settings.generate_kwargs(), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        answers.extend(text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    tokenizer.padding_side = "right"
    return answers


def load_for_generation(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool = False):
    tokenizer = load_tokenizer(name_or_path, trust_remote_code)
    model = load_causal_lm(name_or_path, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts_file {path} does not exist; give a text file with one prompt per line")
        prompts += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Side-by-side answers of a base model and a fine-tuned model")
    parser.add_argument("--model_name_or_path_baseline", default=EMBEDDED_MODEL_NAME,
                        help="the model before fine-tuning (hub name, folder, or the embedded default)")
    parser.add_argument("--model_name_or_path_finetune", required=True,
                        help="the fine-tuned model: step 1's run folder or its model folder")
    parser.add_argument("--prompts", nargs="*", help="prompts to answer (default: a few built-in ones)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--prompt_format", choices=PROMPT_FORMATS, default="auto")
    parser.add_argument("--max_new_tokens", type=int, default=GenerationSettings.max_new_tokens)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=GenerationSettings.temperature)
    parser.add_argument("--top_p", type=float, default=GenerationSettings.top_p)
    parser.add_argument("--top_k", type=int, default=GenerationSettings.top_k)
    parser.add_argument("--num_beams", type=int, default=GenerationSettings.num_beams)
    parser.add_argument("--repetition_penalty", type=float, default=GenerationSettings.repetition_penalty)
    parser.add_argument("--batch_size", type=int, default=GenerationSettings.batch_size)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--output_file", help="also write {prompt, baseline, finetune} rows to this JSONL file")
    return parser.parse_args(argv)


@run_cli
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    set_seed(args.seed)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, num_beams=args.num_beams, repetition_penalty=args.repetition_penalty,
        batch_size=args.batch_size,
    )
    prompts = read_prompts(args)
    dtype = resolve_dtype(args.dtype)
    answers = {}
    for label, name in (("baseline", args.model_name_or_path_baseline), ("finetune", args.model_name_or_path_finetune)):
        model, tokenizer = load_for_generation(name, dtype, args.trust_remote_code)
        answers[label] = generate_answers(model, tokenizer, prompts, settings, args.prompt_format)
        del model
    rows = [{"prompt": p, "baseline": b, "finetune": f} for p, b, f in zip(prompts, answers["baseline"], answers["finetune"])]
    for row in rows:
        print(f"==== prompt: {row['prompt']}\n---- baseline:\n{row['baseline']}\n---- finetune:\n{row['finetune']}\n",
              flush=True)
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
