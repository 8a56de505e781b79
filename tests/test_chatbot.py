"""The chatbot: which folder it loads, multi-turn prompts, streaming, commands, non-interactive use."""
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from conftest import REPO_ROOT
from crash_resume import step_env
from tiny_models import make_scripted_llama, make_tiny_model, make_tokenizer, save_model_also_stopping_at_endoftext

from inference.chatbot import (
    ChatSession,
    ReplyStreamer,
    SamplingOptions,
    chat,
    converse,
    resolve_chat_model,
)
from training.reliability.answer_limit import AnswerLimit
from utils.errors import EXIT_USER_ERROR, UserError

GREEDY = SamplingOptions(max_new_tokens=6, do_sample=False)
# How long a test waits for a chat it starts as a process: the chat's imports alone took 3.5 min on 2 cores beside a
# training run and other test jobs; a chat that ends is not waited on past its end.
CHAT_PROCESS_BOUND_S = 600


def session(prompt_format="auto", chat_template=True, options=GREEDY, tokenizer=None, system_prompt=None, limit=None):
    tokenizer = tokenizer or make_tokenizer(chat_template=chat_template)
    model, tokenizer = make_tiny_model("llama", tokenizer)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    model.resize_token_embeddings(len(tokenizer))
    return ChatSession(model.eval(), tokenizer, options, prompt_format, system_prompt, limit)


def scripted_session(tokenizer, successors: dict[str, str]) -> ChatSession:
    """A greedy chat with a one-layer Llama that answers by rule (`make_scripted_llama`)."""
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return ChatSession(make_scripted_llama(tokenizer, successors), tokenizer, GREEDY)


