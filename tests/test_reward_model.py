"""Reward model / critic: scoring position, save and load, ZeRO-3, and that it can learn preferences."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT
from crash_resume import step_env
from scripts.hybrid_engine_worker import LONG_POSITION_MODEL
from tiny_models import ARCHITECTURES, make_custom_code_model_dir, make_tokenizer
from transformers import AutoModel, AutoModelForCausalLM

from step2_reward.objective import evaluate_pairs, pairwise_loss, split_chosen_rejected
from training.core.answer_window import RowGroups
from training.core.model_loading import load_tokenizer
from training.core.reward_model import MARKER_FILE, RewardModel
from training.core.sequences import last_token_index
from utils.errors import EXIT_USER_ERROR, UserError

TEXTS = ["Human: What is the capital of France? Assistant: Paris.", "Human: Tell me a joke.", "hello"]


def _encode(tokenizer, texts, side):
    tokenizer.padding_side = side
    return tokenizer(texts, return_tensors="pt", padding=True)


def test_last_token_index_left_and_right():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 2, 4]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_score_is_at_last_real_token_for_any_padding(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    tokenizer = load_tokenizer(path)
    model = RewardModel.from_causal_lm(path, tokenizer).eval()
    with torch.no_grad():
        alone = torch.stack([model(**tokenizer([t], return_tensors="pt"))["end_scores"][0] for t in TEXTS])
        for side in ("right", "left"):
            batch = _encode(tokenizer, TEXTS, side)
            out = model(**batch)
            assert out["values"].shape == batch["input_ids"].shape
            torch.testing.assert_close(out["end_scores"], alone, atol=1e-5, rtol=1e-4)
            assert torch.all(out["values"][batch["attention_mask"] == 0] == 0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_backbone_comes_from_the_causal_lm_and_save_load_round_trips(arch, tiny_model_dir, tmp_path):
    path = tiny_model_dir(arch)
    tokenizer = load_tokenizer(path)
    model = RewardModel.from_causal_lm(path, tokenizer).eval()
    causal_lm = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(model.backbone.get_input_embeddings().weight, causal_lm.get_input_embeddings().weight)

    out_dir = tmp_path / "rm"
    model.save_pretrained(out_dir)
    assert json.loads((out_dir / MARKER_FILE).read_text())["format"] == "rlhf-reward-model"
    loaded = RewardModel.from_pretrained(out_dir).eval()
    batch = _encode(tokenizer, TEXTS, "right")
    with torch.no_grad():
        before, after = model(**batch), loaded(**batch)
    assert torch.equal(before["end_scores"], after["end_scores"])
    assert torch.equal(before["values"], after["values"])
    # the folder is an ordinary HF folder too: the backbone loads with AutoModel
    plain = AutoModel.from_pretrained(out_dir)
    torch.testing.assert_close(plain.get_input_embeddings().weight, model.backbone.get_input_embeddings().weight)


def test_bf16_model_scores_in_bf16(tiny_model_dir):
    path = tiny_model_dir("llama")
    model = RewardModel.from_causal_lm(path, dtype=torch.bfloat16)
    assert model.v_head.weight.dtype == torch.bfloat16
    out = model(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long))
    assert out["end_scores"].dtype == torch.bfloat16 and torch.isfinite(out["end_scores"]).all()


def _long_rows(vocab: int) -> list[torch.Tensor]:
    """Three random rows of 700, 523 and 130 tokens."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab - 1, (length,), generator=generator) for length in (700, 523, 130)]


def _padded(rows: list[torch.Tensor], side: str, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids, mask = torch.full((len(rows), width), pad), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, columns], mask[i, columns] = row, 1
    return ids, mask


