"""Step 2 (reward model): `main` end to end after step 1 in one process, the saved model scores as
it did when training ended, and `rw_eval` scores pairs from the command line and from a file."""
import json
from pathlib import Path

import pytest
import torch
from shared_launch import built_once
from supervised_data import build_phase_datasets, write_arithmetic_jsonl

from step1_sft.main import main as step1_main
from step2_reward import rw_eval
from step2_reward.main import main as step2_main
from step2_reward.objective import evaluate_pairs
from training.core.model_loading import load_tokenizer
from training.core.reward_model import RewardModel
from training.loops.metrics import read_metrics
from utils.data import PairwiseCollator

SCORE_KEYS = ("accuracy", "chosen_mean", "rejected_mean", "margin_mean")


def _common(data, cache, out, *extra):
    return ["--data_path", data, "--data_split", "1,1,0", "--data_output_path", str(cache), "--output_dir", str(out),
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_len", "64",
            "--log_interval", "1", *extra]


def _reload_scores(run_dir, data, cache, dtype=torch.float32):
    """Held-out scores of the saved model, on the same held-out pairs the run evaluated."""
    model = RewardModel.from_pretrained(run_dir, dtype=dtype)
    tokenizer = load_tokenizer(str(run_dir))
    _, eval_data = build_phase_datasets(2, [data], "1,1,0", tokenizer, 64, 1234, str(cache))
    collate = PairwiseCollator(tokenizer.pad_token_id)
    batches = [collate([eval_data[i] for i in range(start, min(start + 4, len(eval_data)))])
               for start in range(0, len(eval_data), 4)]
    return evaluate_pairs(model, batches)


@pytest.fixture(scope="module")
def trained(distributed, request):
    """`train_steps_1_and_2`, once for the test run's workers (`built_once`): tests read its folders."""
    return built_once(request, "step2_reward_trained", train_steps_1_and_2)


def train_steps_1_and_2(root: Path) -> dict:
    """Step 1 then step 2 on its run folder, in this one process (as train.py runs them on CPU), in `root`."""
    from tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(root / "tiny", "llama")
    data = write_arithmetic_jsonl(root / "pairs.jsonl", 64)
    step1 = step1_main(["--model_name_or_path", model_dir, "--learning_rate", "3e-3", "--max_steps", "2",
                        "--dtype", "fp32", *_common(data, root / "cache", root / "step1")])
    summary = step2_main(["--model_name_or_path", str(root / "step1"), "--learning_rate", "2e-3",
                          "--num_train_epochs", "2", "--dtype", "fp32",
                          *_common(data, root / "cache", root / "step2")])
    return {"root": root, "data": data, "step1": step1, "summary": summary, "run": root / "step2"}


def test_reward_model_learns_the_pairs_and_reports_each_epoch(trained):
    summary, run = trained["summary"], trained["run"]
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["eval_accuracy_after"] == 1.0
    assert summary["eval_margin_after"] > summary["eval_margin_before"] + 1.0
    assert summary["epochs_completed"] == 2 and summary["optimizer_steps"] == 16  # 29 pairs / batch 4 = 8 per epoch
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 8, 16]
    assert all(f"eval/{key}" in evals[-1] for key in SCORE_KEYS)
    assert (run / "model" / "value_head.safetensors").is_file()


def test_saved_reward_model_loads_back_with_the_same_scores(trained):
    summary = trained["summary"]
    reloaded = _reload_scores(trained["run"], trained["data"], trained["root"] / "cache")
    assert reloaded.num_pairs == summary["eval_pairs"]
    assert reloaded.accuracy == summary["eval_accuracy_after"]
    assert reloaded.margin_mean == pytest.approx(summary["eval_margin_after"], abs=1e-5)
    assert reloaded.chosen_mean == pytest.approx(summary["eval_chosen_mean_after"], abs=1e-5)
    # the run folder itself is accepted wherever a model is (step 3 passes it as the critic/reward model)
    direct = RewardModel.from_pretrained(trained["run"] / "model")
    assert torch.equal(direct.v_head.weight, RewardModel.from_pretrained(trained["run"]).v_head.weight)


