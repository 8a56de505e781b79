"""Generation for PPO rollouts: the shared configuration and output types, token selection, and the
`hf` backend (plain `generate` on the actor's module), the baseline the hybrid engine is measured
against and its fallback.

Conventions shared by every backend:
- input is a LEFT-padded prompt batch (`input_ids`, `attention_mask` [B, P]);
- positions come from the attention mask (`position_ids_from_attention_mask`), so left padding
  gives every prompt the positions 0, 1, ... of an unpadded one, for rotary and learned positions;
- `logprobs[b, t]` is log_softmax(logits / T)[token], T the temperature the token was drawn at
  (`GenerationConfig.logprob_temperature`: 1 for greedy decoding): the log-probability under the
  distribution that drew it, which a train-mode forward computes as `answer_logprobs(..., temperature=T)`.
  Top-k and top-p truncation are not reflected in it (the RLHF trainer refuses them for that reason);
- no backend chooses an id from `GenerationConfig.tokenizer_size` on: a model's embedding may hold rows beyond its
  tokenizer (Qwen2.5's 151,936 for 151,665 tokens; `match_tokenizer` rounds a grown one up to a multiple of 8),
  untrained ids that decode to nothing. Log-probs are those of the distribution over the tokenizer's ids that drew
  the token, which the training forward computes given the same size (`answer_logprobs(..., tokenizer_size=...)`);
- an answer ends at its first stop token (`GenerationConfig.eos_token_id`: the EOS, and for a chat template whose
  turns end in another special token, that token: `PromptFormatter.stop_token_ids`), which it includes, or at
  `max_new_tokens`; answers are right-padded with `pad_token_id` after it; N is the longest answer in the batch;
- with `num_return_sequences` K > 1 (group sampling), every output tensor has B*K rows, prompt-major:
  row i*K + j is the j-th continuation of prompt i, and its prompt part equals prompt i as given
  (padding included). K = 1 is the plain one-answer-per-prompt layout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch
from transformers import GenerationConfig as TransformersGenerationConfig
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from training.core.sequences import token_logprobs
from training.core.zero import is_zero3_module
from utils.dist import get_world_size
from utils.errors import UserError


@dataclass
class SamplingSettings:
    """The distribution the next token is drawn from: the sampling flags of step 3, the chatbot and
    prompt_eval (each tool keeps its own defaults and help in a subclass)."""

    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "sample from the smallest set of tokens holding this much "
                                                        "probability (1: all)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens (0: all)"})


@dataclass(kw_only=True)
class GenerationConfig(SamplingSettings):
    """One call of this project's generators: the sampling settings plus length, special tokens and seed.

    `eos_token_id` is the token, or the tokens, that end an answer (as transformers' `generate` takes it)."""

    max_new_tokens: int
    eos_token_id: int | Sequence[int]
    pad_token_id: int
    do_sample: bool = True
    seed: int | None = None
    num_return_sequences: int = 1  # K continuations per prompt, prompt-major (see the module docstring)
    tokenizer_size: int | None = None  # len(tokenizer): ids from it on are never chosen (None: any row of the model)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.num_return_sequences < 1:
            raise ValueError("num_return_sequences must be at least 1")
        if self.do_sample and not self.temperature > 0:  # nan too
            raise ValueError("temperature must be positive when sampling (use do_sample=False for greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must lie in (0, 1]")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an answer (`eos_token_id`, one or several)."""
        return stop_token_tuple(self.eos_token_id)

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution tokens are drawn from (greedy decoding reports T = 1)."""
        return self.temperature if self.do_sample else 1.0


DEFAULT_MAX_NEW_TOKENS = 128  # the chatbot's and prompt_eval's, for a model no run of this project trained


@dataclass
class DecodingSettings(SamplingSettings):
    """Sampling plus the rest of a `model.generate` call, for the tools that answer with transformers."""

    top_k: int = field(default=50, metadata={"help": "sample from the k most likely tokens (0: all)"})
    max_new_tokens: int | None = field(default=None, metadata={
        "help": "the longest answer, in tokens (default: as long as the model's run let answers be: a step-3 run's "
                "--max_answer_seq_len; a step-1 or DPO run's --max_seq_len, prompt and answer together; else "
                f"{DEFAULT_MAX_NEW_TOKENS}; prompt_eval: the fine-tuned model's run)"})
    do_sample: bool = field(default=False, metadata={"help": "sample instead of greedy decoding"})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "transformers' repetition penalty, sparing the ids an answer stops at (1.0: none)"})

    def check(self) -> None:
        """A `UserError` naming the flag whose value `model.generate` would refuse with a traceback (or, for
        --top_p above 1, take silently)."""
        for flag, broken, rule in self.flag_rules():
            if broken:
                raise UserError(f"--{flag} {rule}, got {getattr(self, flag)}")

    def flag_rules(self) -> list[tuple[str, bool, str]]:
        """(flag, whether its value breaks the rule, the rule) for `check`; a tool's own flags extend it."""
        return [
            ("max_new_tokens", self.max_new_tokens is not None and self.max_new_tokens <= 0, "must be positive"),
            # `not value > 0` refuses nan too, which every comparison answers False
            ("repetition_penalty", not self.repetition_penalty > 0, "must be positive (1.0: none)"),
            ("temperature", self.do_sample and not self.temperature > 0, "must be positive when sampling"),
            ("top_p", self.do_sample and not 0 < self.top_p <= 1, "must lie in (0, 1] (1: all tokens)"),
            ("top_k", self.do_sample and self.top_k < 0, "must be 0 (all tokens) or positive"),
        ]

    def generate_kwargs(self, tokenizer_size: int, stop_token_ids: Sequence[int],
                        attention_mask: torch.Tensor | None = None) -> dict:
        """The `model.generate` keyword arguments, but for `max_new_tokens` (each answer's `AnswerLimit`) and the
        `stop_token_ids` themselves: choices kept to the tokenizer's ids (`BeyondTokenizerBan`), the repetition
        penalty sparing the stop ids and the left padding of the prompts' `attention_mask` (None: prompts without
        padding; `RepetitionPenaltySparingStops`), the sampling ones only when sampling."""
        processors = [BeyondTokenizerBan(tokenizer_size)]
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltySparingStops(self.repetition_penalty, stop_token_ids, attention_mask))
        kwargs = {"do_sample": self.do_sample, "logits_processor": LogitsProcessorList(processors)}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return kwargs


