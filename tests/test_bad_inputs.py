"""Each bad input to a real step entry point ends in one `error: ...` line (exit 2) and leaves the
earlier run in the output folder exactly as it was."""
import hashlib
import json
import re
import shutil
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import pytest
from supervised_data import write_arithmetic_jsonl
from tiny_models import make_custom_code_model_dir, make_tiny_model_dir

from step1_sft.main import main as step1_main
from step2_reward.main import main as step2_main
from step3_rlhf.main import main as step3_main
from training.core.reward_model import RewardModel
from training.reliability.run_lock import LOCK_FILE
from utils.data import DataArguments
from utils.errors import EXIT_USER_ERROR, UserError

STEPS = {"step1": step1_main, "step2": step2_main}


@pytest.fixture
def setup(tmp_path):
    """A tiny model, a data file, and an output folder holding a finished earlier run."""
    model = make_tiny_model_dir(tmp_path / "tiny-llama", "llama")
    data = write_arithmetic_jsonl(tmp_path / "pairs.jsonl", 16)
    run = tmp_path / "run"
    shutil.copytree(model, run / "model")
    for name, text in {"summary.json": '{"step": "step1_sft"}\n', "args.json": "{}\n",
                       "metrics.jsonl": '{"step": 1, "train/loss": 2.0}\n'}.items():
        (run / name).write_text(text)
    return namedtuple("Setup", "model data run tmp")(model, data, run, tmp_path)