def _rollout_layout(rows: list[torch.Tensor], answer_lengths: tuple[int, ...], pad: int):
    """The rows as step 3 holds a rollout: each cut into a prompt, left-padded, and its last `answer_lengths` tokens
    as an answer, right-padded; returns (sequences, attention_mask, prompt length)."""
    prompts = [row[:len(row) - n] for row, n in zip(rows, answer_lengths)]
    answers = [row[len(row) - n:] for row, n in zip(rows, answer_lengths)]
    prompt_ids, prompt_mask = _padded(prompts, "left", pad)
    answer_ids, answer_mask = _padded(answers, "right", pad)
    return torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, answer_mask], 1), prompt_ids.shape[1]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_scores_of_long_padded_rows_are_as_close_to_fp32_as_a_rows_own(arch, tiny_model_dir):
    """Rows of 130 to 700 tokens, left- or right-padded or in step 3's rollout layout (scored flush right by
    `RowGroups`): the bf16 reward model's score of each is within 1.5x (mean over the rows) of the bf16 score of
    the row alone from the fp32 score, plus 0.05. bf16 kernels of other shapes round otherwise, by about what bf16
    costs the row alone (up to 0.6 on scores of 1-12 for these tiny models, whose weights are drawn with std 0.3);
    a score read one token off the last is off by whole units."""
    path = tiny_model_dir(arch, **LONG_POSITION_MODEL)
    tokenizer = load_tokenizer(path)
    model = RewardModel.from_causal_lm(path, tokenizer).eval()
    with torch.no_grad():
        model.v_head.weight.normal_()
    rows, pad = _long_rows(len(tokenizer)), tokenizer.pad_token_id
    with torch.no_grad():
        def alone(reward_model: RewardModel) -> torch.Tensor:  # the head on the row's last hidden state
            return torch.cat([reward_model.v_head(reward_model.backbone(row[None])[0][:, -1])[:, 0]
                              for row in rows]).float()

        exact = alone(model)
        model.to(torch.bfloat16)
        alone_error = (alone(model) - exact).abs().mean()
        batches = {side: model(*_padded(rows, side, pad))["end_scores"].float() for side in ("left", "right")}
        sequences, mask, prompt_length = _rollout_layout(rows, (48, 10, 30), pad)
        batches["rollout"] = RowGroups.of(sequences, mask, prompt_length).end_scores(model)
    for layout, scores in batches.items():
        error = (scores - exact).abs().mean()
        assert error <= 1.5 * alone_error + 0.05, (layout, error, alone_error)


def test_causal_lm_folder_is_not_a_reward_model(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="not trained by step 2"):
        RewardModel.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(UserError, match="does not exist"):
        RewardModel.from_pretrained(tmp_path / "missing")


def test_a_step2_run_that_has_not_saved_its_model_says_so(tmp_path):
    """rw_eval (and step 3's --reward_model) said such a run folder "has no value head: it was not trained by step
    2", where the other tools say the run has not saved its model yet."""
    (tmp_path / "step2" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="step2 holds no model .*: a run that has not saved its model yet"):
        RewardModel.from_pretrained(tmp_path / "step2")