_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def decode_by_flags_only(model: torch.nn.Module) -> None:
    """Replace `model`'s generation config by one that holds only its special token ids. transformers' `generate`
    fills every setting a call leaves unset from the model's generation_config.json, which a checkpoint may fill with
    sampling defaults, `no_repeat_ngram_size`, `min_new_tokens` or token bans: a tool's greedy answer was then not the
    most likely tokens, and two models compared under the same flags decoded differently. A tool that calls this
    decodes by its own flags alone, as step 3's generators do."""
    saved = model.generation_config
    model.generation_config = TransformersGenerationConfig(
        **{name: getattr(saved, name) for name in _SPECIAL_TOKEN_IDS if getattr(saved, name, None) is not None})


@dataclass
class GenerationOutput:
    """B rows are B*K with K continuations per prompt (prompt-major, see the module docstring)."""

    sequences: torch.Tensor  # [B, P+N] prompt (left-padded) + answer (right-padded with pad)
    attention_mask: torch.Tensor  # [B, P+N] prompt mask + answer_mask
    logprobs: torch.Tensor  # [B, N] fp32 log-prob of each generated token at the sampling temperature, 0 where padded
    prompt_length: int  # P
    answer_mask: torch.Tensor  # [B, N] 1 for generated tokens including the stop token that ended the answer

    @property
    def answers(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]


FinishedRowsHook = Callable[[torch.Tensor, GenerationOutput], None]
"""Called by a streaming generator with rows the moment they end (a stop token, or the length limit): their row
indices in the call's output layout (B*K rows) and those rows alone as a `GenerationOutput`, trimmed to their longest
answer (`on_finished` of `HybridEngine.generate`)."""


