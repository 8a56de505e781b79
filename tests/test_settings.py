"""Settings defined once: the dataclass fields are the flags (names, defaults, choices, required-ness),
step 3's per-model groups are prefixed copies of one dataclass, and args.json holds one key per flag."""
import argparse
import json
from dataclasses import fields

import pytest

from inference import chatbot
from step1_sft import prompt_eval
from step1_sft.main import build_parser as step1_parser
from step2_reward import rw_eval
from step2_reward.dpo.main import build_parser as dpo_parser
from step2_reward.main import build_parser as step2_parser
from step3_rlhf.main import build_parser as step3_parser
from step3_rlhf.ppo_trainer import PPOConfig
from training.algorithms import get_rl_algorithm
from training.core.args import ModelTrainingConfig, flag_values
from training.reliability.run_records import ARGS_FILE, save_run_args

REQUIRED = {
    "step1": [],
    "step2": [],
    "step3": ["--actor_model_name_or_path", "a"],  # the reward model is optional (with --reward_fn)
}
PARSERS = {"step1": step1_parser, "step2": step2_parser, "step3": step3_parser}


def _minimal_argv(step: str) -> list[str]:
    return REQUIRED[step] + ["--output_dir", "run"]


def _flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]


@pytest.mark.parametrize("step", sorted(PARSERS))
def test_each_flag_is_one_field_with_the_flags_default(step):
    parser = PARSERS[step]()
    actions = _flag_actions(parser)
    values = flag_values(parser.parse_args(_minimal_argv(step)))
    assert sorted(values) == sorted(action.dest for action in actions)
    for action in actions:
        assert action.option_strings == [f"--{action.dest}"], "exactly the DeepSpeed-Chat spelling, no dashed alias"
        if action.dest in PPOConfig.ALGORITHM_DEFAULTS:  # None on the command line: the default algorithm's
            assert action.default is None and values[action.dest] == getattr(get_rl_algorithm("ppo"), action.dest)
        elif not action.required:
            assert values[action.dest] == action.default, action.dest


@pytest.mark.parametrize("step", sorted(PARSERS))
def test_flag_values_round_trip_through_the_command_line(step):
    parser = PARSERS[step]()
    changed = ["--seed", "7", "--data_path", "x.jsonl", "y.jsonl", "--max_steps", "3", "--resume", "--dtype", "fp32"]
    settings = parser.parse_args(_minimal_argv(step) + changed)
    argv = []
    for name, value in flag_values(settings).items():
        if isinstance(value, bool):
            argv += [f"--{name}"] if value else []
        elif isinstance(value, list):
            argv += [f"--{name}", *value]
        elif value is not None:
            argv += [f"--{name}", str(value)]
    assert parser.parse_args(argv) == settings


def test_supervised_steps_differ_only_in_their_learning_rate_and_data_shard():
    first, second = step1_parser().parse_args(["--output_dir", "r"]), step2_parser().parse_args(["--output_dir", "r"])
    assert (first.training.learning_rate, second.training.learning_rate) == (1e-5, 2e-5)
    assert (first.phase, second.phase) == (1, 2)
    second.training.learning_rate = first.training.learning_rate
    assert flag_values(first) == flag_values(second)


def test_step3_model_groups_are_prefixed_copies_of_one_dataclass():
    parser = step3_parser()
    options = {action.dest for action in _flag_actions(parser)}
    for prefix in ("actor_", "critic_"):
        assert {prefix + f.name for f in fields(ModelTrainingConfig)} <= options
    assert "zero_stage" not in options and "lora_dim" not in options
    settings = parser.parse_args(_minimal_argv("step3") + ["--actor_zero_stage", "3", "--critic_lora_dim", "4",
                                                           "--critic_offload", "--actor_learning_rate", "3e-6"])
    assert settings.actor == ModelTrainingConfig(zero_stage=3, learning_rate=3e-6)
    assert settings.critic == ModelTrainingConfig(lora_dim=4, offload=True)
    with pytest.raises(SystemExit):
        parser.parse_args(_minimal_argv("step3") + ["--actor_zero_stage", "4"])  # choices come from the field


