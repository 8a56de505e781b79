"""Score prompt/answer pairs with a reward model trained by step 2.

    python step2_reward/rw_eval.py --model_name_or_path runs/step2 \\
        --prompt "How do I boil an egg?" --answer "Boil water, add the egg, wait 8 minutes." --answer "No."
    python step2_reward/rw_eval.py --model_name_or_path runs/step2 --input_file pairs.jsonl

`--input_file` takes any `--data_path` source (json/jsonl/parquet; prompt + response, prompt +
chosen + rejected, hh-rlhf transcripts, ...); of a dataset with evaluation splits (test, validation) it reads those,
unless the source names its split (`NAME[SPLIT]`). Rows with a rejected answer also get a verdict and
the file's accuracy and mean margin. Prompts are rendered and tokenised as in training, with the run's
`--max_seq_len` and `--prompt_format` (its args.json) unless given; a row whose prompt alone fills
`--max_seq_len`, whose two answers are the same once cut, or whose two answers differ in whitespace alone
(`identical_replies`, marked by `read_rows`) is skipped and counted, as step 2 drops it (both would tie and count as
wrong); `RewardScorer.score`, which returns one score a pair, refuses such a pair.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from utils.log import deepspeed_logs_to_stderr, setup_logging

deepspeed_logs_to_stderr()  # before training.core imports DeepSpeed: standard output holds the scores alone

from training.core.args import DTYPE_CHOICES, SettingsParser, trust_remote_code_field
from training.core.model_loading import (
    TRAINED_DTYPE_HELP,
    load_config,
    load_tokenizer,
    on_inference_device,
    resolve_trained_dtype,
)
from training.core.reward_model import RewardModel, resolve_reward_model, reward_model_folder
from training.reliability.run_records import args_of_model
from training.reliability.validation import check_output_file, check_sequence_lengths, model_max_positions
from utils.data import PROMPT_FORMATS, PromptFormatter, read_rows
from utils.data.collators import pad_sequences
from utils.data.tokenization import TokenLimits, check_max_seq_len, pair_sequences, sft_sequence
from utils.errors import UserError, refuse_all, run_cli

FALLBACK_MAX_SEQ_LEN = 512  # for a model no run of this project trained
CUT_REASONS = ("prompt_too_long", "identical_after_truncation")  # the pairs step 2 drops at its --max_seq_len


def load_for_scoring(path: str, dtype: str, trust_remote_code: bool = False) -> RewardModel:
    """The reward model at `path` in `dtype` (rw_eval's --dtype, `resolve_trained_dtype`), on the device tools run
    their models on (`on_inference_device`)."""
    return on_inference_device(RewardModel.from_pretrained(path, dtype=resolve_trained_dtype(dtype, path),
                                                           trust_remote_code=trust_remote_code))


class RewardScorer:
    """Scores (rendered prompt, answer) texts: prompt + answer tokens + EOS (none after an answer that ends in the
    chat template's end-of-turn token: `PromptFormatter.answer_suffix_ids`), cut to `max_seq_len`, the same sequence
    step 2 trained on."""

    def __init__(self, model: RewardModel, tokenizer: PreTrainedTokenizerBase, prompt_format: str = "auto",
                 max_seq_len: int = 512, batch_size: int = 8):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.formatter = PromptFormatter(tokenizer, prompt_format)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", prompt_format: str | None = None,
                        max_seq_len: int | None = None, batch_size: int = 8,
                        trust_remote_code: bool = False) -> RewardScorer:
        """The reward model at `path` (what rw_eval.py's --model_name_or_path takes), scoring as rw_eval.py does:
        `prompt_format` and `max_seq_len` left None are those of the step-2 run that trained it (`trained_scoring`);
        `dtype` and `trust_remote_code` are rw_eval.py's --dtype and --trust_remote_code."""
        path = resolve_reward_model(path)
        prompt_format, max_seq_len = trained_scoring(path, prompt_format, max_seq_len)
        max_seq_len = _settled_max_seq_len(max_seq_len, load_config(path, trust_remote_code), path)
        return cls(load_for_scoring(path, dtype, trust_remote_code),
                   load_tokenizer(path, trust_remote_code), prompt_format, max_seq_len, batch_size)

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=self.formatter.adds_special_tokens)["input_ids"]

    def encode(self, prompt: str, answer: str) -> torch.Tensor:
        """Prompt and answer as step 2 trains on them (`_sequences`). A pair step 2 drops (its prompt alone fills
        `max_seq_len`) is refused: no answer would be left to score, and `score_rows` skips it."""
        found = self._sequences({"prompt": prompt, "chosen": answer})
        if isinstance(found, str):
            raise UserError(f"step 2 drops this pair ({found} at max_seq_len {self.max_seq_len}), and rw_eval skips "
                            f"it: give a larger max_seq_len or a shorter prompt | {_short(prompt, -60)}")
        return found[0]

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Reward of each (rendered prompt, formatted answer) pair; a pair step 2 drops is refused (`encode`)."""
        return self._score([self.encode(prompt, answer) for prompt, answer in pairs])

    def _score(self, sequences: list[torch.Tensor]) -> list[float]:
        scores: list[float] = []
        device = next(self.model.parameters()).device
        for start in range(0, len(sequences), self.batch_size):
            batch = sequences[start : start + self.batch_size]
            input_ids = pad_sequences(batch, self.tokenizer.pad_token_id).to(device)
            attention_mask = pad_sequences([torch.ones_like(s) for s in batch], 0).to(device)
            scores += self.model(input_ids=input_ids, attention_mask=attention_mask)["end_scores"].float().tolist()
        return scores

    def _sequences(self, row: dict) -> list[torch.Tensor] | str:
        """The row's answer (and rejected answer) as step 2 trains on them, or why step 2 would drop the row."""
        prompt, suffix = self.token_ids(row["prompt"]), self.formatter.answer_suffix_ids
        limits = TokenLimits(max_seq_len=self.max_seq_len)
        chosen = self.token_ids(row["prompt"] + row["chosen"])
        if row.get("rejected") is None:
            item = sft_sequence(prompt, chosen, suffix, limits)
            return item if isinstance(item, str) else [torch.tensor(item["input_ids"])]
        item = pair_sequences(prompt, chosen, self.token_ids(row["prompt"] + row["rejected"]), suffix, limits)
        if isinstance(item, str):
            return item
        return [torch.tensor(item["chosen_input_ids"]), torch.tensor(item["rejected_input_ids"])]

    @torch.no_grad()
    def score_rows(self, rows: list[dict]) -> list[dict]:
        """Add `chosen_score` (and `rejected_score`, `chosen_preferred`) to canonical rows; a row step 2 would drop
        (its prompt fills `max_seq_len`, or both answers are the same once cut) gets `skipped`, its reason, and one
        `read_rows` marked `skipped` (its answers differ in whitespace alone) keeps it."""
        results, sequences = [], []
        for row in rows:
            found = row["skipped"] if "skipped" in row else self._sequences(row)
            results.append({**row, "skipped": found} if isinstance(found, str) else {**row})
            sequences.append([] if isinstance(found, str) else found)
        scores = iter(self._score([sequence for found in sequences for sequence in found]))
        for result, found in zip(results, sequences):
            if found:
                result["chosen_score"] = next(scores)
            if len(found) == 2:
                rejected = next(scores)
                result.update(rejected_score=rejected, chosen_preferred=result["chosen_score"] > rejected)
        return results


def pair_statistics(results: list[dict]) -> dict:
    judged = [row for row in results if "rejected_score" in row]
    skipped = sum("skipped" in row for row in results)
    if not judged:
        return {"rows": len(results), "skipped": skipped}
    margins = [row["chosen_score"] - row["rejected_score"] for row in judged]
    return {
        "rows": len(results),
        "skipped": skipped,
        "pairs": len(judged),
        "accuracy": sum(row["chosen_preferred"] for row in judged) / len(judged),
        "margin_mean": sum(margins) / len(margins),
    }


@dataclass
class RewardEvalArguments:
    """The reward model, what it scores, and where the scores go."""

    model_name_or_path: str = field(metadata={
        "help": "step 2's run folder or its model folder, or train.py's --output-dir (its step2/)"})
    prompt: str | None = field(default=None, metadata={"help": "a user prompt (with --answer)"})
    answer: list[str] = field(default_factory=list, metadata={
        "action": "append", "nargs": None, "help": "an answer to --prompt; repeat to compare several"})
    input_file: str | None = field(default=None, metadata={
        "help": "a data file of prompt/answer rows (any --data_path source; a dataset's evaluation splits where it has "
                "any, unless it names one as NAME[SPLIT])"})
    prompt_format: str | None = field(default=None, metadata={
        "choices": PROMPT_FORMATS, "help": "default: the step-2 run's (args.json), else auto"})
    max_seq_len: int | None = field(default=None, metadata={
        "help": f"default: the step-2 run's (args.json), else {FALLBACK_MAX_SEQ_LEN} or the model's positions where "
                "fewer"})
    batch_size: int = field(default=8, metadata={"help": "rows scored together"})
    max_rows: int | None = field(default=None, metadata={"help": "score at most this many rows of --input_file"})
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": TRAINED_DTYPE_HELP})
    trust_remote_code: bool = trust_remote_code_field()
    output_file: str | None = field(default=None, metadata={"help": "write the scored rows to this JSONL file"})

    def check(self) -> None:
        """Refuse, all at once and before anything loads, the flags nothing can be scored by: a --batch_size or
        --max_rows below 1 (the scoring crashed on the former, range()'s ValueError, and took the latter as a slice:
        -1 the file less its last row, 0 nothing), a --max_seq_len below 2, and a flag the others leave nothing to do
        (beside --input_file, a --prompt without --answer or the reverse was dropped without a word)."""
        refuse_all(lambda: _check_at_least_one("batch_size", self.batch_size),
                   lambda: _check_at_least_one("max_rows", self.max_rows),
                   lambda: self.max_seq_len is None or check_max_seq_len(self.max_seq_len),
                   self._check_prompt_has_answers, self._check_max_rows_has_a_file)

    def _check_prompt_has_answers(self) -> None:
        if bool(self.prompt) != bool(self.answer):
            given, missing = ("--prompt", "--answer") if self.prompt else ("--answer", "--prompt")
            raise UserError(f"{given} is scored only with {missing}: give --prompt with at least one --answer, or drop "
                            f"{given}")

    def _check_max_rows_has_a_file(self) -> None:
        if self.max_rows is not None and not self.input_file:
            raise UserError("--max_rows caps the rows of --input_file, and none is given: drop --max_rows")


def _check_at_least_one(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"--{flag} must be at least 1, got {value}")


@dataclass
class RewardEvalSettings:
    scoring: RewardEvalArguments


def build_parser() -> SettingsParser:
    return SettingsParser(RewardEvalSettings, description="Score prompt/answer pairs with a step-2 reward model")


def parse_args(argv: list[str] | None = None) -> RewardEvalArguments:
    """The flags, with `--max_seq_len` and `--prompt_format` left unset taken from the step-2 run that trained the
    model (so pairs are cut and rendered as it trained on them)."""
    parser = build_parser()
    args = parser.parse_args(argv).scoring
    if not args.input_file and not (args.prompt and args.answer):
        parser.error("give --prompt with at least one --answer, or --input_file")
    args.check()
    args.model_name_or_path = resolve_reward_model(args.model_name_or_path)
    args.prompt_format, args.max_seq_len = trained_scoring(args.model_name_or_path, args.prompt_format,
                                                           args.max_seq_len)
    return args


def trained_scoring(model: str, prompt_format: str | None, max_seq_len: int | None) -> tuple[str, int | None]:
    """`prompt_format` and `max_seq_len`, each where None that of the step-2 run that trained `model` (its args.json;
    auto and None for a model no run trained), so pairs are rendered and cut as it trained on them."""
    recorded = args_of_model(model)
    return (recorded.get("prompt_format", "auto") if prompt_format is None else prompt_format,
            recorded.get("max_seq_len") if max_seq_len is None else max_seq_len)


def _rows(args: RewardEvalArguments, tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    rows = []
    if args.prompt:
        formatter = PromptFormatter(tokenizer, args.prompt_format)
        turns = [{"role": "user", "content": args.prompt}]
        rendered = formatter.prompt(turns)
        rows += [{"prompt": rendered, "chosen": formatter.answer(turns, a, rendered), "rejected": None}
                 for a in args.answer]
    if args.input_file:
        read = read_rows(args.input_file, tokenizer, args.prompt_format, evaluating=True)
        file_rows = [row for row in read if row.get("chosen") is not None]
        if not file_rows:
            raise UserError(f"{args.input_file} has no rows with a prompt and an answer to score")
        if len(file_rows) < len(read):  # said: the statistics count only the rows scored
            print(f"{args.input_file}: {len(read) - len(file_rows)} of its {len(read)} rows hold a prompt alone, no "
                  "answer to score: left out", flush=True)
        rows += file_rows[: args.max_rows]
    return rows


def _short(text: str, limit: int) -> str:
    """A one-line excerpt: the first `limit` characters, or the last `-limit`."""
    flat = " ".join(text.split())
    return repr(flat[:limit] if limit > 0 else flat[limit:])


def _settled_max_seq_len(max_seq_len: int | None, config, model: str) -> int:
    """A given (or recorded) --max_seq_len, checked to fit the model's positions; none: the fallback, or the model's
    positions where fewer. Past them a learned-position model (OPT, GPT-2) failed with an IndexError once it had
    loaded."""
    if max_seq_len is not None:
        check_sequence_lengths(config, max_seq_len=max_seq_len, model=model)
        return max_seq_len
    positions = model_max_positions(config)
    return FALLBACK_MAX_SEQ_LEN if positions is None else min(FALLBACK_MAX_SEQ_LEN, positions[0])


def _prepared_rows(args: RewardEvalArguments) -> tuple[PreTrainedTokenizerBase, list[dict]]:
    """The tokenizer and the rows to score, all that needs no model weights done and checked before they load: the
    output file, a reward model in the folder, --max_seq_len settled, the rows of --input_file read."""
    check_output_file(args.output_file)
    reward_model_folder(args.model_name_or_path)
    args.max_seq_len = _settled_max_seq_len(args.max_seq_len, load_config(args.model_name_or_path,
                                                                          args.trust_remote_code),
                                            args.model_name_or_path)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    return tokenizer, _rows(args, tokenizer)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    setup_logging()  # on standard error: which splits of --input_file are scored (eval_splits' info line)
    args = parse_args(argv)
    tokenizer, rows = _prepared_rows(args)
    model = load_for_scoring(args.model_name_or_path, args.dtype, args.trust_remote_code)
    scorer = RewardScorer(model, tokenizer, prompt_format=args.prompt_format, max_seq_len=args.max_seq_len,
                          batch_size=args.batch_size)
    results = scorer.score_rows(rows)
    for row in results:
        if "skipped" in row:
            where = f" at --max_seq_len {args.max_seq_len}" if row["skipped"] in CUT_REASONS else ""
            print(f"skipped ({row['skipped']}{where})  | {_short(row['prompt'], -60)}", flush=True)
            continue
        line = f"score {row['chosen_score']:+.4f}"
        if "rejected_score" in row:
            line = f"chosen {row['chosen_score']:+.4f}  rejected {row['rejected_score']:+.4f}  " \
                   f"{'ok' if row['chosen_preferred'] else 'WRONG'}"
        print(f"{line}  | {_short(row['prompt'], -60)} -> {_short(row['chosen'], 60)}", flush=True)
    stats = pair_statistics(results)
    print(json.dumps(stats), flush=True)
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text("".join(json.dumps(row) + "\n" for row in results), encoding="utf-8")
    return {"results": results, **stats}


if __name__ == "__main__":
    main()
