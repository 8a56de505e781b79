"""Step 1 (SFT): the loss covers answer tokens only, and `main` runs end to end on a tiny model."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from supervised_data import arithmetic_rows, build_phase_datasets, write_arithmetic_jsonl
from tiny_models import make_tiny_model, make_tiny_model_dir, make_tokenizer, save_model_also_stopping_at_endoftext
from transformers import AutoModelForCausalLM, set_seed

from step1_sft import prompt_eval
from step1_sft.main import main
from step1_sft.objective import evaluate_perplexity, predicted_token_count, sft_loss
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.generation.generator import DEFAULT_MAX_NEW_TOKENS
from training.loops.metrics import read_metrics
from utils.data import SFTCollator
from utils.errors import UserError


def _args(model_dir, data, tmp_path, *extra):
    return [
        "--model_name_or_path", model_dir, "--data_path", data, "--data_split", "1,1,0",
        "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "run"),
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3",
        "--dtype", "fp32", "--max_seq_len", "64", "--log_interval", "1", *extra,
    ]


def _logit_grads(model_dir, data, tmp_path, whole_sequence_loss):
    """Gradient of `sft_loss` w.r.t. the logits, and the labels, of one collated batch of the real data path."""
    tokenizer = load_tokenizer(model_dir)
    train, _ = build_phase_datasets(1, [data], "1,1,0", tokenizer, 64, 1234, str(tmp_path / f"cache{whole_sequence_loss}"),
                                    whole_sequence_loss=whole_sequence_loss)
    batch = SFTCollator(tokenizer.pad_token_id)([train[i] for i in range(4)])
    model = load_causal_lm(model_dir, tokenizer)
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    model.get_output_embeddings().register_forward_hook(keep_logits)
    sft_loss(model, batch).backward()
    # logits at position t predict token t + 1
    return captured["logits"].grad[:, :-1].abs().sum(-1), batch["labels"][:, 1:], batch, tokenizer


def test_prompt_tokens_carry_no_loss_and_the_answer_ends_with_eos(tiny_model_dir, tmp_path):
    model_dir, data = tiny_model_dir("llama"), write_arithmetic_jsonl(tmp_path / "d.jsonl")
    grads, next_labels, batch, tokenizer = _logit_grads(model_dir, data, tmp_path, whole_sequence_loss=False)
    predicts_prompt = next_labels == -100
    assert predicts_prompt.any() and (~predicts_prompt).any()
    assert torch.all(grads[predicts_prompt] == 0)
    assert torch.all(grads[~predicts_prompt] > 0)
    for row, mask in zip(batch["labels"], batch["attention_mask"]):
        answer = row[row != -100]
        assert answer[-1] == tokenizer.eos_token_id
        assert row[0] == -100 and len(answer) < int(mask.sum())

    whole_grads, whole_labels, _, _ = _logit_grads(model_dir, data, tmp_path, whole_sequence_loss=True)
    real = whole_labels != -100  # everything but padding
    assert torch.all(whole_grads[real] > 0)


def test_held_out_tokens_are_counted_as_the_loss_predicts_them_with_the_whole_sequence_labelled():
    """With --whole_sequence_loss position 0 carries a label, but nothing predicts it: a batch counts the tokens its
    loss averages over, and the held-out loss of a 3- and a 9-token batch, weighted by those counts, is that of the
    two rows in one batch (counting position 0 weighed them 3:9 instead of 2:8)."""
    model, _ = make_tiny_model("llama")
    model.eval()
    rows = [torch.arange(5, 8), torch.arange(20, 29)]
    items = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in rows]
    collate = SFTCollator(pad_token_id=0)
    short, long = collate(items[:1]), collate(items[1:])
    assert (predicted_token_count(short["labels"]), predicted_token_count(long["labels"])) == (2, 8)

    held_out = evaluate_perplexity(model, [short, long])
    with torch.no_grad():
        together = sft_loss(model, collate(items)).item()
    assert held_out["tokens"] == 10
    assert held_out["loss"] == pytest.approx(together, rel=1e-5)


def test_main_trains_evaluates_and_saves_a_loadable_model(distributed, tiny_model_dir, tmp_path):
    model_dir, data = tiny_model_dir("llama"), write_arithmetic_jsonl(tmp_path / "d.jsonl")
    summary = main(_args(model_dir, data, tmp_path, "--num_train_epochs", "2"))
    run = tmp_path / "run"
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["eval_perplexity_after"] < 0.7 * summary["eval_perplexity_before"]
    assert summary["epochs_completed"] == 2 and summary["optimizer_steps"] == 2 * 6  # 22 items / batch 4
    records = read_metrics(run)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == summary["optimizer_steps"] and losses[-1] < losses[0]
    assert [r["step"] for r in records if "eval/perplexity" in r] == [0, 6, 12]  # before, after each epoch
    assert (run / "args.json").is_file() and any((run / "tensorboard").iterdir())
    model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    assert load_tokenizer(str(run)).pad_token_id is not None
    assert model.config.eos_token_id == load_tokenizer(str(run)).eos_token_id

    answers_file = tmp_path / "answers.jsonl"
    rows = prompt_eval.main(["--model_name_or_path_baseline", model_dir, "--model_name_or_path_finetune", str(run),
                             "--prompts", "What is 2 plus 3?", "What is 4 plus 1?", "--max_new_tokens", "6",
                             "--output_file", str(answers_file), "--dtype", "fp32"])
    assert [row["prompt"] for row in rows] == ["What is 2 plus 3?", "What is 4 plus 1?"]
    assert all(row["finetune"] and row["finetune"] != row["baseline"] for row in rows)
    assert [json.loads(line) for line in answers_file.read_text().splitlines()] == rows


# ZeRO-3 with the base weights trained too refused peft's fp32 adapters beside them (AssertionError at initialize)
@pytest.mark.parametrize("stage,only_lora", [(2, True), (3, False)])
def test_lora_bf16_gradient_checkpointing_saves_a_merged_model(distributed, tiny_model_dir, tmp_path, stage,
                                                               only_lora):
    model_dir, data = tiny_model_dir("gpt2"), write_arithmetic_jsonl(tmp_path / "d.jsonl", 16)
    summary = main(_args(model_dir, data, tmp_path, "--dtype", "bf16", "--zero_stage", str(stage), "--lora_dim", "4",
                         "--lora_module_name", "h.", *(["--only_optimize_lora"] if only_lora else []),
                         "--gradient_checkpointing",
                         "--gradient_accumulation_steps", "2", "--max_steps", "1", "--disable_dropout"))
    assert summary["optimizer_steps"] == 1 and summary["dtype"] == "bf16"
    weights = load_file(f"{summary['model_dir']}/model.safetensors")
    assert not any("lora" in key for key in weights)
    base = load_file(f"{model_dir}/model.safetensors")
    changed = [key for key in base if key in weights and not torch.equal(base[key], weights[key].to(base[key].dtype))]
    assert any(".attn." in key for key in changed)  # the adapters were folded into the attention weights


def test_prompt_eval_renders_prompts_as_the_fine_tuned_models_run_trained_on_them(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    run = tmp_path / "step1"
    shutil.copytree(model, run / "model")
    (run / "args.json").write_text(json.dumps({"prompt_format": "human_assistant"}))

    def prompt_format(finetune: str, *argv: str) -> str:
        return prompt_eval.parse_args(["--model_name_or_path_finetune", finetune, *argv]).run.prompt_format

    assert prompt_format(str(run)) == prompt_format(str(run / "model")) == "human_assistant"
    assert prompt_format(str(run), "--prompt_format", "chat_template") == "chat_template"
    assert prompt_format(model) == "auto"


def test_prompt_eval_reads_a_prompts_file_as_utf8_text(tmp_path):
    """A Windows editor's byte-order mark went into the first prompt (U+FEFF before its text), and a Latin-1 file
    ended in a UnicodeDecodeError traceback."""
    def prompts_of(data: bytes) -> list[str]:
        path = tmp_path / "prompts.txt"
        path.write_bytes(data)
        return prompt_eval.read_prompts(prompt_eval.PromptEvalArguments("run", prompts_file=str(path)))

    assert prompts_of("\ufeffHow are you?\r\nCaf\u00e9?\n\n".encode()) == ["How are you?", "Caf\u00e9?"]
    with pytest.raises(UserError, match=r"prompts.txt is not UTF-8 text: its byte 3 \(0xe9\)"):
        prompts_of("Caf\u00e9?\n".encode("latin-1"))


def test_prompt_eval_samples_when_asked(tmp_path):
    model, tokenizer = make_tiny_model("opt", make_tokenizer(with_pad=True))
    settings = prompt_eval.GenerationSettings(max_new_tokens=5, do_sample=True, top_k=20, batch_size=2)
    answers = {
        seed: (set_seed(seed), prompt_eval.generate_answers(model, tokenizer, ["hello", "a", "b"], settings))[1]
        for seed in (1, 2)
    }
    assert all(len(a) == 3 for a in answers.values()) and answers[1] != answers[2]
    settings.do_sample = False
    greedy = [prompt_eval.generate_answers(model, tokenizer, ["hello"], settings) for _ in range(2)]
    assert greedy[0] == greedy[1]


def test_prompt_eval_answers_end_at_every_id_the_models_generation_config_stops_at(tmp_path):
    """Qwen2.5-Instruct's generation_config.json stops at <|endoftext|> beside its tokenizer's <|im_end|> EOS
    (Llama-3.1-Instruct's at <|eom_id|> too), where transformers' generate and the chatbot stop: prompt_eval stopped
    at the formatter's ids alone and went on past that token (hidden, as special): 'Huuu' for the chatbot's 'H'."""
    folder = save_model_also_stopping_at_endoftext(tmp_path / "instruct")
    rows = prompt_eval.main(["--model_name_or_path_baseline", str(folder), "--model_name_or_path_finetune",
                             str(folder), "--prompts", "hello", "--max_new_tokens", "5", "--dtype", "fp32"])
    assert rows == [{"prompt": "hello", "baseline": "H", "finetune": "H", "baseline_cut_at": None,
                     "finetune_cut_at": None}]


@pytest.mark.parametrize("side", ["left", "right"])
def test_prompt_eval_leaves_the_tokenizer_padding_on_the_side_it_found(side, monkeypatch):
    """generate_answers padded on the left, then always set the tokenizer to the right: a tokenizer that came on the
    left went back on the right, and one whose generation raised stayed on the left."""
    model, tokenizer = make_tiny_model("opt", make_tokenizer(with_pad=True))
    tokenizer.padding_side = side
    settings = prompt_eval.GenerationSettings(max_new_tokens=2)
    prompt_eval.generate_answers(model, tokenizer, ["hello"], settings)
    assert tokenizer.padding_side == side

    def fail(**_):
        raise RuntimeError("generation failed")

    monkeypatch.setattr(model, "generate", fail)
    with pytest.raises(RuntimeError, match="generation failed"):
        prompt_eval.generate_answers(model, tokenizer, ["hello"], settings)
    assert tokenizer.padding_side == side


def test_prompt_eval_seeds_each_model_alike_and_refuses_a_prompt_past_the_positions(tmp_path, tiny_model_dir,
                                                                                   capsys):
    """The fine-tuned model sampled from whatever random state the baseline's generation left, so its answers
    depended on the baseline; and a prompt with --max_new_tokens past the model's positions was an IndexError."""
    model, other = tiny_model_dir("llama"), tiny_model_dir("gpt2")
    argv = ["--model_name_or_path_finetune", model, "--prompts", "Compute 3 + 4.", "--max_new_tokens", "8",
            "--do_sample", "--temperature", "1.5", "--seed", "7"]
    beside_itself = prompt_eval.main(["--model_name_or_path_baseline", model, *argv])
    beside_another = prompt_eval.main(["--model_name_or_path_baseline", other, *argv])
    assert beside_itself[0]["finetune"] == beside_another[0]["finetune"] == beside_itself[0]["baseline"]
    with pytest.raises(SystemExit) as refused:
        prompt_eval.main(["--model_name_or_path_baseline", model, *argv[:4], "--max_new_tokens", "256"])
    assert refused.value.code == 2
    assert "error: the prompt 'Compute 3 + 4.' is" in capsys.readouterr().err


def _run_of(model: str, folder, record: dict) -> str:
    """`model` copied into a run folder of this project whose args.json holds `record`."""
    shutil.copytree(model, folder / "model")
    (folder / "args.json").write_text(json.dumps(record))
    return str(folder)


def test_prompt_eval_decodes_both_models_by_its_flags_in_one_dtype(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A checkpoint's generation_config.json (no_repeat_ngram_size, suppress_tokens, ...) joined prompt_eval's flags:
    its 'greedy' answers were not the most likely tokens, and a baseline and a fine-tuned model of the same weights
    answered differently. Under --dtype auto the fine-tuned run's fp32 model ran beside a bf16 baseline."""
    import training.core.model_loading as model_loading

    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: True)  # auto picks bf16 on any CPU
    model = tiny_model_dir("llama")
    finetune = _run_of(model, tmp_path / "step1", {"dtype": "fp32", "max_seq_len": 64})
    config_file = tmp_path / "step1" / "model" / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "no_repeat_ngram_size": 1,
                                       "suppress_tokens": list(range(3, 128)), "repetition_penalty": 3.0,
                                       "do_sample": True}))
    dtypes = []
    load = prompt_eval.load_causal_lm
    monkeypatch.setattr(prompt_eval, "load_causal_lm", lambda *a, **kw: (dtypes.append(kw["dtype"]), load(*a, **kw))[1])
    rows = prompt_eval.main(["--model_name_or_path_baseline", model, "--model_name_or_path_finetune", finetune,
                             "--prompts", "Compute 3 + 4.", "hello", "--max_new_tokens", "8"])
    assert dtypes == [torch.float32, torch.float32]
    assert "both in fp32, greedy, answers of at most 8 tokens (--max_new_tokens)" in capsys.readouterr().out
    assert [row["finetune"] for row in rows] == [row["baseline"] for row in rows]