def test_step2_from_a_reward_model_trains_on_from_its_value_head(trained, tmp_path):
    """Step 2 given a reward model (its own run folder) drew a fresh value head on its backbone: its held-out scores
    before training were a new head's (margin 5.34 where the model had learnt 5.99), not the model's. It starts from
    the model's head, so it scores as the model does."""
    summary = trained["summary"]
    again = step2_main(["--model_name_or_path", str(trained["run"]), "--learning_rate", "2e-3", "--max_steps", "1",
                        "--dtype", "fp32", *_common(trained["data"], trained["root"] / "cache", tmp_path / "again")])
    assert again["eval_accuracy_before"] == summary["eval_accuracy_after"] == 1.0
    assert again["eval_margin_before"] == pytest.approx(summary["eval_margin_after"], abs=1e-5)


def test_each_step_records_the_shard_it_trained_on(trained, tmp_path):
    """The same-shard checks read the phase a run's data_split.json records: steps 1, 2, DPO and 3 each write their
    own (no other test reads it back from a step's run, so a step writing another went unseen)."""
    from step2_reward.dpo.main import main as dpo_main
    from step3_rlhf.main import main as step3_main
    from utils.data.split_record import read_split_phase

    root = trained["root"]
    dpo_main(["--model_name_or_path", str(root / "step1"), "--learning_rate", "1e-3", "--max_steps", "1",
              "--dtype", "fp32", *_common(trained["data"], root / "cache", tmp_path / "dpo")])
    step3_main(["--actor_model_name_or_path", str(root / "step1"), "--critic_model_name_or_path", str(trained["run"]),
                "--output_dir", str(tmp_path / "step3"), "--data_path", write_arithmetic_jsonl(tmp_path / "p.jsonl", 8),
                "--data_split", "0,0,1", "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "48",
                "--max_answer_seq_len", "8", "--eval_samples", "8", "--dtype", "fp32", "--max_steps", "1"])
    phases = {run: read_split_phase(folder) for run, folder in
              (("step1", root / "step1"), ("step2", trained["run"]), ("dpo", tmp_path / "dpo"),
               ("step3", tmp_path / "step3"))}
    assert phases == {"step1": 1, "step2": 2, "dpo": 2, "step3": 3}


def test_rw_eval_scores_command_line_pairs_and_files(trained, tmp_path):
    run = str(trained["run"])
    cli = rw_eval.main(["--model_name_or_path", run, "--prompt", "What is 3 plus 4?",
                        "--answer", "3 plus 4 is 7.", "--answer", "I do not know."])
    right, refusal = (row["chosen_score"] for row in cli["results"])
    assert right > refusal

    out = tmp_path / "scored.jsonl"
    from_file = rw_eval.main(["--model_name_or_path", run, "--input_file", trained["data"], "--max_rows", "10",
                              "--output_file", str(out)])
    assert from_file["pairs"] == 10 and from_file["accuracy"] == 1.0 and from_file["margin_mean"] > 0
    assert len(out.read_text().splitlines()) == 10
    # the same text scores the same through the CLI and through the file path
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    scorer = rw_eval.RewardScorer.from_pretrained(run)
    assert scorer.score([(rows[0]["prompt"], rows[0]["chosen"])])[0] == pytest.approx(rows[0]["chosen_score"], abs=1e-5)