def test_run_folders_resolve_to_the_model_to_chat_with(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    pipeline = tmp_path / "runs"
    for sub in ("step3/actor", "step3/actor_ema", "step1/model"):
        shutil.copytree(model, pipeline / sub)
    assert resolve_chat_model(str(pipeline)) == str(pipeline / "step3" / "actor")
    assert resolve_chat_model(str(pipeline), ema=True) == str(pipeline / "step3" / "actor_ema")
    assert resolve_chat_model(str(pipeline / "step3")) == str(pipeline / "step3" / "actor")
    assert resolve_chat_model(str(pipeline / "step1")) == str(pipeline / "step1" / "model")
    assert resolve_chat_model(model) == model
    with pytest.raises(UserError, match="no EMA actor"):
        resolve_chat_model(str(pipeline / "step1"), ema=True)


def test_the_chatbot_refuses_a_prompt_format_the_tokenizer_cannot_render_before_the_model_loads(tiny_model_dir,
                                                                                                 monkeypatch):
    """--prompt_format chat_template for a tokenizer without a template was refused once the model had loaded."""
    from inference import chatbot

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(chatbot, "load_causal_lm", not_loaded)
    with pytest.raises(UserError, match="--prompt_format chat_template needs a tokenizer with a chat template"):
        chat(["--model", tiny_model_dir("llama", chat_template=False), "--prompt_format", "chat_template",
              "--prompt", "hi"])


@pytest.mark.parametrize("flags, message", [
    (["--prompt_format", "chat_template"], "--prompt_format chat_template needs a tokenizer with a chat template"),
    (["--prompts", "word " * 40, "--max_new_tokens", "4"], "that passes the model's 32 positions"),
], ids=["format", "length"])
def test_prompt_eval_refuses_the_fine_tuned_models_prompts_before_the_baseline_loads(tiny_model_dir, monkeypatch,
                                                                                     capsys, flags, message):
    """A prompt format or a prompt the fine-tuned model cannot take was refused only once the baseline had loaded and
    answered every prompt (here: the fine-tuned model has no chat template, and 32 positions)."""
    from step1_sft import prompt_eval

    baseline, finetune = tiny_model_dir("llama"), tiny_model_dir("opt", max_positions=32, chat_template=False)

    def not_loaded(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(prompt_eval, "load_for_generation", not_loaded)
    with pytest.raises(SystemExit) as exited:
        prompt_eval.main(["--model_name_or_path_baseline", baseline, "--model_name_or_path_finetune", finetune, *flags])
    assert exited.value.code == EXIT_USER_ERROR and message in capsys.readouterr().err


def test_prompt_eval_compares_against_a_step3_run_and_a_folder_without_a_model_is_one_error(tmp_path, tiny_model_dir,
                                                                                           capsys):
    """prompt_eval took only step 1's run folders: a step-3 run folder, like an unfinished run's folder (checkpoints,
    no saved model) or an empty one, ended in a tokenizer ValueError traceback; the chatbot too for the latter."""
    from step1_sft import prompt_eval

    model = tiny_model_dir("llama")
    shutil.copytree(model, tmp_path / "step3" / "actor")
    answers = prompt_eval.main(["--model_name_or_path_baseline", model, "--model_name_or_path_finetune",
                                str(tmp_path / "step3"), "--prompts", "Compute 3 + 4.", "--max_new_tokens", "3"])
    assert answers[0]["finetune"] == answers[0]["baseline"]  # the same weights, greedy
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    message = "unfinished holds no model (no config.json there, nor in its model/ folder)"
    for run in (lambda: prompt_eval.main(["--model_name_or_path_baseline", model, "--model_name_or_path_finetune",
                                          str(tmp_path / "unfinished"), "--prompts", "Compute 3 + 4."]),
                lambda: chat(["--model", str(tmp_path / "unfinished"), "--prompt", "hi"])):
        with pytest.raises((SystemExit, UserError)) as stopped:
            run()
        text = str(stopped.value) if stopped.type is UserError else capsys.readouterr().err
        assert message in text


def test_a_dpo_run_resolves_to_its_model(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    pipeline = tmp_path / "runs"  # train.py --algorithm dpo: step1/ and dpo/, no step3/
    for sub in ("step1/model", "dpo/model"):
        shutil.copytree(model, pipeline / sub)
    assert resolve_chat_model(str(pipeline)) == str(pipeline / "dpo" / "model")
    assert resolve_chat_model(str(pipeline / "dpo")) == str(pipeline / "dpo" / "model")


def test_prompt_eval_says_once_that_a_train_py_folder_holds_only_its_step1_model(tmp_path, tiny_model_dir, caplog):
    """prompt_eval resolved the fine-tuned folder twice (for its args.json, then to load it): the warning twice."""
    from step1_sft import prompt_eval

    model = tiny_model_dir("llama")
    shutil.copytree(model, tmp_path / "runs" / "step1" / "model")
    prompt_eval.main(["--model_name_or_path_baseline", model, "--model_name_or_path_finetune", str(tmp_path / "runs"),
                      "--prompts", "hi", "--max_new_tokens", "2"])
    assert caplog.text.count("holds no step-3 actor nor DPO model yet") == 1


def test_prompt_eval_reads_each_models_tokenizer_once(tiny_model_dir, monkeypatch):
    """prompt_eval read each model's tokenizer for its check of the prompts before either model loaded, then again to
    load the model: twice each."""
    from step1_sft import prompt_eval

    baseline, finetune = tiny_model_dir("llama"), tiny_model_dir("opt")
    read = []
    load_tokenizer = prompt_eval.load_tokenizer

    def counted(name, *args, **kwargs):
        read.append(name)
        return load_tokenizer(name, *args, **kwargs)

    monkeypatch.setattr(prompt_eval, "load_tokenizer", counted)
    prompt_eval.main(["--model_name_or_path_baseline", baseline, "--model_name_or_path_finetune", finetune,
                      "--prompts", "hi", "--max_new_tokens", "2"])
    assert read == [baseline, finetune]


def test_a_reward_model_is_refused(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    (tmp_path / "step2").mkdir()
    os.replace(model, tmp_path / "step2" / "model")
    (tmp_path / "step2" / "model" / "reward_model.json").write_text(json.dumps({"format": "rlhf-reward-model"}))
    with pytest.raises(UserError, match=r"reward model or critic \(step 2's model, step 3's critic/\)"):
        resolve_chat_model(str(tmp_path / "step2"))


def test_the_chat_renders_prompts_as_the_models_run_trained_on_them(tmp_path, tiny_model_dir):
    """A step-1 run trained with --prompt_format human_assistant (its args.json): chatting with its run folder or
    its model folder renders the conversation that way although the tokenizer has a chat template; a flag still
    wins, and a model no run trained takes auto."""
    from inference.chatbot import build_parser, load_session

    model = tiny_model_dir("llama")
    run = tmp_path / "step1"
    shutil.copytree(model, run / "model")
    (run / "args.json").write_text(json.dumps({"prompt_format": "human_assistant"}))

    def style(*argv: str) -> str:
        return load_session(build_parser().parse_args(["--path", *argv])).style

    assert style(model) == "chat_template"
    assert style(str(run)) == style(str(run / "model")) == "human_assistant"
    assert style(str(run), "--prompt_format", "chat_template") == "chat_template"


def test_prompt_eval_prompts_the_baseline_as_it_was_trained_not_as_the_fine_tuned_model(tmp_path, tiny_model_dir,
                                                                                          monkeypatch):
    """The fine-tuned model's run format (its args.json) was given to the baseline too: a run trained with
    --prompt_format human_assistant had its template-bearing baseline prompted in Human/Assistant text, and one trained
    with chat_template failed on a baseline whose tokenizer has no template, over a flag nobody passed. Now each model
    is prompted as its own run trained it (a model no run trained: auto), unless --prompt_format (both) or
    --baseline_prompt_format says otherwise."""
    from step1_sft import prompt_eval

    with_template, plain = tiny_model_dir("llama"), tiny_model_dir("gpt2", chat_template=False)
    formats = []
    answer = prompt_eval.generate_answers
    monkeypatch.setattr(prompt_eval, "generate_answers", lambda model, tokenizer, prompts, settings, prompt_format,
                        limit: formats.append(prompt_format) or answer(model, tokenizer, prompts, settings,
                                                                      prompt_format, limit))

    def formats_of(baseline: str, trained_as: str, *flags: str) -> list[str]:
        run = tmp_path / trained_as
        if not run.exists():
            shutil.copytree(with_template, run / "model")
            (run / "args.json").write_text(json.dumps({"prompt_format": trained_as}))
        formats.clear()
        prompt_eval.main(["--model_name_or_path_baseline", baseline, "--model_name_or_path_finetune", str(run),
                          "--prompts", "hi", "--max_new_tokens", "2", *flags])
        return formats

    assert formats_of(with_template, "human_assistant") == ["auto", "human_assistant"]
    assert formats_of(plain, "chat_template") == ["auto", "chat_template"]
    assert formats_of(with_template, "human_assistant", "--prompt_format", "chat_template") == ["chat_template"] * 2
    assert formats_of(with_template, "human_assistant", "--baseline_prompt_format", "human_assistant") == \
        ["human_assistant"] * 2
    assert formats_of(str(tmp_path / "human_assistant"), "chat_template") == ["human_assistant", "chat_template"]


def test_each_turn_sees_the_whole_conversation_in_the_chat_template():
    chat_session = session()
    first = chat_session.reply("hello world")
    chat_session.reply("how are you")
    prompt = chat_session.tokenizer.decode(chat_session._encode(chat_session.history)[0][0])
    assert prompt.startswith("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count("<|im_start|>user") == 2 and prompt.count("<|im_start|>assistant") == 3
    assert "<|im_start|>user\nhow are you<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert [turn["role"] for turn in chat_session.history] == ["user", "assistant", "user", "assistant"]
    assert chat_session.history[1]["content"] == first
    chat_session.clear()
    assert chat_session.history == []


def test_the_human_assistant_format_is_used_without_a_chat_template():
    chat_session = session(chat_template=False)
    assert chat_session.style == "human_assistant"
    chat_session.history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                            {"role": "user", "content": "bye"}]
    ids, _ = chat_session._encode(chat_session.history)
    assert chat_session.tokenizer.decode(ids[0]) == " Human: hi Assistant: yo Human: bye Assistant:"


def test_old_turns_are_dropped_when_the_context_is_full():
    chat_session = session()
    chat_session.model.config.max_position_embeddings = 160
    for index in range(8):
        chat_session.reply(f"tell me a joke number {index} please")
    ids, kept = chat_session._encode([*chat_session.history, {"role": "user", "content": "and number 8?"}])
    prompt = chat_session.tokenizer.decode(ids[0])
    assert ids.shape[1] <= 160 - GREEDY.max_new_tokens and kept[-1]["content"] == "and number 8?"
    assert "number 7" in prompt and "number 0" not in prompt and len(kept) < len(chat_session.history)


def test_a_message_that_does_not_fit_with_its_answer_is_refused_and_the_chat_goes_on():
    """The last message was cut from its start to fit the positions (losing the question, then the chat format), and
    a --max_new_tokens past the positions crashed generate with an IndexError."""
    chat_session = session()
    chat_session.model.config.max_position_embeddings = 60
    chat_session.reply("hello there")
    kept = list(chat_session.history)
    with pytest.raises(UserError, match=r"this message, with the system prompt and the chat format, is \d+ tokens; "
                                        r"with --max_new_tokens 6 that passes the model's 60 positions"):
        chat_session.reply("a long question " * 20)
    assert chat_session.history == kept  # taken back: the conversation goes on as it was
    out = io.StringIO()
    answers = converse(chat_session, ["word " * 80, "hi"], out)
    assert "(not answered: this message" in out.getvalue() and len(answers) == 1
    chat_session.limit = AnswerLimit(60)
    with pytest.raises(UserError, match="with --max_new_tokens 60 that passes the model's 60 positions"):
        chat_session.reply("hi")


def test_answers_stream_and_commands_work():
    chat_session = session()
    out = io.StringIO()
    answers = converse(chat_session, ["hello", "", "clear", "yes no maybe", "quit", "never answered"], out)
    text = out.getvalue()
    assert len(answers) == 2
    assert "Human: hello\nAssistant: " in text and "(conversation cleared)" in text
    assert "never answered" not in text
    assert answers[1] in text  # streamed to the output as generated
    assert len(chat_session.history) == 2  # cleared after the first exchange


@pytest.mark.parametrize("pieces", [[" Paris is nice.", " Human:", " more"], [" Paris is nice. Hu", "man: more"],
                                    [" Paris is nice. H", "uman", ":"]])
def test_the_stop_text_that_ends_a_reply_is_never_shown(pieces):
    """Generation stops after the text "Human:" (the Human/Assistant format): the user sees the reply before it,
    however the decoded pieces split it, and a tail that only looked like its start is shown in the end."""
    shown = []
    streamer = ReplyStreamer(session(chat_template=False).tokenizer, shown.append, "Human:")
    for index, piece in enumerate(pieces):
        streamer.on_finalized_text(piece, stream_end=index == len(pieces) - 1)
    assert "".join(shown) == " Paris is nice. " and streamer.reply() == " Paris is nice. "
    shown.clear()
    held = ReplyStreamer(session(chat_template=False).tokenizer, shown.append, "Human:")
    held.on_finalized_text(" I said H")
    assert "".join(shown) == " I said "
    held.on_finalized_text("", stream_end=True)
    assert "".join(shown) == " I said H"


def test_sampling_is_reproducible_with_a_seed_and_greedy_is_deterministic(tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    base = ["--path", model, "--prompt", "hello", "--prompt", "again", "--max_new_tokens", "5"]
    assert chat(base + ["--greedy"]) == chat(base + ["--greedy"])
    assert chat(base + ["--seed", "3", "--temperature", "1.5"]) == chat(base + ["--seed", "3", "--temperature", "1.5"])
    printed = capsys.readouterr().out
    assert printed.count("Human: hello") == 4 and printed.count("Human: again") == 4
    with pytest.raises(SystemExit):
        from inference.chatbot import main

        main(base + ["--temperature", "0"])


def test_the_chat_decodes_by_its_flags_alone_not_the_checkpoints_generation_config(tiny_model_dir, tmp_path):
    """A checkpoint's generation_config.json (suppress_tokens, no_repeat_ngram_size) joined the chatbot's flags:
    `--greedy` did not answer with the most likely tokens."""
    model = tiny_model_dir("llama")
    banning = tmp_path / "banning"
    shutil.copytree(model, banning)
    config_file = banning / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "suppress_tokens": list(range(3, 128)),
                                       "no_repeat_ngram_size": 1}))
    argv = ["--prompt", "hello", "--prompt", "again", "--max_new_tokens", "5", "--greedy"]
    assert chat(["--path", str(banning), *argv]) == chat(["--path", model, *argv])


def _printed(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _fail_unended(bound_s: float, stdout: bytes | str | None, stderr: bytes | str | None) -> NoReturn:
    pytest.fail(f"the chat did not end within {bound_s} s; it printed:\n{_printed(stdout)[-3000:]}\n"
                f"and on standard error:\n{_printed(stderr)[-3000:]}")


def run_chat_process(argv: list[str], bound_s: float = CHAT_PROCESS_BOUND_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` of a chat process from the repository's folder. One still running after `bound_s` (it hangs,
    or waits for input it never gets) is killed and fails the test with what it printed: TimeoutExpired named only
    the command."""
    try:
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, check=False, timeout=bound_s, **kwargs)
    except subprocess.TimeoutExpired as hung:
        _fail_unended(bound_s, hung.stdout, hung.stderr)


def _until_first_answer(child: subprocess.Popen, bound_s: float = CHAT_PROCESS_BOUND_S) -> tuple[bytes, bytes]:
    """What `child` (its output and error piped) printed to its output and error up to its first answer's line, or
    to its end. A chat that shows neither within `bound_s` is killed and fails the test with what it printed: a
    blocking readline waited for it without end."""
    printed, errors, deadline = b"", b"", time.monotonic() + bound_s
    open_streams = [child.stdout, child.stderr]
    while not re.search(rb"(?m)^Assistant: .*\n", printed):
        left_s = deadline - time.monotonic()
        ready = select.select(open_streams, [], [], left_s)[0] if left_s > 0 else []
        if not ready:
            child.kill()
            rest, more_errors = child.communicate()
            _fail_unended(bound_s, printed + rest, errors + more_errors)
        if child.stderr in ready:
            error_chunk = os.read(child.stderr.fileno(), 65536)
            errors += error_chunk
            if not error_chunk:  # closed: a stream at its end is always ready, and would keep the loop from waiting
                open_streams.remove(child.stderr)
        if child.stdout in ready:
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:  # it ended without an answer
                break
            printed += chunk
    return printed, errors


def _errors_once_ended(child: subprocess.Popen, given: bytes, bound_s: float = CHAT_PROCESS_BOUND_S) -> bytes:
    """`child`'s standard error once it ends, `given` on its input; one still running after `bound_s` is killed and
    fails the test with what it printed (to its output too, where that is still read)."""
    try:
        return child.communicate(given, timeout=bound_s)[1]
    except subprocess.TimeoutExpired:
        child.kill()
        _fail_unended(bound_s, *child.communicate())


def test_a_chat_process_that_never_answers_fails_its_test_at_the_bound_with_what_it_printed():
    """The subprocess tests' waits on a chat that hangs: a readline without a bound hung the suite, and
    subprocess.run's TimeoutExpired named the command alone."""
    hangs = [sys.executable, "-c", ("import sys, time; print('Human: loading', flush=True); "
                                    "print('stuck loading', file=sys.stderr, flush=True); time.sleep(120)")]
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)within 1 s; it printed:\nHuman: loading.*stuck loading"):
        run_chat_process(hangs, bound_s=1)
    for wait in (_until_first_answer, lambda child, bound_s: _errors_once_ended(child, b"hello\n", bound_s)):
        with subprocess.Popen(hangs, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
            with pytest.raises(pytest.fail.Exception, match=r"(?s)within 1 s; .*stuck loading"):
                wait(child, bound_s=1)
            assert child.poll() is not None
    assert time.monotonic() - started < 60


def test_a_chat_that_closes_its_error_output_and_hangs_fails_at_the_bound():
    """A closed stream is always ready to `select`: the wait read its end over and over, at full speed, never reaching
    the bound."""
    closes = [sys.executable, "-c", "import os, time; print('Human: loading', flush=True); os.close(2); time.sleep(60)"]
    failures = []

    def wait() -> None:
        with subprocess.Popen(closes, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
            try:
                _until_first_answer(child, bound_s=1)
            except pytest.fail.Exception as failed:
                failures.append(str(failed))
            finally:
                child.kill()

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(30)
    assert failures and "within 1 s; it printed:\nHuman: loading" in failures[0]

def test_prompts_on_standard_input_are_answered_in_a_subprocess(tiny_model_dir):
    model = tiny_model_dir("gpt2")
    result = run_chat_process(
        [sys.executable, "-m", "inference.chatbot", "--path", model, "--greedy", "--max_new_tokens", "4"],
        input="hello\nclear\nhow are you\nquit\nignored\n", env=step_env(), text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Assistant: ") == 2
    assert "(conversation cleared)" in result.stdout and "ignored" not in result.stdout


@pytest.mark.parametrize("tool, first_line", [
    (["-m", "inference.chatbot", "--prompt", "hello", "--greedy", "--path", "{model}"], "Human: hello\n"),
    (["step1_sft/prompt_eval.py", "--prompts", "hello", "--model_name_or_path_finetune", "{model}",
      "--model_name_or_path_baseline", "{model}"], "baseline "),
])
def test_scripted_output_holds_the_answers_alone_and_deepspeeds_warnings_go_to_stderr(tiny_model_dir, tool,
                                                                                       first_line):
    """DeepSpeed's logger writes to standard output, and on a machine without a GPU (DS_ACCELERATOR unset) warns
    'Setting accelerator to CPU' there as it is imported: that line came first in the output a script reads."""
    model = tiny_model_dir("gpt2")
    argv = [arg.format(model=model) for arg in tool]
    env = {key: value for key, value in step_env().items() if key != "DS_ACCELERATOR"}
    result = run_chat_process([sys.executable, *argv, "--max_new_tokens", "2"], env={**env, "CUDA_VISIBLE_DEVICES": ""},
                              text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(first_line), result.stdout[:300]
    assert "Setting accelerator to CPU" in result.stderr


def test_deepspeeds_records_move_to_stderr_also_from_a_stream_closed_under_them(monkeypatch, tmp_path):
    """A tool first imported in a test that captured its output left DeepSpeed's handler on that capture, closed
    after the test, and the next tool's import raised 'I/O operation on closed file' (rw_eval after prompt_eval in a
    narrow test run)."""
    import logging

    from deepspeed.utils import logger

    from utils.log import deepspeed_logs_to_stderr

    closed = (tmp_path / "captured.txt").open("w", encoding="utf-8")  # pytest's captured output is a file
    closed.close()
    handler = next(handler for handler in logger.handlers if type(handler) is logging.StreamHandler)
    monkeypatch.setattr(handler, "stream", closed)
    deepspeed_logs_to_stderr()
    assert handler.stream is sys.stderr


def test_a_line_that_is_not_utf8_text_is_refused_and_the_chat_goes_on(tiny_model_dir):
    """A Latin-1 'café' piped in ended the chat in a traceback: a UnicodeDecodeError where standard input decodes
    strictly (a UTF-8 locale), else the tokenizer's TypeError on the byte Python kept as a lone surrogate (as it
    keeps an argument's: the next test)."""
    model = tiny_model_dir("gpt2")
    result = run_chat_process(
        [sys.executable, "-m", "inference.chatbot", "--path", model, "--greedy", "--max_new_tokens", "4"],
        input="hello\ncafé\nhow are you\n".encode("latin-1"), env={**step_env(), "PYTHONIOENCODING": "utf-8:strict"})
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    printed = result.stdout.decode()
    assert "Human: caf\\udce9\nAssistant: (not answered: this message is not UTF-8 text (byte 0xe9 at character 4);" \
        in printed
    assert printed.count("Assistant: ") == 3 and printed.count("not answered") == 1


def test_a_message_or_system_prompt_that_is_not_utf8_text_is_one_error():
    """An argument in another encoding (--prompt, --system) reaches Python as lone surrogates, on which the tokenizer
    raised a TypeError."""
    with pytest.raises(UserError, match=r"--system is not UTF-8 text \(byte 0xe9 at character 4\)"):
        session(system_prompt="caf\udce9")
    chat_session = session()
    with pytest.raises(UserError, match=r"this message is not UTF-8 text \(byte 0xe9 at character 2\)"):
        chat_session.reply("p\udce9che")
    assert chat_session.history == []


def test_a_system_prompt_that_is_not_utf8_text_is_refused_before_the_model_loads(tiny_model_dir, monkeypatch):
    from inference import chatbot

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(chatbot, "load_causal_lm", not_loaded)
    with pytest.raises(UserError, match=r"--system is not UTF-8 text \(byte 0xe9 at character 4\)"):
        chat(["--model", tiny_model_dir("llama"), "--system", "caf\udce9", "--prompt", "hi"])


def test_a_reader_of_the_answers_that_leaves_ends_the_chat_without_a_traceback(tiny_model_dir):
    """`rlhf-chat < questions | head` ended in a BrokenPipeError traceback once head had its lines."""
    child = subprocess.Popen(
        [sys.executable, "-m", "inference.chatbot", "--path", tiny_model_dir("gpt2"), "--greedy", "--max_new_tokens",
         "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=step_env())
    child.stdin.write(b"hello\n")
    child.stdin.flush()
    printed, errors = _until_first_answer(child)
    child.stdout.close()  # the reader leaves after the first answer
    errors += _errors_once_ended(child, b"and again\n")
    assert re.search(rb"(?m)^Assistant: ", printed) and child.returncode == 141, errors.decode()[-3000:]
    assert b"Traceback" not in errors and b"BrokenPipeError" not in errors


@pytest.mark.parametrize("flags, message", [
    (["--repetition_penalty", "0"], "--repetition_penalty must be positive"),
    (["--top_k", "-1"], r"--top_k must be 0 \(all tokens\) or positive, got -1"),
    (["--top_p", "1.5"], r"--top_p must lie in \(0, 1\]"),
    (["--temperature", "0"], "--temperature must be positive when sampling"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be positive"),
    # nan passed `<= 0` (every comparison with nan is False) and reached generate
    (["--temperature", "nan"], "--temperature must be positive when sampling, got nan"),
    (["--repetition_penalty", "nan"], "--repetition_penalty must be positive"),
])
def test_sampling_flags_that_generate_would_refuse_or_ignore_are_user_errors(flags, message, tmp_path):
    """They ended in a transformers traceback (exit 1), and --top_p 1.5 was taken silently; checked before any model
    loads, by the chatbot and prompt_eval alike."""
    from step1_sft import prompt_eval

    with pytest.raises(UserError, match=message):
        chat(["--model", str(tmp_path / "no-model-needed"), *flags])
    with pytest.raises(SystemExit) as exited:
        prompt_eval.main(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b", "--do_sample",
                          *flags])
    assert exited.value.code == 2


@pytest.mark.parametrize("flag", ["--batch_size", "--num_beams"])
def test_prompt_evals_own_flags_are_checked_before_a_model_loads(flag, capsys):
    from step1_sft import prompt_eval

    with pytest.raises(SystemExit) as exited:
        prompt_eval.main(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b", flag, "0"])
    assert exited.value.code == 2 and f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_an_answer_ends_at_the_chat_templates_end_of_turn_token_where_the_eos_is_another():
    """Gemma's tokenizer (and Llama-3-Instruct's as first released) ends a turn in one special token and names
    another its EOS: the model, served as it is, wrote the end of its turn and the chat went on with the next turn's
    header, shown without its special tokens (SmolLM2-135M-Instruct with its base tokenizer's EOS: "The capital of
    France is Paris.\\nsystem\\nProvide a concise, ..."). The answer ends at the token the template writes after a
    reply, where a model this project tuned on that template ends its answers too (tests/test_end_of_turn.py)."""
    tokenizer = make_tokenizer()
    tokenizer.eos_token = "<|endoftext|>"
    chat_session = scripted_session(tokenizer, {"Ċ": "H", "H": "<|im_end|>", "<|im_end|>": "<|im_start|>",
                                                "<|im_start|>": "u", "u": "u"})
    shown = []
    assert chat_session.reply("hello", shown.append) == "H" and "".join(shown) == "H"
    assert chat_session.history[-1] == {"role": "assistant", "content": "H"}
    ids = tokenizer.convert_tokens_to_ids
    assert chat_session.stop_token_ids == [ids("<|endoftext|>"), ids("<|im_end|>")]
    tokenizer.eos_token = "<|im_end|>"  # the turn ends in the EOS (ChatML's), and without a template in the EOS alone
    chat_session.model.generation_config.eos_token_id = ids("<|im_end|>")
    assert ChatSession(chat_session.model, tokenizer, GREEDY).stop_token_ids == [ids("<|im_end|>")]
    assert ChatSession(chat_session.model, tokenizer, GREEDY, "human_assistant").stop_token_ids == [ids("<|im_end|>")]


def test_an_answer_ends_at_every_id_the_models_generation_config_stops_at(tmp_path):
    """Qwen2.5-Instruct's generation_config.json stops at <|endoftext|> beside its tokenizer's <|im_end|> EOS
    (Llama-3.1-Instruct's at <|eom_id|> too), as transformers' generate does: the chat stopped at the formatter's
    ids alone and went on past that token (hidden, as special) with whatever the model wrote next."""
    folder = save_model_also_stopping_at_endoftext(tmp_path / "instruct")
    argv = ["--path", str(folder), "--greedy", "--repetition_penalty", "1.0", "--max_new_tokens", "5"]
    assert chat([*argv, "--prompt", "hello"]) == ["H"]


@pytest.mark.parametrize("prompt_format", ["chat_template", "human_assistant"])
def test_each_turns_prompt_is_the_prompt_training_tokenised_for_that_conversation(prompt_format):
    """The second turn's input ids, with a system prompt, are those step 1 trains on for the same turns (its
    tokenisation of the PromptFormatter's prompt), and the answer is shown as training wrote it."""
    from utils.data.formatting import PromptFormatter
    from utils.data.samples import Sample
    from utils.data.tokenization import IGNORE_INDEX, TokenLimits, tokenize_samples

    chat_session = session(prompt_format, system_prompt="Be brief.")
    chat_session.reply("hello world")
    message = {"role": "user", "content": "how are you"}
    ids, _ = chat_session._encode([*chat_session.history, message])
    turns = [{"role": "system", "content": "Be brief."}, *chat_session.history, message]
    item = tokenize_samples([Sample(turns=turns, chosen="fine", rejected=None)], "sft",
                            PromptFormatter(chat_session.tokenizer, prompt_format), chat_session.tokenizer,
                            TokenLimits(max_seq_len=512))[0]
    prompt_length = int((item["labels"] == IGNORE_INDEX).sum())
    assert ids[0].tolist() == item["input_ids"][:prompt_length].tolist()


def test_a_chat_template_that_refuses_the_system_prompt_is_one_error_at_the_start():
    """Gemma's template raises for a system message: --system ended the chat in a jinja traceback at the first
    message."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}" + tokenizer.chat_template)
    with pytest.raises(UserError, match=r"the chat template cannot render this conversation with --system "
                                        r"\(TemplateError: System role not supported\)"):
        session(tokenizer=tokenizer, system_prompt="Be brief.")
    assert session(tokenizer=tokenizer).reply("hi") is not None


class CtrlCAtTheFirstAnswer(io.StringIO):
    """An output whose first write of an answer's text is followed by Ctrl-C, as when the user presses it while
    the model answers."""

    def __init__(self):
        super().__init__()
        self.pressed = False

    def write(self, text: str) -> int:
        written = super().write(text)
        if not self.pressed and text.strip() and self.getvalue()[:-len(text)].endswith("Assistant: "):
            self.pressed = True
            raise KeyboardInterrupt
        return written


def test_ctrl_c_while_the_model_answers_stops_that_answer_and_the_chat_goes_on():
    """Ctrl-C during an answer ended the chat in a traceback through generate, the conversation lost. Interactive,
    it stops the answer: the conversation keeps what was shown of it, and the next message is answered. In a
    scripted conversation it still ends the run."""
    tokenizer = make_tokenizer()
    chat_session = scripted_session(tokenizer, {"Ċ": "H", "H": "i", "i": "<|im_end|>"})
    out = CtrlCAtTheFirstAnswer()
    try:
        answers = converse(chat_session, ["hello", "again"], out, interactive=True)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during an answer ended the chat")
    shown, rest = out.getvalue().removeprefix("Assistant: ").split(" (stopped)\n\n")
    assert out.pressed and answers == ["Hi"] and rest == "Assistant: Hi\n\n"
    assert shown and "Hi".startswith(shown)  # the answer's first piece, then Ctrl-C
    assert [turn["content"] for turn in chat_session.history] == ["hello", shown, "again", "Hi"]
    kept = list(chat_session.history)
    with pytest.raises(KeyboardInterrupt):
        converse(chat_session, ["hello", "again"], CtrlCAtTheFirstAnswer())
    assert chat_session.history[:4] == kept and len(chat_session.history) == 6

    def pressed_before_the_first_token(*args, **kwargs):
        raise KeyboardInterrupt

    chat_session.model.forward = pressed_before_the_first_token
    out = io.StringIO()
    assert converse(chat_session, ["more"], out, interactive=True) == []
    # nothing shown, nothing kept
    assert out.getvalue() == "Assistant: (stopped)\n\n" and len(chat_session.history) == 6


@pytest.mark.parametrize("key", [EOFError, KeyboardInterrupt])
def test_ctrl_d_or_ctrl_c_at_the_prompt_ends_the_chat_on_a_line_of_its_own(key, monkeypatch, capsys):
    """Ctrl-C at the prompt ended in a traceback, and after Ctrl-D the shell's prompt followed "Human: " on its
    line."""
    from inference.chatbot import _interactive_lines

    typed = iter(["hello"])

    def terminal(prompt: str) -> str:
        print(prompt, end="")
        try:
            return next(typed)
        except StopIteration:
            raise key from None

    monkeypatch.setattr("builtins.input", terminal)
    assert list(_interactive_lines()) == ["hello"]
    assert capsys.readouterr().out.endswith("Human: Human: \n")


def test_ctrl_c_that_ends_a_scripted_chat_exits_130_without_a_traceback(tiny_model_dir, monkeypatch, capsys):
    from inference.chatbot import main

    def pressed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ChatSession, "reply", pressed)
    with pytest.raises(SystemExit) as exited:
        main(["--path", tiny_model_dir("llama"), "--prompt", "hi"])
    assert exited.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_a_file_passed_for_the_model_is_one_error(tiny_model_dir):
    """A run's args.json ended in a traceback (transformers read it as a model's config: "AttributeError: module
    'torch' has no attribute 'bf16'" from its --dtype), a model's config.json or weights in a misleading "could not
    load the tokenizer from ...: Repo id must be in the form 'repo_name' ..." or "...: It looks like the config
    file at ... is not a valid JSON file"."""
    model = tiny_model_dir("llama")
    (Path(model) / "args.json").write_text(json.dumps({"dtype": "bf16", "prompt_format": "auto"}))
    for name in ("args.json", "config.json", "model.safetensors"):
        with pytest.raises(UserError, match=f"{model}/{name} is a file; pass the folder that holds the model "
                                            rf"\({model}\) or a run folder"):
            chat(["--path", f"{model}/{name}", "--prompt", "hi"])


def test_a_model_folder_without_a_tokenizer_and_a_lora_adapter_alone_are_one_error_each(tmp_path, tiny_model_dir):
    """A model folder without its tokenizer's files ended in transformers' ValueError traceback ("Couldn't
    instantiate the backend tokenizer ... install sentencepiece"); a PEFT adapter folder whose base model does not
    load was "holds no model (...): a run that has not saved its model yet"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = Path(tiny_model_dir("llama"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare)
    with pytest.raises(UserError, match="bare holds a model but no tokenizer .*copy its files from the model it was"):
        chat(["--path", str(bare), "--prompt", "hi"])
    moved = tmp_path / "moved-base"
    shutil.copytree(model, moved)
    get_peft_model(AutoModelForCausalLM.from_pretrained(moved), LoraConfig(r=2)).save_pretrained(tmp_path / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, tmp_path / "adapter")
    shutil.rmtree(moved)
    with pytest.raises(UserError, match=f"adapter holds a LoRA adapter, not a whole model: it loads only over its base "
                                        f"model '{moved}' .*its model did not load"):
        chat(["--path", str(tmp_path / "adapter"), "--prompt", "hi"])


def test_auto_dtype_is_the_dtype_a_run_trained_its_model_in(tmp_path, tiny_model_dir, monkeypatch):
    """`--dtype auto`, every tool's default, took the device's best: on a CPU with bf16 instructions a model its run
    trained and evaluated in fp32 answered in bf16 (other greedy answers than its run's)."""
    import torch

    from inference.chatbot import build_parser, load_session
    from training.core import model_loading

    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: True)  # "auto" is bf16 on this device
    model = tiny_model_dir("llama")  # saved in fp32
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        shutil.copytree(model, run / "model")
        (run / "args.json").write_text(json.dumps({"dtype": dtype}))
    model_loading.load_causal_lm(model, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16" / "model")

    def dtype(path: str, *argv: str) -> torch.dtype:
        return load_session(build_parser().parse_args(["--path", path, *argv])).model.dtype

    assert dtype(str(tmp_path / "fp32")) == torch.float32
    assert dtype(str(tmp_path / "bf16")) == torch.bfloat16
    assert dtype(model) == torch.bfloat16  # no run saved it: the device's best
    assert dtype(str(tmp_path / "fp32"), "--dtype", "bf16") == torch.bfloat16


def _answer_budgets(path: str, messages: Sequence[str], *flags: str) -> list[tuple[int, int]]:
    """(prompt tokens, max_new_tokens) of each message's generate, in one chat with the model at `path`."""
    from inference.chatbot import build_parser, load_session

    chat_session = load_session(build_parser().parse_args(["--path", path, "--greedy", *flags]))
    calls, generate = [], chat_session.model.generate

    def recording(**kwargs):
        calls.append((kwargs["input_ids"].shape[1], kwargs["max_new_tokens"]))
        return generate(**kwargs)

    chat_session.model.generate = recording
    for message in messages:
        chat_session.reply(message)
    return calls


def test_the_chat_answers_as_long_as_the_models_run_let_answers_be(tmp_path, tiny_model_dir):
    """The chatbot's --max_new_tokens was 128 whatever the run, defined apart from prompt_eval's: a step-3 actor
    trained to answer within --max_answer_seq_len ran on past it. Unset, it follows the run as prompt_eval does
    (`answer_limit`); given, it wins; under a step-1 run's --max_seq_len the conversation and its answer share the
    window, the oldest exchanges dropped when the conversation leaves no room."""
    model = tiny_model_dir("llama")
    runs = {"step3": {"max_seq_len": 512, "max_answer_seq_len": 3}, "step1": {"max_seq_len": 40}}
    for name, record in runs.items():
        shutil.copytree(model, tmp_path / name / "model")
        (tmp_path / name / "args.json").write_text(json.dumps(record))

    def budgets(path: str, *flags: str) -> list[tuple[int, int]]:
        return _answer_budgets(path, ("hello", "how are you", "tell me a joke"), *flags)

    assert [budget for _, budget in budgets(str(tmp_path / "step3"))] == [3, 3, 3]
    assert [budget for _, budget in budgets(str(tmp_path / "step3"), "--max_new_tokens", "5")] == [5, 5, 5]
    assert [budget for _, budget in budgets(model, "--max_new_tokens", "4")] == [4, 4, 4]
    window = budgets(str(tmp_path / "step1"))
    assert all(prompt + budget == 40 for prompt, budget in window), window
    assert SamplingOptions().max_new_tokens is None  # one default, prompt_eval's: `answer_limit`


def test_a_chat_in_a_window_leaves_out_old_exchanges_before_the_answer_gets_short():
    """Under a step-1 run's --max_seq_len the oldest exchanges were dropped only when no room at all was left: each
    answer got what the conversation left of the window, down to a few tokens (17 of 200 here). They are now
    dropped while an answer would get less than half the window; one that leaves that room is kept."""
    chat_session = session()
    chat_session.limit = AnswerLimit(200, 200, source="its run's --max_seq_len")
    exchange = [{"role": "user", "content": "question"}, {"role": "assistant", "content": " ".join(["story"] * 5)}]
    message = [{"role": "user", "content": "and then"}]
    for earlier, kept in ((2, 1), (1, 1), (0, 0)):
        ids, history = chat_session._encode(exchange * earlier + message)
        assert history == exchange * kept + message
        assert chat_session.limit.after(ids.shape[1]) >= 100, ids.shape


def test_a_system_prompt_that_leaves_no_room_is_refused_at_the_start():
    """A --system too long for the window was kept, and every message refused in turn, each told to shorten itself."""
    window = AnswerLimit(6, 40, source="its run's --max_seq_len")
    with pytest.raises(UserError, match=r"--system, with the chat format and a one-word message, is \d+ tokens, which "
                                        r"leaves no room for an answer within the 40 tokens"):
        session(system_prompt="You are a helpful assistant. " * 10, limit=window)
    assert session(system_prompt="Be brief.", limit=AnswerLimit(6, 200)).reply("hi") is not None


def test_a_conversation_cut_to_fit_says_so_after_the_answer():
    """The oldest exchanges were dropped to fit the model's positions without a word: the model seemed to forget the
    start of the conversation."""
    chat_session = session()
    chat_session.model.config.max_position_embeddings = 60
    out = io.StringIO()
    converse(chat_session, ["hello there my friend", "how are you today"], out)
    first, second = out.getvalue().split("Human: ")[1:]
    assert "left out" not in first
    assert second.endswith("\n(the oldest exchange was left out of the conversation to leave room for this answer; "
                           "'clear' starts a new one)\n\n")
    assert [turn["role"] for turn in chat_session.history] == ["user", "assistant"]
    assert chat_session.history[0]["content"] == "how are you today"


def test_an_answer_cut_at_the_length_limit_says_so_after_it():
    """An answer that ran into --max_new_tokens stopped mid-word without a word, and read as complete. One that ends
    at a stop token or the stop text on the limit's last token is not cut."""
    tokenizer = make_tokenizer()

    def printed(successors: dict[str, str], prompt_format: str = "auto", limit: int = 6) -> str:
        scripted = scripted_session(tokenizer, successors)
        chat_session = ChatSession(scripted.model, tokenizer, GREEDY, prompt_format, limit=AnswerLimit(limit))
        out = io.StringIO()
        converse(chat_session, ["hello"], out)
        return out.getvalue()

    assert printed({"Ċ": "H", "H": "u", "u": "u"}).endswith(
        "Assistant: Huuuuu\n(the answer was cut at the limit of 6 tokens; --max_new_tokens raises it)\n\n")
    assert printed({"Ċ": "a", "a": "b", "b": "c", "c": "d", "d": "e", "e": "<|im_end|>"}).endswith(
        "Assistant: abcde\n\n")
    ok_then_human = {":": "O", "O": "k", "k": "Ġ", "Ġ": "H", "H": "u", "u": "m", "m": "a", "a": "n", "n": ":"}
    assert printed(ok_then_human, "human_assistant", limit=9).endswith("Assistant: Ok \n\n")
    assert printed(ok_then_human, "human_assistant", limit=8).endswith(
        "Assistant: Ok Human\n(the answer was cut at the limit of 8 tokens; --max_new_tokens raises it)\n\n")


def test_the_repetition_penalty_spares_the_ids_an_answer_stops_at():
    """transformers' repetition penalty divides the positive logit of every id the input holds by it, and a chat
    prompt holds the template's end-of-turn token after each message (<|im_end|>, SmolLM2-Instruct's EOS): under the
    chatbot's default 1.1 every answer was less likely to end, and ran on. Here the model ends its answer 'H' at
    <|im_end|>, 'x' a close second: penalised, the end fell below it and the answer ran on to 'Hx'. The penalty now
    spares the ids an answer stops at; other ids the conversation holds are penalised as before."""
    tokenizer = make_tokenizer()
    scripted = scripted_session(tokenizer, {"Ċ": "H", "H": "<|im_end|>"})
    ids = tokenizer.convert_tokens_to_ids
    head = scripted.model.lm_head.weight
    with torch.no_grad():
        head[ids("x"), ids("H")] = 0.95 * head[ids("<|im_end|>"), ids("H")]
    options = SamplingOptions(max_new_tokens=3, do_sample=False)
    assert options.repetition_penalty == 1.1  # the chatbot's default
    assert ChatSession(scripted.model, tokenizer, options).reply("hello") == "H"

    from transformers import RepetitionPenaltyLogitsProcessor

    from training.generation.generator import RepetitionPenaltySparingStops

    prompt = torch.tensor([[ids("<|im_end|>"), ids("h"), ids("<|im_end|>")]])
    scores = torch.full((1, len(tokenizer)), 2.0)
    scores[0, ids("h")] = -2.0
    penalised = RepetitionPenaltySparingStops(1.1, [ids("<|im_end|>")])(prompt, scores.clone())
    assert RepetitionPenaltyLogitsProcessor(1.1)(prompt, scores.clone())[0, ids("<|im_end|>")] < 2.0
    assert penalised[0, ids("<|im_end|>")] == 2.0 and penalised[0, ids("h")] == pytest.approx(-2.2)
    untouched = torch.ones_like(scores, dtype=torch.bool)
    untouched[0, ids("h")] = False
    assert torch.equal(penalised[untouched], scores[untouched])


def _messages_typed_on_a_terminal(keys: bytes, typed_ahead: bytes = b"", then: bytes = b"",
                                  readline: bool = True) -> str:
    """What the chat's prompt shows on a terminal where `typed_ahead` waits before the chat starts (lines typed while
    an answer streamed), `keys` arrive at once at its first "Human: " that waits for them, `then` once the terminal is
    quiet after them with no new prompt (the Enter that ends a paste's last line), Ctrl-D at the next prompt: each
    message it reads printed as MESSAGE 'text', until a quit command. Without `readline`, the chat's Python has no
    readline module (plain `input`)."""
    pty = pytest.importorskip("pty")

    child, terminal = pty.fork()
    if child == 0:  # the chat's prompt on a terminal
        os.chdir(REPO_ROOT)
        messages = (("" if readline else "import sys; sys.modules['readline'] = None\n") +
                    "from inference.chatbot import QUIT_COMMANDS, _interactive_lines\n"
                    "for message in _interactive_lines():\n"
                    "    print('MESSAGE', repr(message), flush=True)\n"
                    "    if message.strip().lower() in QUIT_COMMANDS: break")
        os.execve(sys.executable, [sys.executable, "-c", messages], step_env())
    os.write(terminal, typed_ahead)
    shown, deadline, answered, closed = b"", time.monotonic() + CHAT_PROCESS_BOUND_S, [], False
    while not closed and time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.2)[0]:
            try:
                read = os.read(terminal, 4096)
            except OSError:  # the child exited: its terminal closed
                read = b""
            shown, closed = shown + read, not read
        elif shown.endswith(b"Human: ") and len(shown) not in answered:  # a prompt quiet for 0.2 s waits for keys
            os.write(terminal, b"\x04" if answered else keys)
            answered.append(len(shown))
        elif then and answered:  # quiet after the keys, and no new prompt: they left a line without its Enter
            os.write(terminal, then)
            then = b""
    return _what_the_ended_chat_showed(child, shown.decode(errors="replace"), closed)


def _what_the_ended_chat_showed(child: int, shown: str, closed: bool) -> str:
    """`shown` once the chat's process `child` is reaped (killed if its terminal is still open: past the bound); a
    chat that did not end, or ended in an error, fails the test with what it showed."""
    import signal

    if not closed:
        os.kill(child, signal.SIGKILL)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if not closed:
        pytest.fail(f"the chat's prompt did not end within {CHAT_PROCESS_BOUND_S} s; it showed:\n{shown}")
    if status != 0:
        pytest.fail(f"the chat's prompt ended with status {status}; it showed:\n{shown}")
    return shown


def test_the_prompt_edits_its_line_as_a_shell_does():
    """`input` without readline took the keys as typed: 'helo', a left arrow and 'l' was the message 'helo\\x1b[Dl'."""
    shown = _messages_typed_on_a_terminal(b"helo\x1b[Dl\r")
    assert "MESSAGE 'hello'" in shown, shown


def test_lines_pasted_at_once_are_one_message():
    """A paste of three lines was three messages, each answered before the next was read."""
    shown = _messages_typed_on_a_terminal(b"Why does this fail?\r\rx = 1 +\rprint(x)\r")
    assert shown.count("MESSAGE") == 1, shown
    assert "MESSAGE 'Why does this fail?\\n\\nx = 1 +\\nprint(x)'" in shown, shown


@pytest.mark.parametrize("readline", [pytest.param(True, id="readline"), pytest.param(False, id="plain_input")])
def test_a_pasted_last_line_without_its_newline_joins_the_message_at_its_enter(readline):
    """A paste copied without its last newline leaves that line on the terminal until the Enter. With plain `input`
    (a Python without readline) the terminal held that line back from the check for more pasted lines: the lines
    before it were answered alone, and it became a message of its own."""
    shown = _messages_typed_on_a_terminal(b"Why does this fail?\rx = 1 +\rprint(x)", then=b"\r", readline=readline)
    assert shown.count("MESSAGE") == 1, shown
    assert "MESSAGE 'Why does this fail?\\nx = 1 +\\nprint(x)'" in shown, shown


def test_lines_typed_ahead_while_an_answer_streams_are_a_message_each():
    """Lines typed during an answer wait on the terminal before the next prompt: they were joined as a paste, a
    typed-ahead 'quit' sent to the model with the question before it instead of ending the chat."""
    shown = _messages_typed_on_a_terminal(b"\x04", typed_ahead=b"what is 2+2?\rquit\r")
    assert "MESSAGE 'what is 2+2?'" in shown and "MESSAGE 'quit'" in shown and shown.count("MESSAGE") == 2, shown


def test_only_a_terminal_has_pasted_lines_waiting():
    """/dev/null, always readable, had a line waiting after every message: under `pytest -s < /dev/null` a typed
    message waited for a next line that ended the chat and lost it."""
    from inference.chatbot import _input_waiting

    with open(os.devnull) as devnull:
        assert not _input_waiting(devnull, 0.0)