def test_prompt_eval_answers_as_long_as_the_fine_tuned_models_run_let_answers_be(tmp_path, tiny_model_dir, capsys):
    """--max_new_tokens was 128 whatever the run: a step-3 actor trained to answer within --max_answer_seq_len ran on
    past it, a step-1 model trained within --max_seq_len (prompt and answer) was cut short of it, or refused where
    128 more tokens passed the model's positions. Unset, it follows the run; given, it wins."""
    model = tiny_model_dir("llama")
    step3 = _run_of(model, tmp_path / "step3", {"max_seq_len": 512, "max_answer_seq_len": 3})
    step1 = _run_of(model, tmp_path / "step1", {"max_seq_len": 100})
    assert prompt_eval.answer_limit(None, step3).max_new_tokens == 3
    assert prompt_eval.answer_limit(9, step3) == prompt_eval.AnswerLimit(9)
    assert prompt_eval.answer_limit(None, model).max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    window = prompt_eval.answer_limit(None, step1)
    assert (window.max_seq_len, window.after(15)) == (100, 85)

    rows = prompt_eval.main(["--model_name_or_path_finetune", step3, "--model_name_or_path_baseline", model,
                             "--prompts", "Compute 3 + 4."])
    assert "answers of at most 3 tokens (its run's --max_answer_seq_len)" in capsys.readouterr().out
    loaded, tokenizer = prompt_eval.load_for_generation(model, torch.float32)
    three = prompt_eval.GenerationSettings(max_new_tokens=3)
    answer = prompt_eval.generate_answers(loaded, tokenizer, ["Compute 3 + 4."], three)[0]
    assert (rows[0]["finetune"], rows[0]["finetune_cut_at"]) == answer

    # each answer of a batch fills its own prompt's window, as if generated alone
    prompts = ["hi", "Tell me a joke."]
    windowed = prompt_eval.generate_answers(loaded, tokenizer, prompts, prompt_eval.GenerationSettings(), "auto",
                                            window)
    formatter = prompt_eval.PromptFormatter(tokenizer)
    lengths = [len(tokenizer(prompt_eval.render_prompt(formatter, p), add_special_tokens=False)["input_ids"])
               for p in prompts]
    assert lengths[0] != lengths[1]
    alone = [prompt_eval.generate_answers(loaded, tokenizer, [p], prompt_eval.GenerationSettings(max_new_tokens=100 - n))
             for p, n in zip(prompts, lengths)]
    assert windowed == [answer for (answer,) in alone]
    # where the window is the model's learned positions, a short prompt's budget for the batch ran the long one's
    # row past them: IndexError
    learned = _run_of(tiny_model_dir("gpt2", max_positions=64), tmp_path / "gpt2_step1", {"max_seq_len": 64})
    gpt2, gpt2_tokenizer = prompt_eval.load_for_generation(learned, torch.float32)
    prompts = ["hi", "Tell me a joke."]
    answers = prompt_eval.generate_answers(gpt2, gpt2_tokenizer, prompts, prompt_eval.GenerationSettings(), "auto",
                                           prompt_eval.answer_limit(None, learned))
    assert answers == [prompt_eval.generate_answers(gpt2, gpt2_tokenizer, [p], prompt_eval.GenerationSettings(), "auto",
                                                    prompt_eval.answer_limit(None, learned))[0] for p in prompts]
    with pytest.raises(UserError, match="leaves no room for an answer within the 100 tokens of its run's --max_seq_len"):
        prompt_eval.generate_answers(loaded, tokenizer, ["Tell me a joke. " * 20], prompt_eval.GenerationSettings(),
                                     "auto", window)