def _save_reward_model(causal_lm: str, folder) -> str:
    """A reward model on `causal_lm`'s backbone (a fresh head), saved in `folder` as step 2 saves one."""
    tokenizer = load_tokenizer(causal_lm)
    RewardModel.from_causal_lm(causal_lm, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_rw_eval_takes_a_train_py_output_folder(tiny_model_dir, tmp_path, capsys):
    """rw_eval's help says it takes step 2's run folder; given train.py's --output-dir (whose step2/ holds it) it
    said the folder had no value head, as if the model were not a reward model."""
    from step2_reward.rw_eval import main as rw_eval_main

    _save_reward_model(tiny_model_dir("llama"), tmp_path / "out" / "step2" / "model")
    argv = ["--prompt", "Compute 3 + 4.", "--answer", "7", "--answer", "8"]
    by_output_dir = rw_eval_main(["--model_name_or_path", str(tmp_path / "out"), *argv])
    by_run = rw_eval_main(["--model_name_or_path", str(tmp_path / "out" / "step2"), *argv])
    assert by_output_dir == by_run


def test_rw_eval_scores_a_reward_model_on_a_backbone_with_its_own_code(tmp_path, capsys):
    """Step 2 trains on a model that ships its own code with --trust_remote_code, and rw_eval had no such flag: the
    reward model it saved could not be scored, from the command line or by RewardScorer.from_pretrained."""
    from step2_reward.rw_eval import RewardScorer
    from step2_reward.rw_eval import main as rw_eval_main

    custom = make_custom_code_model_dir(tmp_path / "custom")
    tokenizer = load_tokenizer(custom, trust_remote_code=True)
    folder = tmp_path / "rm"
    RewardModel.from_causal_lm(custom, tokenizer, trust_remote_code=True).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = ["--model_name_or_path", str(folder), "--prompt", "Compute 3 + 4.", "--answer", "7"]
    with pytest.raises(SystemExit) as exited:
        rw_eval_main(argv)
    assert exited.value.code == EXIT_USER_ERROR and "runs only with --trust_remote_code" in capsys.readouterr().err
    scored = rw_eval_main([*argv, "--trust_remote_code"])["results"]
    assert len(scored) == 1 and math.isfinite(scored[0]["chosen_score"])
    scorer = RewardScorer.from_pretrained(str(folder), trust_remote_code=True)
    turns = [{"role": "user", "content": "Compute 3 + 4."}]
    rendered = scorer.formatter.prompt(turns)
    assert scorer.score([(rendered, scorer.formatter.answer(turns, "7", rendered))]) == pytest.approx(
        [scored[0]["chosen_score"]], abs=1e-5)


def test_a_backbone_whose_own_code_names_no_base_model_is_one_error(tmp_path):
    """A model whose auto_map names its causal LM alone (Phi-1.5's and Phi-2's did, before transformers had them)
    has no class to build a reward model's backbone by: step 2 ended in transformers' ValueError listing every model
    type it knows, as a traceback."""
    custom = Path(make_custom_code_model_dir(tmp_path / "custom"))
    config = json.loads((custom / "config.json").read_text())
    del config["auto_map"]["AutoModel"]
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="custom ships its own model code, and it names no AutoModel class"):
        RewardModel.from_causal_lm(str(custom), trust_remote_code=True)


def test_rw_eval_prints_its_scores_alone_and_deepspeeds_warnings_go_to_stderr(tiny_model_dir, tmp_path):
    """DeepSpeed's logger writes to the standard output it finds when imported, and on a machine without a GPU
    (DS_ACCELERATOR unset) warns 'Setting accelerator to CPU' there: that line came before the scores a script
    reads (the chatbot and prompt_eval were fixed in e7958e8)."""
    model = _save_reward_model(tiny_model_dir("llama"), tmp_path / "rm")
    env = {key: value for key, value in step_env().items() if key != "DS_ACCELERATOR"}
    result = subprocess.run(
        [sys.executable, "step2_reward/rw_eval.py", "--model_name_or_path", model, "--prompt", "p", "--answer", "a"],
        cwd=REPO_ROOT, check=False, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Setting accelerator to CPU" in result.stderr
    assert "Setting accelerator" not in result.stdout, result.stdout[:300]
    json.loads(result.stdout.splitlines()[-1])


PAIR = ["--prompt", "p", "--answer", "a"]


@pytest.mark.parametrize("flags, messages", [
    ([*PAIR, "--max_seq_len", "1"], ["--max_seq_len must be at least 2 (a prompt token and a reply token), got 1"]),
    ([*PAIR, "--max_seq_len", "0", "--batch_size", "0"],
     ["2 problems: (1) --batch_size must be at least 1, got 0; (2) --max_seq_len must be at least 2"]),
    ([*PAIR, "--max_seq_len", "1000"], ["--max_seq_len 1000 exceeds the 256 positions of"]),
    ([*PAIR, "--max_rows", "3"], ["--max_rows caps the rows of --input_file, and none is given"]),
    (["--input_file", "{pairs}", "--prompt", "p"], ["--prompt is scored only with --answer"]),
    (["--input_file", "{pairs}", "--answer", "a"], ["--answer is scored only with --prompt"]),
    (["--input_file", "{missing}"], ["data path", "missing.jsonl does not exist"]),
])
def test_rw_eval_refuses_what_it_cannot_score_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                     flags, messages):
    """Each was refused only once the model had loaded (--max_seq_len 1, a missing --input_file), or not at all: a
    --max_seq_len past a learned-position model's positions ended in an IndexError traceback, and beside
    --input_file a --prompt or --answer alone (or --max_rows without a file) was dropped without a word."""
    from step2_reward.rw_eval import main as rw_eval_main

    model = _save_reward_model(tiny_model_dir("opt"), tmp_path / "rm")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")

    def not_loaded(*args, **kwargs):
        raise AssertionError("the reward model loaded")

    monkeypatch.setattr(RewardModel, "from_pretrained", not_loaded)
    argv = [flag.format(pairs=tmp_path / "pairs.jsonl", missing=tmp_path / "missing.jsonl") for flag in flags]
    with pytest.raises(SystemExit) as exited:
        rw_eval_main(["--model_name_or_path", model, *argv])
    error = capsys.readouterr().err
    assert exited.value.code == EXIT_USER_ERROR and all(message in error for message in messages), error


