"""Multi-turn chat with any saved model: a step-3 actor, its EMA copy, a step-1 model, or any HF model.

Interactive by default: type a message (lines pasted at once are one), the answer streams as it is generated; `clear`
starts a new conversation, `quit` (or Ctrl-D, or Ctrl-C at the prompt) ends, and Ctrl-C while the model answers stops
that answer. For scripts, `--prompt` (repeatable) or prompts on standard input (one a line, when it is not a terminal)
are answered in order as one conversation, then the program exits (Ctrl-C ends it, with status 130; a reader of its
output that leaves, as `| head` does, with status 141).

Each turn's prompt is rendered by the `PromptFormatter` training used, in the format the model's run trained on.
"""
from __future__ import annotations

import contextlib
import select
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TextIO

try:
    import termios
except ImportError:  # Windows: no terminal modes, and its console is never watched (`_input_waiting`)
    termios = None

import torch
from transformers import TextStreamer

from utils.log import deepspeed_logs_to_stderr

deepspeed_logs_to_stderr()  # before training.core imports DeepSpeed: standard output holds the answers alone

from training.core.args import DTYPE_CHOICES, SettingsParser, trust_remote_code_field
from training.core.model_loading import (
    EMBEDDED_MODEL_NAME,
    TRAINED_DTYPE_HELP,
    answer_stop_ids,
    listed_stop_ids,
    load_causal_lm,
    load_tokenizer,
    on_inference_device,
    resolve_trained_dtype,
    resolve_trained_model,
)
from training.core.reward_model import is_reward_model_dir
from training.generation.generator import DecodingSettings, decode_by_flags_only
from training.reliability.answer_limit import AnswerLimit, answer_limit, cut_note
from training.reliability.run_records import trained_prompt_format
from utils.data.formatting import PROMPT_FORMATS, PromptFormatter, resolve_prompt_format
from utils.data.samples import SkipRow
from utils.errors import EXIT_BROKEN_PIPE, UserError, run_cli
from utils.output_pipes import write_to_devnull

CLEAR_COMMANDS = frozenset({"clear", "reset"})
QUIT_COMMANDS = frozenset({"quit", "exit"})
_HUMAN_STOP = "Human:"
EXIT_INTERRUPTED = 130  # a shell's status for a process that SIGINT ended
# a line that follows the prompt's line within this long came with it, in one paste: no one types so fast
PASTE_GAP_S = 0.05


def resolve_chat_model(path: str, ema: bool = False) -> str:
    """The model folder to chat with (`resolve_trained_model`, which refuses a file); a reward model is refused."""
    resolved = resolve_trained_model(path, ema)
    if is_reward_model_dir(resolved):
        raise UserError(f"{path} is a reward model or critic (step 2's model, step 3's critic/), which scores text but "
                        "cannot chat; pass a step-1 model or a step-3 actor")
    return resolved


@dataclass
class SamplingOptions(DecodingSettings):
    """The chatbot's decoding: samples by default (`--greedy` turns it off)."""

    temperature: float = field(default=0.7, metadata={"help": "sampling temperature"})
    top_p: float = field(default=0.9, metadata={
        "help": "sample from the smallest set of tokens holding this much probability (1: all)"})
    do_sample: bool = field(default=True, metadata={
        "flag": "greedy", "negated": True,
        "help": "pick the most likely token (no sampling; --repetition_penalty still applies: 1.0 for plain argmax)"})
    repetition_penalty: float = field(default=1.1, metadata={
        "help": "transformers' repetition penalty, sparing the ids an answer stops at (1.0: none)"})


@dataclass
class ChatArguments:
    """Which model to chat with, and how the conversation is rendered."""

    path: str = field(default=EMBEDDED_MODEL_NAME, metadata={
        "aliases": ["--model"],
        "help": "train.py output dir, step-3 run folder (its actor), step-1 run folder, HF folder or hub name"})
    ema: bool = field(default=False, metadata={"help": "chat with step 3's EMA actor (actor_ema/)"})
    prompt: list[str] | None = field(default=None, metadata={
        "action": "append", "nargs": None,
        "help": "answer this message and exit (repeat for a multi-turn conversation)"})
    seed: int | None = field(default=None, metadata={"help": "seed for sampling (reproducible answers)"})
    prompt_format: str | None = field(default=None, metadata={
        "choices": PROMPT_FORMATS,
        "help": "the tokenizer's chat template, or ' Human: ... Assistant:' (auto: template if any); default: the "
                "format the model's run trained on (its args.json), else auto"})
    system: str | None = field(default=None, metadata={"help": "a system message at the start of the conversation"})
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": TRAINED_DTYPE_HELP})
    trust_remote_code: bool = trust_remote_code_field()