def test_a_bad_flag_value_is_one_clear_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tiny_model_dir("llama"), "unused.jsonl", tmp_path, "--max_steps", "0"))
    assert exit_info.value.code == 2
    assert "--max_steps must be positive" in capsys.readouterr().err


def test_a_held_out_part_left_empty_is_said(distributed, tiny_model_dir, tmp_path, caplog):
    """--eval_fraction 0.1 of a 1-record shard holds out nothing: the run finished with null held-out metrics and
    no word why."""
    data = write_arithmetic_jsonl(tmp_path / "d.jsonl", 2)
    with caplog.at_level("WARNING"):
        main(_args(tiny_model_dir("llama"), data, tmp_path, "--max_steps", "1"))
    assert "--eval_fraction 0.1 held out no usable item of step 1" in caplog.text, caplog.text
    caplog.clear()
    more = write_arithmetic_jsonl(tmp_path / "more.jsonl", 8)
    with caplog.at_level("WARNING"):  # --max_eval_samples 0 asked for none
        main(_args(tiny_model_dir("llama"), more, tmp_path / "asked", "--max_steps", "1", "--max_eval_samples", "0"))
    assert "held out no usable item" not in caplog.text, caplog.text


def test_a_warmup_the_data_ends_before_is_warned_of(distributed, tiny_model_dir, tmp_path, caplog):
    """Without --max_steps the run's optimizer steps are known once the data has loaded: 8 records split 1:1 make 4
    training items, one step of 4, which a warm-up of 3 outlasts (its one step at the learning rate 0)."""
    data = write_arithmetic_jsonl(tmp_path / "d.jsonl", 8)
    with caplog.at_level("WARNING"):
        main(_args(tiny_model_dir("llama"), data, tmp_path, "--num_warmup_steps", "3"))
    assert "--num_warmup_steps 3 lasts the whole run (1 optimizer steps of its data)" in caplog.text, caplog.text


