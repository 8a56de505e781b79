"""How long an answer of the chatbot or prompt_eval may be: `--max_new_tokens` where given, else as long as the run
that trained the model let answers be (its args.json), else `DEFAULT_MAX_NEW_TOKENS`."""
from __future__ import annotations

from dataclasses import dataclass

from training.generation.generator import DEFAULT_MAX_NEW_TOKENS
from training.reliability.run_records import args_of_model
from training.reliability.validation import check_generation_fits, generation_fits
from utils.errors import UserError


@dataclass(frozen=True)
class AnswerLimit:
    """How long each answer may be: `max_new_tokens`, and with `max_seq_len` no longer than fills prompt and answer
    to it (the window step 1 and DPO train in). `source` says where the limit came from."""

    max_new_tokens: int
    max_seq_len: int | None = None
    source: str = "--max_new_tokens"

    def after(self, prompt_tokens: int) -> int:
        """The most tokens an answer to a prompt of `prompt_tokens` tokens may have."""
        return self.max_new_tokens if self.max_seq_len is None else min(self.max_new_tokens,
                                                                        self.max_seq_len - prompt_tokens)

    @property
    def roomy_answer(self) -> int:
        """The room a chat keeps for an answer by leaving its oldest exchanges out: within a window, half of it (or
        `max_new_tokens` where less); without one, an answer's room does not depend on the prompt."""
        return self.max_new_tokens if self.max_seq_len is None else min(self.max_new_tokens, self.max_seq_len // 2)

    def fits(self, config, prompt_tokens: int) -> bool:
        """Whether a prompt of `prompt_tokens` tokens leaves room for an answer, within the window and, with its
        answer, within the model's positions."""
        return self.after(prompt_tokens) >= 1 and generation_fits(config, prompt_tokens, self.after(prompt_tokens))

    def check(self, config, prompt_tokens: int, what: str) -> None:
        """Refuse a prompt (`what`, for the message) that does not `fit`, saying why."""
        if self.after(prompt_tokens) < 1:
            raise UserError(f"{what} is {prompt_tokens} tokens, which leaves no room for an answer within the "
                            f"{self.max_seq_len} tokens of {self.source}: shorten it or pass --max_new_tokens")
        check_generation_fits(config, prompt_tokens, self.after(prompt_tokens), what)


def cut_note(tokens: int) -> str:
    """What the chatbot and prompt_eval say of an answer that ran into its length limit: silently, it read as
    complete."""
    return f"the answer was cut at the limit of {tokens} tokens; --max_new_tokens raises it"


def answer_limit(max_new_tokens: int | None, model: str | None = None) -> AnswerLimit:
    """`--max_new_tokens` where given; else the limit `model`'s run answered within (its args.json): a step-3 run's
    --max_answer_seq_len, a step-1 or DPO run's --max_seq_len (prompt and answer together); else
    `DEFAULT_MAX_NEW_TOKENS`."""
    if max_new_tokens is not None:
        return AnswerLimit(max_new_tokens)
    recorded = args_of_model(model) if model is not None else {}
    if recorded.get("max_answer_seq_len"):
        return AnswerLimit(int(recorded["max_answer_seq_len"]), source="its run's --max_answer_seq_len")
    if recorded.get("max_seq_len"):
        window = int(recorded["max_seq_len"])
        return AnswerLimit(window, window, source="its run's --max_seq_len, prompt and answer together")
    return AnswerLimit(DEFAULT_MAX_NEW_TOKENS, source="the default")
