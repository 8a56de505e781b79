"""Each step's flag-only checks (its settings' `check_flags`): the step runs them when it starts, and train.py runs
every step's before its first step, so a value step 3 refuses fails in seconds, not after steps 1 and 2 trained."""
import re
import shutil

import pytest

from step1_sft.main import build_parser as step1_parser
from step3_rlhf.main import build_parser as step3_parser
from training.core.args import flag_values
from training.pipeline.cli import parse_config
from training.pipeline.hardware import Hardware
from training.pipeline.runner import run_pipeline
from training.pipeline.steps import STEPS, StepEntry
from training.reliability.run_records import save_run_args, save_summary
from utils.errors import UserError

TWO_CORES = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=True)


class RecordedMains:
    """The steps' real parsers (so train.py runs their real checks) with mains that only record that they ran."""

    def __init__(self):
        self.ran: list[int] = []

    def main(self, step: int):
        def main(argv: list[str]) -> dict:
            self.ran.append(step)
            raise UserError(f"step {step} started")

        return main

    def entries(self) -> dict[int, StepEntry]:
        return {step: StepEntry(self.main(step), spec.entry().build_parser) for step, spec in STEPS.items()}


def train(tmp_path, model: str, *flags: str, mains: RecordedMains | None = None) -> dict:
    argv = ["--actor-model", model, "--reward-model", model, "--output-dir", str(tmp_path / "out"), *flags]
    return run_pipeline(parse_config(argv), entries=(mains or RecordedMains()).entries(), hardware=TWO_CORES)


@pytest.mark.parametrize("step3_args, message", [
    ("--ema_beta 2", r"--ema_beta must lie in \[0, 1\), got 2.0"),
    # the hybrid engine refused it when it was built, after step 3 had loaded its four models
    ("--enable_hybrid_engine --unpin_actor_parameters --keep_inference_copy",
     "--inference_tp_size > 1 and --keep_inference_copy need the gathered inference copy"),
    # the checkpoint manager refused it when it was made, in step 3's new run folder
    ("--keep_last_checkpoints 0", "--keep_last_checkpoints must be at least 1, got 0"),
    # refused once step 3 had loaded its tokenizer and read its models' configs
    ("--max_answer_seq_len 0", "--max_answer_seq_len must be positive, got 0"),
    # the data layer refused them when step 3 built its data, after its tokenizer had loaded
    ("--eval_fraction 1.5", r"--eval_fraction must be in \[0, 1\), not 1.5"),
    ("--data_split 1,2", "--data_split '1,2' must be three non-negative numbers"),
    # step 3 refused them as it laid out its models, once its processes had started
    ("--placement disaggregate", "the placement gives the rollout a share of 0.5 of 1 rank"),
    ("--placement auto --placement_ratio actor=1", "--placement_ratio 'actor=1' with --placement auto"),
])
def test_a_flag_step_3_refuses_fails_train_py_before_step_1_starts(tmp_path, tiny_model_dir, step3_args, message):
    """The flags parsed, and train.py trained steps 1 and 2 before step 3 refused them."""
    mains = RecordedMains()
    with pytest.raises(UserError, match=f"^step 3: {message}"):
        train(tmp_path, tiny_model_dir("llama"), "--step3-args", step3_args, mains=mains)
    assert mains.ran == [] and not (tmp_path / "out" / "step1").exists()