def test_answers_cut_at_max_seq_len_are_counted_in_the_summary_and_warned_of(distributed, tiny_model_dir, tmp_path,
                                                                              caplog):
    """A run at a --max_seq_len that cuts answers said so only inside the data build's info line of stats: its
    summary.json now counts the cut training and held-out items, and a warning says how many."""
    data = write_arithmetic_jsonl(tmp_path / "d.jsonl", 8)
    with caplog.at_level("WARNING"):
        summary = main(_args(tiny_model_dir("llama"), data, tmp_path, "--max_steps", "1", "--max_seq_len", "40"))
    assert summary["train_answer_truncated"] == summary["train_items"] > 0
    capped = main(_args(tiny_model_dir("llama"), data, tmp_path / "capped", "--max_steps", "1", "--max_seq_len", "40",
                        "--max_train_samples", "2", "--max_eval_samples", "1"))
    assert capped["train_answer_truncated"] == capped["train_items"] == 2  # of the items used, not of those built
    assert capped["eval_answer_truncated"] == capped["eval_items"] == 1
    assert "end inside their answer at --max_seq_len 40" in caplog.text, caplog.text
    whole = main(_args(tiny_model_dir("llama"), data, tmp_path / "whole", "--max_steps", "1"))
    assert whole["train_answer_truncated"] == whole["eval_answer_truncated"] == 0