def test_step3_settings_flags_that_differ_from_their_fields():
    settings = step3_parser().parse_args(_minimal_argv("step3") + ["--disable_advantage_whitening", "--temperature",
                                                                   "0.5", "--disable_cuda_graph"])
    assert not settings.ppo.whiten_advantages and settings.ppo.temperature == 0.5
    assert not settings.hybrid.cuda_graph and settings.hybrid.onednn_packing
    assert settings.ppo.max_answer_seq_len == 128
    with pytest.raises(SystemExit):
        step3_parser().parse_args(["--output_dir", "run"])  # the two model paths are required


def test_switches_optional_lists_and_the_hidden_launcher_flag(capsys):
    parser = step1_parser()
    settings = parser.parse_args(["--output_dir", "r", "--offload", "--sft_only_data_path", "--local_rank", "3"])
    assert settings.training.offload is True and settings.data.sft_only_data_path == [] and settings.run.local_rank == 3
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "--zero_stage" in help_text and "--local_rank" not in help_text and "30% slower" in help_text


@pytest.mark.parametrize("build_parser", [step1_parser, step2_parser, step3_parser, dpo_parser, chatbot.build_parser,
                                          prompt_eval.build_parser, rw_eval.build_parser])
def test_every_flag_says_what_it_does_and_its_default_in_help(build_parser):
    """A field without a help string shows neither a meaning nor a default under --help (the chatbot's
    --temperature 0.7 read as a bare flag)."""
    silent = [action.option_strings[0] for action in _flag_actions(build_parser())
              if not action.help]
    assert silent == []


@pytest.mark.parametrize("step", sorted(PARSERS))
def test_args_json_has_one_key_per_flag(step, tmp_path):
    parser = PARSERS[step]()
    save_run_args(tmp_path, flag_values(parser.parse_args(_minimal_argv(step))))
    recorded = json.loads((tmp_path / ARGS_FILE).read_text())
    assert sorted(recorded) == sorted(action.dest for action in _flag_actions(parser))
    assert {"seed", "data_split", "data_path"} <= set(recorded)
    if step == "step3":
        assert recorded["actor_zero_stage"] == 0 and recorded["disable_advantage_whitening"] is False


def _decoding(settings) -> tuple[dict, list[str]]:
    """A tool's `generate` keyword arguments, and the names of the logits processors among them."""
    kwargs = settings.generate_kwargs(64, [0])
    return kwargs, [type(processor).__name__ for processor in kwargs.pop("logits_processor")]


def test_each_tool_keeps_its_sampling_defaults():
    chat = chatbot.build_parser().parse_args([]).sampling
    assert (chat.max_new_tokens, chat.temperature, chat.top_p, chat.top_k, chat.repetition_penalty) == \
        (None, 0.7, 0.9, 50, 1.1)  # None: as long as the model's run let answers be (`answer_limit`)
    assert _decoding(chat) == ({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50},
                               ["BeyondTokenizerBan", "RepetitionPenaltySparingStops"])
    greedy = chatbot.build_parser().parse_args(["--greedy", "--model", "m"])
    assert greedy.chat.path == "m"
    assert _decoding(greedy.sampling) == ({"do_sample": False}, ["BeyondTokenizerBan", "RepetitionPenaltySparingStops"])
    evaluation = prompt_eval.parse_args(["--model_name_or_path_finetune", "f"]).generation
    assert (evaluation.do_sample, evaluation.temperature, evaluation.top_p, evaluation.top_k) == (False, 1.0, 1.0, 50)
    assert _decoding(evaluation) == ({"do_sample": False, "num_beams": 1}, ["BeyondTokenizerBan"])  # penalty 1.0: none
    assert prompt_eval.answer_limit(evaluation.max_new_tokens, "f").max_new_tokens == 128  # not a run of this project
    rollout = step3_parser().parse_args(_minimal_argv("step3")).sampling
    assert (rollout.temperature, rollout.top_p, rollout.top_k) == (1.0, 1.0, 0)


def test_repeatable_flags_of_the_scoring_and_chat_tools():
    args = rw_eval.parse_args(["--model_name_or_path", "m", "--prompt", "p", "--answer", "a", "--answer", "b"])
    assert args.answer == ["a", "b"] and args.dtype == "auto"
    assert chatbot.build_parser().parse_args(["--prompt", "x", "--prompt", "y"]).chat.prompt == ["x", "y"]
    with pytest.raises(SystemExit):
        rw_eval.parse_args(["--model_name_or_path", "m"])
