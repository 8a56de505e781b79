"""The step registry: each step's plan, inputs and overrides are flags of its own CLI, plans give
today's argv, and a new step is one registry entry."""
from dataclasses import dataclass, field, fields

import pytest
from transformers import HfArgumentParser

from training.pipeline.config import PipelineConfig
from training.pipeline.deployment import DeploymentType, Model, ModelSizes, plan_sft
from training.pipeline.hardware import Hardware, ModelSize
from training.pipeline.planning import plan_cpu, plan_gpu
from training.pipeline.plans import SupervisedPlan
from training.pipeline.runner import run_pipeline
from training.pipeline.steps import STEPS, ModelInput, StepOutput, StepSpec, accepted_options, has_model
from utils.errors import UserError

SMALL = ModelSize(parameters=135_000_000, hidden_size=576, num_layers=30, vocab_size=49152)
TWO_CORES = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=True)
LAPTOP_GPU = Hardware(num_gpus=1, gpu_memory_gib=24, cpu_memory_gib=64, cpu_cores=8, bf16=True)


@pytest.mark.parametrize("number", sorted(STEPS))
def test_every_planned_field_and_input_is_a_flag_of_its_step(number):
    spec = STEPS[number]
    options = accepted_options(spec.entry().build_parser())
    assert {f"--{f.name}" for f in fields(spec.plan)} <= options
    assert {source.flag for source in spec.inputs} | {"--output_dir"} <= options
    assert set(spec.zero_stage_fields.values()) <= {f.name for f in fields(spec.plan)}


def test_each_planner_gives_its_steps_plan_type():
    for plan in (plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES),
                 plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(SMALL, SMALL), LAPTOP_GPU, None)):
        assert set(plan.steps) == set(STEPS)
        assert all(type(plan.steps[number]) is spec.plan for number, spec in STEPS.items())


def test_a_plans_argv_leaves_out_unplanned_and_false_fields_and_makes_true_a_switch():
    plan = SupervisedPlan(zero_stage=0, offload=False, gradient_checkpointing=True, learning_rate=3e-05)
    assert plan.flags == {"zero_stage": 0, "offload": False, "gradient_checkpointing": True, "learning_rate": 3e-05}
    assert plan.argv() == ["--zero_stage", "0", "--gradient_checkpointing", "--learning_rate", "3e-05"]


def test_the_cpu_quick_runs_argv_keeps_its_order():
    plan = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES)
    sft, reward, rlhf = (" ".join(plan.steps[number].argv()) for number in (1, 2, 3))
    assert sft == ("--zero_stage 0 --lora_dim 0 --dtype bf16 --gradient_accumulation_steps 1 --max_seq_len 256 "
                   "--per_device_train_batch_size 8 --per_device_eval_batch_size 16 --learning_rate 3e-05 "
                   "--num_warmup_steps 1 --max_steps 17 --max_train_samples 136 --max_eval_samples 32")
    assert reward == ("--zero_stage 0 --lora_dim 0 --dtype bf16 --gradient_accumulation_steps 1 --max_seq_len 192 "
                      "--per_device_train_batch_size 8 --per_device_eval_batch_size 16 --learning_rate 0.0002 "
                      "--num_warmup_steps 7 --max_steps 79 --max_train_samples 632 --max_eval_samples 64")
    assert rlhf == ("--actor_zero_stage 0 --critic_zero_stage 0 --dtype bf16 --per_device_generation_batch_size 4 "
                    "--per_device_training_batch_size 4 --gradient_accumulation_steps 1 --max_prompt_seq_len 128 "
                    "--max_answer_seq_len 48 --enable_hybrid_engine --actor_learning_rate 3e-05 --max_steps 36 "
                    "--max_train_samples 144")


@dataclass
class _Args:
    learning_rate: float = field(default=1e-5, metadata={"help": "step size"})


def test_accepted_options_come_from_argparse_and_hf_parsers():
    assert {"--learning_rate", "--learning-rate", "--help"} <= accepted_options(HfArgumentParser(_Args))
    parser = HfArgumentParser()
    parser.add_argument("--seed", type=int)
    assert {"--seed", "-h"} <= accepted_options(parser)


def test_a_new_step_is_one_registry_entry(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A DPO-like step 4 that starts from step 1's model: chained, planned, overridden and checked (its entry point
    here is step 1's: train.py parses every step's flags with it before anything runs)."""
    monkeypatch.setitem(STEPS, 4, StepSpec(
        4, "step4", "preference optimisation", "step1_sft.main",
        inputs=(ModelInput("--model_name_or_path", Model.ACTOR, from_step=1),),
        output=StepOutput("model", has_model), plan=SupervisedPlan, planner=plan_sft,
        zero_stage_fields={Model.ACTOR: "zero_stage"},
    ))
    model, out = tiny_model_dir("llama"), tmp_path / "out"
    config = PipelineConfig(step=[4, 1], actor_model=model, reward_model=model, output_dir=out, actor_zero_stage=2,
                            dry_run=True)
    command = run_pipeline(config, hardware=TWO_CORES)["commands"][4]
    assert command[:9] == ["python", "-m", "step1_sft.main", "--model_name_or_path", str(out / "step1"),
                           "--output_dir", str(out / "step4"), "--zero_stage", "2"]
    assert "step 4" in capsys.readouterr().out  # the settings table has its column
    with pytest.raises(UserError, match=r"step 4 needs the step-1 model, .* \(--step 1 4\), or point --step1-output"):
        run_pipeline(PipelineConfig(step=[4], actor_model=model, output_dir=out, dry_run=True), hardware=TWO_CORES)
