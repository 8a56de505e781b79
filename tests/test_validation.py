"""Start-up checks: each bad input ends in one clear UserError and leaves existing files as they were.
Also the non-finite guard, which stops a run with the step and the checkpoint to resume from."""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_config, make_custom_code_model_dir

from training.core.model_loading import load_causal_lm, load_tokenizer
from training.reliability.checkpointing import MARKER_FILE, CheckpointManager
from training.reliability.guards import NonFiniteError, check_finite
from training.reliability.validation import (
    check_disk_space,
    check_model_source,
    check_output_dir,
    check_remote_code,
    check_reward_model_dir,
    check_sequence_lengths,
    estimate_output_bytes,
    model_max_positions,
    parse_data_split,
)
from utils.errors import UserError

REWARD_FILES = ("reward_model.json", "value_head.safetensors")


def test_output_dir_that_is_a_file_is_refused_and_kept(tmp_path):
    existing = tmp_path / "results"
    existing.write_text("keep me")
    with pytest.raises(UserError, match=f"--output_dir {existing} is a file, not a folder; choose another --output_dir"):
        check_output_dir(existing)
    with pytest.raises(UserError, match="part of that path is a file"):
        check_output_dir(existing / "run")
    assert existing.read_text() == "keep me"
    assert check_output_dir(tmp_path / "a" / "b").is_dir()