def step_args(setup, **overrides) -> list[str]:
    values = {
        "model_name_or_path": setup.model, "data_path": setup.data, "data_split": "1,1,0",
        "data_output_path": str(setup.tmp / "cache"), "output_dir": str(setup.run),
        "per_device_train_batch_size": "2", "per_device_eval_batch_size": "2", "max_seq_len": "64",
        "dtype": "fp32", "max_steps": "1", **overrides,
    }
    return [word for flag, value in values.items() for word in (f"--{flag}", value)]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder` with its content hash and modification time."""
    return {
        str(path.relative_to(folder)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*")) if path.is_file()
    }


def assert_refused_and_untouched(main, argv, message: str, folder: Path, capsys) -> str:
    """`main(argv)` exits 2 with `message` on its `error:` line, and `folder` is as it was before."""
    before = snapshot(folder)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == EXIT_USER_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors
    after = snapshot(folder)
    assert {path: after[path] for path in before} == before, "an earlier file was changed"
    assert set(after) - set(before) <= {LOCK_FILE}, f"new files: {sorted(set(after) - set(before))}"
    return errors[0]


CASES = {
    # id: (step, flag overrides; "{tmp}" is the test's folder, message on the error line)
    "model_path_missing": ("step1", {"model_name_or_path": "{tmp}/missing/model"}, "no such folder; check the path"),
    "model_name_unknown_offline_hub": ("step2", {"model_name_or_path": "nobody/no-such-model"},
                                       "is not a local folder and the Hugging Face hub is offline"),
    "model_folder_without_config": ("step1", {"model_name_or_path": "{tmp}"}, "holds no config.json"),
    "dataset_path_missing": ("step1", {"data_path": "{tmp}/missing.jsonl"}, "missing.jsonl does not exist"),
    "dataset_name_unknown": ("step2", {"data_path": "no_such_dataset"},
                             "could not load dataset 'no_such_dataset' from the Hugging Face hub"),
    "dataset_hub_offline": ("step1", {"data_path": "someone/preference-pairs"},
                            "could not load dataset 'someone/preference-pairs' from the Hugging Face hub"),
    "data_split_sums_to_zero": ("step1", {"data_split": "0,0,0"},
                                "--data_split '0,0,0' must be three non-negative numbers with a positive sum"),
    "data_split_gives_no_share": ("step2", {"data_split": "1,0,1"}, "gives step 2 no share of the data"),
    "train_batch_size_zero": ("step1", {"per_device_train_batch_size": "0"},
                              "--per_device_train_batch_size must be positive, got 0"),
    "eval_batch_size_negative": ("step2", {"per_device_eval_batch_size": "-1"},
                                 "--per_device_eval_batch_size must be positive, got -1"),
    "accumulation_beyond_the_data": ("step1", {"gradient_accumulation_steps": "64"},
                                     "fewer than one optimizer step of 64"),
    "max_seq_len_zero": ("step1", {"max_seq_len": "0"},
                         "--max_seq_len must be at least 2 (a prompt token and a reply token), got 0"),
    "eval_iters_zero": ("step1", {"eval_iters": "0"}, "--eval_iters must be positive, got 0"),  # perplexity 1.0
    "eval_interval_negative": ("step2", {"eval_interval": "-1"}, "--eval_interval must be 0 or positive, got -1"),
    "warmup_negative": ("step1", {"num_warmup_steps": "-3"}, "--num_warmup_steps must be 0 or positive, got -3"),
    "lora_dim_negative": ("step2", {"lora_dim": "-4"}, "--lora_dim must be 0 or positive, got -4"),
    "offload_at_zero_0": ("step1", {"offload": "true"}, "--offload needs --zero_stage 1, 2 or 3"),
    "lora_learning_rate_without_lora": ("step2", {"lora_learning_rate": "1e-4"},
                                        "--lora_learning_rate needs --lora_dim > 0"),
    "lora_module_name_without_lora": ("step1", {"lora_module_name": "h."}, "--lora_module_name needs --lora_dim > 0"),
    "max_seq_len_beyond_positions": ("step2", {"max_seq_len": "1024"},
                                     "--max_seq_len 1024 exceeds the 256 positions of"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_error_and_overwrites_nothing(distributed, setup, capsys, case):
    step, overrides, message = CASES[case]
    overrides = {flag: value.format(tmp=setup.tmp) for flag, value in overrides.items()}
    assert_refused_and_untouched(STEPS[step], step_args(setup, **overrides), message, setup.run, capsys)


def test_a_data_cache_folder_that_is_a_file(distributed, setup, capsys):
    """--data_output_path pointing at a file ended in a FileExistsError traceback."""
    (setup.tmp / "cachefile").write_text("not a folder")
    assert_refused_and_untouched(step1_main, step_args(setup, data_output_path=str(setup.tmp / "cachefile")),
                                 "a file stands where the data cache's folder goes", setup.run, capsys)


@pytest.mark.parametrize("tool", ["rw_eval", "prompt_eval"])
def test_an_output_file_that_is_a_folder_is_refused_before_any_work(setup, capsys, tool):
    """It failed with IsADirectoryError once every row was scored or answered."""
    from step1_sft.prompt_eval import main as prompt_eval_main
    from step2_reward.rw_eval import main as rw_eval_main

    folder = setup.tmp / "results"
    folder.mkdir()
    argv = (["--model_name_or_path", "no-such-model-is-loaded", "--prompt", "p", "--answer", "a"] if tool == "rw_eval"
            else ["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b"])
    with pytest.raises(SystemExit) as exited:
        (rw_eval_main if tool == "rw_eval" else prompt_eval_main)([*argv, "--output_file", str(folder)])
    assert exited.value.code == EXIT_USER_ERROR
    assert f"--output_file {folder} is a folder" in capsys.readouterr().err


def test_output_dir_that_is_a_file(distributed, setup, capsys):
    results = setup.tmp / "results.txt"
    results.write_text("earlier results")
    assert_refused_and_untouched(step1_main, step_args(setup, output_dir=str(results)),
                                 f"--output_dir {results} is a file, not a folder", setup.tmp, capsys)


def test_no_disk_space(distributed, setup, capsys, monkeypatch):
    usage = shutil.disk_usage(setup.tmp)
    monkeypatch.setattr("training.reliability.validation.shutil.disk_usage", lambda path: usage._replace(free=1000))
    assert_refused_and_untouched(step2_main, step_args(setup), "only 0.00 GB are free on the disk of", setup.run, capsys)


def test_model_with_its_own_code_needs_trust_remote_code(distributed, setup, capsys):
    model = make_custom_code_model_dir(setup.tmp / "custom")
    assert_refused_and_untouched(step1_main, step_args(setup, model_name_or_path=model),
                                 "runs only with --trust_remote_code", setup.run, capsys)


class _RunsCode:
    """Unpickling this would create the file named in `marker`: the proof that a load ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_model_weights_are_refused_without_running_code(distributed, setup, capsys):
    import torch

    marker = setup.tmp / "code_ran"
    (Path(setup.model) / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, Path(setup.model) / "pytorch_model.bin")
    assert_refused_and_untouched(step1_main, step_args(setup), "hold pickled objects that a safe load refuses",
                                 setup.run, capsys)
    assert not marker.exists()


def test_reward_model_without_a_value_head(distributed, setup, capsys):
    """Step 3 needs step 2's output as its critic and reward model; an SFT model folder is refused."""
    step3_run = setup.tmp / "step3"
    (step3_run / "actor").mkdir(parents=True)
    (step3_run / "actor" / "config.json").write_text("{}\n")
    argv = ["--actor_model_name_or_path", setup.model, "--critic_model_name_or_path", str(setup.run),
            "--data_path", setup.data, "--data_output_path", str(setup.tmp / "cache"), "--output_dir", str(step3_run)]
    assert_refused_and_untouched(step3_main, argv, "is not a reward model (missing reward_model.json, "
                                 "value_head.safetensors); pass the run folder", step3_run, capsys)
    with pytest.raises(UserError, match="has no value head: it was not trained by step 2"):
        RewardModel.from_pretrained(setup.run)


def test_a_reward_model_given_where_a_causal_lm_trains_is_refused(distributed, setup, capsys):
    """A step-2 folder loads as a causal LM with a freshly drawn LM head: step 1, DPO and step 3 trained it and
    prompt_eval answered with it, silently (untied models; a tied one hides the missing head)."""
    from step1_sft.prompt_eval import main as prompt_eval_main
    from step2_reward.dpo.main import main as dpo_main

    reward = setup.tmp / "reward"
    shutil.copytree(setup.model, reward / "model")
    (reward / "model" / "reward_model.json").write_text(json.dumps({"format": "rlhf-reward-model"}))
    message = "is a reward model or critic (a backbone and a value head: step 2's model, step 3's critic/); it has no"
    for main in (step1_main, dpo_main):
        assert_refused_and_untouched(main, step_args(setup, model_name_or_path=str(reward)), message, setup.run,
                                     capsys)
    step3_run = setup.tmp / "step3"
    step3_run.mkdir()
    argv = ["--actor_model_name_or_path", str(reward), "--critic_model_name_or_path", str(reward),
            "--data_path", setup.data, "--output_dir", str(step3_run)]
    assert_refused_and_untouched(step3_main, argv, f"--actor_model_name_or_path {reward} {message}", step3_run, capsys)
    with pytest.raises(SystemExit) as exited:
        prompt_eval_main(["--model_name_or_path_baseline", setup.model, "--model_name_or_path_finetune", str(reward),
                          "--prompts", "Compute 3 + 4."])
    assert exited.value.code == EXIT_USER_ERROR and message in capsys.readouterr().err


def test_step3_refuses_rollouts_longer_than_the_reward_models_positions(distributed, setup, capsys):
    """Only the actor's positions were checked: a reward model of fewer failed with an IndexError in its embedding
    at the first scoring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    short = make_tiny_model_dir(setup.tmp / "short", "gpt2", max_positions=32)
    tokenizer = AutoTokenizer.from_pretrained(short)
    RewardModel.from_causal_lm(AutoModelForCausalLM.from_pretrained(short), tokenizer).save_pretrained(
        setup.tmp / "reward")
    tokenizer.save_pretrained(setup.tmp / "reward")
    step3_run = setup.tmp / "step3"
    step3_run.mkdir()
    argv = ["--actor_model_name_or_path", setup.model, "--critic_model_name_or_path", str(setup.tmp / "reward"),
            "--data_path", setup.data, "--data_output_path", str(setup.tmp / "cache"), "--output_dir", str(step3_run),
            "--max_prompt_seq_len", "64", "--max_answer_seq_len", "16", "--dtype", "fp32", "--max_steps", "1"]
    assert_refused_and_untouched(step3_main, argv, "= 80 tokens exceed the 32 positions of "
                                 f"{setup.tmp / 'reward'}", step3_run, capsys)


def test_an_output_dir_that_holds_the_input_model_is_refused(distributed, setup, capsys):
    """A run writing into the folder of the model it reads replaced that model with its own final save (and its
    records), so the model it started from was lost."""
    message = "lies in --output_dir {out} where this run writes its model, checkpoints and records: it would write"
    for model in (setup.run, setup.run / "model"):
        argv = step_args(setup, model_name_or_path=str(model))
        assert_refused_and_untouched(step1_main, argv, message.format(out=setup.run), setup.run, capsys)
    shutil.copytree(setup.model, setup.tmp / "experiment" / "base")  # beside what the run writes: nothing is in its way
    step1_main(step_args(setup, model_name_or_path=str(setup.tmp / "experiment" / "base"),
                         output_dir=str(setup.tmp / "experiment")))
    assert (setup.tmp / "experiment" / "model" / "config.json").is_file()
    step3_run = setup.tmp / "step3"
    shutil.copytree(setup.model, step3_run / "actor")
    argv = ["--actor_model_name_or_path", str(step3_run / "actor"), "--critic_model_name_or_path", str(setup.run),
            "--data_path", setup.data, "--output_dir", str(step3_run)]
    error = assert_refused_and_untouched(step3_main, argv, message.format(out=step3_run), step3_run, capsys)
    assert error.startswith(f"error: --actor_model_name_or_path {step3_run / 'actor'} lies in"), error


def test_a_diverging_run_stops_at_the_non_finite_loss_naming_the_step_and_last_good_checkpoint(
        distributed, setup, capsys):
    run = setup.tmp / "diverging"
    argv = step_args(setup, output_dir=str(run), learning_rate="1e30", max_steps="6", save_interval="1",
                     gradient_clipping="0")
    with pytest.raises(SystemExit) as exited:
        step1_main(argv)
    assert exited.value.code == EXIT_USER_ERROR
    error = capsys.readouterr().err.splitlines()[-1]
    found = re.fullmatch(r"error: training loss is not finite \((nan|inf)\) at step (\d+); stopping\. the last good "
                         r"checkpoint is (\S+) \(step (\d+)\): continue from it with --resume \(a resumed run takes a "
                         r"new --learning_rate and --gradient_clipping\), or start again, e\.g\. with a lower "
                         r"--learning_rate.*", error)
    assert found, error
    failed_step, checkpoint, good_step = int(found[2]), Path(found[3]), int(found[4])
    assert 1 < failed_step < 6 and good_step == failed_step - 1
    assert checkpoint == run / "checkpoints" / f"step{good_step}" and (checkpoint / "checkpoint.json").is_file()
    assert not (run / "checkpoints" / f"step{failed_step}").exists() and not (run / "model").exists()


def write_earlier_run(setup, name: str, **recorded) -> Path:
    """A run folder as an earlier step leaves it: its final model and the args.json it recorded."""
    run = setup.tmp / name
    shutil.copytree(setup.model, run / "model")
    values = {"model_name_or_path": setup.model, "data_path": [setup.data], "data_split": "1,1,0", "seed": 1234,
              "eval_fraction": 0.1, "output_dir": str(run), **recorded}
    (run / "args.json").write_text(json.dumps(values, indent=2))
    return run


def test_step2_refuses_a_step1_model_whose_shards_overlap_its_own(distributed, setup, capsys):
    step1 = write_earlier_run(setup, "step1", seed=7)
    error = assert_refused_and_untouched(step2_main, step_args(setup, model_name_or_path=str(step1)),
                                         f"--model_name_or_path {step1} was trained on", setup.run, capsys)
    assert "--seed 7 --data_split 1,1,0" in error and "--seed 1234 --data_split 1,1,0" in error
    assert f"rerun with --seed 7 --data_split 1,1,0 to match {step1}" in error
    split = write_earlier_run(setup, "split", data_split="2,1,0")
    assert_refused_and_untouched(step2_main, step_args(setup, model_name_or_path=str(split / "model")),
                                 "--seed 1234 --data_split 2,1,0", setup.run, capsys)


def test_step2_refuses_a_step1_model_that_trained_on_all_of_its_data(distributed, setup, capsys):
    """A source step 1 took whole (--sft_only_data_path) overlaps any shard of it, whatever the seeds."""
    step1 = write_earlier_run(setup, "sft_only", data_path=[], sft_only_data_path=[setup.data])
    error = assert_refused_and_untouched(step2_main, step_args(setup, model_name_or_path=str(step1)),
                                         f"--model_name_or_path {step1} was trained on all of {setup.data} "
                                         "(--sft_only_data_path)", setup.run, capsys)
    assert "drop it from --data_path" in error


def test_step2_refuses_a_step1_run_whose_data_gained_a_record_since(distributed, setup, capsys):
    """Step 1 skipped a malformed line, which the user then fixed: with one more record, the same --seed and
    --data_split permute every record anew, and step 2's shard overlapped the rows step 1 trained on."""
    lines = Path(setup.data).read_text().splitlines()
    Path(setup.data).write_text("\n".join(lines[:5] + [lines[5][:-1]] + lines[6:]) + "\n")
    step1 = setup.tmp / "step1"
    step1_main(step_args(setup, output_dir=str(step1)))
    Path(setup.data).write_text("\n".join(lines) + "\n")
    assert_refused_and_untouched(step2_main, step_args(setup, model_name_or_path=str(step1)),
                                 f"--model_name_or_path {step1} was trained on a shard of {setup.data} cut from its 15 "
                                 "records, but it holds 16 now", setup.run, capsys)


def test_step3_refuses_step1_and_step2_models_cut_another_way(distributed, setup, capsys):
    from training.core.reward_model import MARKER_FILE, VALUE_HEAD_FILE

    step1 = write_earlier_run(setup, "step1", data_split="1,1,1")
    step2 = write_earlier_run(setup, "step2", seed=99, data_split="1,1,1")
    for marker in (MARKER_FILE, VALUE_HEAD_FILE):
        (step2 / "model" / marker).write_text("{}")
    step3_run = setup.tmp / "step3"
    step3_run.mkdir()
    argv = ["--actor_model_name_or_path", str(step1), "--critic_model_name_or_path", str(step2),
            "--data_path", setup.data, "--data_split", "1,1,1", "--data_output_path", str(setup.tmp / "cache"),
            "--max_prompt_seq_len", "64", "--max_answer_seq_len", "32", "--output_dir", str(step3_run)]
    assert_refused_and_untouched(step3_main, argv, f"--critic_model_name_or_path {step2} was trained on", step3_run,
                                 capsys)
    assert_refused_and_untouched(step3_main, argv + ["--seed", "99"],
                                 f"--actor_model_name_or_path {step1} was trained on", step3_run, capsys)


@dataclass
class _DataCLI:
    data: DataArguments


def test_the_shard_check_finds_a_relative_data_path_from_another_directory(setup, tmp_path, monkeypatch):
    """Step 1 ran from the project folder on data/pairs.jsonl; step 2 runs from scripts/ on ../data/pairs.jsonl,
    the same file, cut with another seed: refused. (args.json held the path as typed, which the check resolved
    from step 2's directory: another file, so the overlap passed.) A record of the typed path still compares equal
    to the run's own from the directory it was typed in (earlier runs' args.json and checkpoints)."""
    from training.core.args import SettingsParser, flag_values
    from training.reliability.run_records import changed_flags
    from training.reliability.validation import check_input_run_shards

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "scripts").mkdir()
    shutil.copy(setup.data, project / "data" / "pairs.jsonl")
    monkeypatch.chdir(project)
    step1 = SettingsParser(_DataCLI).parse_args(["--data_path", "data/pairs.jsonl", "--data_split", "1,1,0"])
    run = write_earlier_run(setup, "relative", **flag_values(step1))
    assert changed_flags({"data_path": ["data/pairs.jsonl"]}, {"data_path": step1.data.data_path}) == {}
    monkeypatch.chdir(project / "scripts")
    step2 = SettingsParser(_DataCLI).parse_args(["--data_path", "../data/pairs.jsonl", "--data_split", "1,1,0",
                                                 "--seed", "7"]).data
    with pytest.raises(UserError, match="was trained on"):
        check_input_run_shards(str(run), step2, 2)


def test_input_runs_with_the_same_shards_or_other_data_pass_the_shard_check(setup, tmp_path):
    from training.core.args import SettingsParser
    from training.reliability.validation import check_input_run_shards

    args = SettingsParser(_DataCLI).parse_args(["--data_path", setup.data, "--data_split", "2,2,0"]).data
    check_input_run_shards(str(write_earlier_run(setup, "same", data_split="1,1,0")), args, 2)  # 2,2,0 cuts as 1,1,0
    check_input_run_shards(str(write_earlier_run(setup, "other_data", seed=7, data_path=["embedded"])), args, 2)
    check_input_run_shards(setup.model, args, 2)  # a plain model folder: no args.json
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "args.json").write_text('{"seed": 7}')  # not this project's run arguments
    check_input_run_shards(str(tmp_path / "foreign"), args, 2)
    with pytest.raises(UserError, match="was trained on"):
        check_input_run_shards(str(write_earlier_run(setup, "other_seed", seed=7)), args, 2)


def test_a_run_of_the_same_step_holds_out_no_record_its_input_run_trained_on(setup):
    """Step 2 started from a step-2 run (its data_split.json says so) with a larger --eval_fraction held out records
    that run trained on (40 of 80 held-out records of 1,000 at 0.2 against 0.1), and step 1 with another --seed cut
    the held-out part of a step-1-only source anew: both passed the check, which compared --seed and --data_split
    alone. A smaller --eval_fraction holds out a part of what the run held out; another step's shard, and a run whose
    record does not say its step (written before it did), are not checked for it."""
    from training.core.args import SettingsParser
    from training.reliability.validation import check_input_run_shards
    from utils.data import write_split_record

    def data(*flags: str) -> DataArguments:
        return SettingsParser(_DataCLI).parse_args(["--data_path", setup.data, "--data_split", "1,1,0", *flags]).data

    step2_run = write_earlier_run(setup, "step2_run")  # --eval_fraction 0.1
    write_split_record(step2_run, [(setup.data, 30)], 2)
    with pytest.raises(UserError, match="would hold out records that model trained on and score it on them; rerun "
                                        "with --eval_fraction 0.1 or less"):
        check_input_run_shards(str(step2_run), data("--eval_fraction", "0.3"), 2)
    check_input_run_shards(str(step2_run), data("--eval_fraction", "0.05"), 2)
    check_input_run_shards(str(step2_run), data("--eval_fraction", "0.3"), 3)
    check_input_run_shards(str(write_earlier_run(setup, "unrecorded")), data("--eval_fraction", "0.3"), 2)
    step1_run = write_earlier_run(setup, "step1_run", data_path=["embedded"], sft_only_data_path=[setup.data])
    write_split_record(step1_run, [("embedded", 1000)], 1)

    def step1(*flags: str) -> DataArguments:
        return SettingsParser(_DataCLI).parse_args(["--data_path", "task:arithmetic", "--sft_only_data_path",
                                                    setup.data, *flags]).data

    with pytest.raises(UserError, match="--sft_only_data_path.* cut with --seed 1234.*rerun with --seed 1234"):
        check_input_run_shards(str(step1_run), step1("--seed", "7"), 1)
    with pytest.raises(UserError, match="rerun with --eval_fraction 0.1 or less"):
        check_input_run_shards(str(step1_run), step1("--eval_fraction", "0.2"), 1)
    check_input_run_shards(str(step1_run), step1(), 1)


def test_step_1_refuses_a_source_its_step_1_input_run_sharded_and_it_reads_whole(setup):
    """A source moved from --data_path to --sft_only_data_path between two step-1 runs was not refused (the check
    returned None): the step-1-only source's held-out part is cut by --seed alone, so it held out records the input
    run trained on. And step 2 started from a DPO run (both train on shard 2) was told the input was a run of 'this
    same step'."""
    from training.core.args import SettingsParser
    from training.reliability.validation import check_input_run_shards
    from utils.data import write_split_record

    step1_run = write_earlier_run(setup, "step1_run")
    write_split_record(step1_run, [(setup.data, 16)], 1)
    moved = SettingsParser(_DataCLI).parse_args(["--data_path", "embedded", "--sft_only_data_path", setup.data]).data
    with pytest.raises(UserError, match=r"cut .*pairs.jsonl into shards \(--data_path\).* reads it whole "
                                        r"\(--sft_only_data_path\).*keep it in --data_path"):
        check_input_run_shards(str(step1_run), moved, 1)
    check_input_run_shards(str(step1_run), moved, 2)  # step 2 reads no step-1-only source
    dpo_run = write_earlier_run(setup, "dpo_run")
    write_split_record(dpo_run, [(setup.data, 16)], 2)
    larger = SettingsParser(_DataCLI).parse_args(["--data_path", setup.data, "--data_split", "1,1,0",
                                                  "--eval_fraction", "0.3"]).data
    with pytest.raises(UserError, match=r"was trained on this step's shard \(a run of this step, or of DPO for step 2"):
        check_input_run_shards(str(dpo_run), larger, 2)
