"""Multi-turn chat with any saved model: a step-3 actor, its EMA copy, a step-1 model, or any HF model.

Interactive by default: type a message, the answer streams as it is generated; `clear` starts a new
conversation and `quit` ends. For scripts, `--prompt` (repeatable) or prompts on standard input (one
a line, when it is not a terminal) are answered in order as one conversation, then the program exits.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TextIO

import torch
from transformers import TextStreamer

from training.core.model_loading import (
    EMBEDDED_MODEL_NAME,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from training.core.reward_model import is_reward_model_dir
from utils.data.formatting import (
    PROMPT_FORMATS,
    render_human_assistant,
    resolve_prompt_format,
)
from utils.errors import UserError, run_cli

CLEAR_COMMANDS = frozenset({"clear", "reset"})
QUIT_COMMANDS = frozenset({"quit", "exit"})
_HUMAN_STOP = "Human:"


def resolve_chat_model(path: str, ema: bool = False) -> str:
    """The model folder to chat with: a train.py output dir means its step-3 actor, a step-3 run folder
    its `actor/` (or `actor_ema/` with `ema`), a step-1 run folder its `model/`."""
    actor = "actor_ema" if ema else "actor"
    folder = Path(path)
    for candidate in (folder / "step3" / actor, folder / actor):
        if (candidate / "config.json").is_file():
            return str(candidate)
    if ema:
        raise UserError(f"{path} holds no EMA actor ({actor}/); run step 3 with --enable_ema or drop --ema")
    resolved = resolve_model_path(path)
    if is_reward_model_dir(resolved):
        raise UserError(f"{path} is a reward model (step 2), which scores text but cannot chat; pass a step-1 or step-3 model")
    return resolved


@dataclass
class SamplingOptions:
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1
    greedy: bool = False

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens, "repetition_penalty": self.repetition_penalty}
        return {
            "do_sample": True,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
        }


class _ChunkStreamer(TextStreamer):
    """Hands each piece of decoded text to a callback as soon as it is final, and keeps the whole reply."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._on_text = on_text
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        if text:
            self._on_text(text)


class ChatSession:
    """A conversation with one model; `reply` extends the history by one exchange."""

    def __init__(self, model, tokenizer, options: SamplingOptions, prompt_format: str = "auto",
                 system_prompt: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.style = resolve_prompt_format(prompt_format, tokenizer)
        self.system_prompt = system_prompt
        self.history: list[dict] = []

    def clear(self) -> None:
        self.history = []

    def _turns(self) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.history

    def _context_limit(self) -> int:
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        return max(1, limit - self.options.max_new_tokens)

    def _encode(self) -> torch.Tensor:
        """The conversation as input ids; the oldest exchanges are dropped until it fits the context."""
        while True:
            if self.style == "human_assistant":
                text = render_human_assistant(self._turns())
            else:
                text = self.tokenizer.apply_chat_template(self._turns(), tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=self.style == "human_assistant", return_tensors="pt")["input_ids"]
            if ids.shape[1] <= self._context_limit() or len(self.history) <= 2:
                return ids[:, -self._context_limit():]
            self.history = self.history[2:]

    @torch.no_grad()
    def reply(self, message: str, on_text: Callable[[str], None] = lambda text: None) -> str:
        self.history.append({"role": "user", "content": message})
        input_ids = self._encode().to(self.model.device)
        streamer = _ChunkStreamer(self.tokenizer, on_text)
        stop = {"stop_strings": [_HUMAN_STOP], "tokenizer": self.tokenizer} if self.style == "human_assistant" else {}
        self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            streamer=streamer,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            **stop,
            **self.options.generate_kwargs(),
        )
        answer = streamer.text.split(_HUMAN_STOP)[0].strip() if stop else streamer.text.strip()
        self.history.append({"role": "assistant", "content": answer})
        return answer


def converse(session: ChatSession, messages: Iterable[str], out: TextIO, show_prompts: bool) -> list[str]:
    """Answer each message in turn (streaming to `out`); honours `clear` and `quit`. Returns the answers."""
    answers = []
    for raw in messages:
        message = raw.strip()
        if not message:
            continue
        if message.lower() in QUIT_COMMANDS:
            break
        if message.lower() in CLEAR_COMMANDS:
            session.clear()
            out.write("(conversation cleared)\n")
            continue
        if show_prompts:
            out.write(f"Human: {message}\n")
        out.write("Assistant: ")
        out.flush()

        started = False

        def stream(text: str) -> None:
            nonlocal started
            if not started:
                text = text.lstrip()
                started = bool(text)
            out.write(text)
            out.flush()

        answers.append(session.reply(message, stream))
        out.write("\n\n")
        out.flush()
    return answers


def _interactive_lines() -> Iterable[str]:
    print("chat: type a message; 'clear' starts over, 'quit' ends.", flush=True)
    while True:
        try:
            yield input("Human: ")
        except EOFError:
            return


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Chat with a model trained by this project, or any HF causal LM.")
    parser.add_argument("--path", "--model", dest="path", default=EMBEDDED_MODEL_NAME,
                        help="train.py output dir, step-3 run folder (its actor), step-1 run folder, HF folder or hub name")
    parser.add_argument("--ema", action="store_true", help="chat with step 3's EMA actor (actor_ema/)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="answer this message and exit (repeat for a multi-turn conversation)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top_p", type=float, default=0.9)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--repetition_penalty", type=float, default=1.1)
    parser.add_argument("--greedy", action="store_true", help="pick the most likely token (no sampling)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible answers)")
    parser.add_argument("--prompt_format", choices=PROMPT_FORMATS, default="auto",
                        help="the tokenizer's chat template, or ' Human: ... Assistant:' (auto: template if any)")
    parser.add_argument("--system", default=None, help="a system message at the start of the conversation")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    parser.add_argument("--trust_remote_code", action="store_true")
    return parser


def load_session(args: argparse.Namespace) -> ChatSession:
    path = resolve_chat_model(args.path, args.ema)
    tokenizer = load_tokenizer(path, trust_remote_code=args.trust_remote_code)
    model = load_causal_lm(path, tokenizer, dtype=resolve_dtype(args.dtype), trust_remote_code=args.trust_remote_code)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    options = SamplingOptions(args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                              args.repetition_penalty, args.greedy)
    return ChatSession(model, tokenizer, options, args.prompt_format, args.system)


def chat(argv: list[str] | None = None) -> list[str]:
    """Run the chatbot; returns the answers given (the console entry point is `main`)."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        raise UserError("--max_new_tokens must be positive")
    if not args.greedy and args.temperature <= 0:
        raise UserError("--temperature must be positive; use --greedy for deterministic answers")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    session = load_session(args)
    if args.prompt:
        return converse(session, args.prompt, sys.stdout, show_prompts=True)
    if not sys.stdin.isatty():
        return converse(session, sys.stdin, sys.stdout, show_prompts=True)
    return converse(session, _interactive_lines(), sys.stdout, show_prompts=False)


@run_cli
def main(argv: list[str] | None = None) -> None:
    """`rlhf-chat`: returns nothing, so the console script exits with status 0."""
    chat(argv)


if __name__ == "__main__":
    main()