@dataclass
class ChatSettings:
    chat: ChatArguments
    sampling: SamplingOptions


class ReplyStreamer(TextStreamer):
    """Hands each piece of decoded text to a callback as soon as it is final, and keeps the whole reply.

    With `stop` (the text that ends a reply, which generation includes), nothing from `stop` on is shown, and a
    tail that could be its beginning is held back until the next piece settles it."""

    def __init__(self, tokenizer, on_text: Callable[[str], None], stop: str | None = None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._on_text = on_text
        self.stop = stop
        self.text = ""
        self._shown = 0

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        visible = self.reply(final=stream_end)
        if len(visible) > self._shown:
            self._on_text(visible[self._shown:])
            self._shown = len(visible)

    def reply(self, final: bool = True) -> str:
        """The text before `stop`; while not `final`, less a tail that may begin it."""
        if self.stop is None:
            return self.text
        cut = self.text.find(self.stop)
        if cut >= 0:
            return self.text[:cut]
        if not final:
            for tail in range(min(len(self.stop) - 1, len(self.text)), 0, -1):
                if self.stop.startswith(self.text[-tail:]):
                    return self.text[:-tail]
        return self.text


class ChatSession:
    """A conversation with one model; `reply` extends the history by one exchange, an answer as long as `limit`
    lets it be (default: `--max_new_tokens`, else `DEFAULT_MAX_NEW_TOKENS`)."""

    def __init__(self, model, tokenizer, options: SamplingOptions, prompt_format: str = "auto",
                 system_prompt: str | None = None, limit: AnswerLimit | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.limit = limit or answer_limit(options.max_new_tokens)
        self.formatter = PromptFormatter(tokenizer, prompt_format)
        self.style = self.formatter.style
        if system_prompt is not None:
            refuse_undecodable(system_prompt, "--system")
        self.system_prompt = system_prompt
        self.history: list[dict] = []
        self.dropped_exchanges = 0  # the oldest exchanges the last reply left out to fit
        self.cut_at: int | None = None  # the length limit the last reply ran into unfinished, in tokens
        greeting = self._prompt_ids([{"role": "user", "content": "Hi"}])  # a template refusing --system fails here
        if system_prompt is not None:  # else every message was refused in turn, each told to shorten itself
            self.limit.check(model.config, greeting.shape[1], "--system, with the chat format and a one-word message,")
        # past any of them a model served as its authors made it would go on with a made-up next turn
        self.stop_token_ids = answer_stop_ids(self.formatter.stop_token_ids, listed_stop_ids(model))

    def clear(self) -> None:
        self.history = []

    def _turns(self, history: list[dict]) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + history

    def _prompt(self, history: list[dict]) -> str:
        """The prompt training renders for the conversation `history` (after the system prompt)."""
        try:
            return self.formatter.prompt(self._turns(history))
        except SkipRow as err:  # a template that refuses a system message (Gemma's), or a role order
            given = " with --system" if self.system_prompt else ""
            raise UserError(f"the chat template cannot render this conversation{given} "
                            f"({self.formatter.template_error})") from err

    def _prompt_ids(self, history: list[dict]) -> torch.Tensor:
        """`_prompt(history)` tokenised as training tokenised it: [1, T]."""
        return self.tokenizer(self._prompt(history), add_special_tokens=self.formatter.adds_special_tokens,
                              return_tensors="pt")["input_ids"]

    def _encode(self, history: list[dict]) -> tuple[torch.Tensor, list[dict]]:
        """The conversation `history` (ending with the new message) as input ids, and the history kept: the oldest
        exchanges are dropped until it leaves room for an answer (`self.limit`: within the window of the model's run,
        if any) within the model's positions, and within a window until the answer has half of it
        (`roomy_answer`) or no earlier exchange is left. A new message that does not fit alone (with the system
        prompt) is refused: cut to fit, it lost its own question."""
        while True:
            ids = self._prompt_ids(history)
            roomy = self.limit.after(ids.shape[1]) >= self.limit.roomy_answer or len(history) < 3
            if roomy and self.limit.fits(self.model.config, ids.shape[1]):
                return ids, history
            if len(history) < 3:  # no earlier exchange left to drop
                self.limit.check(self.model.config, ids.shape[1],
                                 "this message, with the system prompt and the chat format,")
            history = history[2:]

    @torch.no_grad()
    def reply(self, message: str, on_text: Callable[[str], None] = lambda text: None) -> str:
        """The model's answer to `message`, after the conversation so far; a `UserError` (the conversation left as it
        was) where the message does not fit the model's positions with the answer. A `KeyboardInterrupt` (Ctrl-C)
        while it answers ends the answer there: the conversation keeps what `on_text` was given of it."""
        self.dropped_exchanges = 0
        self.cut_at = None
        refuse_undecodable(message, "this message")
        input_ids, history = self._encode([*self.history, {"role": "user", "content": message}])
        self.dropped_exchanges = (len(self.history) + 1 - len(history)) // 2
        input_ids = input_ids.to(self.model.device)
        stop_text = _HUMAN_STOP if self.style == "human_assistant" else None
        streamer = ReplyStreamer(self.tokenizer, on_text, stop_text)
        stop = {"stop_strings": [stop_text], "tokenizer": self.tokenizer} if stop_text is not None else {}
        max_new_tokens = self.limit.after(input_ids.shape[1])
        try:
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                streamer=streamer,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_token_ids,
                **stop,
                **self.options.generate_kwargs(len(self.tokenizer), self.stop_token_ids),
                max_new_tokens=max_new_tokens,
            )
        except KeyboardInterrupt:
            shown = streamer.reply(final=False).strip()
            if shown:
                self.history = [*history, {"role": "assistant", "content": shown}]
            raise
        answer = streamer.reply().strip()
        self.history = [*history, {"role": "assistant", "content": answer}]
        if self._ran_into_limit(sequences[0, input_ids.shape[1]:], max_new_tokens, streamer):
            self.cut_at = max_new_tokens
        return answer

    def _ran_into_limit(self, answer_ids: torch.Tensor, max_new_tokens: int, streamer: ReplyStreamer) -> bool:
        """Whether generation stopped at `max_new_tokens` rather than at a stop token or the stop text: the answer
        ends where it was cut, mid-sentence or mid-word."""
        ended_at_stop_text = streamer.stop is not None and streamer.stop in streamer.text
        return (len(answer_ids) >= max_new_tokens and int(answer_ids[-1]) not in self.stop_token_ids
                and not ended_at_stop_text)


def refuse_undecodable(text: str, what: str) -> None:
    """A `UserError` where `text` holds bytes its source could not decode as UTF-8, which Python keeps as lone
    surrogates (a Latin-1 file piped in, an argument in another encoding): the tokenizer raised a TypeError on them,
    which ended the chat."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        character = f"byte {code - 0xDC00:#x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise UserError(f"{what} is not UTF-8 text ({character} at character {err.start + 1}); give it in UTF-8, e.g. "
                        "a file converted with iconv -t utf-8") from err


def printable(text: str) -> str:
    """`text` as a UTF-8 stream can write it: what is not UTF-8 text (`refuse_undecodable`) as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def dropped_note(exchanges: int) -> str:
    """What the chat says after an answer for which the oldest `exchanges` were left out: silently, the model seemed
    to forget the conversation's start."""
    which = "exchange was" if exchanges == 1 else f"{exchanges} exchanges were"
    return (f"the oldest {which} left out of the conversation to leave room for this answer; 'clear' starts a new "
            "one")


def converse(session: ChatSession, messages: Iterable[str], out: TextIO, interactive: bool = False) -> list[str]:
    """Answer each message in turn (streaming to `out`); honours `clear` and `quit`. Returns the answers.

    `interactive`: the terminal shows the messages as typed (they are not echoed), and Ctrl-C stops only the answer
    being generated; otherwise it ends the conversation."""
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
        if not interactive:
            out.write(f"Human: {printable(message)}\n")
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

        try:
            answers.append(session.reply(message, stream))
            if session.cut_at is not None:
                out.write(f"\n({cut_note(session.cut_at)})")
            if session.dropped_exchanges:
                out.write(f"\n({dropped_note(session.dropped_exchanges)})")
        except UserError as err:  # the conversation goes on without this message
            out.write(f"(not answered: {err})")
        except KeyboardInterrupt:
            if not interactive:
                raise
            out.write(" (stopped)" if started else "(stopped)")
        out.write("\n\n")
        out.flush()
    return answers


def _enable_line_editing() -> None:
    """Arrow keys, Home/End and earlier messages (up arrow) at the prompt, through GNU readline where this Python has
    it: importing it is what makes `input` edit lines. Without it a left arrow went into the message as '\\x1b[D'."""
    with contextlib.suppress(ImportError):  # a Python without readline (Windows') reads plain lines
        import readline  # noqa: F401


def _keep_undecodable_bytes(stream: TextIO) -> None:
    """Read `stream` keeping what is not UTF-8 as lone surrogates, as Python reads arguments, for the chat to refuse
    that message alone: decoded strictly (a UTF-8 locale's default), a Latin-1 line ended the chat in a
    UnicodeDecodeError."""
    reconfigure = getattr(stream, "reconfigure", None)  # a stand-in stream (a test's) may have none
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def _input_waiting(stream: TextIO, timeout: float) -> bool:
    """Whether more typed input arrives on the terminal `stream` within `timeout` seconds, a line without its Enter
    too (`_unfinished_lines_readable`); False on anything but a terminal (a file or /dev/null is always readable) and
    where it cannot be watched (Windows' console, a stand-in stream)."""
    if termios is None:
        return False
    try:
        if not stream.isatty():
            return False
        with _unfinished_lines_readable(stream):
            return bool(select.select([stream], [], [], timeout)[0])
    except (OSError, ValueError, termios.error):
        return False


@contextlib.contextmanager
def _unfinished_lines_readable(stream: TextIO) -> Iterator[None]:
    """The terminal `stream` out of line mode meanwhile, so that a line that has no Enter yet (a paste's last line,
    copied without its newline) is seen waiting: in line mode the terminal holds it back until the Enter. GNU
    readline reads so already; with plain `input` (a Python without readline) the paste was answered without its
    last line, which then became a message of its own. Back in line mode the waiting text is handed to the next
    read, which takes the rest of its line."""
    fd = stream.fileno()
    line_mode = termios.tcgetattr(fd)
    keys_mode = [*line_mode[:6], list(line_mode[6])]
    keys_mode[3] &= ~termios.ICANON
    keys_mode[6][termios.VMIN], keys_mode[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, keys_mode)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, line_mode)