class Generator(Protocol):
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig
    ) -> GenerationOutput: ...

    @property
    def logprobs_match_training(self) -> bool:
        """Whether `GenerationOutput.logprobs` equal a training forward's within fp32 rounding, so a trainer
        may use them as the rollout's old log-probs instead of recomputing them."""
        ...


TokenSync = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TokenChoice:
    """How a decode step turns its logits [B, V] into the next tokens [B] and their log-probs [B] (fp32).

    A function of tensors alone: the uniform numbers a draw needs come in (`uniforms`, drawn outside), so the
    whole choice can sit inside a captured CUDA graph after the step's forward (decode_graphs), and the same
    numbers give the same tokens whichever path computed the logits. Choices with equal settings compare equal:
    a captured graph is kept per choice. `sync_tokens` makes ranks that decode the same batch (a tensor-parallel
    group) agree on the tokens before their log-probs are taken."""

    do_sample: bool
    temperature: float  # of the distribution tokens are drawn from and their log-probs taken at (1 when greedy)
    top_k: int = 0
    top_p: float = 1.0
    sync_tokens: TokenSync | None = None
    tokenizer_size: int | None = None  # logits columns from it on are never chosen (`GenerationConfig.tokenizer_size`)

    @classmethod
    def of(cls, config: GenerationConfig, sync_tokens: TokenSync | None = None) -> TokenChoice:
        """The choice `config` asks for (greedy ignores the filters, so greedy choices are all equal)."""
        sampling = config.do_sample
        return cls(do_sample=sampling, temperature=config.logprob_temperature, top_k=config.top_k if sampling else 0,
                   top_p=config.top_p if sampling else 1.0, sync_tokens=sync_tokens,
                   tokenizer_size=config.tokenizer_size)

    def uniforms(self, rows: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor | None:
        """One uniform number per row for a draw ([rows, 1] fp64), None when greedy."""
        if not self.do_sample:
            return None
        return torch.rand(rows, 1, dtype=torch.float64, device=device, generator=generator)

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.select(logits, uniforms)
        if self.sync_tokens is not None:
            tokens = self.sync_tokens(tokens)
        return tokens, token_logprobs(logits, tokens, self.temperature, tokenizer_size=self.tokenizer_size)

    def select(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        """Greedy argmax, or a draw from the temperature / top-k / top-p filtered distribution: [B, V] -> [B], among
        the tokenizer's ids only."""
        logits = logits.float()[:, :self.tokenizer_size]
        if not self.do_sample:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # drop a token when the tokens ranked above it already cover top_p (the first one always stays)
            drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= self.top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return draw_from(logits.softmax(-1), uniforms)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `probs` [B, V] by inverting its cumulative distribution (fp64) at the row's
    uniform number (`uniforms` [B, 1]): [B]. A token of probability 0 is never drawn. `torch.multinomial` draws V
    exponential numbers per row instead, which took 3.6 ms of a ~50 ms decode step over SmolLM2's 49,152 tokens
    at batch 8 on CPU; this takes 0.3 ms."""
    cumulative = probs.double().cumsum(-1)
    tokens = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True)
    return tokens.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


class BeyondTokenizerBan(LogitsProcessor):
    """transformers' `generate` never chooses an id from `tokenizer_size` on (see the module docstring)."""

    def __init__(self, tokenizer_size: int):
        self.tokenizer_size = tokenizer_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] <= self.tokenizer_size:
            return scores
        beyond = torch.arange(self.tokenizer_size, scores.shape[-1], device=scores.device)
        # a new tensor: `generate` keeps the one it passes in as the step's raw logits (`output_logits`)
        return scores.index_fill(-1, beyond, float("-inf"))


class RepetitionPenaltySparingStops(LogitsProcessor):
    """transformers' repetition penalty on every id the sequence holds but the ids an answer stops at and the left
    padding of its prompt. A chat prompt holds the end-of-turn token after each message (ChatML's <|im_end|>,
    SmolLM2-Instruct's EOS too), so transformers' own penalty made the end of every answer less likely (a positive
    logit divided by the penalty) and answers ran on. The padding is left out as `generate`'s own penalty leaves it
    (from the attention mask), so that an answer does not depend on the prompts that share its batch."""

    def __init__(self, penalty: float, stop_token_ids: Sequence[int], attention_mask: torch.Tensor | None = None):
        self.penalty = penalty
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        self.padding_lengths = None if attention_mask is None else (attention_mask != 0).int().argmax(dim=1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        stops = self.stop_token_ids[self.stop_token_ids < scores.shape[-1]].to(scores.device)
        unpenalized = scores.index_select(-1, stops)
        penalize = RepetitionPenaltyLogitsProcessor(self.penalty, self._padding_of_rows(input_ids))
        return penalize(input_ids, scores).index_copy(-1, stops, unpenalized)

    def _padding_of_rows(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Each row's left padding: its prompt's, for each of the prompt's beams (`generate` holds a prompt's beams
        in consecutive rows)."""
        if self.padding_lengths is None:
            return None
        beams = input_ids.shape[0] // self.padding_lengths.shape[0]
        return self.padding_lengths.repeat_interleave(beams).to(input_ids.device)


def tokenizer_ids_only(tokenizer_size: int | None) -> dict:
    """The `generate` keyword arguments that keep its choices to a tokenizer of `tokenizer_size` ids (None: none)."""
    if tokenizer_size is None:
        return {}
    return {"logits_processor": LogitsProcessorList([BeyondTokenizerBan(tokenizer_size)])}


def sampling_generator(config: GenerationConfig, device: torch.device | str) -> torch.Generator | None:
    """A private RNG when the config carries a seed (reproducible draws), else None (the global RNG)."""
    if config.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    return generator


def repeat_per_prompt(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Each row repeated `k` times in a row ([B, ...] -> [B*k, ...]): the prompt-major layout of K continuations."""
    return rows if k == 1 else rows.repeat_interleave(k, dim=0)


def assemble_output(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    answers: torch.Tensor,
    logprobs: torch.Tensor,
    answer_mask: torch.Tensor,
    pad_token_id: int,
) -> GenerationOutput:
    """Trim answer columns no sequence uses, pad after each answer's end, zero padded log-probs, and join prompt +
    answer."""
    used = int(answer_mask.sum(-1).max().item()) if answer_mask.numel() else 0
    used = max(used, 1) if answers.shape[1] else 0
    answers, logprobs, answer_mask = answers[:, :used], logprobs[:, :used].float(), answer_mask[:, :used].long()
    answers = answers.masked_fill(answer_mask == 0, pad_token_id)
    logprobs = logprobs.masked_fill(answer_mask == 0, 0.0)
    return GenerationOutput(
        sequences=torch.cat([input_ids, answers.to(input_ids.dtype)], dim=1),
        attention_mask=torch.cat([attention_mask.long(), answer_mask], dim=1),
        logprobs=logprobs,
        prompt_length=input_ids.shape[1],
        answer_mask=answer_mask,
    )


def stop_token_tuple(eos_token_id: int | Sequence[int]) -> tuple[int, ...]:
    """One stop token or several (`GenerationConfig.eos_token_id`) as a tuple."""
    return tuple(eos_token_id) if isinstance(eos_token_id, Sequence) else (int(eos_token_id),)


def is_stop_token(tokens: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """Bool, of `tokens`' shape: where a token is one of the stop tokens (`eos_token_id`: one or several)."""
    return torch.isin(tokens, torch.tensor(stop_token_tuple(eos_token_id), dtype=tokens.dtype, device=tokens.device))


def answer_mask_from_tokens(answers: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """1 up to and including each row's first stop token (`eos_token_id`: one or several), 0 after it:
    [B, N] -> [B, N] long."""
    is_stop = is_stop_token(answers, eos_token_id).long()
    stop_before = is_stop.cumsum(-1) - is_stop
    return (stop_before == 0).long()


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module | None) -> Iterator[None]:
    """Eval mode for the duration, then each submodule's own train/eval flag restored (None: nothing to do)."""
    if module is None:
        yield
        return
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for submodule, training in flags:
            submodule.training = training


class HFGenerator:
    """`generate` on the engine's module (peft or plain), ZeRO-3 hooks and all. transformers derives
    the positions from the attention mask itself, as `position_ids_from_attention_mask` does.

    `synced_gpus=True` under ZeRO-3 with several ranks keeps every rank stepping until all finish,
    because each forward gathers weights collectively.

    K continuations per prompt (`num_return_sequences`) repeat each prompt K times before `generate`, which
    is what transformers' own `num_return_sequences` does (it expands the inputs before the prefill, so the
    prefill runs on B*K rows); transformers refuses that argument for greedy decoding, so the expansion is
    done here for both. The layout is the hybrid engine's: row i*K + j continues prompt i.

    `generate_kwargs` go to every `generate` call (`cache_implementation="static"`: bench/generation.py's
    transformers baseline).
    """

    def __init__(self, engine: torch.nn.Module, **generate_kwargs):
        self.engine = engine
        self.module = getattr(engine, "module", engine)
        self.generate_kwargs = generate_kwargs

    @property
    def logprobs_match_training(self) -> bool:
        """An fp32 module: the cached decode's logits equal the full forward's within fp32 rounding
        (tests/test_generation.py); in half precision the two orders of summation differ visibly."""
        return next(self.module.parameters()).dtype == torch.float32

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig) -> GenerationOutput:
        device = next(self.module.parameters()).device
        input_ids = repeat_per_prompt(input_ids.to(device), config.num_return_sequences)
        attention_mask = repeat_per_prompt(attention_mask.to(device), config.num_return_sequences)
        sampling = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k) if config.do_sample else {}
        # the seed reaches the CUDA generator too: the rank's device is restored with the CPU's
        cuda_devices = [] if device.type != "cuda" else [
            device.index if device.index is not None else torch.cuda.current_device()]
        rng = torch.random.fork_rng(devices=cuda_devices) if config.seed is not None else contextlib.nullcontext()
        with rng, eval_mode(self.module), neutral_generation_config(self.module), torch.no_grad():
            if config.seed is not None:
                torch.manual_seed(config.seed)
            out = self.module.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=config.max_new_tokens,
                do_sample=config.do_sample,
                eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id,
                synced_gpus=is_zero3_module(self.module) and get_world_size() > 1,
                return_dict_in_generate=True,
                output_logits=True,
                **tokenizer_ids_only(config.tokenizer_size),
                **sampling,
                **self.generate_kwargs,
            )
        answers = out.sequences[:, input_ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1)[:, : answers.shape[1]]
        return assemble_output(
            input_ids,
            attention_mask,
            answers,
            token_logprobs(logits, answers, config.logprob_temperature, tokenizer_size=config.tokenizer_size),
            answer_mask_from_tokens(answers, config.eos_token_id),
            config.pad_token_id,
        )


@contextlib.contextmanager
def neutral_generation_config(module: torch.nn.Module) -> Iterator[None]:
    """`generate` draws from plain softmax(logits / T) while inside: the module's own generation config (its
    folder's `generation_config.json`: a repetition penalty, an n-gram ban, a minimum length, beams, ...) is set
    aside, because transformers fills every setting a call leaves unset from it. The log-probabilities this
    backend reports, and the trainer recomputes, are those of the plain distribution, so anything else would make
    the rollouts off-policy (and the `hf` backend sample otherwise than the hybrid engine).

    The config is swapped where it is held: on the transformers model itself, also under a peft wrapper (which
    only forwards the attribute)."""
    holders = [part for part in module.modules() if "generation_config" in vars(part)]
    saved = [part.generation_config for part in holders]
    for part in holders:
        part.generation_config = TransformersGenerationConfig()
    try:
        yield
    finally:
        for part, config in zip(holders, saved):
            part.generation_config = config