def test_disk_space_check_compares_free_space_with_the_estimate(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_disk_space(tmp_path / "not" / "yet" / "there", 1024)
    with pytest.raises(UserError, match=r"only [\d.]+ GB are free on the disk of .*, but step 1 will write about "
                                        r"[\d.]+ GB; free some space, keep fewer checkpoints"):
        check_disk_space(tmp_path, free + 2**40, what="step 1")
    # 10 params fp32: model 40 B; checkpoint 40 + 80 (Adam) B; 2 kept + 1 being written
    assert estimate_output_bytes(10, 4, keep_last_checkpoints=2) == 40 + 3 * 120
    # bf16 adds an fp32 master copy; only trainable parameters carry optimizer state
    assert estimate_output_bytes(10, 2, trainable_params=1, keep_last_checkpoints=1) == 20 + 2 * (20 + 12)
    assert estimate_output_bytes(10, 4) == 40
    # a resume finds checkpoints on disk: only those still to come (at least the one being written) need room
    assert estimate_output_bytes(10, 4, keep_last_checkpoints=2, checkpoints_on_disk=1) == 40 + 2 * 120
    assert estimate_output_bytes(10, 4, keep_last_checkpoints=2, checkpoints_on_disk=5) == 40 + 120


@pytest.mark.parametrize("arch,attribute", [("gpt2", "max_position_embeddings"), ("opt", "max_position_embeddings"),
                                             ("custom", "n_positions")])
def test_sequence_lengths_must_fit_the_model(arch, attribute):
    config = SimpleNamespace(n_positions=256) if arch == "custom" else make_config(arch, vocab_size=64)
    assert model_max_positions(config) == (256, attribute)
    check_sequence_lengths(config, max_seq_len=256, max_prompt_seq_len=128, max_answer_seq_len=128)
    with pytest.raises(UserError, match=f"--max_prompt_seq_len 200 \\+ --max_answer_seq_len 100 = 300 tokens exceed "
                                        f"the 256 positions of the model \\({attribute}\\); lower them"):
        check_sequence_lengths(config, max_prompt_seq_len=200, max_answer_seq_len=100)
    with pytest.raises(UserError, match="--max_seq_len 512 exceeds the 256 positions .*pass --max_seq_len 256 or less"):
        check_sequence_lengths(config, max_seq_len=512)
    with pytest.raises(UserError, match="--max_answer_seq_len must be a positive number of tokens, got 0"):
        check_sequence_lengths(config, max_prompt_seq_len=10, max_answer_seq_len=0)


def test_data_split_needs_three_weights_with_a_positive_sum():
    assert tuple(parse_data_split("2,4,4")) == (2.0, 4.0, 4.0)
    for bad in ("0,0,0", "1,2", "a,b,c", "1,-1,2"):
        with pytest.raises(UserError, match=f"--data_split '{bad}' must be three non-negative numbers with a positive sum"):
            parse_data_split(bad)


def test_model_source(tiny_model_dir, tmp_path, monkeypatch):
    model = tiny_model_dir("gpt2")
    check_model_source(model)
    check_model_source("smollm2-135m")
    run_folder = tmp_path / "step1"
    shutil.copytree(model, run_folder / "model")
    check_model_source(str(run_folder))
    with pytest.raises(UserError, match=r"--model_name_or_path ./missing/model: no such folder; check the path"):
        check_model_source("./missing/model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no config.json .*a previous step's run folder, or 'smollm2-135m'"):
        check_model_source(str(empty))
    step3_run = tmp_path / "step3"  # a step-3 run folder: its models one level down, none in model/
    for name in ("actor", "critic"):
        shutil.copytree(model, step3_run / name)
    (step3_run / "args.json").write_text("{}")
    with pytest.raises(UserError, match=rf"--actor_model_name_or_path {step3_run} is a folder of models \(actor, "
                                        rf"critic\), not a model; pass the one to start from, e\.g\. {step3_run}/actor"):
        check_model_source(str(step3_run), "--actor_model_name_or_path")
    adapter = tmp_path / "adapter"  # a PEFT/TRL LoRA save: the adapter alone
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}')
    with pytest.raises(UserError, match=r"adapter holds a LoRA adapter, not a whole model \(its base model: "
                                        r"'Qwen/Qwen2.5-0.5B'.*merge the adapter into its base model"):
        check_model_source(str(adapter))
    with pytest.raises(UserError, match="is a file"):
        check_model_source(str(run_folder / "model" / "config.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="--actor_model_name_or_path nobody/no-such-model is not a local folder and the "
                                        "Hugging Face hub is offline .* pass its local folder, or use 'smollm2-135m'"):
        check_model_source("nobody/no-such-model", flag="--actor_model_name_or_path")


def test_remote_code_needs_the_flag(tiny_model_dir, tmp_path):
    check_remote_code(tiny_model_dir("llama"), trust_remote_code=False)
    model = make_custom_code_model_dir(tmp_path / "custom")
    with pytest.raises(UserError, match="--model_name_or_path .*custom ships its own model code .* runs only with "
                                        "--trust_remote_code"):
        check_remote_code(model, trust_remote_code=False)
    check_remote_code(model, trust_remote_code=True)


def test_a_tokenizer_with_its_own_code_needs_the_flag_before_the_step_starts(tiny_model_dir, tmp_path):
    """A model of a type transformers knows whose tokenizer alone ships its own code passed the check, and the step
    created its output folder before the tokenizer's load refused it."""
    model = make_custom_code_model_dir(tmp_path / "custom")
    shutil.copy(Path(tiny_model_dir("llama")) / "config.json", Path(model) / "config.json")
    with pytest.raises(UserError, match="--model_name_or_path .*custom ships its own tokenizer code \\(auto_map in "
                                        "its tokenizer_config.json\\), which runs only with --trust_remote_code"):
        check_remote_code(model, trust_remote_code=False)
    check_remote_code(model, trust_remote_code=True)


def test_a_model_type_transformers_knows_needs_no_flag_for_its_auto_map(tiny_model_dir):
    """A checkpoint of a type transformers has since taken in keeps the auto_map of the code it shipped before
    (microsoft/Phi-3-mini-4k-instruct: model_type phi3, auto_map to its modeling_phi3.py); transformers loads it
    with its own code without trust_remote_code, and a local copy of it was refused as needing the flag."""
    model = tiny_model_dir("llama")
    config_file = Path(model) / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoConfig": "configuration_llama.LlamaConfig",
                          "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}
    config_file.write_text(json.dumps(config))
    check_remote_code(model, trust_remote_code=False)
    assert type(load_causal_lm(model, load_tokenizer(model))).__name__ == "LlamaForCausalLM"


def test_reward_model_folder_needs_a_value_head(tiny_model_dir, tmp_path):
    sft = tiny_model_dir("gpt2")
    with pytest.raises(UserError, match="--critic_model_name_or_path .* is not a reward model \\(missing reward_model.json, "
                                        "value_head.safetensors\\); pass the run folder .* written by step 2"):
        check_reward_model_dir(sft, REWARD_FILES)
    with pytest.raises(UserError, match="missing a value head"):
        check_reward_model_dir(sft, lambda folder: (folder / "reward_model.json").is_file())
    with pytest.raises(UserError, match="base language model with no value head"):
        check_reward_model_dir("smollm2-135m", REWARD_FILES)
    with pytest.raises(UserError, match="no such folder"):
        check_reward_model_dir(str(tmp_path / "nope"), REWARD_FILES)
    run_folder = tmp_path / "step2"
    shutil.copytree(sft, run_folder / "model")
    for name in REWARD_FILES:
        (run_folder / "model" / name).write_text("{}")
    assert check_reward_model_dir(str(run_folder), REWARD_FILES) == run_folder / "model"


def test_non_finite_values_stop_with_the_step_and_the_last_checkpoint(distributed, tmp_path):
    check_finite("train/loss", 1.5, step=3)
    check_finite("reward", torch.tensor([0.1, -2.0]), step=3)
    with pytest.raises(NonFiniteError, match="train/loss is not finite \\(nan\\) at step 7; stopping. no checkpoint "
                                             "was saved before it \\(set --save_interval"):
        check_finite("train/loss", math.nan, step=7)
    manager = CheckpointManager(tmp_path)
    folder = manager.checkpoints_dir / "step5"
    folder.mkdir(parents=True)
    (folder / MARKER_FILE).write_text(json.dumps({"step": 5, "engines": ["actor"]}))
    with pytest.raises(NonFiniteError, match=f"reward is not finite \\(1 of 3 values non-finite\\) at step 9; stopping. "
                                             f"the last good checkpoint is {folder} \\(step 5\\): continue from it with --resume"):
        check_finite("reward", torch.tensor([0.0, math.inf, 1.0]), step=9, checkpoint_manager=manager)
    assert issubclass(NonFiniteError, UserError)