def test_a_resume_on_other_data_is_refused(distributed, tiny_model_dir, tmp_path, capsys):
    """The data file was rewritten under the same --data_path between the run and its resume: the checkpointed
    position, shuffle and schedule belong to the old rows, so the resume is refused, naming what changed."""
    model_dir = tiny_model_dir("llama")
    data = write_arithmetic_jsonl(tmp_path / "d.jsonl", 16)
    args = _args(model_dir, data, tmp_path, "--max_steps", "1", "--save_interval", "1")
    main(args)
    main([*args, "--resume"])  # the same data: resumes
    write_arithmetic_jsonl(tmp_path / "d.jsonl", 32)
    with pytest.raises(SystemExit) as refused:
        main([*args, "--resume"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "but its data differ from that run's (eval: " in error, error
    assert "train: 7 items -> 14" in error


def test_a_resume_on_data_that_lost_its_evaluation_splits_says_this_version_leaves_them_out(
        distributed, tiny_model_dir, tmp_path, capsys):
    """A run checkpointed before this version read a folder's evaluation-split files; now left out, its resume was
    refused as 'the data files changed', though no file had: the refusal says that this version leaves them out."""
    model_dir = tiny_model_dir("llama")
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [json.dumps(row) + "\n" for row in arithmetic_rows(32)]
    (folder / "train.jsonl").write_text("".join(rows[:16]))
    (folder / "train_held.jsonl").write_text("".join(rows[16:]))  # test.jsonl as an earlier version read it: kept
    args = _args(model_dir, str(folder), tmp_path, "--max_steps", "1", "--save_interval", "1")
    main(args)
    (folder / "train_held.jsonl").rename(folder / "test.jsonl")
    with pytest.raises(SystemExit) as refused:
        main([*args, "--resume"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "but its data differ from that run's" in error, error
    assert "If a source has evaluation splits" in error and "this version leaves them out" in error, error


def test_a_resume_from_an_input_model_replaced_at_the_same_path_is_refused(distributed, tiny_model_dir, tmp_path,
                                                                          capsys):
    """The input folder was rewritten with another model between the run and its resume: the resume went on with
    the new model's tokenizer and config (DPO: its frozen reference), so it is refused, naming the flag and the
    files that changed. The same input resumes."""
    model_dir, data = tiny_model_dir("llama"), write_arithmetic_jsonl(tmp_path / "d.jsonl", 16)
    args = _args(model_dir, data, tmp_path, "--max_steps", "1", "--save_interval", "1")
    main(args)
    main([*args, "--resume"])
    make_tiny_model_dir(model_dir, "llama", seed=5)
    with pytest.raises(SystemExit) as refused:
        main([*args, "--resume"])
    error = capsys.readouterr().err
    assert refused.value.code == 2, error
    assert f"its input models are not those that run started from (--model_name_or_path {model_dir}: its files " \
           "changed (" in error and "model.safetensors" in error, error


def test_a_resume_needs_free_space_only_for_the_checkpoints_not_yet_on_disk(distributed, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    """A resume was asked for free space for every checkpoint it keeps and one more, though those on disk hold theirs
    already: a run stopped for want of space, resumed once room for its next checkpoint and its final model was
    freed, was refused."""
    from training.loops import supervised_step

    needed, check = [], supervised_step.check_disk_space
    monkeypatch.setattr(supervised_step, "check_disk_space",
                        lambda path, needed_bytes, what: needed.append(needed_bytes) or check(path, needed_bytes, what))
    model_dir, data = tiny_model_dir("llama"), write_arithmetic_jsonl(tmp_path / "d.jsonl", 16)
    args = _args(model_dir, data, tmp_path, "--max_steps", "2", "--save_interval", "1")
    first = main(args)  # leaves the checkpoints of steps 1 and 2 (--keep_last_checkpoints 2)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=needed[0] - 1))
    resumed = main([*args, "--resume"])
    assert resumed["eval_perplexity_after"] == pytest.approx(first["eval_perplexity_after"])


def test_run_folder_rules_lock_checkpoints_and_resume(distributed, tiny_model_dir, tmp_path, capsys):
    from training.reliability.run_lock import RunLock

    model_dir, data = tiny_model_dir("llama"), write_arithmetic_jsonl(tmp_path / "d.jsonl", 16)
    args = _args(model_dir, data, tmp_path, "--max_steps", "2", "--save_interval", "1")
    with RunLock(tmp_path / "run"), pytest.raises(SystemExit) as locked:
        main(args)
    assert locked.value.code == 2 and "in use by another run" in capsys.readouterr().err

    first = main(args)
    with pytest.raises(SystemExit) as refused:  # a fresh run must not overwrite the earlier run's checkpoints
        main(args)
    assert refused.value.code == 2 and "--resume" in capsys.readouterr().err
    resumed = main([*args, "--resume"])  # nothing left to train: the same result comes back
    assert resumed["eval_perplexity_after"] == pytest.approx(first["eval_perplexity_after"])
    assert resumed["eval_perplexity_before"] == pytest.approx(first["eval_perplexity_before"])
    recorded = (tmp_path / "run" / "args.json").read_text()
    # a resume goes on with the checkpointed run's flags: others are refused before anything is written; what
    # only changes saving, logging, evaluation or memory use, and the learning rate, may differ
    free = ["--save_interval", "5", "--learning_rate", "1e-3", "--gradient_checkpointing", "--eval_interval", "1",
            "--eval_iters", "3", "--per_device_eval_batch_size", "2"]
    with pytest.raises(SystemExit) as changed:
        main([*args, "--zero_stage", "2", "--per_device_train_batch_size", "3", *free, "--resume"])
    error = capsys.readouterr().err
    assert changed.value.code == 2 and "these flags differ from that run's: --per_device_train_batch_size 4 -> 3, " \
        "--zero_stage 0 -> 2." in error, error
    assert (tmp_path / "run" / "args.json").read_text() == recorded
    main([*args, *free, "--resume"])