@pytest.mark.parametrize("step_args, message", [
    # the data build refused them, after the step had loaded its tokenizer (under train.py, after the steps before)
    ("--step1-args=--max_seq_len=1", "step 1: --max_seq_len must be at least 2 (a prompt token and a reply token)"),
    ("--step3-args=--max_seq_len=0", "step 3: --max_seq_len must be at least 2"),
    ("--step2-args=--max_prompt_seq_len=0", "step 2: --max_prompt_seq_len must be at least 1, got 0"),
    ("--step3-args=--max_train_samples=-1", "step 3: --max_train_samples must be 1 or more, not -1"),
    ("--step2-args=--max_train_samples=0", "step 2: --max_train_samples must be 1 or more, not 0"),
    ("--step1-args=--max_eval_samples=-1", "step 1: --max_eval_samples must be 0 or more, not -1"),
    # taken as 1
    ("--step3-args=--enable_hybrid_engine --actor_zero_stage 3 --tp_gather_partition_size 0",
     "step 3: --tp_gather_partition_size must be at least 1 (decoder layers gathered at once), got 0"),
    # AdamW refused it once the model had loaded
    ("--step1-args=--learning_rate=-1e-5", "step 1: --learning_rate must be 0 or positive, got -1e-05"),
    # taken without a word: per parameter group, or a clipping norm applied only when positive
    ("--step2-args=--lora_dim 8 --lora_learning_rate=-1e-4", "step 2: --lora_learning_rate must be 0 or positive"),
    ("--step3-args=--critic_weight_decay=-0.1", "step 3: --critic_weight_decay must be 0 or positive, got -0.1"),
    ("--step3-args=--gradient_clipping=-1", "step 3: --gradient_clipping must be 0 or positive, got -1.0"),
    # nan passed every comparison: AdamW refused it once the model had loaded, the others trained into nan losses
    ("--step1-args=--learning_rate=nan", "step 1: --learning_rate must be a finite number, got nan"),
    ("--step2-args=--weight_decay=inf", "step 2: --weight_decay must be a finite number, got inf"),
    ("--step3-args=--kl_ctl=nan", "step 3: --kl_ctl must be a finite number, got nan"),
    ("--step3-args=--temperature=nan", "step 3: --temperature must be a finite number, got nan"),
    ("--step3-args=--cliprange=inf", "step 3: --cliprange must be a finite number, got inf"),
    # a warm-up as long as the run kept the learning rate below the one given to the end
    ("--step1-args=--max_steps 5 --num_warmup_steps 5", "step 1: --num_warmup_steps 5 lasts the whole run (--max_steps 5 "
                                                       "optimizer steps), so the learning rate never reaches the one "
                                                       "given; give fewer warm-up steps than 5 (a tenth of the run is "
                                                       "usual), or 0 for none"),
    ("--step3-args=--max_steps 2 --num_warmup_steps 4 --ppo_epochs 2",
     "step 3: --num_warmup_steps 4 lasts the whole run (--max_steps 2 PPO steps of 2 optimizer steps each: 4)"),
    # inf once left the scores unclipped: the refusal says how to ask for that now
    ("--step3-args=--clip_reward_value=inf", "step 3: --clip_reward_value must be a finite number, got inf; to leave "
                                             "the reward model's scores unclipped give a bound above any score it "
                                             "gives (e.g. --clip_reward_value 1e6)"),
])
def test_a_value_only_a_later_stage_refused_fails_train_py_before_step_1_starts(tmp_path, tiny_model_dir, step_args,
                                                                              message):
    mains = RecordedMains()
    with pytest.raises(UserError, match=f"^{re.escape(message)}"):
        train(tmp_path, tiny_model_dir("llama"), step_args, mains=mains)
    assert mains.ran == [] and not (tmp_path / "out" / "step1").exists()


@pytest.mark.parametrize("step_args, message", [
    # the hybrid engine refused it when it was built, after steps 1 and 2 had trained and step 3 had loaded its models
    ("--step3-args=--enable_hybrid_engine --generation_dtype fp16",
     "step 3: --generation_dtype fp16: fp16 is not supported on CPU; use --generation_dtype bf16 or --generation_dtype "
     "fp32"),
    ("--step2-args=--dtype fp16", "step 2: --dtype fp16: fp16 is not supported on CPU"),  # when step 2 started
])
def test_a_precision_the_steps_device_lacks_fails_train_py_before_step_1_starts(tmp_path, tiny_model_dir, monkeypatch,
                                                                                step_args, message):
    """The cpu deployment runs the steps in train.py's process, on this CPU, and a GPU deployment run from a machine
    without a GPU launches its ranks on this CPU too: that one was not checked, so step 1 trained before a later step
    refused its precision. Only planned (a dry run from a login node), the ranks' devices are not this one's, and
    their precision is theirs to refuse."""
    from training.pipeline import runner

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched = []
    monkeypatch.setattr(runner, "run_subprocess", lambda command, *args, **kwargs: launched.append(command))
    model = tiny_model_dir("llama")
    mains = RecordedMains()
    for deployment in ("cpu", "single_gpu"):
        with pytest.raises(UserError, match=f"^{re.escape(message)}"):
            train(tmp_path, model, "--deployment-type", deployment, step_args, mains=mains)
    assert mains.ran == [] and launched == []
    train(tmp_path, model, "--deployment-type", "single_gpu", step_args, "--dry-run")