def _typed_message(prompt: str) -> str:
    """One message at the prompt: its line and the lines that arrived with it. A paste of several lines was a message
    per line, the first answered before the rest was read (a question and the code it asks about: two answers, to
    neither whole). Lines typed ahead, while the answer before streamed, wait on the terminal before the prompt shows:
    each is a message as typed (joined, a typed-ahead 'quit' was part of the message before it)."""
    if _input_waiting(sys.stdin, 0.0):
        return input(prompt)
    lines = [input(prompt)]
    while _input_waiting(sys.stdin, PASTE_GAP_S):
        lines.append(input())
    return "\n".join(lines)


def _interactive_lines() -> Iterable[str]:
    _enable_line_editing()
    print("chat: type a message; 'clear' starts over, 'quit' (or Ctrl-D) ends, Ctrl-C stops an answer.", flush=True)
    while True:
        try:
            yield _typed_message("Human: ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: the shell's prompt on a line of its own
            print(flush=True)
            return


def build_parser() -> SettingsParser:
    return SettingsParser(ChatSettings, description="Chat with a model trained by this project, or any HF causal LM.")


def load_session(args: ChatSettings) -> ChatSession:
    chat_args = args.chat
    if chat_args.system is not None:  # refused before the model loads, not after
        refuse_undecodable(chat_args.system, "--system")
    path = resolve_chat_model(chat_args.path, chat_args.ema)
    tokenizer = load_tokenizer(path, trust_remote_code=chat_args.trust_remote_code)
    prompt_format = chat_args.prompt_format or trained_prompt_format(path)
    resolve_prompt_format(prompt_format, tokenizer)  # refused before the model loads, not after
    model = load_causal_lm(path, tokenizer, dtype=resolve_trained_dtype(chat_args.dtype, path),
                           trust_remote_code=chat_args.trust_remote_code)
    decode_by_flags_only(model)  # the chatbot's flags, not what a checkpoint's generation_config.json adds to them
    on_inference_device(model)  # B200's cuDNN attention has corrupted grouped-query models' answers
    return ChatSession(model, tokenizer, args.sampling, prompt_format, chat_args.system,
                       answer_limit(args.sampling.max_new_tokens, path))


def chat(argv: list[str] | None = None) -> list[str]:
    """Run the chatbot; returns the answers given (the console entry point is `main`)."""
    args = build_parser().parse_args(argv)
    args.sampling.check()
    if args.chat.seed is not None:
        torch.manual_seed(args.chat.seed)
    session = load_session(args)
    if args.chat.prompt:
        return converse(session, args.chat.prompt, sys.stdout)
    _keep_undecodable_bytes(sys.stdin)
    if not sys.stdin.isatty():
        return converse(session, sys.stdin, sys.stdout)
    return converse(session, _interactive_lines(), sys.stdout, interactive=True)


@run_cli
def main(argv: list[str] | None = None) -> None:
    """`rlhf-chat`: returns nothing, so the console script exits with status 0; Ctrl-C that ends it (while the model
    loads, or in a scripted conversation) exits with status 130, and a reader of its output that left (`| head`)
    with status 141, without a traceback."""
    try:
        chat(argv)
    except KeyboardInterrupt:
        print(flush=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)


def _silence_stdout() -> None:
    """Standard output to /dev/null, whose reader left: Python's flush of it at exit would raise again."""
    with contextlib.suppress(OSError, ValueError):  # a stand-in stream (a test's) has no file descriptor
        write_to_devnull(sys.stdout.fileno())


if __name__ == "__main__":
    main()
