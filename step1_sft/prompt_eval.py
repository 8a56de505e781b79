"""Compare a base model and its fine-tuned version side by side on a set of prompts.

    python step1_sft/prompt_eval.py --model_name_or_path_baseline smollm2-135m \\
        --model_name_or_path_finetune runs/step1 --prompts "How do I boil an egg?"

Each model's prompts are rendered the way its training rendered them (chat template, or " Human: ... Assistant:"):
the run that trained it (its args.json) says how, and a model no run of this project trained is prompted as its
tokenizer says (auto: its chat template, else plain); `--prompt_format` renders both alike, `--baseline_prompt_format`
the baseline's alone. An answer ends where training ends the model's turn: at the EOS, or at the chat template's end-of-turn token where that is
another (`PromptFormatter.stop_token_ids`); and at every other id the model's generation config stops at, as the
chatbot's (`answer_stop_ids`).
Decoding is greedy unless `--do_sample`, and follows these flags alone for both models (not a checkpoint's
generation_config.json); both run in one dtype, so a difference is the fine-tuning's. An answer is as long as the
fine-tuned model's run let answers be, unless `--max_new_tokens`; one that ran into that limit is shown as cut there.
`--output_file` also writes the answers as JSONL.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, set_seed

from utils.log import deepspeed_logs_to_stderr

deepspeed_logs_to_stderr()  # before training.core imports DeepSpeed: standard output holds the answers alone

from training.core.args import DTYPE_CHOICES, DTYPE_NAMES, SettingsParser, trust_remote_code_field
from training.core.model_loading import (
    EMBEDDED_MODEL_NAME,
    TRAINED_DTYPE_HELP,
    answer_stop_ids,
    listed_stop_ids,
    load_causal_lm,
    load_config,
    load_tokenizer,
    on_inference_device,
    resolve_trained_dtype,
    resolve_trained_model,
)
from training.generation.generator import DecodingSettings, decode_by_flags_only
from training.reliability.answer_limit import AnswerLimit, answer_limit, cut_note
from training.reliability.run_records import trained_prompt_format
from training.reliability.validation import check_output_file
from utils.data import PROMPT_FORMATS, PromptFormatter
from utils.data.jsonio import utf8_text
from utils.errors import UserError, run_cli

DEFAULT_PROMPTS = (
    "How do I make a cup of tea?",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a neural network is in one paragraph.",
    "Give me three tips for learning a new language.",
)


@dataclass
class GenerationSettings(DecodingSettings):
    """Decoding (greedy unless `--do_sample`) and the batch size of the comparison."""

    num_beams: int = field(default=1, metadata={"help": "beam search with this many beams (1: none)"})
    batch_size: int = field(default=8, metadata={"help": "prompts answered together"})

    def generate_kwargs(self, tokenizer_size: int, stop_token_ids: Sequence[int],
                        attention_mask: torch.Tensor | None = None) -> dict:
        return {**super().generate_kwargs(tokenizer_size, stop_token_ids, attention_mask), "num_beams": self.num_beams}

    def flag_rules(self) -> list[tuple[str, bool, str]]:
        return [*super().flag_rules(), ("num_beams", self.num_beams < 1, "must be at least 1"),
                ("batch_size", self.batch_size < 1, "must be at least 1")]


@dataclass
class PromptEvalArguments:
    """The two models, the prompts and where the answers go."""

    model_name_or_path_finetune: str = field(metadata={
        "help": "the fine-tuned model: a run folder of step 1, DPO or step 3 (its actor), train.py's output folder "
                "(its last model), or a model folder"})
    model_name_or_path_baseline: str = field(default=EMBEDDED_MODEL_NAME, metadata={
        "help": "the model before fine-tuning (hub name, folder, or the embedded default)"})
    prompts: list[str] | None = field(default=None, metadata={
        "nargs": "*", "help": "prompts to answer (default: a few built-in ones)"})
    prompts_file: str | None = field(default=None, metadata={"help": "a text file with one prompt per line"})
    prompt_format: str | None = field(default=None, metadata={
        "choices": PROMPT_FORMATS,
        "help": "how both models' prompts are rendered (default: each model's as the run that trained it rendered "
                "them, its args.json; else auto)"})
    baseline_prompt_format: str | None = field(default=None, metadata={
        "choices": PROMPT_FORMATS,
        "help": "how the baseline's prompts are rendered (default: --prompt_format where given, else as the run that "
                "trained the baseline rendered them, its args.json; else auto: its own chat template, else plain)"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPE_CHOICES,
        "help": f"both models' dtype, under auto the fine-tuned model's ({TRAINED_DTYPE_HELP})"})
    seed: int = field(default=1234, metadata={"help": "seed each model samples from (with --do_sample)"})
    trust_remote_code: bool = trust_remote_code_field()
    output_file: str | None = field(default=None, metadata={
        "help": "also write {prompt, baseline, finetune, baseline_cut_at, finetune_cut_at} rows to this JSONL file (a "
                "*_cut_at: the token limit that answer was cut at, null where it ended)"})


@dataclass
class PromptEvalSettings:
    run: PromptEvalArguments
    generation: GenerationSettings


def render_prompt(formatter: PromptFormatter, text: str) -> str:
    """A single user turn, rendered as training rendered prompts."""
    return formatter.prompt([{"role": "user", "content": text}])


@contextmanager
def padding_on(tokenizer: PreTrainedTokenizerBase, side: str) -> Iterator[None]:
    """The tokenizer pads on `side` within the block, and on the side it came with after it, also when it raises."""
    found = tokenizer.padding_side
    tokenizer.padding_side = side
    try:
        yield
    finally:
        tokenizer.padding_side = found


class Answer(NamedTuple):
    """A model's answer (special tokens stripped) and, where it ran into its length limit rather than ending at a
    stop id, that limit in tokens: a cut answer read as complete."""

    text: str
    cut_at: int | None = None


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], settings: GenerationSettings,
    prompt_format: str = "auto", limit: AnswerLimit | None = None,
) -> list[Answer]:
    """The model's answer to each user prompt (batched, left-padded), each at most as long as `limit` lets it be
    (default: `settings.max_new_tokens`). A batch holds prompts of one budget: under a run's window a short prompt's
    longer budget, generated for the whole batch, ran a long prompt's row past the window (and past a model's
    learned positions)."""
    with padding_on(tokenizer, "left"):
        return _answers(model, tokenizer, prompts, settings, prompt_format, limit or answer_limit(settings.max_new_tokens))


def checked_prompts(tokenizer: PreTrainedTokenizerBase, config, prompts: list[str], prompt_format: str,
                    limit: AnswerLimit) -> tuple[PromptFormatter, list[str], list[int]]:
    """The formatter of `prompt_format`, each prompt rendered by it and its length in tokens, each checked to fit the
    model's positions (its `config`'s) with its answer (`limit`): alone, before any generates, as a batch is as wide
    as its longest prompt."""
    formatter = PromptFormatter(tokenizer, prompt_format)
    rendered = [render_prompt(formatter, prompt) for prompt in prompts]
    lengths = [len(ids) for ids in tokenizer(rendered, add_special_tokens=formatter.adds_special_tokens)["input_ids"]]
    for prompt, length in zip(prompts, lengths):
        limit.check(config, length, f"the prompt {prompt[:40]!r}")
    return formatter, rendered, lengths


def _answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
             settings: GenerationSettings, prompt_format: str, limit: AnswerLimit) -> list[Answer]:
    """`generate_answers` with the tokenizer already padding on the left."""
    formatter, rendered, lengths = checked_prompts(tokenizer, model.config, prompts, prompt_format, limit)
    add_special_tokens = formatter.adds_special_tokens
    stop_token_ids = answer_stop_ids(formatter.stop_token_ids, listed_stop_ids(model))
    device = next(model.parameters()).device
    budgets = [limit.after(length) for length in lengths]
    answers = [Answer("")] * len(prompts)
    for budget, group in groupby(sorted(range(len(prompts)), key=budgets.__getitem__), key=budgets.__getitem__):
        group = list(group)
        for start in range(0, len(group), settings.batch_size):
            batch_rows = group[start : start + settings.batch_size]
            batch = tokenizer([rendered[row] for row in batch_rows], return_tensors="pt", padding=True,
                              add_special_tokens=add_special_tokens).to(device)
            decoding = settings.generate_kwargs(len(tokenizer), stop_token_ids, batch["attention_mask"])
            output = model.generate(**batch, **decoding, max_new_tokens=budget, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=stop_token_ids)
            for row, new_tokens in zip(batch_rows, output[:, batch["input_ids"].shape[1]:]):
                cut = len(new_tokens) >= budget and not set(new_tokens.tolist()) & set(stop_token_ids)
                answers[row] = Answer(tokenizer.decode(new_tokens, skip_special_tokens=True).strip(),
                                      budget if cut else None)
    return answers


def load_for_generation(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool = False,
                        tokenizer: PreTrainedTokenizerBase | None = None):
    """The model a folder holds (a run folder of any step that trains a causal LM: `resolve_trained_model`) in
    `dtype`, decoding by the tool's flags alone (`decode_by_flags_only`), with its `tokenizer` where already read."""
    path = resolve_trained_model(name_or_path)
    if tokenizer is None:
        tokenizer = load_tokenizer(path, trust_remote_code)
    model = load_causal_lm(path, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code)
    decode_by_flags_only(model)
    return on_inference_device(model), tokenizer