def test_every_steps_refusal_is_reported_at_once_naming_its_step(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(UserError) as refused:
        train(tmp_path, model, "--step1-args=--offload", "--step3-args", "--top_p 0.9", "--dry-run")
    message = str(refused.value)
    assert message.startswith("2 steps can't run as given, before any step runs: step 1: --offload needs --zero_stage")
    assert "; step 3: --top_p 0.9 / --top_k 0: step 3 samples rollouts from the full distribution" in message
    with pytest.raises(UserError, match=r"^2 steps can't run as given, before any step runs: step 1's flags do not "
                                        r"parse .*--learnin_rate.*; step 3's flags do not parse .*--ema_beta"):
        train(tmp_path, model, "--step1-args", "--learnin_rate 1", "--step3-args", "--ema_beta x", "--dry-run")
    with pytest.raises(UserError, match=r"^step 3: --kl_in_loss with --kl_estimator k1: "):  # refused as parsed
        train(tmp_path, model, "--step3-args", "--kl_in_loss --kl_estimator k1", "--dry-run")
    with pytest.raises(UserError, match=r"^step 4: --dpo_beta must be positive, got 0.0$"):
        train(tmp_path, model, "--algorithm", "dpo", "--dpo-args", "--dpo_beta 0", "--dry-run")
    with pytest.raises(UserError, match=r"^step 4: --dpo_beta must be a finite number, got nan$"):
        train(tmp_path, model, "--algorithm", "dpo", "--dpo-args", "--dpo_beta nan", "--dry-run")


def test_every_refusal_of_one_step_is_reported_at_once(tmp_path, tiny_model_dir):
    """Each step reported its first refusal only: a command line with three mistakes took three runs to tell."""
    model = tiny_model_dir("llama")
    with pytest.raises(UserError) as refused:
        train(tmp_path, model, "--step3-args", "--ema_beta 2 --top_p 0.9 --keep_last_checkpoints 0", "--dry-run")
    assert re.match(r"step 3: 3 problems: \(1\) --ema_beta must lie in \[0, 1\), got 2.0; \(2\) --top_p 0.9 / --top_k 0: "
                    r".*; \(3\) --keep_last_checkpoints must be at least 1, got 0", str(refused.value))
    with pytest.raises(UserError, match=r"^step 4: 2 problems: \(1\) --offload needs --zero_stage .*; \(2\) "
                                        r"--dpo_beta must be positive, got 0.0$"):
        train(tmp_path, model, "--algorithm", "dpo", "--dpo-args", "--offload --dpo_beta 0", "--dry-run")


@pytest.mark.parametrize("parser, argv, message", [
    (step1_parser, ["--max_seq_len", "0"],
     "--max_seq_len must be at least 2 (a prompt token and a reply token), got 0"),
    (step3_parser, ["--actor_model_name_or_path", "a", "--max_prompt_seq_len", "0"],
     "--max_prompt_seq_len must be at least 1, got 0"),
], ids=["step1", "step3"])
def test_a_length_two_checks_refuse_is_reported_once(parser, argv, message):
    """The step's positive-number check and the data's token limits both refused it: '2 problems', one flag."""
    with pytest.raises(UserError) as refused:
        parser().parse_args(["--output_dir", "run", *argv]).check_flags(1)
    assert str(refused.value) == message


def test_a_flag_every_step_refuses_is_not_blamed_on_routing(tmp_path, tiny_model_dir):
    """The --stepN-args hint is for a flag one step takes and another refuses, not for a value no step takes."""
    model = tiny_model_dir("llama")
    with pytest.raises(UserError) as refused:
        train(tmp_path, model, "--max_steps", "0", "--dry-run")
    assert str(refused.value).count("--max_steps must be positive, got 0") == 3
    assert "--step1-args" not in str(refused.value)
    with pytest.raises(UserError, match=r"^step 2: --lora_learning_rate needs .*: to give one to some steps only, "
                                        r"pass it in --step1-args/"):
        train(tmp_path, model, "--step", "1", "2", "--lora_learning_rate", "1e-3", "--step1-args", "--lora_dim 8",
              "--dry-run")


@pytest.mark.parametrize("module, model_flags, flags, message", [
    ("step1_sft.main", ["--model_name_or_path"], ["--offload"], "--offload needs --zero_stage 1, 2 or 3"),
    ("step1_sft.main", ["--model_name_or_path"], ["--save_interval", "-1"], "--save_interval must be 0 (off) or"),
    ("step2_reward.dpo.main", ["--model_name_or_path"], ["--dpo_label_smoothing", "0.5"],
     "--dpo_label_smoothing must be in [0, 0.5)"),
    ("step3_rlhf.main", ["--actor_model_name_or_path", "--critic_model_name_or_path"], ["--ema_beta", "2"],
     "--ema_beta must lie in [0, 1), got 2.0"),
    ("step3_rlhf.main", ["--actor_model_name_or_path", "--critic_model_name_or_path"],
     ["--enable_hybrid_engine", "--generation_dtype", "fp16"], "--generation_dtype fp16: fp16 is not supported on CPU"),
    # steps 2, 3 and DPO took step 1's own sources and trained without them
    *((module, model_flags, ["--sft_only_data_path", "sft.jsonl"], "--sft_only_data_path names sources step 1 alone")
      for module, model_flags in (("step2_reward.main", ["--model_name_or_path"]),
                                  ("step2_reward.dpo.main", ["--model_name_or_path"]),
                                  ("step3_rlhf.main", ["--actor_model_name_or_path", "--critic_model_name_or_path"]))),
])
def test_a_step_script_alone_still_refuses_the_flag(tmp_path, module, model_flags, flags, message):
    """Before it reads its models (which do not exist here) or writes its run folder."""
    import importlib

    models = [token for flag in model_flags for token in (flag, str(tmp_path / "no_model"))]
    with pytest.raises(UserError) as refused:
        importlib.import_module(module).main.__wrapped__([*models, "--output_dir", str(tmp_path / "run"), *flags])
    assert message in str(refused.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, refused", [("--sft_only_data_path", "names sources step 1 alone trains on"),
                                           ("--whole_sequence_loss", "sets step 1's loss alone")])