def test_rw_eval_cuts_at_the_positions_of_a_model_no_run_trained(tiny_model_dir, tmp_path):
    """Without --max_seq_len, a model no run of this project trained (no args.json) was cut at 512 tokens, past the
    64 positions of this learned-position model: a longer answer ended in an IndexError traceback."""
    from step2_reward.rw_eval import main as rw_eval_main

    model = _save_reward_model(tiny_model_dir("opt", max_positions=64), tmp_path / "rm")
    argv = ["--model_name_or_path", model, "--prompt", "p", "--answer", "word " * 100]
    assert rw_eval_main(argv)["results"] == rw_eval_main([*argv, "--max_seq_len", "64"])["results"]


def test_rw_evals_scorer_refuses_a_pair_step_2_drops_as_its_command_line_skips_it():
    """`RewardScorer.score` and `encode` scored a pair whose prompt alone fills --max_seq_len, its prompt cut with no
    answer left, where rw_eval's command line (`score_rows`) and step 2 drop it: they now refuse it, saying why."""
    from step2_reward.rw_eval import RewardScorer

    scorer = RewardScorer(torch.nn.Linear(1, 1), make_tokenizer(), "auto", max_seq_len=8)  # no pair reaches it
    long_prompt, short_prompt = "hello world " * 8, "hi"
    (result,) = scorer.score_rows([{"prompt": long_prompt, "chosen": " yes", "rejected": None}])
    assert result["skipped"] == "prompt_too_long"
    for refused in (lambda: scorer.encode(long_prompt, " yes"), lambda: scorer.score([(long_prompt, " yes")])):
        with pytest.raises(UserError, match="^step 2 drops this pair \\(prompt_too_long at max_seq_len 8\\)"):
            refused()
    as_trained = (scorer.token_ids(short_prompt + " yes") + scorer.formatter.answer_suffix_ids)[:8]
    assert scorer.encode(short_prompt, " yes").tolist() == as_trained  # a prompt that leaves room: scored as before


def test_pairwise_loss_value():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    expected = -(F.logsigmoid(torch.tensor(2.0)) + F.logsigmoid(torch.tensor(0.0))) / 2
    torch.testing.assert_close(pairwise_loss(chosen, rejected), expected)


def _preference_batches(tokenizer, good, bad, n_batches=2, pairs=4):
    """Chosen answers contain `good`, rejected ones `bad`; stacked chosen-then-rejected, right-padded."""
    batches = []
    for b in range(n_batches):
        prompts = [f"Human: question {b * pairs + i} Assistant:" + " filler" * (i % 3) for i in range(pairs)]
        texts = [p + good for p in prompts] + [p + bad for p in prompts]
        batches.append(dict(_encode(tokenizer, texts, "right")))
    return batches