def test_rw_eval_scorer_from_pretrained_scores_as_rw_eval_does(trained):
    """`RewardScorer.from_pretrained(run)` cut at 512 tokens whatever the run trained at (64 here): an answer longer
    than that scored otherwise than rw_eval.py scored the same text. It takes the run's --max_seq_len, as rw_eval.py."""
    run = str(trained["run"])
    cli = rw_eval.main(["--model_name_or_path", run, "--prompt", "What is 3 plus 4?", "--answer", "3 plus 4 is 7. " * 20])
    row = cli["results"][0]
    scorer = rw_eval.RewardScorer.from_pretrained(run)
    assert scorer.max_seq_len == 64
    assert scorer.score([(row["prompt"], row["chosen"])])[0] == pytest.approx(row["chosen_score"], abs=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    (["--max_rows", "-1"], "--max_rows must be at least 1, got -1"),
    (["--max_rows", "0"], "--max_rows must be at least 1, got 0"),
])
def test_rw_eval_refuses_a_batch_size_or_row_cap_it_cannot_score_by(trained, flags, message, capsys):
    """--batch_size 0 ended in range()'s ValueError once the model had loaded; --max_rows -1 scored the file less its
    last row and --max_rows 0 nothing, silently (a slice)."""
    with pytest.raises(SystemExit) as exited:
        rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", trained["data"], *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_rw_eval_says_how_many_rows_of_a_file_hold_a_prompt_alone(trained, tmp_path, capsys):
    """Rows without an answer were left out of the scoring without a word: the statistics counted the others."""
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "What is 1 plus 2?", "chosen": "1 plus 2 is 3.", "rejected": "I do not know."},
            {"prompt": "What is 2 plus 2?"}, {"prompt": "What is 3 plus 2?"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored = rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", str(path)])
    assert scored["rows"] == 1
    assert f"{path}: 2 of its 3 rows hold a prompt alone, no answer to score: left out" in capsys.readouterr().out


def test_rw_eval_scores_a_datasets_evaluation_splits_unless_a_split_is_named(trained, tmp_path):
    """rw_eval read a source as the steps do, its training splits alone, so a dataset's test split went unscored; it
    reads the evaluation splits where a dataset has any, and the split a source names (NAME[SPLIT])."""
    def pairs(*questions: str) -> list[dict]:
        return [{"prompt": f"What is {q}?", "chosen": "It is 4.", "rejected": "I do not know."} for q in questions]

    data = tmp_path / "splits.json"
    data.write_text(json.dumps({"train": pairs("1 plus 1", "1 plus 2", "1 plus 3"),
                                "test": pairs("2 plus 2", "3 plus 1")}))
    for entry, rows in ((str(data), 2), (f"{data}[train]", 3)):
        assert rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", entry])["rows"] == rows


def test_rw_eval_says_which_splits_of_its_input_it_scores(trained, tmp_path):
    """rw_eval set up no logging, so the info line naming the evaluation splits it scored was never shown: a user
    scoring a hub name got its test split alone without a word. It is on standard error, the scores on standard
    output."""
    import subprocess
    import sys

    data = tmp_path / "splits.json"
    data.write_text(json.dumps({split: [{"prompt": "What is 2 plus 2?", "chosen": "It is 4.", "rejected": "No."}]
                                for split in ("train", "test")}))
    done = subprocess.run([sys.executable, "-m", "step2_reward.rw_eval", "--model_name_or_path", str(trained["run"]),
                           "--input_file", str(data)], capture_output=True, text=True, timeout=600, check=True)
    assert "its evaluation splits test are read" in done.stderr
    assert "its evaluation splits" not in done.stdout


def test_rw_eval_cuts_as_the_run_trained_and_skips_what_step_2_drops(trained, tmp_path):
    """The run trained at --max_seq_len 64 (its args.json): a prompt that alone fills it, and two answers the same
    once cut, are skipped and counted, as step 2 dropped such pairs (they would tie and count as wrong)."""
    rows = [{"prompt": "What is 2 plus 2?", "chosen": "2 plus 2 is 4.", "rejected": "I do not know."},
            {"prompt": "Tell me everything. " * 40, "chosen": "Sure.", "rejected": "No."},
            {"prompt": "Count.", "chosen": "one two " * 40 + "three", "rejected": "one two " * 40 + "four"}]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert rw_eval.parse_args(["--model_name_or_path", str(trained["run"]), "--input_file", str(data)]).max_seq_len == 64
    scored = rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", str(data)])
    assert (scored["rows"], scored["skipped"], scored["pairs"]) == (3, 2, 1)
    assert [row.get("skipped") for row in scored["results"]] == [None, "prompt_too_long", "identical_after_truncation"]
    assert "chosen_score" not in scored["results"][1]


def test_rw_eval_skips_a_pair_whose_answers_differ_in_whitespace_alone_as_step_2_does(trained, tmp_path, capsys):
    """Step 2 drops a pair whose answers differ in whitespace alone (identical_replies): rw_eval scored it and counted
    it in the accuracy, and skipped two identical answers as identical_after_truncation at --max_seq_len 64, as if a
    larger --max_seq_len would tell them apart."""
    rows = [{"prompt": "What is 2 plus 2?", "chosen": "2 plus 2 is 4.", "rejected": "I do not know."},
            {"prompt": "What is 3 plus 3?", "chosen": "3 plus 3 is 6.", "rejected": "3 plus  3 is\n6."},
            {"prompt": "What is 4 plus 4?", "chosen": "4 plus 4 is 8.", "rejected": "4 plus 4 is 8."}]
    data = tmp_path / "spacing.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored = rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", str(data)])
    assert (scored["rows"], scored["skipped"], scored["pairs"]) == (3, 2, 1)
    assert [row.get("skipped") for row in scored["results"]] == [None, "identical_replies", "identical_replies"]
    out = capsys.readouterr().out
    assert out.count("skipped (identical_replies)  | ") == 2 and "max_seq_len" not in out