def test_train_py_gives_step_1s_own_flags_to_step_1_only(tmp_path, tiny_model_dir, flag, refused):
    """--sft_only_data_path went to every step, steps 2 and 3 taking it and ignoring it, and --whole_sequence_loss
    still did (step 2 and DPO ignored it); without step 1 in the run nothing reads them."""
    model, sft = tiny_model_dir("llama"), str(tmp_path / "sft.jsonl")
    (tmp_path / "sft.jsonl").write_text('{"prompt": "p", "chosen": "c"}\n')
    given = [flag, sft] if flag == "--sft_only_data_path" else [flag]
    commands = train(tmp_path, model, *given, "--dry-run")["commands"]
    assert {step: flag in command for step, command in commands.items()} == {1: True, 2: False, 3: False}
    with pytest.raises(UserError, match=f"^{flag} is read by step 1 only, which this run does not run"):
        train(tmp_path, model, "--step", "2", "3", "--step1-output", model, *given, "--dry-run")
    with pytest.raises(UserError, match=f"^step 2: {flag} {refused}"):
        train(tmp_path, model, f"--step2-args={' '.join(given)}", "--dry-run")


def test_a_finished_step_skipped_on_rerun_is_not_checked(tmp_path, tiny_model_dir):
    """Step 1 finished with a flag a later check refuses (--lora_learning_rate without adapters, which an earlier
    version took): a rerun skips it, so refusing its flags would block the steps after it for nothing."""
    model = tiny_model_dir("llama")
    flags = ["--step", "1", "--step1-args", "--lora_learning_rate 1e-3", "--dry-run"]
    with pytest.raises(UserError, match="^step 1: --lora_learning_rate needs --lora_dim > 0"):
        train(tmp_path, model, *flags)
    planned = train(tmp_path, model, "--step", "1", "--dry-run")["commands"][1][3:]
    run_dir = tmp_path / "out" / "step1"
    finished = STEPS[1].entry().build_parser().parse_args([*planned, "--lora_learning_rate", "1e-3"])
    shutil.copytree(model, run_dir / "model")
    save_run_args(run_dir, flag_values(finished))
    save_summary(run_dir, {"step": "step1_sft"})
    assert train(tmp_path, model, *flags)["commands"] == {}


def test_a_finished_later_step_that_recorded_a_step_1_flag_is_reused(tmp_path, tiny_model_dir):
    """train.py gave --whole_sequence_loss to every step before it was step 1's alone, so a finished step 2 recorded
    it: the same command run again gives it to step 1 only, and that step 2 is reused, not refused as
    '--whole_sequence_loss true -> false' for a flag it never read."""
    model = tiny_model_dir("llama")
    planned = train(tmp_path, model, "--whole_sequence_loss", "--dry-run")["commands"][2][3:]
    run_dir = tmp_path / "out" / "step2"
    finished = STEPS[2].entry().build_parser().parse_args(planned)
    shutil.copytree(model, run_dir / "model")
    (run_dir / "model" / "reward_model.json").write_text("{}")
    save_run_args(run_dir, {**flag_values(finished), "whole_sequence_loss": True})
    save_summary(run_dir, {"step": "step2_reward"})
    assert sorted(train(tmp_path, model, "--whole_sequence_loss", "--dry-run")["commands"]) == [1, 3]

def test_step_3_is_checked_on_the_ranks_the_deployment_plans(tmp_path, tiny_model_dir):
    """Stage fusion with a ZeRO-3 actor runs on one rank, not on the two of this single_node run."""
    argv = ["--actor-model", tiny_model_dir("llama"), "--reward-model", tiny_model_dir("llama"), "--output-dir",
            str(tmp_path / "out"), "--deployment-type", "single_node", "--actor-zero-stage", "3", "--step3-args",
            "--enable_hybrid_engine --enable_stage_fusion", "--dry-run"]
    two_gpus = Hardware(num_gpus=2, gpu_memory_gib=80, cpu_memory_gib=24, cpu_cores=2, bf16=True)
    with pytest.raises(UserError, match="^step 3: --enable_stage_fusion with ZeRO-3 for the actor on 2 ranks"):
        run_pipeline(parse_config(argv), entries=RecordedMains().entries(), hardware=two_gpus)