def test_tiny_reward_model_learns_a_separable_preference(tiny_model_dir):
    torch.manual_seed(0)
    path = tiny_model_dir("gpt2")
    tokenizer = load_tokenizer(path)
    model = RewardModel.from_causal_lm(path, tokenizer, disable_dropout_layers=True)
    batches = _preference_batches(tokenizer, " good", " bad")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        for batch in batches:
            loss = pairwise_loss(*split_chosen_rejected(model(**batch)["end_scores"]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    result = evaluate_pairs(model, batches)
    assert result.accuracy == 1.0 and result.num_pairs == 8
    with torch.no_grad():
        scores = [split_chosen_rejected(model(**b)["end_scores"]) for b in batches]
    chosen = torch.cat([c for c, _ in scores])
    rejected = torch.cat([r for _, r in scores])
    assert result.chosen_mean == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert result.rejected_mean == pytest.approx(rejected.mean().item(), abs=1e-5)
    assert result.margin_mean == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert result.margin_mean > 1.0 and model.training


def test_zero3_reward_model_and_critic_load_score_and_save(distributed, tiny_model_dir, tmp_path):
    """Step 2 saves through save_hf_model; step 3 loads the folder partitioned, as reward and as critic."""
    from training.core.ds_config import get_eval_ds_config
    from training.core.engine import create_frozen_engine
    from training.core.save import save_hf_model

    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    reference = RewardModel.from_causal_lm(path, tokenizer).eval()
    rm_dir = tmp_path / "rm"
    reference.save_pretrained(rm_dir)
    batch = _encode(tokenizer, TEXTS, "left")
    with torch.no_grad():
        expected = reference(**batch)

    zero3 = RewardModel.from_pretrained(rm_dir, ds_config=get_eval_ds_config(stage=3))
    assert all(hasattr(p, "ds_id") for p in zero3.backbone.parameters()), "backbone was not partitioned"
    engine = create_frozen_engine(zero3, zero_stage=3)
    with torch.no_grad():
        got = engine(**batch)
    torch.testing.assert_close(got["end_scores"], expected["end_scores"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["values"], expected["values"], atol=1e-5, rtol=1e-4)

    saved_dir = tmp_path / "rm-from-zero3"
    save_hf_model(engine, tokenizer, saved_dir)
    with torch.no_grad():
        reloaded = RewardModel.from_pretrained(saved_dir).eval()(**batch)
    torch.testing.assert_close(reloaded["end_scores"], expected["end_scores"], atol=1e-6, rtol=1e-5)


def test_zero3_lora_training_from_a_causal_lm_then_save(distributed, tiny_model_dir, tmp_path):
    """Step 2's path: fresh head on a partitioned backbone, LoRA, a ZeRO-3 engine, save_hf_model, reload."""
    from training.core.engine import OptimizationSettings, create_train_engine
    from training.core.lora import apply_lora
    from training.core.save import save_hf_model

    path = tiny_model_dir("opt")
    tokenizer = load_tokenizer(path)
    settings = OptimizationSettings(learning_rate=1e-2, num_training_steps=4, zero_stage=3, micro_batch_size=4,
                                    lr_scheduler_type="constant_with_warmup")
    model = RewardModel.from_causal_lm(path, tokenizer, ds_config=settings.ds_config(), disable_dropout_layers=True)
    engine = create_train_engine(apply_lora(model, lora_dim=4, lora_module_name="decoder.layers."), settings)
    assert hasattr(engine.module.get_base_model().v_head.weight, "ds_id"), "the value head was not partitioned"
    batch = _encode(tokenizer, ["a good", "b good", "a bad", "b bad"], "right")
    losses = []
    for _ in range(4):
        loss = pairwise_loss(*split_chosen_rejected(engine(**batch)["end_scores"]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        expected = engine(**batch)["end_scores"]
    save_hf_model(engine, tokenizer, tmp_path / "rm")
    with torch.no_grad():
        reloaded = RewardModel.from_pretrained(tmp_path / "rm").eval()(**batch)["end_scores"]
    torch.testing.assert_close(reloaded, expected, atol=1e-5, rtol=1e-4)