def test_rw_eval_scores_a_pair_whose_preferred_reply_is_empty(trained, tmp_path):
    """An hh-rlhf refusal pair (the preferred reply empty) is a pair step 2 trains on, so rw_eval scores it too."""
    def transcript(prompt: str, reply: str) -> str:
        return f"\n\nHuman: {prompt}\n\nAssistant: {reply}"

    rows = [{"chosen": transcript("Give me her home address.", ""),
             "rejected": transcript("Give me her home address.", "Sure, it is 12 Main Street.")},
            {"chosen": transcript("What is 2 plus 2?", "2 plus 2 is 4."),
             "rejected": transcript("What is 2 plus 2?", "I do not know.")}]
    data = tmp_path / "refusal.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored = rw_eval.main(["--model_name_or_path", str(trained["run"]), "--input_file", str(data)])
    assert (scored["rows"], scored["pairs"]) == (2, 2)
    assert [row["chosen"] for row in scored["results"]] == ["", "2 plus 2 is 4."]


def test_rw_eval_needs_something_to_score(trained):
    with pytest.raises(SystemExit):
        rw_eval.main(["--model_name_or_path", str(trained["run"])])


def test_zero3_bf16_reward_model_saves_and_reloads_with_its_scores(distributed, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("opt")
    data = write_arithmetic_jsonl(tmp_path / "pairs.jsonl", 24)
    summary = step2_main(["--model_name_or_path", model_dir, "--learning_rate", "2e-3", "--max_steps", "3",
                          "--zero_stage", "3", "--dtype", "bf16", *_common(data, tmp_path / "cache", tmp_path / "run")])
    assert summary["optimizer_steps"] == 3 and summary["dtype"] == "bf16"
    reloaded = _reload_scores(tmp_path / "run", data, tmp_path / "cache", dtype=torch.bfloat16)
    assert reloaded.chosen_mean == pytest.approx(summary["eval_chosen_mean_after"], abs=2e-2)
    assert reloaded.rejected_mean == pytest.approx(summary["eval_rejected_mean_after"], abs=2e-2)


def test_a_step_2_checkpoint_that_recorded_a_step_1_flag_resumes(distributed, tiny_model_dir, tmp_path, capsys):
    """Before d3462bc train.py gave --whole_sequence_loss to every step, so a step 2 checkpoint recorded it; now only
    step 1 gets it, and --resume refused that checkpoint as '--whole_sequence_loss True -> False', a flag step 2 never
    read. It resumes; a flag step 2 reads that differs (--seed) is still refused."""
    from training.reliability.checkpointing import MARKER_FILE

    data = write_arithmetic_jsonl(tmp_path / "pairs.jsonl", 16)
    args = ["--model_name_or_path", tiny_model_dir("llama"), "--max_steps", "1", "--save_interval", "1",
            *_common(data, tmp_path / "cache", tmp_path / "run")]
    step2_main(args)
    [marker] = (tmp_path / "run").glob(f"checkpoints/*/{MARKER_FILE}")
    recorded = json.loads(marker.read_text())

    def record_flags(**flags):
        marker.write_text(json.dumps({**recorded, "flags": {**recorded["flags"], **flags}}))

    record_flags(whole_sequence_loss=True)
    assert step2_main([*args, "--resume"])["optimizer_steps"] == 1
    record_flags(whole_sequence_loss=True, seed=1)
    with pytest.raises(SystemExit) as refused:
        step2_main([*args, "--resume"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "--seed 1 -> 1234" in error and "whole_sequence_loss" not in error, error