def read_prompts(args: PromptEvalArguments) -> list[str]:
    """--prompts, then --prompts_file's lines (UTF-8, as the data files: a byte-order mark is no part of the first
    prompt, and another encoding is refused naming its first bad byte); the built-in prompts where neither gives one."""
    prompts = list(args.prompts or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts_file {path} does not exist; give a text file with one prompt per line")
        prompts += [line.strip() for line in utf8_text(path.read_bytes(), path).splitlines() if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


def build_parser() -> SettingsParser:
    return SettingsParser(PromptEvalSettings, description="Side-by-side answers of a base model and a fine-tuned model")


def parse_args(argv: list[str] | None = None) -> PromptEvalSettings:
    """The flags, both models resolved to the folders they load from (once: a train.py folder without a step-3
    actor says so once), each model's prompt format left unset taken from the run that trained it: a baseline
    prompted in the fine-tuned model's format reads text unlike its training (or has no chat template to render)."""
    settings = build_parser().parse_args(argv)
    run = settings.run
    run.model_name_or_path_finetune = resolve_trained_model(run.model_name_or_path_finetune)
    run.model_name_or_path_baseline = resolve_trained_model(run.model_name_or_path_baseline)
    both = run.prompt_format
    run.prompt_format = both or trained_prompt_format(run.model_name_or_path_finetune)
    run.baseline_prompt_format = run.baseline_prompt_format or both or trained_prompt_format(
        run.model_name_or_path_baseline)
    return settings


def compared_models(args: PromptEvalArguments) -> tuple[tuple[str, str, str], ...]:
    """(label, model, prompt format) of the baseline, then of the fine-tuned model."""
    return (("baseline", args.model_name_or_path_baseline, args.baseline_prompt_format),
            ("finetune", args.model_name_or_path_finetune, args.prompt_format))


def check_prompts_before_loading(args: PromptEvalArguments, prompts: list[str],
                                 limit: AnswerLimit) -> dict[str, PreTrainedTokenizerBase]:
    """`checked_prompts` for both models from their tokenizers and configs, before either model loads: a prompt
    format or a prompt length the fine-tuned model refuses was refused once the baseline had loaded and answered
    every prompt. Returns each model's tokenizer by label, for its model to load with (read once)."""
    tokenizers = {}
    for label, name, prompt_format in compared_models(args):
        tokenizers[label] = load_tokenizer(name, args.trust_remote_code)
        checked_prompts(tokenizers[label], load_config(name, args.trust_remote_code), prompts, prompt_format, limit)
    return tokenizers


def answer_row(prompt: str, baseline: Answer, finetune: Answer) -> dict:
    """A prompt's row of --output_file: both answers, and for each the limit it was cut at (null: it ended)."""
    return {"prompt": prompt, "baseline": baseline.text, "finetune": finetune.text,
            "baseline_cut_at": baseline.cut_at, "finetune_cut_at": finetune.cut_at}


def shown(label: str, answer: Answer) -> str:
    """An answer as printed under its model's label, which says where it was cut."""
    note = f" ({cut_note(answer.cut_at)})" if answer.cut_at is not None else ""
    return f"---- {label}{note}:\n{answer.text}"


@run_cli
def main(argv: list[str] | None = None) -> list[dict]:
    settings = parse_args(argv)
    settings.generation.check()
    check_output_file(settings.run.output_file)
    args = settings.run
    prompts = read_prompts(args)
    # one dtype for both, the fine-tuned model's under auto: in two, the answers would differ by the rounding too
    dtype = resolve_trained_dtype(args.dtype, args.model_name_or_path_finetune)
    limit = answer_limit(settings.generation.max_new_tokens, args.model_name_or_path_finetune)
    decoding = "sampled" if settings.generation.do_sample else "greedy"
    print(f"baseline {args.model_name_or_path_baseline} and finetune {args.model_name_or_path_finetune}: both in "
          f"{DTYPE_NAMES[dtype]}, {decoding}, answers of at most {limit.max_new_tokens} tokens ({limit.source}), "
          f"prompts rendered as {args.baseline_prompt_format} (baseline) and {args.prompt_format} (finetune)\n",
          flush=True)
    tokenizers = check_prompts_before_loading(args, prompts, limit)
    answers = {}
    for label, name, prompt_format in compared_models(args):
        model, tokenizer = load_for_generation(name, dtype, args.trust_remote_code, tokenizers[label])
        set_seed(args.seed)  # each model samples from the same seed, whatever the other drew
        answers[label] = generate_answers(model, tokenizer, prompts, settings.generation, prompt_format, limit)
        del model
    rows = [answer_row(prompt, baseline, finetune)
            for prompt, baseline, finetune in zip(prompts, answers["baseline"], answers["finetune"])]
    for prompt, baseline, finetune in zip(prompts, answers["baseline"], answers["finetune"]):
        print(f"==== prompt: {prompt}\n{shown('baseline', baseline)}\n{shown('finetune', finetune)}\n", flush=True)
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
