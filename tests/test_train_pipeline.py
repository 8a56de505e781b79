"""train.py: steps in order with outputs chained, prerequisites, flag routing, logs, summary; and a real
end-to-end run on a tiny model with the chatbot answering from its result."""
import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from crash_resume import step_env
from supervised_data import write_arithmetic_jsonl
from tiny_models import make_custom_code_model_dir, make_tiny_model_dir

from training.core.model_loading import EMBEDDED_MODEL_NAME, load_tokenizer
from training.pipeline.cli import build_parser, parse_config
from training.pipeline.config import PipelineConfig
from training.pipeline.deployment import DeploymentType
from training.pipeline.hardware import Hardware, model_size
from training.pipeline.launch import StepStopped
from training.pipeline.runner import run_pipeline
from training.pipeline.steps import StepEntry, step_args_flags
from training.reliability.checkpointing import CHECKPOINTS_SUBDIR, MARKER_FILE
from training.reliability.run_lock import RunLock
from training.reliability.run_records import ARGS_FILE, SUMMARY_FILE, save_run_args, save_summary
from training.reliability.signals import EXIT_INTERRUPTED, record_signal, take_received_signal
from utils.errors import EXIT_BROKEN_PIPE, EXIT_USER_ERROR, UserError, run_cli

TWO_CORES = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=True)
MODEL_FLAGS = {1: ["--model_name_or_path"], 2: ["--model_name_or_path"],
               3: ["--actor_model_name_or_path", "--critic_model_name_or_path"], 4: ["--model_name_or_path"]}


class FakeSteps:
    """Step mains with real argparse CLIs that record their calls and save a (tiny) model where the real
    steps do."""

    def __init__(self, model_dir: str, extra_options=None, fail_step=None):
        self.model_dir = model_dir
        self.calls: list[tuple[int, argparse.Namespace, list[str]]] = []
        self.extra_options = extra_options or {}
        self.fail_step = fail_step

    def parser(self, step: int) -> argparse.ArgumentParser:
        from training.pipeline.deployment import ModelSizes
        from training.pipeline.hardware import ModelSize
        from training.pipeline.planning import plan_cpu, plan_gpu

        size = ModelSize(1000, 8, 2, 100)
        planned = set(plan_cpu(ModelSizes(size, size), TWO_CORES).steps[step].flags)
        planned |= set(plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(size, size), TWO_CORES, None).steps[step].flags)
        parser = argparse.ArgumentParser()
        for flag in MODEL_FLAGS[step] + ["--output_dir", "--seed"] + [f"--{name}" for name in planned] + \
                self.extra_options.get(step, []):
            parser.add_argument(flag, nargs="?", const=True)
        return parser

    def main(self, step: int):
        @run_cli
        def main(argv):
            args = self.parser(step).parse_args(argv)
            self.calls.append((step, args, list(argv)))
            print(f"fake step {step} prints")
            logging.getLogger("fake").info("fake step %d logs", step)
            if step == self.fail_step:
                raise UserError("the data file is empty; pass a bigger one")
            out = Path(args.output_dir)
            save_run_args(out, args)
            saved = out / ("actor" if step == 3 else "model")
            shutil.copytree(self.model_dir, saved, dirs_exist_ok=True)
            if step == 2:
                (saved / "reward_model.json").write_text("{}")
            summary = {"model_dir": str(saved), "eval_loss_before": 2.5, "eval_loss_after": 1.25, "optimizer_steps": 3}
            save_summary(out, summary)
            return summary

        return main

    def entries(self):
        return {step: StepEntry(self.main(step), functools.partial(self.parser, step)) for step in MODEL_FLAGS}


def run(argv, fakes):
    return run_pipeline(parse_config(argv), entries=fakes.entries(), hardware=TWO_CORES)


@pytest.fixture
def fakes(tiny_model_dir):
    return FakeSteps(tiny_model_dir("llama"))


def common(tmp_path, model):
    return ["--actor-model", model, "--reward-model", model, "--output-dir", str(tmp_path / "out")]


def test_a_model_with_its_own_code_runs_with_trust_remote_code(tmp_path):
    """train.py passed --trust_remote_code on to the steps, but read the models' sizes for its plan without it: a
    model that ships its own code failed there, before any step, however the run was told to trust it."""
    custom = make_custom_code_model_dir(tmp_path / "custom")
    fakes = FakeSteps(custom, extra_options={step: ["--trust_remote_code"] for step in MODEL_FLAGS})
    with pytest.raises(UserError, match="ships its own model code .* runs only with --trust_remote_code"):
        run(common(tmp_path, custom), fakes)
    for flag in (["--trust_remote_code"], ["--trust_remote_code=true"]):
        run(common(tmp_path, custom) + flag + ["--dry-run"], fakes)
    run(common(tmp_path, custom) + ["--trust_remote_code"], fakes)
    assert [(step, args.trust_remote_code) for step, args, _ in fakes.calls] == [(1, True), (2, True), (3, True)]
    with pytest.raises(UserError, match="--trust_remote_code takes true or false .*, got 'maybe'"):
        run(common(tmp_path, custom) + ["--trust_remote_code", "maybe"], fakes)


def test_a_model_size_is_read_by_its_own_code_with_trust_remote_code(tmp_path):
    """The model is built on the meta device by its own code: without trust_remote_code transformers asked at the
    terminal whether to run it, and where it could not ask the size was the rough estimate, not the model's."""
    llama, custom = make_tiny_model_dir(tmp_path / "llama"), make_custom_code_model_dir(tmp_path / "custom")
    assert model_size(custom, trust_remote_code=True) == model_size(llama)


def _machine_with_memory(monkeypatch, installed_gib: int, available_gib: int, gpus: int,
                         cgroups: Path | None = None) -> Hardware:
    """This machine as detected, with `gpus` 24 GiB GPUs and these memory figures from psutil, its process in the
    cgroups of the folder `cgroups` (`_fake_cgroups`; None: in none, whatever memory limit this machine sets)."""
    from types import SimpleNamespace

    import psutil

    from training.pipeline import hardware
    from training.pipeline.hardware import GIB, detect_hardware

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=installed_gib * GIB,
                                                                           available=available_gib * GIB))
    cgroups = cgroups or Path("/nonexistent")
    monkeypatch.setattr(hardware, "PROC_SELF_CGROUP", cgroups / "proc_self_cgroup")
    monkeypatch.setattr(hardware, "CGROUP_ROOT", cgroups / "sys_fs_cgroup")
    return dataclasses.replace(detect_hardware(), num_gpus=gpus, gpu_memory_gib=24 if gpus else None)


def _planned_with_memory(monkeypatch, installed_gib: int, available_gib: int, gpus: int, sizes, workload, steps,
                         cgroups: Path | None = None):
    """plan_gpu's plan on a detected machine of `gpus` 24 GiB GPUs whose psutil says these memory figures."""
    from training.pipeline.planning import plan_gpu

    here = _machine_with_memory(monkeypatch, installed_gib, available_gib, gpus, cgroups)
    return plan_gpu(DeploymentType.SINGLE_GPU, sizes, here, None, workload, steps)


def _offload_warned_with_memory(monkeypatch, installed_gib: int, available_gib: int, gpus: int, sizes, workload,
                                steps, user_flags: dict | None = None) -> list[str]:
    """The host memory warnings of `_planned_with_memory`'s plan, all its steps running with its flags, each step's
    `user_flags` (step: {flag: value}) over them."""
    from training.pipeline.planning import host_memory_warnings

    plan = _planned_with_memory(monkeypatch, installed_gib, available_gib, gpus, sizes, workload, steps)
    runs_with = {step: {**plan.steps[step].flags, **(user_flags or {}).get(step, {})} for step in steps}
    return host_memory_warnings(plan, _machine_with_memory(monkeypatch, installed_gib, available_gib, gpus), None,
                                runs_with)


def test_the_same_command_plans_the_same_flags_whatever_memory_other_jobs_hold_now(monkeypatch):
    """677c882 sized the plan from the memory available at the moment: a 3B step 1 on one 24 GiB GPU was planned
    as a ZeRO-2 offload full fine-tune with 56 GiB free and as ZeRO-3 LoRA 128 with 52 GiB free, so a rerun refused
    its finished step or checkpoint, or trained another way. The plan counts the memory installed."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b3 = ModelSize(parameters=3_000_000_000, hidden_size=3072, num_layers=28, vocab_size=32000)
    plans = {gpus: [_planned_with_memory(monkeypatch, 96, available, gpus, ModelSizes(b3, b3), Workload(), [1])
                    for available in (90, 56, 52, 40)]
             for gpus in (1, 0)}  # 0: planned on a login node, each GPU sized from this machine's memory
    for same_command in plans.values():
        assert all(plan.steps[1].flags == same_command[0].steps[1].flags for plan in same_command)
        assert all(plan.notes == same_command[0].notes for plan in same_command)
    assert plans[1][0].steps[1].flags["offload"] and not plans[1][0].steps[1].flags["lora_dim"]
    assert ("host memory counted for offload and as each GPU's (no GPU here): 96 GiB installed on this machine"
            in plans[0][0].notes)


def _fake_cgroups(folder: Path, proc_self_cgroup: str, limits: dict[str, str]) -> Path:
    """A folder holding a /proc/self/cgroup of these lines and, under sys_fs_cgroup, these limit files (path below
    /sys/fs/cgroup: text)."""
    (folder / "proc_self_cgroup").write_text(proc_self_cgroup)
    for path, limit in limits.items():
        (folder / "sys_fs_cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / "sys_fs_cgroup" / path).write_text(limit)
    return folder


V1_NO_LIMIT = "9223372036854771712"


@pytest.mark.parametrize("proc_self_cgroup, limits, limit_gib, counted", [
    ("0::/system.slice/slurmstepd.scope/job_7/step_0\n",  # Slurm's --mem=64G, set on the job, not the step
     {"memory.max": "max", "system.slice/slurmstepd.scope/job_7/memory.max": str(64 * 1024**3),
      "system.slice/slurmstepd.scope/job_7/step_0/memory.max": "max"},
     64, "64 GiB (this process's cgroup memory limit; 1024 GiB installed)"),
    ("5:cpuacct,cpu:/docker/3f2a\n4:memory:/docker/3f2a\n",  # docker --memory 32g: the container's own root
     {"memory/memory.limit_in_bytes": str(32 * 1024**3)},
     32, "32 GiB (this process's cgroup memory limit; 1024 GiB installed)"),
    ("4:memory:/user/1000\n0::/user.slice\n",  # v1's 'no limit' figure, v2's 'max'
     {"memory/user/1000/memory.limit_in_bytes": V1_NO_LIMIT, "memory/memory.limit_in_bytes": V1_NO_LIMIT,
      "user.slice/memory.max": "max", "memory.max": "max"},
     None, "1024 GiB installed"),
    ("0::/user.slice\n", {"user.slice/memory.max": str(2048 * 1024**3)}, 2048, "1024 GiB installed"),
], ids=["v2", "v1", "none", "above_installed"])
def test_host_memory_is_counted_up_to_the_cgroup_memory_limit(proc_self_cgroup, limits, limit_gib, counted,
                                                             tmp_path, monkeypatch):
    """psutil's memory installed ignores a cgroup's limit (Slurm's --mem, Kubernetes, docker --memory): a 1 TiB node
    running a 64 GiB job was planned as 1 TiB, offload sized for memory the job may not use, and the job killed. The
    plan counts the limit where one is set below what is installed, and its note says so."""
    from training.pipeline.deployment import HostNeed, ModelSizes, Workload, host_memory_short_now
    from training.pipeline.hardware import GIB, ModelSize, cgroup_memory_limit

    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    cgroups = _fake_cgroups(tmp_path, proc_self_cgroup, limits)
    here = _machine_with_memory(monkeypatch, 1024, 900, 1, cgroups)
    assert cgroup_memory_limit() == (limit_gib and limit_gib * GIB)
    capped = limit_gib is not None and limit_gib < 1024
    assert (here.cpu_memory_gib, here.cpu_memory_available_gib) == ((limit_gib,) * 2 if capped else (1024, 900))
    plan = _planned_with_memory(monkeypatch, 1024, 900, 1, ModelSizes(b7, b7), Workload(), [1], cgroups)
    assert f"host memory counted for offload: {counted} on this machine" in plan.notes
    if capped:  # the offload warning names the figure the plan counted as the note does, not "installed" alone
        (warning,) = host_memory_short_now(here, {1: HostNeed(limit_gib * GIB, limit_gib * GIB)})
        assert f"the plan counts its {counted}, other processes hold the rest" in warning


def test_offload_that_the_memory_available_now_does_not_hold_is_warned_of(monkeypatch):
    """The plan keeps to the memory installed; where other jobs leave less available than its offload needs, it
    warns naming both figures and what to do, without changing a flag. The refusal names the memory installed."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    sizes, grpo = ModelSizes(b7, b7), Workload(critic=False, samples_per_prompt=4)

    free = _planned_with_memory(monkeypatch, 64, 64, 1, sizes, grpo, [3])
    assert free.steps[3].flags["actor_offload"]
    assert _offload_warned_with_memory(monkeypatch, 64, 64, 1, sizes, grpo, [3]) == []
    assert "host memory counted for offload: 64 GiB installed on this machine" in free.notes
    busy = _planned_with_memory(monkeypatch, 64, 20, 1, sizes, grpo, [3])
    assert busy.steps[3].flags == free.steps[3].flags
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 20, 1, sizes, grpo, [3])
    assert re.search(r"step 3's offload puts \d+\.\d GiB in host memory, more than 70% of the 20 GiB available on "
                     r"this machine now \(14\.0 GiB; the plan counts its 64 GiB installed.*free memory here",
                     warning)
    # planned where no GPU is, the steps run elsewhere: this machine's available memory is not theirs
    assert _offload_warned_with_memory(monkeypatch, 64, 20, 0, sizes, grpo, [3]) == []
    with pytest.raises(UserError, match=r"more than 70% of this machine's 20 GiB \(14\.0 GiB\)"):
        _planned_with_memory(monkeypatch, 20, 16, 1, sizes, grpo, [3])  # the figure installed, not the 16 available


def test_dpos_offload_is_warned_of_by_its_name(monkeypatch):
    """DPO, planned as step 4, was warned of as "step 4's offload", a name no other message of train.py gives it."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 20, 1, ModelSizes(b7, b7), Workload(), [4])
    assert warning.startswith("DPO (step 4)'s offload puts")


def test_offload_the_users_flags_turn_on_is_warned_of_by_its_own_need(monkeypatch):
    """A step whose memory flags the user changed was not warned of at all, as its need was not the planned one: a
    0.5B step 1 planned without offload, run with --zero_stage 3 --offload true where 8 GiB are available, went
    unwarned though its offload puts 7.5 GiB there. Its need is counted from the flags it runs with; flags that
    lower the need below what is available stay unwarned."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b05 = ModelSize(parameters=500_000_000, hidden_size=1024, num_layers=24, vocab_size=32000)
    sizes = ModelSizes(b05, b05)
    assert not _planned_with_memory(monkeypatch, 64, 8, 1, sizes, Workload(), [1]).steps[1].flags["offload"]
    assert _offload_warned_with_memory(monkeypatch, 64, 8, 1, sizes, Workload(), [1]) == []
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 8, 1, sizes, Workload(), [1],
                                             {1: {"zero_stage": 3, "offload": True}})
    assert warning.startswith("step 1's offload, as your --zero_stage, --offload set it, puts 7.5 GiB in host memory, "
                              "more than 70% of the 8 GiB available on this machine now (5.6 GiB;")
    assert warning.endswith("offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes")
    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    assert _offload_warned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), Workload(), [1])
    assert _offload_warned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), Workload(), [1],
                                       {1: {"offload": False}}) == []


def test_step_3s_offload_is_counted_model_by_model_from_the_flags_it_runs_with(monkeypatch):
    """Step 3 has an offload flag for each of its four models and a ZeRO stage and LoRA for each trained one; its need
    adds up each model's by its own flags, the planner's figure where they are the plan's."""
    from training.pipeline.deployment import MemoryChoice, ModelSizes, Workload, host_bytes_per_node
    from training.pipeline.hardware import ModelSize
    from training.pipeline.planning import _host_need

    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    grpo = Workload(critic=False, samples_per_prompt=4)
    plan = _planned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), grpo, [3])
    assert _host_need(plan, 3, plan.steps[3].flags).as_planned == \
        host_bytes_per_node([b7], [b7, b7], MemoryChoice(3, offload=True, lora=True), 1)
    frozen_kept_on_gpu = {"offload_reference_model": False, "offload_reward_model": False}
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), grpo, [3],
                                             {3: frozen_kept_on_gpu})
    assert warning.startswith("step 3's offload puts 17.0 GiB")  # the ZeRO-3 actor's weights and LoRA optimizer state
    assert warning.endswith("plan less offload: a smaller model, more GPUs or nodes (your --offload_reference_model, "
                            "--offload_reward_model lowered it from the plan's 43.1 GiB)")
    assert _offload_warned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), grpo, [3],
                                       {3: {**frozen_kept_on_gpu, "actor_offload": False}}) == []
    b025 = ModelSize(parameters=250_000_000, hidden_size=1024, num_layers=16, vocab_size=32000)
    ppo = _planned_with_memory(monkeypatch, 64, 4, 1, ModelSizes(b025, b025), Workload(), [3])
    assert not any(value for name, value in ppo.steps[3].flags.items() if "offload" in name)
    (warning,) = _offload_warned_with_memory(
        monkeypatch, 64, 4, 1, ModelSizes(b025, b025), Workload(), [3],
        {3: {"actor_zero_stage": 3, "actor_offload": True, "offload_reference_model": True}})
    assert warning.startswith("step 3's offload, as your --actor_zero_stage, --actor_offload, "
                              "--offload_reference_model set it, puts 4.2 GiB")


@pytest.mark.parametrize("off", [False, "false", "False", "0", "no"], ids=["bool", "false", "False", "0", "no"])
def test_a_flag_that_lowers_the_need_is_not_blamed_for_it(off, monkeypatch):
    """2d2ed93 named every memory flag set otherwise than planned as the one to blame: DPO 7B where 16 GiB are
    available, with --offload_reference_model false (its offload 14.0 GiB, the plan's 27.0), was warned of "as your
    --offload_reference_model set it", advising to leave it to the plan, which raises the need. A flag that lowered
    it is said to have, in any spelling the step's parser reads as false."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 16, 1, ModelSizes(b7, b7), Workload(), [4],
                                             {4: {"offload_reference_model": off}})
    assert warning.startswith("DPO (step 4)'s offload puts 17.0 GiB in host memory")
    assert warning.endswith("plan less offload: a smaller model, more GPUs or nodes (your --offload_reference_model "
                            "lowered it from the plan's 30.0 GiB)")


@pytest.mark.parametrize("billions, available_gib, user, named, gib, note", [
    (3, 60, {"zero_stage": 3, "lora_dim": 8}, "--zero_stage", 44.7, ""),
    (3, 60, {"zero_stage": "3", "offload": "true", "only_optimize_lora": "false"}, "--zero_stage", 44.7, ""),
    (3, 8, {"zero_stage": 3, "lora_dim": 8, "only_optimize_lora": True}, "--zero_stage", 5.7,
     " (your --lora_dim, --only_optimize_lora lowered it from the plan's 39.1 GiB)"),
    (7, 30, {"lora_dim": 0, "only_optimize_lora": False}, "--lora_dim, --only_optimize_lora", 104.3, ""),
    (1.3, 30, {"actor_offload": "false", "actor_zero_stage": "3", "critic_zero_stage": "3"}, "--critic_zero_stage",
     24.2, " (your --actor_offload lowered it from the plan's 38.7 GiB)")],
    ids=["rank_without_only_optimize_lora", "planned_values_as_text", "stage_raised_lora_lowered",
         "lora_off_only_together", "stage_of_a_model_not_offloaded"])
def test_a_flag_is_named_only_where_it_moved_the_need_its_way(billions, available_gib, user, named, gib, note,
                                                             monkeypatch):
    """Every memory flag of a model whose need moved was named, compared with the plan's as text, in the way the
    model's need moved: a 3B step 1 planned as ZeRO-2 with offload (39.1 GiB), run at ZeRO-3, was warned "as your
    --zero_stage, --lora_dim set it" for --lora_dim 8, which without --only_optimize_lora trains every weight as
    planned; "as your --zero_stage, --offload, --only_optimize_lora set it" for "true" and "false", the plan's True
    and False as a plain argparse step reads them; and with LoRA on, "your --zero_stage, --lora_dim,
    --only_optimize_lora lowered it", though ZeRO-3 raised it (the weights). A flag is named where the plan's value
    for it alone would move the need the other way, or where it alone on the plan's values would: --lora_dim 0 and
    --only_optimize_lora false turn a 7B plan's LoRA off only together. Of a step 3 planned as ZeRO-2 with offload
    for both models, run with --actor_offload false --actor_zero_stage 3 --critic_zero_stage 3, --actor_zero_stage
    was named as raising the need, though the actor it stages is no longer offloaded."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    size = {1.3: ModelSize(parameters=1_300_000_000, hidden_size=2048, num_layers=24, vocab_size=32000),
            3: ModelSize(parameters=3_000_000_000, hidden_size=3072, num_layers=28, vocab_size=32000),
            7: ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)}[billions]
    installed_gib = {1.3: 64, 3: 96, 7: 64}[billions]
    step, prefix = (3, "actor_") if billions == 1.3 else (1, "")
    plan = _planned_with_memory(monkeypatch, installed_gib, available_gib, 1, ModelSizes(size, size), Workload(),
                                [step])
    flags = plan.steps[step].flags
    assert flags[f"{prefix}offload"] and bool(flags[f"{prefix}lora_dim"]) == (billions == 7)
    (warning,) = _offload_warned_with_memory(monkeypatch, installed_gib, available_gib, 1, ModelSizes(size, size),
                                             Workload(), [step], {step: user})
    assert warning.startswith(f"step {step}'s offload, as your {named} set it, puts {gib} GiB in host memory")
    advice = "offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes"
    assert warning.endswith(f"{advice}{note}")


@pytest.mark.parametrize("on", [True, "true", "True", "1", "yes"], ids=["bool", "true", "True", "1", "yes"])
def test_offload_is_on_in_any_spelling_the_steps_parser_reads_as_true(on, monkeypatch):
    """A plain argparse step gives its flags as text, which the need was counted on only as "true": "--offload 1"
    or "yes", which the settings parser reads as true, counted no offload, and went unwarned."""
    from training.pipeline.deployment import ModelSizes, Workload
    from training.pipeline.hardware import ModelSize

    b05 = ModelSize(parameters=500_000_000, hidden_size=1024, num_layers=24, vocab_size=32000)
    (warning,) = _offload_warned_with_memory(monkeypatch, 64, 8, 1, ModelSizes(b05, b05), Workload(), [1],
                                             {1: {"zero_stage": "3", "offload": on}})
    assert warning.startswith("step 1's offload, as your --zero_stage, --offload set it, puts 7.5 GiB")


def test_a_zero_stage_train_py_sets_is_named_where_it_raises_the_need(monkeypatch):
    """--actor-zero-stage changes the plan's own flags: a 3B step 1 planned as ZeRO-2 with offload (39.1 GiB, under
    70% of 60 GiB available) run at ZeRO-3 also offloads the weights (44.7 GiB), and was warned of without naming the
    flag that did it, advising "plan less offload" alone."""
    from training.pipeline.deployment import Model, ModelSizes, Workload
    from training.pipeline.hardware import ModelSize
    from training.pipeline.planning import apply_zero_overrides, host_memory_warnings

    b3 = ModelSize(parameters=3_000_000_000, hidden_size=3072, num_layers=28, vocab_size=32000)
    plan = _planned_with_memory(monkeypatch, 96, 60, 1, ModelSizes(b3, b3), Workload(), [1])
    here = _machine_with_memory(monkeypatch, 96, 60, 1)
    assert (plan.steps[1].flags["zero_stage"], plan.steps[1].flags["offload"]) == (2, True)
    assert host_memory_warnings(plan, here, None, {1: plan.steps[1].flags}) == []
    apply_zero_overrides(plan, {Model.ACTOR: 3, Model.REWARD: None}, [1])
    (warning,) = host_memory_warnings(plan, here, None, {1: plan.steps[1].flags})
    assert warning.startswith("step 1's offload, as your --actor-zero-stage set it, puts 44.7 GiB")
    assert warning.endswith("offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes")


def _seventy_b_on_one_gpu(tmp_path, model: str, monkeypatch, *flags: str, deployment: str = "single_gpu",
                          available_gib: int = 100) -> tuple[PipelineConfig, Hardware]:
    """train.py's dry run of `flags` with a 70B model (every model given) on one 80 GiB GPU of a 256 GiB machine with
    `available_gib` available now: on single_gpu its plan offloads more than 70% of 100 GiB."""
    from training.pipeline import runner
    from training.pipeline.hardware import ModelSize

    b70 = ModelSize(parameters=70_000_000_000, hidden_size=8192, num_layers=80, vocab_size=32000)
    monkeypatch.setattr(runner, "model_size", lambda *args, **kwargs: b70)
    node = Hardware(num_gpus=1, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=32, bf16=True,
                    cpu_memory_available_gib=available_gib)
    argv = ["--deployment-type", deployment, "--actor-model", model, "--reward-model", model, "--output-dir",
            str(tmp_path / "out"), "--dry-run", *flags]
    return parse_config(argv), node


def test_train_py_says_the_offload_warning_before_any_step(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The plan's warning reaches the user: train.py prints it (stderr) with the plan, and the plan stands."""
    config, node = _seventy_b_on_one_gpu(tmp_path, tiny_model_dir("llama"), monkeypatch, "--step", "1")
    command = run_pipeline(config, hardware=node)["commands"][1]
    assert "--offload" in command
    assert "warning: step 1's offload puts" in capsys.readouterr().err


def test_a_finished_steps_offload_is_not_warned_of_on_a_rerun(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The warning was said for every planned step: a rerun after step 1 finished still warned that step 1's
    offload needs more host memory than is free, though step 1 is skipped. It is said for the steps that run."""
    from training.core.args import flag_values
    from training.pipeline import runner
    from training.pipeline.steps import STEPS

    model = tiny_model_dir("llama")
    config, node = _seventy_b_on_one_gpu(tmp_path, model, monkeypatch, "--step", "1", "2")
    assert sorted(run_pipeline(config, hardware=node)["commands"]) == [1, 2]
    assert _offload_warnings_said(capsys) == {"step 1", "step 2"}

    step1_argv = runner.prepare_run(config, lambda step: STEPS[step].entry(), node).argvs[1]
    run_dir = config.run_dir(1)
    shutil.copytree(model, run_dir / "model")
    save_run_args(run_dir, flag_values(STEPS[1].entry().build_parser().parse_args(step1_argv)))
    save_summary(run_dir, {"step": "step1_sft"})
    assert sorted(run_pipeline(config, hardware=node)["commands"]) == [2]
    assert _offload_warnings_said(capsys) == {"step 2"}


def test_a_zero_stage_the_user_sets_is_not_warned_of_with_the_planned_offloads_figure(tmp_path, tiny_model_dir,
                                                                                      monkeypatch, capsys):
    """The need was recorded as planned, before --actor-zero-stage: at ZeRO-0 nothing is offloaded, yet step 1 was
    warned of the planned offload's figure. A step whose stage the user sets is warned of by its own need."""
    config, node = _seventy_b_on_one_gpu(tmp_path, tiny_model_dir("llama"), monkeypatch, "--step", "1", "2",
                                         "--actor-zero-stage", "0")
    assert "--offload" not in run_pipeline(config, hardware=node)["commands"][1]
    assert _offload_warnings_said(capsys) == {"step 2"}


@pytest.mark.parametrize("flags, warned", [
    (("--step1-args", "--offload false"), {"step 2"}),
    (("--step1-args", "--lora_dim 8"), {"step 1", "step 2"}),  # the ZeRO-3 offload's weights stay in host memory
    (("--step1-args", "--only_optimize_lora false"), {"step 1", "step 2"}),  # every weight's optimizer state too
    (("--zero_stage", "2"), set()),  # routed to each step that takes it: 1 and 2; no weight offloaded
], ids=["step_args_offload", "step_args_lora", "step_args_full_training", "routed_stage"])
def test_a_step_the_users_flags_run_with_other_memory_flags_is_warned_of_by_their_need(flags, warned, tmp_path,
                                                                                       tiny_model_dir, monkeypatch,
                                                                                       capsys):
    """The user's own step flags come after the plan's: with --step1-args "--offload false" step 1 offloads nothing,
    yet was warned of the planned offload's figure; then no step whose memory flags the user changed was warned of,
    though theirs may need more host memory than the plan's. A step is warned of by the need of the flags it runs
    with."""
    config, node = _seventy_b_on_one_gpu(tmp_path, tiny_model_dir("llama"), monkeypatch, "--step", "1", "2", *flags)
    run_pipeline(config, hardware=node)
    assert _offload_warnings_said(capsys) == warned


@pytest.mark.parametrize("rank, need, said", [
    ("128", "150.1", ""), ("64", "140.2", " (your --lora_dim lowered it from the plan's 150.1 GiB)")])
def test_a_flag_that_leaves_the_need_as_planned_is_not_named(rank, need, said, tmp_path, tiny_model_dir, monkeypatch,
                                                             capsys):
    """70B's step 1 with --lora_dim 64 offloaded what the plan's LoRA 128 did while LoRA counted 1% of the
    parameters whatever the rank, yet was warned of "as your --lora_dim set it", advising to leave it to the plan,
    which changed nothing. The plan's own rank is not named; since the rank counts (857fa99), 64 lowers the need and
    is said to."""
    config, node = _seventy_b_on_one_gpu(tmp_path, tiny_model_dir("llama"), monkeypatch, "--step", "1",
                                         "--step1-args", f"--lora_dim {rank}")
    run_pipeline(config, hardware=node)
    (warning,) = re.findall(r"^warning: step 1's offload.*", capsys.readouterr().err, re.MULTILINE)
    assert warning.startswith(f"warning: step 1's offload puts {need} GiB")
    assert warning.endswith(f"plan less offload: a smaller model, more GPUs or nodes{said}")


@pytest.mark.parametrize("hosts, warned", [
    ("node1 slots=1\nnode2 slots=1\n", set()),  # planned on a head node that runs no rank
    ("gpu-node-7-ib slots=1\nnode2 slots=1\n", {"step 1"}),  # this machine, under a name that resolves to it
])
def test_a_multi_node_offload_is_warned_of_only_where_a_hostfile_line_is_this_machine(
        hosts, warned, tmp_path, tiny_model_dir, monkeypatch, capsys):
    """On multi_node the steps' offload was compared with this machine's available memory even where the hostfile
    lists only other machines, whose memory that figure says nothing of."""
    import socket

    def resolver(host, *args, **kwargs):
        if host != "gpu-node-7-ib":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    config, node = _seventy_b_on_one_gpu(tmp_path, tiny_model_dir("llama"), monkeypatch, "--step", "1", "--hostfile",
                                         str(hostfile), deployment="multi_node", available_gib=60)
    assert "--offload" in run_pipeline(config, hardware=node)["commands"][1]
    assert _offload_warnings_said(capsys) == warned


def _offload_warnings_said(capsys) -> set[str]:
    """The steps train.py warned of on stderr that their offload may not fit the memory available now."""
    return set(re.findall(r"^warning: (step \d)'s offload(?:, as your .+? set it,)? puts", capsys.readouterr().err,
                          re.MULTILINE))


@pytest.mark.parametrize("command", ["train.py", "rlhf-train"])
def test_usage_names_the_command_as_it_was_run(command, monkeypatch):
    """`rlhf-train --help` (setup.py's console script) said `usage: train.py`, a command not on the PATH."""
    monkeypatch.setattr(sys, "argv", [f"/somewhere/bin/{command}"])
    assert build_parser().format_usage().startswith(f"usage: {command} ")


def test_steps_run_in_order_each_feeding_the_next_with_logs_and_a_summary(tmp_path, fakes, capsys):
    out = tmp_path / "out"
    report = run(common(tmp_path, fakes.model_dir) + ["--seed", "7"], fakes)
    assert [call[0] for call in fakes.calls] == [1, 2, 3]
    (_, sft, _), (_, reward, _), (_, rlhf, _) = fakes.calls
    assert sft.model_name_or_path == fakes.model_dir and sft.output_dir == str(out / "step1")
    assert reward.output_dir == str(out / "step2")
    assert rlhf.actor_model_name_or_path == str(out / "step1")
    assert rlhf.critic_model_name_or_path == str(out / "step2")
    assert sft.seed == reward.seed == rlhf.seed == "7"
    assert sft.dtype == "bf16" and sft.max_seq_len == "256" and rlhf.max_answer_seq_len == "48"

    for step in (1, 2, 3):
        log = (out / "logs" / f"step{step}.log").read_text()
        assert f"fake step {step} prints" in log and f"fake step {step} logs" in log
        assert f"fake step {step % 3 + 1} prints" not in log
    printed = capsys.readouterr().out
    settings = printed.index("deployment: cpu")
    assert settings < printed.index("=== step 1") < printed.index("=== step 2") < printed.index("=== step 3")
    assert "eval_loss 2.5 -> 1.25" in printed and str(out / "step3" / "actor") in printed
    assert "total" in printed.splitlines()[-1]
    saved = json.loads((out / "summary.json").read_text())
    assert set(saved["steps"]) == {"1", "2", "3"} and saved["steps"]["2"]["summary"]["optimizer_steps"] == 3
    assert report["total_seconds"] >= sum(step["seconds"] for step in saved["steps"].values())


def test_step3_alone_needs_the_outputs_of_steps_1_and_2(tmp_path, fakes):
    argv = common(tmp_path, fakes.model_dir) + ["--step", "3"]
    with pytest.raises(UserError, match="step 3 needs the step-1 model.*--step1-output"):
        run(argv, fakes)
    shutil.copytree(fakes.model_dir, tmp_path / "out" / "step1" / "model")
    with pytest.raises(UserError, match="step 3 needs the step-2 reward model"):
        run(argv, fakes)
    shutil.copytree(fakes.model_dir, tmp_path / "out" / "step2" / "model")
    with pytest.raises(UserError, match="step-2 reward model"):  # a causal LM is not a reward model
        run(argv, fakes)
    (tmp_path / "out" / "step2" / "model" / "reward_model.json").write_text("{}")
    run(argv, fakes)
    assert [call[0] for call in fakes.calls] == [3]


def test_explicit_step_outputs_feed_step3(tmp_path, fakes):
    run(common(tmp_path, fakes.model_dir) + ["--step", "1", "2", "--output-dir", str(tmp_path / "first")], fakes)
    argv = common(tmp_path, fakes.model_dir) + ["--step", "3", "--step1-output", str(tmp_path / "first" / "step1"),
                                               "--step2-output", str(tmp_path / "first" / "step2")]
    run(argv, fakes)
    _, rlhf, _ = fakes.calls[-1]
    assert rlhf.actor_model_name_or_path == str(tmp_path / "first" / "step1")
    assert rlhf.output_dir == str(tmp_path / "out" / "step3")


def test_flags_go_to_the_steps_that_accept_them_and_user_values_win(tmp_path, tiny_model_dir):
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={2: ["--only_step2"], 3: ["--only_step2"]})
    argv = common(tmp_path, fakes.model_dir) + [
        "--only_step2", "x", "--max_steps=9", "--step1-args", "--max_seq_len 64 --seed -1",
        "--actor-zero-stage", "3", "--reward-zero-stage", "1",
    ]
    run(argv, fakes)
    (_, sft, sft_argv), (_, reward, _), (_, rlhf, _) = fakes.calls
    assert "--only_step2" not in sft_argv  # step 1's CLI does not take it
    assert reward.only_step2 == "x" and rlhf.only_step2 == "x"
    assert sft.max_steps == reward.max_steps == rlhf.max_steps == "9"  # over the planned values
    assert sft.max_seq_len == "64" and sft.seed == "-1" and reward.max_seq_len == "192"
    assert sft.zero_stage == "3" and rlhf.actor_zero_stage == "3"
    assert reward.zero_stage == "1" and rlhf.critic_zero_stage == "1"
    with pytest.raises(UserError, match="--bogus is not a flag of train.py nor of step"):
        run(common(tmp_path, fakes.model_dir) + ["--bogus", "1"], fakes)


def test_a_step_given_max_steps_is_not_capped_at_the_plans_samples(tmp_path, fakes):
    """The quick run caps each step's data at its planned steps' worth (--max_train_samples): a user's --max_steps
    (the README's way to train longer) ended at that cap, one epoch, unless it also raised the cap."""
    run(common(tmp_path, fakes.model_dir) + ["--step2-args", "--max_steps 200"], fakes)
    (_, sft, _), (_, reward, reward_argv), (_, rlhf, _) = fakes.calls
    assert reward.max_steps == "200" and "--max_train_samples" not in reward_argv
    assert sft.max_train_samples is not None and rlhf.max_train_samples is not None
    fakes.calls.clear()
    run(common(tmp_path, fakes.model_dir) + ["--output-dir", str(tmp_path / "both"),
                                             "--step2-args", "--max_steps 200 --max_train_samples 64"], fakes)
    assert fakes.calls[1][1].max_train_samples == "64"


def test_a_step_given_max_steps_keeps_the_plans_warmup_share(tmp_path, fakes):
    """The plan's --num_warmup_steps (a tenth of its own steps) stayed when the user set --max_steps: a shorter run
    never reached its peak learning rate."""
    run(common(tmp_path, fakes.model_dir), fakes)
    (_, planned, _), (_, planned_reward, _), _ = fakes.calls
    steps, warmup = int(planned.max_steps), int(planned.num_warmup_steps)
    assert 1 < warmup < steps and 1 < int(planned_reward.num_warmup_steps), (steps, warmup)
    fakes.calls.clear()
    run(common(tmp_path, fakes.model_dir) + ["--output-dir", str(tmp_path / "short"), "--step1-args", "--max_steps 3",
                                             "--step2-args", "--max_steps 9 --num_warmup_steps 5"], fakes)
    (_, sft, _), (_, reward, _), _ = fakes.calls
    assert sft.max_steps == "3" and sft.num_warmup_steps == str(max(1, 3 * warmup // steps))
    assert int(sft.num_warmup_steps) < 3 and reward.num_warmup_steps == "5"
    fakes.calls.clear()  # a one-step run warms up for none: its one step, warmed up, had the rate 0 (and is refused)
    run(common(tmp_path, fakes.model_dir) + ["--output-dir", str(tmp_path / "one"), "--step1-args", "--max_steps 1"],
        fakes)
    assert fakes.calls[0][1].num_warmup_steps == "0"
    fakes.calls.clear()  # a longer --max_steps is a cap the data may end the step before: the planned warm-up stays
    run(common(tmp_path, fakes.model_dir) + ["--output-dir", str(tmp_path / "long"), "--step1-args",
                                             f"--max_steps {steps * 10}"], fakes)
    assert fakes.calls[0][1].num_warmup_steps == str(warmup)


def test_a_finished_step_whose_input_was_trained_again_since_is_not_reused(tmp_path, fakes):
    """Steps 1-3 finished; step 1 was then deleted and retrained alone (`--step 1`). The next full run skipped
    step 3 as finished although it was trained from the old step-1 model. Copies of the run folders (new file
    times, in any order) are still the same runs."""
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    out, saved = tmp_path / "out", tmp_path / "saved"
    out.rename(saved)
    for step in ("step3", "step2", "step1", "logs"):  # copied back, step 1 last: the newest files
        shutil.copytree(saved / step, out / step)
    fakes.calls.clear()
    run(argv, fakes)
    assert fakes.calls == []
    shutil.rmtree(out / "step1")
    run(argv + ["--step", "1"], fakes)
    fakes.calls.clear()
    with pytest.raises(UserError, match="step 3 finished in .* from an earlier run of its input .*step1 "
                                        "\\(--actor_model_name_or_path\\), which was trained again since"):
        run(argv, fakes)
    assert fakes.calls == []
    shutil.rmtree(out / "step3")
    run(argv, fakes)
    assert [call[0] for call in fakes.calls] == [3]


def test_a_finished_step_whose_data_file_changed_since_is_not_reused(tmp_path, tiny_model_dir):
    """A finished step was skipped as done after its --data_path file was rewritten: only its flags were compared."""
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={1: ["--data_path"]})
    data = write_arithmetic_jsonl(tmp_path / "data.jsonl", 8)
    argv = common(tmp_path, fakes.model_dir) + ["--step", "1", "--step1-args", f"--data_path {data}"]
    run(argv, fakes)
    fakes.calls.clear()
    run(argv, fakes)
    assert fakes.calls == []  # the same data: finished, skipped
    write_arithmetic_jsonl(tmp_path / "data.jsonl", 12)
    with pytest.raises(UserError, match=f"step 1 finished in .* on data that changed since: {data} "):
        run(argv, fakes)
    assert fakes.calls == []

    again = common(tmp_path, fakes.model_dir) + ["--step", "1", "--step1-args", f"--data_path {data}",
                                                 "--output-dir", str(tmp_path / "again")]
    run(again, fakes)
    record = tmp_path / "again" / "step1" / "trained_from.json"  # as written before content hashes: mtimes
    legacy = json.loads(record.read_text())
    legacy["data files"] = {source: [[path, size, os.stat(path).st_mtime_ns] for path, size, _ in files]
                            for source, files in legacy["data files"].items()}
    record.write_text(json.dumps(legacy))
    fakes.calls.clear()
    run(again, fakes)
    assert fakes.calls == [], "a record of the older format, of the same files, is of a finished step"
    os.utime(data, ns=(os.stat(data).st_atime_ns, os.stat(data).st_mtime_ns + 10**9))
    with pytest.raises(UserError, match=f"step 1 finished in .* on data that changed since: {data} "):
        run(again, fakes)

    folder = tmp_path / "pairs"  # what the data layer does not read of a folder may change; a finished step whose
    folder.mkdir()                # data is gone since is still skipped (it needs it no more)
    write_arithmetic_jsonl(folder / "part1.jsonl", 8)
    (folder / "README.md").write_text("about these pairs\n")
    argv = common(tmp_path, fakes.model_dir) + ["--step", "1", "--step1-args", f"--data_path {folder}",
                                                "--output-dir", str(tmp_path / "from_folder")]
    run(argv, fakes)
    (folder / "README.md").write_text("about these pairs, revised\n")
    fakes.calls.clear()
    run(argv, fakes)
    shutil.rmtree(folder)
    run(argv, fakes)
    assert fakes.calls == []


def test_every_steps_flags_are_checked_before_the_first_step_runs(tmp_path, fakes):
    """A typo in --step3-args failed only when step 3 started, after steps 1 and 2 had trained; --output_dir (the
    steps' spelling) sent every step's model into one folder, and the run failed after step 1."""
    argv = common(tmp_path, fakes.model_dir)
    with pytest.raises(UserError, match="step 3's flags do not parse .*unrecognized arguments: --actor_learnin_rate "
                                        "1e-6.*or in --step3-args"):
        run(argv + ["--step3-args", "--actor_learnin_rate 1e-6"], fakes)
    with pytest.raises(UserError, match="--output_dir was passed to step 1: .* use --output-dir"):
        run(argv + ["--output_dir", str(tmp_path / "elsewhere")], fakes)
    assert fakes.calls == [] and not (tmp_path / "out" / "step1").exists()


REFUSED_UP_FRONT = {
    # id: (train.py flags, the error's text): each passed the dry run, then failed hours in, crashed with a
    # traceback, or was dropped unseen
    "unclosed_quote": (["--step1-args", "--learning_rate 'x"], "--step1-args \"--learning_rate 'x\" does not split "
                       "into flags (No closing quotation); check its quotes"),
    "samples_not_a_number": (["--algorithm", "grpo", "--n_samples_per_prompt", "abc"],
                             "--n_samples_per_prompt must be a positive whole number, got 'abc'"),
    "samples_zero": (["--algorithm", "grpo", "--n_samples_per_prompt", "0"],
                     "must be a positive whole number, got '0'"),
    "samples_negative": (["--algorithm", "grpo", "--n_samples_per_prompt=-2"], "a positive whole number, got '-2'"),
    "model_flag_passed_to_a_step": (["--step1-args", "--model_name_or_path /m"],
                                    "--model_name_or_path was passed to step 1: train.py gives each step its model, "
                                    "and plans the memory for it; use --actor-model"),
    "step3_model_flag": (["--step3-args", "--critic_model_name_or_path /m"],
                         "use --reward-model (or --step2-output)"),
    "algorithm_in_step3_args": (["--step3-args", "--algorithm grpo"],
                                "--algorithm was passed to step 3: train.py plans step 3 for its own --algorithm"),
    "hostfile_off_multi_node": (["--deployment-type", "cpu", "--hostfile", "hosts"],
                                "--hostfile is for --deployment-type multi_node; this run is cpu"),
    "output_of_a_step_that_runs": (["--step1-output", "/m"], "--step1-output names step 1's model for a run without "
                                   "step 1, but this run runs it"),
    "output_no_step_takes": (["--algorithm", "dpo", "--step2-output", "/m"],
                             "--step2-output is for step 3, which this run (steps 1, 4) does not include; drop it"),
    "dpo_with_steps_2_3": (["--algorithm", "dpo", "--step", "1", "2", "3"], "--algorithm dpo runs step 1 then DPO"),
    "grpo_with_dpo": (["--algorithm", "grpo", "--step", "1", "4"], "--algorithm grpo is step 3's RL algorithm, but "
                      "this run runs DPO (step 4)"),
    "unknown_builtin_reward": (["--algorithm", "grpo", "--reward_fn", "builtin:nosuch"], "nosuch"),
    "missing_step3_data": (["--step3-args", "--data_path /nonexistent/prompts.jsonl"],
                           ("step 3's --data_path /nonexistent/prompts.jsonl: /nonexistent/prompts.jsonl does not "
                            "exist")),
}


@pytest.mark.parametrize("case", REFUSED_UP_FRONT)
def test_flags_a_run_would_drop_or_fail_on_later_are_refused_before_anything_runs(tmp_path, tiny_model_dir, case):
    flags, message = REFUSED_UP_FRONT[case]
    options = {1: ["--data_path"],
               3: ["--algorithm", "--reward_fn", "--n_samples_per_prompt", "--data_path", "--eval_samples"]}
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options=options)
    with pytest.raises(UserError) as refused:
        run(common(tmp_path, fakes.model_dir) + flags + ["--dry-run"], fakes)
    assert message in str(refused.value), str(refused.value)
    assert fakes.calls == []


def test_a_lora_flag_given_to_train_py_for_one_steps_adapters_is_refused_before_any_step_runs(tmp_path,
                                                                                              tiny_model_dir):
    """train.py gives --lora_learning_rate to every step that takes it: step 2, without --lora_dim, refused it when it
    started, after step 1 had trained."""
    from training.pipeline.cli import run as run_train_py

    model = tiny_model_dir("llama")
    argv = ["--step", "1", "2", "--actor-model", model, "--reward-model", model, "--output-dir", str(tmp_path / "out"),
            "--deployment-type", "cpu", "--dry-run"]
    with pytest.raises(UserError, match="step 2: --lora_learning_rate needs --lora_dim > 0"):
        run_train_py([*argv, "--lora_learning_rate", "1e-3", "--step1-args", "--lora_dim 8"])
    assert set(run_train_py([*argv, "--step1-args", "--lora_dim 8 --lora_learning_rate 1e-3"])["commands"]) == {1, 2}


def test_a_model_no_step_of_the_run_uses_is_not_read(tmp_path, fakes):
    """`--step 2 --actor-model X` failed on X, which step 2 never uses (while `--step 3` ignored it)."""
    for steps, unused in ((["2"], "--actor-model"), (["1"], "--reward-model")):
        argv = [*common(tmp_path, fakes.model_dir), "--step", *steps, unused, str(tmp_path / "missing"), "--dry-run"]
        assert set(run(argv, fakes)["commands"]) == {int(steps[0])}
    with pytest.raises(UserError, match="missing"):
        run([*common(tmp_path, fakes.model_dir), "--step", "2", "--reward-model", str(tmp_path / "missing"),
             "--dry-run"], fakes)


def test_a_model_flag_no_step_of_the_run_starts_from_is_said_with_what_is_used_instead(tmp_path, tiny_model_dir,
                                                                                        capsys):
    """`--algorithm dpo --reward-model X` and `--reward_fn builtin:math --reward-model X` took X and used no reward
    model, and `--step 3 --reward-model X` took step 2's output, all without a word. The default (the embedded
    model) is said nothing of, nor a model a step of the run starts from."""
    options = {1: ["--data_path"], 3: ["--algorithm", "--reward_fn", "--data_path", "--eval_samples"]}
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options=options)
    model = fakes.model_dir

    def warnings(*flags: str) -> list[str]:
        run([*common(tmp_path, model), *flags, "--dry-run"], fakes)
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --")]

    assert warnings() == []
    assert warnings("--algorithm", "dpo") == [(
        f"warning: --reward-model {model} is not used: no step of this run (steps 1, 4) uses the reward model: DPO "
        "trains the step-1 model against a frozen copy of itself, with no reward model; drop --reward-model")]
    (grpo,) = warnings("--algorithm", "grpo", "--reward_fn", "builtin:math")
    assert "(steps 1, 3) uses the reward model: step 3 scores its answers with --reward_fn builtin:math alone" in grpo
    run([*common(tmp_path, model), "--step", "1", "2"], fakes)
    capsys.readouterr()
    out = tmp_path / "out"
    assert warnings("--step", "3") == [
        f"warning: --{name}-model {model} is not used: step 3 takes the step-{step} {what} in {out / f'step{step}'}, "
        f"not one trained from it (add {step} to --step for that); or drop --{name}-model"
        for name, step, what in (("actor", 1, "model"), ("reward", 2, "reward model"))]
    run_pipeline(parse_config(["--algorithm", "dpo", "--output-dir", str(tmp_path / "default"), "--dry-run"]),
                 entries=fakes.entries(), hardware=TWO_CORES)
    assert "warning: --" not in capsys.readouterr().err


def test_flags_for_a_step_the_run_does_not_include_are_refused(tmp_path, fakes):
    """DPO lives in step2_reward/, so --step2-args is an easy slip for --dpo-args: the flags were dropped unseen."""
    argv = common(tmp_path, fakes.model_dir)
    with pytest.raises(UserError, match=r"--step2-args is given, but step 2 \(reward model\) is not part of this run, "
                                        r"whose steps are 1 \(--step1-args\), 4 \(--dpo-args\)"):
        run(argv + ["--algorithm", "dpo", "--step2-args", "--dpo_beta 0.5", "--dry-run"], fakes)
    with pytest.raises(UserError, match="--dpo-args is given, but step 4"):
        run(argv + ["--dpo-args", "--dpo_beta 0.5"], fakes)
    assert fakes.calls == []


@pytest.mark.parametrize("blocked", ["file", "under_a_file"])
def test_an_output_dir_a_file_blocks_is_refused_before_anything_runs(tmp_path, fakes, blocked):
    """train.py ended in a NotADirectoryError traceback, and --dry-run passed it."""
    (tmp_path / "afile").write_text("keep me")
    output = tmp_path / "afile" if blocked == "file" else tmp_path / "afile" / "run"
    argv = ["--actor-model", fakes.model_dir, "--reward-model", fakes.model_dir, "--output-dir", str(output)]
    for dry_run in ([], ["--dry-run"]):
        with pytest.raises(UserError, match="--output-dir .*afile"):
            run(argv + dry_run, fakes)
    assert (tmp_path / "afile").read_text() == "keep me" and fakes.calls == []


@pytest.mark.parametrize("output", ["new", "new/under_a_new_folder", "there_before"])
def test_a_run_refused_while_planning_leaves_no_folder_it_created(tmp_path, fakes, output):
    """train.py's lock on --output-dir (taken before it plans) left the folder it created, its parents and its lock
    file behind a run that planning refused, where it left nothing before: a folder of nothing but a lock. A folder
    that was there before the run stays, empty as it was."""
    runs = tmp_path / "runs"
    (runs / "there_before").mkdir(parents=True)
    argv = ["--actor-model", fakes.model_dir, "--reward-model", fakes.model_dir, "--output-dir", str(runs / output)]
    with pytest.raises(UserError, match="--dpo-args is given, but step 4"):
        run(argv + ["--dpo-args", "--dpo_beta 0.5"], fakes)
    assert sorted(path.name for path in runs.rglob("*")) == ["there_before"]
    assert fakes.calls == []


def test_a_zero_stage_0_override_drops_the_planned_offload():
    """--actor-zero-stage 0 over a plan that offloads at ZeRO-3: the step would be refused (ZeRO-0 offloads
    nothing), so the offload goes with the stage."""
    from training.pipeline.deployment import DeploymentType, Model, ModelSizes
    from training.pipeline.hardware import Hardware, ModelSize
    from training.pipeline.planning import apply_zero_overrides, plan_gpu

    big = ModelSize(7_000_000_000, 4096, 32, 4096)
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(big, big),
                    Hardware(num_gpus=1, gpu_memory_gib=24, cpu_memory_gib=512, cpu_cores=8, bf16=True), None)
    assert plan.steps[1].flags["offload"] and plan.steps[3].flags["actor_offload"]
    assert apply_zero_overrides(plan, {Model.ACTOR: 0, Model.REWARD: None}, steps=(1, 2, 3)) == set()
    assert (plan.steps[1].flags["zero_stage"], plan.steps[1].flags["offload"]) == (0, False)
    assert (plan.steps[3].flags["actor_zero_stage"], plan.steps[3].flags["actor_offload"]) == (0, False)
    assert plan.steps[3].flags["critic_offload"] and plan.steps[2].flags["offload"]


def test_underscore_spellings_of_train_py_flags_go_to_the_steps(tmp_path, fakes):
    """--actor_zero_stage is step 3's flag; train.py's is --actor-zero-stage (step 1 and step 3's actor)."""
    run(common(tmp_path, fakes.model_dir) + ["--actor_zero_stage", "2"], fakes)
    (_, sft, _), _, (_, rlhf, _) = fakes.calls
    assert rlhf.actor_zero_stage == "2" and sft.zero_stage == "0"


def test_algorithm_dpo_runs_step_1_then_dpo_on_its_model(tmp_path, fakes):
    run(common(tmp_path, fakes.model_dir) + ["--algorithm", "dpo"], fakes)
    assert [call[0] for call in fakes.calls] == [1, 4]
    assert fakes.calls[1][1].model_name_or_path == str(tmp_path / "out" / "step1")
    assert fakes.calls[1][1].output_dir == str(tmp_path / "out" / "dpo")


def test_dpo_is_step_4_wherever_a_user_meets_its_number(tmp_path, fakes, capsys):
    """DPO's number is one constant (deployment.DPO_STEP); a wrong one shows where a user meets the number: the
    --step they give (README: 'DPO as step 4'), DPO's key in summary.json, its column of the settings table, the
    refusal of it under another --algorithm and the quick-run budget the cpu note names as step 4's (DPO)."""
    from training.pipeline.deployment import CpuQuickRun, ModelSizes
    from training.pipeline.hardware import ModelSize
    from training.pipeline.planning import plan_cpu

    run(common(tmp_path, fakes.model_dir) + ["--algorithm", "dpo", "--step", "1", "4"], fakes)
    assert [call[0] for call in fakes.calls] == [1, 4]
    assert list(json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]) == ["1", "4"]
    said = capsys.readouterr().out
    assert re.search(r"\nsetting +step 1 +step 4\n", said) and "\n=== step 4: DPO" in said and "\n4 DPO" in said
    with pytest.raises(UserError, match=r"this run runs DPO \(step 4\) in its place; drop step 4, or give"):
        run(common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--step", "4"], fakes)
    quick = CpuQuickRun()
    reference = ModelSize(int(quick.reference_params), 576, 30, 49152)  # a quick-run step costs dpo_step_s
    plan = plan_cpu(ModelSizes(reference, reference), TWO_CORES, quick)
    assert "for steps 1, 2, 3 and 4 (DPO)" in plan.notes[0]
    dpo_budget_s = quick.step_budget_s[3] - quick.step_overhead_s[3]
    assert plan.steps[4].flags["max_steps"] == int(dpo_budget_s / quick.dpo_step_s)


def test_a_builtin_verifier_runs_steps_1_and_3_on_the_task_without_a_reward_model(tmp_path, tiny_model_dir):
    options = {1: ["--data_path"], 3: ["--data_path", "--algorithm", "--reward_fn", "--eval_samples"]}
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options=options)
    run(common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--reward_fn", "builtin:math"], fakes)
    (_, sft, _), (_, rlhf, rlhf_argv) = fakes.calls
    assert [call[0] for call in fakes.calls] == [1, 3] and "--critic_model_name_or_path" not in rlhf_argv
    assert sft.data_path == rlhf.data_path == "task:arithmetic"
    assert rlhf.algorithm == "grpo" and rlhf.reward_fn == "builtin:math"
    # the quick run's task plan: 32 answers a step, 4 to each of 8 prompts, short prompts and answers
    assert (rlhf.per_device_generation_batch_size, rlhf.max_answer_seq_len, rlhf.eval_samples) == ("8", "32", "80")

    fakes.calls.clear()  # step 1 alone still trains on the task --reward_fn checks (no step of it takes the flag)
    run(common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--reward_fn", "builtin:math", "--step", "1",
                                             "--output-dir", str(tmp_path / "alone")], fakes)
    assert [call[0] for call in fakes.calls] == [1] and fakes.calls[0][1].data_path == "task:arithmetic"

    fakes.calls.clear()  # the user's data wins, and is not joined by the task
    mine = write_arithmetic_jsonl(tmp_path / "mine.jsonl", 8)
    run(common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--reward_fn", "builtin:math",
                                             "--data_path", mine, "--output-dir", str(tmp_path / "mine")], fakes)
    assert all("task:arithmetic" not in argv for _, _, argv in fakes.calls)
    assert fakes.calls[1][1].data_path == mine


def test_a_zero_stage_override_no_step_of_the_run_takes_is_refused(tmp_path, tiny_model_dir):
    """--reward-zero-stage under a critic-free algorithm with --reward_fn (steps 1 and 3: no reward model, no
    critic) and --actor-zero-stage for step 2 alone were dropped without a word."""
    options = {1: ["--data_path"], 3: ["--data_path", "--algorithm", "--reward_fn", "--eval_samples"]}
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options=options)
    verifier = common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--reward_fn", "builtin:math"]
    with pytest.raises(UserError, match=r"^--reward-zero-stage 2: no step of this run \(steps 1, 3\) has a reward "
                                        r"model or critic .*: drop it$"):
        run(verifier + ["--reward-zero-stage", "2"], fakes)
    with pytest.raises(UserError, match=r"^--actor-zero-stage 3: no step of this run \(steps 2\) trains or runs "
                                        r"the actor: drop it$"):
        run(common(tmp_path, fakes.model_dir) + ["--step", "2", "--actor-zero-stage", "3"], fakes)
    assert fakes.calls == []
    run(verifier + ["--actor-zero-stage", "2"], fakes)
    assert fakes.calls[-1][1].actor_zero_stage == "2"


def test_step3s_planned_workload_has_a_reward_model_exactly_when_its_inputs_give_one(tmp_path, tiny_model_dir,
                                                                                     monkeypatch):
    import training.pipeline.runner as runner

    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={3: ["--algorithm", "--reward_fn"]})
    workloads = []
    plan_deployment = runner.plan_deployment
    monkeypatch.setattr(runner, "plan_deployment",
                        lambda *args, **kwargs: workloads.append(args[-1]) or plan_deployment(*args, **kwargs))
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def score(prompt, answer, metadata):\n    return float(len(answer) > 3)\n")
    grpo = common(tmp_path, fakes.model_dir) + ["--algorithm", "grpo", "--reward_fn", f"{scorer}:score"]
    run(grpo + ["--dry-run"], fakes)  # steps 1 and 3, no step-2 output: the reward function alone
    assert workloads[-1].reward_model is False and not workloads[-1].critic
    run(common(tmp_path, fakes.model_dir) + ["--step", "1", "2"], fakes)
    run(grpo + ["--step", "3", "--dry-run"], fakes)  # step 2's saved output now feeds step 3 beside the function
    assert workloads[-1].reward_model is True


def test_train_py_flags_parse_into_the_pipeline_config():
    config = parse_config(["--step", "3", "1", "1", "--deployment-type", "cpu", "--actor-zero-stage", "2",
                           "--step1-output", "/m", "--step2-args", "--seed 1", "--dry-run", "--seed", "7"])
    assert config.steps == [1, 3] and config.deployment_type is DeploymentType.CPU and config.actor_zero_stage == 2
    assert config.step_outputs == {1: "/m", 2: None, 3: None, 4: None}
    assert config.step_args == {1: [], 2: ["--seed", "1"], 3: [], 4: []}
    assert config.extra_args == ["--seed", "7"] and config.dry_run is True
    defaults = parse_config([])
    assert defaults.steps == [1, 2, 3] and defaults.actor_model == defaults.reward_model == EMBEDDED_MODEL_NAME
    assert defaults.deployment_type is None and defaults.reward_zero_stage is None and defaults.dry_run is False
    assert defaults.output_dir == Path("runs/default").resolve() and defaults.extra_args == []
    for bad in (["--step", "5"], ["--deployment-type", "gpu"], ["--reward-zero-stage", "5"], ["--algorithm", "kto"]):
        with pytest.raises(SystemExit):
            parse_config(bad)


def test_no_args_file_beside_the_script_is_read(tmp_path, monkeypatch):
    (tmp_path / "train.args").write_text("--dry-run\n")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "train.py")])
    assert parse_config([]).dry_run is False


def test_a_failing_step_stops_the_run_with_its_message(tmp_path, tiny_model_dir):
    fakes = FakeSteps(tiny_model_dir("llama"), fail_step=2)
    with pytest.raises(UserError, match=r"step 2 \(reward model\): the data file is empty"):
        run(common(tmp_path, fakes.model_dir), fakes)
    assert [call[0] for call in fakes.calls] == [1, 2]
    assert "the data file is empty" in (tmp_path / "out" / "logs" / "step2.log").read_text()


def test_a_rerun_skips_the_finished_steps_and_resumes_the_unfinished_one(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={step: ["--resume"] for step in (1, 2, 3)}, fail_step=3)
    argv = common(tmp_path, fakes.model_dir)
    with pytest.raises(UserError, match="the data file is empty"):
        run(argv, fakes)
    fakes.calls.clear()
    fakes.fail_step = None
    report = run(argv + ["--resume"], fakes)  # step 3 saved no checkpoint: it starts from the beginning
    assert [(step, args.resume) for step, args, _ in fakes.calls] == [(3, None)]
    printed = capsys.readouterr().out
    assert f"step 1: finished in {out / 'step1'}, skipped" in printed
    assert f"step 2: finished in {out / 'step2'}, skipped" in printed
    assert [report["steps"][step]["skipped"] for step in ("1", "2", "3")] == [True, True, False]
    assert report["steps"]["1"]["summary"]["model_dir"] == str(out / "step1" / "model")
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(report))

    (out / "step3" / SUMMARY_FILE).unlink()  # stopped after a checkpoint: the same command with --resume resumes it
    checkpoint = out / "step3" / CHECKPOINTS_SUBDIR / "step2"
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 2, "engines": ["actor"]}))
    fakes.calls.clear()
    run(argv + ["--resume"], fakes)
    assert [(step, args.resume) for step, args, _ in fakes.calls] == [(3, True)]
    fakes.calls.clear()
    capsys.readouterr()
    run(argv, fakes)  # all finished
    printed = capsys.readouterr().out
    assert fakes.calls == [] and printed.count(", skipped") == 3 and printed.count(" skipped ") == 3  # in the table


def test_train_py_parses_each_steps_flags_once_before_the_steps_run(tmp_path, fakes, monkeypatch):
    """The flag check, the finished-step check and the settings table read one parse of each step's command line
    (each parsed it anew: three times for a finished step)."""
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    parses = []
    parse_args = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda parser, args=None, namespace=None:
                        parses.append(args) or parse_args(parser, args, namespace))
    fakes.calls.clear()
    run(argv, fakes)  # every step finished: none runs, each is checked against its recorded flags
    assert fakes.calls == [] and len(parses) == 3, parses


def test_a_finished_step_is_not_reused_for_other_flags(tmp_path, fakes):
    argv = common(tmp_path, fakes.model_dir)
    run(argv + ["--step", "1"], fakes)
    changed = r'step 1 finished in .*step1 with other settings than this run gives it \(--max_seq_len "256" -> "64"\)'
    with pytest.raises(UserError, match=changed + r".*choose another --output-dir \(or delete .*step1"):
        run(argv + ["--step1-args", "--max_seq_len 64"], fakes)
    assert [call[0] for call in fakes.calls] == [1]


def test_the_steps_after_one_that_runs_again_run_too(tmp_path, fakes):
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    shutil.rmtree(tmp_path / "out" / "step1")
    fakes.calls.clear()
    run(argv, fakes)
    assert [call[0] for call in fakes.calls] == [1, 3]  # step 2 does not start from step 1's model


def test_a_finished_step_whose_model_is_gone_runs_again(tmp_path, fakes):
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    shutil.rmtree(tmp_path / "out" / "step1" / "model")  # its summary.json stays
    fakes.calls.clear()
    run(argv, fakes)
    assert [call[0] for call in fakes.calls] == [1, 3]


def test_checkpoints_of_a_step_whose_input_model_is_made_again_are_refused_before_anything_runs(tmp_path,
                                                                                                tiny_model_dir):
    """Resumed, step 3 would go on from weights trained on step 1's old model."""
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={step: ["--resume"] for step in (1, 2, 3)})
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    out = tmp_path / "out"
    (out / "step1" / SUMMARY_FILE).unlink()  # step 1 runs again
    (out / "step3" / SUMMARY_FILE).unlink()  # step 3 stopped after a checkpoint
    checkpoint = out / "step3" / CHECKPOINTS_SUBDIR / "step2"
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 2, "engines": ["actor"]}))
    fakes.calls.clear()
    with pytest.raises(UserError, match=f"{out / 'step3'} holds checkpoints of step 3 trained from a model this run "
                                        "makes again"):
        run(argv + ["--resume"], fakes)
    assert fakes.calls == []


def test_checkpoints_of_a_step_whose_input_was_made_again_by_an_earlier_invocation_are_refused(tmp_path,
                                                                                              tiny_model_dir):
    """Step 3 stopped with checkpoints; step 1 was then retrained alone (`--step 1`). `--step 3 --resume` went on
    from weights trained on the old step-1 model, beside the new one as reference: what a step was trained from was
    recorded only once it finished."""
    model = tiny_model_dir("llama")
    argv = common(tmp_path, model)
    stopping = FakeSteps(model, extra_options={step: ["--resume"] for step in (1, 2, 3)}, fail_step=3)
    with pytest.raises(UserError, match="step 3 .*the data file is empty"):
        run(argv, stopping)
    out = tmp_path / "out"
    checkpoint = out / "step3" / CHECKPOINTS_SUBDIR / "step2"  # what step 3 saved before it stopped
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 2, "engines": ["actor"]}))
    shutil.rmtree(out / "step1")
    fakes = FakeSteps(model, extra_options={step: ["--resume"] for step in (1, 2, 3)})
    run(argv + ["--step", "1"], fakes)
    fakes.calls.clear()
    with pytest.raises(UserError, match=f"step 3 stopped with checkpoints in {out / 'step3'} from an earlier run of "
                                        "its input .*step1 \\(--actor_model_name_or_path\\), which was trained again"):
        run(argv + ["--step", "3", "--resume"], fakes)
    assert fakes.calls == []


def test_a_new_run_in_a_finished_run_folder_is_unfinished_until_it_saves_its_summary(tmp_path):
    save_run_args(tmp_path, argparse.Namespace(seed=1))
    save_summary(tmp_path, {"optimizer_steps": 3})
    save_run_args(tmp_path, argparse.Namespace(seed=2))
    assert not (tmp_path / SUMMARY_FILE).exists()


class _KilledMidWrite:
    """A file opened for writing that takes half of the first write, then stops the process as a kill would."""

    def __init__(self, handle):
        self.handle = handle

    def write(self, data):
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        raise KeyboardInterrupt

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.handle.close()

    def __getattr__(self, name):
        return getattr(self.handle, name)


def kill_writes_of(monkeypatch, killed):
    """Make writes to the files `killed(path)` picks (their temporary names too) stop midway."""
    import builtins
    import io

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return _KilledMidWrite(handle) if "w" in mode and killed(Path(file)) else handle

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)


@pytest.mark.parametrize("name, save", [(ARGS_FILE, save_run_args), (SUMMARY_FILE, save_summary)])
def test_a_kill_while_a_record_is_written_leaves_the_earlier_record_whole(tmp_path, monkeypatch, name, save):
    save(tmp_path, {"seed": 1, "data_path": ["embedded"]})
    earlier = (tmp_path / name).read_text()
    kill_writes_of(monkeypatch, lambda path: name in path.name)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, {"seed": 2, "data_path": ["other"]})
    monkeypatch.undo()
    assert (tmp_path / name).read_text() == earlier and json.loads(earlier)["seed"] == 1


def test_a_kill_while_the_pipeline_summary_is_written_leaves_the_earlier_one_whole(tmp_path, fakes, monkeypatch):
    out = tmp_path / "out"
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    earlier = (out / "summary.json").read_text()
    kill_writes_of(monkeypatch, lambda path: path.parent == out and "summary.json" in path.name)
    with pytest.raises(KeyboardInterrupt):
        run(argv, fakes)
    monkeypatch.undo()
    assert (out / "summary.json").read_text() == earlier


def test_launcher_runs_tee_the_output_into_the_log(tmp_path):
    from training.pipeline.launch import run_subprocess

    log = tmp_path / "logs" / "step1.log"
    run_subprocess([sys.executable, "-c", "import sys; print('to stdout'); print('to stderr', file=sys.stderr)"], log,
                   "step 1")
    text = log.read_text()
    assert "to stdout" in text and "to stderr" in text and text.startswith("$ ")
    with pytest.raises(UserError, match=r"step 1 failed \(exit status 4\).*step1.log"):
        run_subprocess([sys.executable, "-c", "raise SystemExit(4)"], log, "step 1")
    with pytest.raises(StepStopped, match="step 1"):  # a step's exit after the checkpoint of a stop request
        run_subprocess([sys.executable, "-c", "raise SystemExit(3)"], log, "step 1")


class StoppingSteps(FakeSteps):
    """Fake steps of which `stop_step` takes a stop request: while it finishes (it then ends as finished), or
    mid-training (it saves a checkpoint of its step `checkpoint`, unless None, and exits with EXIT_INTERRUPTED)."""

    def __init__(self, model_dir: str, stop_step: int, finishing: bool, checkpoint: int | None = None):
        super().__init__(model_dir, extra_options={step: ["--resume"] for step in MODEL_FLAGS})
        self.stop_step, self.finishing, self.checkpoint = stop_step, finishing, checkpoint

    def main(self, step: int):
        finished = super().main(step).__wrapped__

        def main(argv):
            if step != self.stop_step:
                return finished(argv)
            record_signal(signal.SIGTERM)  # what the step's GracefulInterrupt does when the signal comes
            if self.finishing:
                return finished(argv)
            if self.checkpoint is not None:
                output_dir = Path(self.parser(step).parse_args(argv).output_dir)
                saved = output_dir / CHECKPOINTS_SUBDIR / f"step{self.checkpoint}"
                saved.mkdir(parents=True)
                (saved / MARKER_FILE).write_text(json.dumps({"step": self.checkpoint, "engines": ["model"],
                                                             "world_size": 1}))
            raise SystemExit(EXIT_INTERRUPTED)

        return main


@pytest.mark.parametrize("finishing", [True, False])
def test_a_stop_request_during_a_step_ends_train_py_before_the_next_step(tmp_path, tiny_model_dir, capsys, finishing):
    """A Ctrl-C while a step wrote its final model let the step end as finished, and train.py went on to the next
    step as if nothing had been asked; a step stopped with a checkpoint was reported as failed (exit status 3)."""
    steps = StoppingSteps(tiny_model_dir("llama"), stop_step=2, finishing=finishing)
    with pytest.raises(SystemExit) as stopped:
        run(common(tmp_path, steps.model_dir), steps)
    assert stopped.value.code == EXIT_INTERRUPTED and [call[0] for call in steps.calls] == [1, 2][:1 + finishing]
    printed = capsys.readouterr().out.splitlines()[-1]
    if finishing:
        assert printed == ("train.py stopped on SIGTERM: step 2 finished and the next did not start; to go on, run the "
                           "same train.py command (finished steps are skipped)")
    else:
        assert printed == ("train.py stopped on SIGTERM: step 2 stopped before its first checkpoint; to go on, run the "
                           "same train.py command (step 2 starts over)")
    assert take_received_signal() is None


@pytest.mark.parametrize("resume", [False, True])
def test_a_step_stopped_with_a_checkpoint_says_which_and_how_to_go_on_from_it(tmp_path, tiny_model_dir, capsys, resume):
    """train.py said 'its checkpoints hold its progress; ... run the same train.py command with --resume' of every
    step stopped mid-training: of one stopped before its first checkpoint too, and 'with --resume' to a command that
    had it."""
    steps = StoppingSteps(tiny_model_dir("llama"), stop_step=2, finishing=False, checkpoint=5)
    with pytest.raises(SystemExit) as stopped:
        run(common(tmp_path, steps.model_dir) + (["--resume"] if resume else []), steps)
    assert stopped.value.code == EXIT_INTERRUPTED
    checkpoint = tmp_path / "out" / "step2" / CHECKPOINTS_SUBDIR / "step5"
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"train.py stopped on SIGTERM: step 2 stopped before it finished, with a checkpoint of its step 5 "
        f"({checkpoint}); to go on, run the same train.py command{'' if resume else ' with --resume'}")


@pytest.mark.parametrize("finishing", [True, False], ids=["between_steps", "mid_step"])
def test_a_run_a_stop_request_ends_says_so_in_its_summary(tmp_path, tiny_model_dir, capsys, monkeypatch, finishing):
    """A run stopped during a step or between steps wrote no summary.json, while a failed one wrote one with 'failed':
    a user or a scheduler reading the run folder could not tell a stopped run from one still going. It now says
    which step a rerun goes on with, the signal, what train.py said and the command that goes on."""
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py", "--step", "1", "2", "3"])
    steps = StoppingSteps(tiny_model_dir("llama"), stop_step=2, finishing=finishing, checkpoint=5)
    with pytest.raises(SystemExit):
        run(common(tmp_path, steps.model_dir), steps)
    report = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(report["steps"]) == ["1", "2"][:1 + finishing] and "failed" not in report
    assert report["stopped"] == {"step": 3 if finishing else 2, "signal": "SIGTERM",
                                 "message": capsys.readouterr().out.splitlines()[-1],
                                 "resume": "python train.py --step 1 2 3 --resume"}


class RecordReadingSteps(FakeSteps):
    """Fake steps that note, as each starts, what the run folder's summary.json says (`seen`, by step)."""

    def __init__(self, model_dir: str, fail_step=None):
        super().__init__(model_dir, fail_step=fail_step)
        self.seen: dict[int, dict] = {}

    def main(self, step: int):
        finished = super().main(step).__wrapped__

        def main(argv):
            out = Path(self.parser(step).parse_args(argv).output_dir).parent
            self.seen[step] = json.loads((out / SUMMARY_FILE).read_text())
            return finished(argv)

        return main


def test_a_run_says_it_is_running_in_its_summary_from_before_its_first_step(tmp_path, tiny_model_dir, monkeypatch):
    """An earlier run's summary.json (a failed one here) stayed in place while a new run went, until that one ended:
    whoever read the run folder meanwhile took the earlier result for this run's. From before its first step it says
    the run is running (when it started, the command, host and pid, the steps it runs, the finished ones it keeps),
    and the end record replaces that; a dry run writes nothing."""
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py", "--step", "1", "2", "3"])
    out = tmp_path / "out"
    steps = RecordReadingSteps(tiny_model_dir("llama"), fail_step=3)
    argv = common(tmp_path, steps.model_dir)
    with pytest.raises(UserError):
        run(argv, steps)
    failed = (out / SUMMARY_FILE).read_text()
    assert json.loads(failed)["status"] == "failed" and steps.seen[1]["status"] == "running"
    run(argv + ["--dry-run"], steps)
    assert (out / SUMMARY_FILE).read_text() == failed
    steps.fail_step, steps.seen = None, {}
    before = datetime.datetime.now().astimezone().replace(microsecond=0)
    report = run(argv, steps)
    running = steps.seen[3]
    assert running["status"] == "running" and running["steps_to_run"] == [3] and running["deployment"] == "cpu"
    assert running["command"] == "python train.py --step 1 2 3"
    assert running["host"] == socket.gethostname() and running["pid"] == os.getpid()
    assert before <= datetime.datetime.fromisoformat(running["started"]) <= datetime.datetime.now().astimezone()
    assert running["steps"] == {step: report["steps"][step] for step in ("1", "2")}  # finished, kept as the end keeps
    assert report["status"] == "completed" and json.loads((out / SUMMARY_FILE).read_text()) == report


def stop_request_after_planning(monkeypatch) -> None:
    """A SIGTERM taken as train.py plans, which it acts on before step 1."""
    from training.pipeline import runner

    planned = runner.prepare_run

    def signalled_while_planning(*args):
        prepared = planned(*args)
        record_signal(signal.SIGTERM)
        return prepared

    monkeypatch.setattr(runner, "prepare_run", signalled_while_planning)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_stop_request_while_planning_is_recorded_unless_in_a_dry_run(tmp_path, fakes, monkeypatch, capsys, dry_run):
    """A stop request taken while train.py planned ended it (status 3) leaving the earlier run's summary.json as it was,
    there a completed run's: read as this run's result. It now records the stop and the finished steps it keeps."""
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    out = tmp_path / "out"
    argv = common(tmp_path, fakes.model_dir)
    run(argv, fakes)
    (out / "step3" / SUMMARY_FILE).unlink()  # step 3 runs again
    earlier = (out / SUMMARY_FILE).read_text()
    stop_request_after_planning(monkeypatch)
    fakes.calls.clear()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run(argv + (["--dry-run"] if dry_run else []), fakes)
    said = capsys.readouterr().out.splitlines()[-1]
    assert stopped.value.code == EXIT_INTERRUPTED and fakes.calls == []
    assert said == ("train.py stopped on SIGTERM: stopped while planning, before any step started; to go on, run the "
                    "same train.py command")
    report = json.loads((out / SUMMARY_FILE).read_text())
    if dry_run:
        assert (out / SUMMARY_FILE).read_text() == earlier
        return
    assert report["status"] == "stopped"
    assert [report["steps"][step]["skipped"] for step in report["steps"]] == [True] * 2
    assert report["stopped"] == {"step": 3, "signal": "SIGTERM", "message": said, "resume": "python train.py --resume"}


class AbortedSteps(FakeSteps):
    """Fake steps of which step 2 is aborted by a second Ctrl-C, as its stop handler aborts it."""

    def main(self, step: int):
        finished = super().main(step).__wrapped__

        def main(argv):
            if step == 2:
                record_signal(signal.SIGINT)
                raise KeyboardInterrupt("second interrupt: aborting without a checkpoint")
            return finished(argv)

        return main


def crash_in_train_py_after_step_1(monkeypatch, error: type[BaseException] = RuntimeError,
                                   message: str = "the output folder went away") -> None:
    """train.py's own code raising `error(message)`, past step 1 (its check of step 1's output)."""
    from training.pipeline import runner

    checked = runner._check_output

    def check_output(config, step):
        checked(config, step)
        if step == 1:
            raise error(message)

    monkeypatch.setattr(runner, "_check_output", check_output)


@pytest.mark.parametrize("ending", ["second_ctrl_c", "train_py_crashes"])
def test_a_run_ended_past_its_running_mark_says_how_it_ended(tmp_path, tiny_model_dir, monkeypatch, ending):
    """A second Ctrl-C while a step stopped in train.py's own process, and an exception of train.py's own, ended it
    with no word in summary.json: it still said what an earlier run had left there, or that this one was running."""
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    steps = AbortedSteps(tiny_model_dir("llama")) if ending == "second_ctrl_c" else FakeSteps(tiny_model_dir("llama"))
    if ending == "train_py_crashes":
        crash_in_train_py_after_step_1(monkeypatch)
    with pytest.raises(KeyboardInterrupt if ending == "second_ctrl_c" else RuntimeError):
        run(common(tmp_path, steps.model_dir), steps)
    report = json.loads((tmp_path / "out" / SUMMARY_FILE).read_text())
    if ending == "second_ctrl_c":
        assert list(report["steps"]) == ["1"] and report["status"] == "stopped"
        assert report["stopped"] == {"step": 2, "signal": "SIGINT", "resume": "python train.py --resume",
                                     "message": "second interrupt: aborting without a checkpoint"}
    else:
        assert report["steps"] == {} and report["status"] == "failed"
        assert report["failed"] == {"step": 1, "error": "train.py crashed: RuntimeError: the output folder went away; "
                                                        "the traceback is on its stderr"}
    take_received_signal()


@pytest.mark.parametrize("reader_gone", [True, False])
def test_a_print_meeting_train_pys_output_without_a_reader_is_recorded_as_a_stop(tmp_path, fakes, monkeypatch,
                                                                              reader_gone):
    """A print of train.py's that met its output left without a reader before the output watch did raised a
    BrokenPipeError, which run_cli ends quietly on with status 141, but summary.json said 'failed', 'train.py
    crashed: BrokenPipeError', where the watch's way records a stop by SIGPIPE. A BrokenPipeError of another pipe
    (train.py's outputs still read) is still train.py's own crash."""
    from utils import output_pipes

    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    monkeypatch.setattr(output_pipes, "pipes_among", lambda fds: list(fds))
    monkeypatch.setattr(output_pipes, "without_reader", lambda fd: reader_gone)
    crash_in_train_py_after_step_1(monkeypatch, BrokenPipeError, "Broken pipe")
    with pytest.raises(BrokenPipeError):
        run(common(tmp_path, fakes.model_dir), fakes)
    report = json.loads((tmp_path / "out" / SUMMARY_FILE).read_text())
    if reader_gone:
        assert report["status"] == "stopped"
        assert report["stopped"] == {"step": 1, "signal": "SIGPIPE", "message": None,
                                     "resume": "python train.py --resume"}
    else:
        assert report["status"] == "failed"
        assert report["failed"]["error"].startswith("train.py crashed: BrokenPipeError")


@pytest.mark.parametrize("ending", ["train_py_crashes", "stop_request"])
def test_an_end_record_that_cannot_be_written_leaves_what_ended_the_run(tmp_path, fakes, monkeypatch, capsys,
                                                                        ending):
    """A full disk as train.py recorded its own crash, or a stop, raised the OSError of that write in place of what
    ended the run: the crash shown only behind 'During handling of the above exception', the stop's message and
    its status 3 not at all."""
    from training.pipeline import runner

    written = runner.atomic_write_text

    def write_running_mark_only(path, text):
        if Path(path).name == SUMMARY_FILE and json.loads(text)["status"] != "running":
            raise OSError(28, "No space left on device", str(path))
        written(path, text)

    monkeypatch.setattr(runner, "atomic_write_text", write_running_mark_only)
    if ending == "train_py_crashes":
        crash_in_train_py_after_step_1(monkeypatch)
    else:
        stop_request_after_planning(monkeypatch)
    with pytest.raises(RuntimeError if ending == "train_py_crashes" else SystemExit) as ended:
        run(common(tmp_path, fakes.model_dir), fakes)
    said = capsys.readouterr()
    if ending == "stop_request":
        assert ended.value.code == EXIT_INTERRUPTED and "train.py stopped on SIGTERM" in said.out
    summary = tmp_path / "out" / SUMMARY_FILE
    assert json.loads(summary.read_text())["status"] == "running"
    assert said.err.count(f"warning: train.py could not record how this run ended in {summary}") == 1
    assert "No space left on device" in said.err


def test_a_running_mark_that_cannot_be_written_refuses_the_run_before_step_1(tmp_path, fakes, monkeypatch):
    """A full disk as train.py wrote its running mark, before step 1, ended it in that OSError's traceback. It is now
    a refusal naming summary.json and the OSError, saying what to do; no step runs and the folder it made is gone."""
    from training.pipeline import runner

    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(runner, "atomic_write_text", full_disk)
    out = tmp_path / "out"
    with pytest.raises(UserError) as refused:
        run(common(tmp_path, fakes.model_dir), fakes)
    assert str(refused.value) == (
        f"train.py could not record that this run started in {out / SUMMARY_FILE} ([Errno 28] No space left on "
        f"device: '{out / SUMMARY_FILE}'), so it ran no step; free space there, or make it writable, or choose another "
        "--output-dir")
    assert fakes.calls == [] and not out.exists()


class LockingSteps(FakeSteps):
    """Fake steps that hold their run folder's lock while they run, as the real steps do."""

    def main(self, step: int):
        finished = super().main(step).__wrapped__

        def main(argv):
            run_dir = Path(self.parser(step).parse_args(argv).output_dir)
            with RunLock(run_dir):
                self.started(step, run_dir)
                return finished(argv)

        return main

    def started(self, step: int, run_dir: Path) -> None:
        """Called as `step` starts, holding its run folder's lock."""


class SecondTrainPyStartingSteps(LockingSteps):
    """Locking fake steps of which step 1 starts a dry run and then a second train.py on the same --output-dir,
    noting what each said on stderr, how the second ended and whether either changed summary.json."""

    def __init__(self, model_dir: str, argv: list[str]):
        super().__init__(model_dir)
        self.argv = argv
        self.second = LockingSteps(model_dir)
        self.said: dict[str, str] = {}
        self.summary_changed: dict[str, bool] = {}
        self.second_exit: int | None = None

    def started(self, step: int, run_dir: Path) -> None:
        if step == 1:
            self._start_others(run_dir.parent)

    def _start_others(self, out: Path) -> None:
        running = (out / SUMMARY_FILE).read_text()
        for name, argv in (("dry run", [*self.argv, "--dry-run"]), ("second run", self.argv)):
            said = io.StringIO()
            with contextlib.redirect_stderr(said):
                try:
                    run_cli(lambda argv=argv: run(argv, self.second))()
                except SystemExit as ended:
                    self.second_exit = ended.code
            self.said[name] = said.getvalue()
            self.summary_changed[name] = (out / SUMMARY_FILE).read_text() != running


def test_a_second_train_py_on_an_output_folder_in_use_is_refused_at_once(tmp_path, tiny_model_dir, monkeypatch):
    """train.py took no lock on its --output-dir: a second one started there while the first ran wrote its running
    mark over the first's, then its own failure (its step 1 refused by the step's lock) over that, so summary.json
    told of the wrong run until the first ended. The first holds the folder for the whole run: the second is refused
    before it plans (status 2, naming the folder and its holder) and writes nothing; a dry run says the folder is in
    use. The steps' own locks, on their run folders below it, are taken as before."""
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    out = tmp_path / "out"
    argv = common(tmp_path, tiny_model_dir("llama"))
    steps = SecondTrainPyStartingSteps(tiny_model_dir("llama"), argv)
    report = run(argv, steps)
    holder = rf"\(pid {os.getpid()} on {re.escape(socket.gethostname())}, started 20[-\d]+ [:\d]+\)"
    assert re.search(rf"^error: output dir {re.escape(str(out))} is in use by another run {holder}; wait for it to "
                     r"finish or choose another --output-dir$", steps.said["second run"].strip()), steps.said
    assert steps.second_exit == EXIT_USER_ERROR and steps.second.calls == []
    assert re.search(rf"warning: --output-dir {re.escape(str(out))} is in use by another run {holder}",
                     steps.said["dry run"]), steps.said
    assert steps.summary_changed == {"dry run": False, "second run": False}
    assert [step for step, _, _ in steps.calls] == [1, 2, 3] and report["status"] == "completed"
    run(argv, steps.second)  # the folder is free once the first has ended
    assert json.loads((out / SUMMARY_FILE).read_text())["status"] == "completed"


SIGNALLED_OUTSIDE_A_STEP = """
import os, signal, sys
from pathlib import Path
import test_train_pipeline as t
from training.pipeline import runner

where, signum, model, out = sys.argv[1], signal.Signals[sys.argv[2]], sys.argv[3], Path(sys.argv[4])
planned = runner.prepare_run
checked = runner._check_output

def signalled_while_planning(*args):
    prepared = planned(*args)
    os.kill(os.getpid(), signum)
    return prepared

def signalled_after_step_1(config, step):
    checked(config, step)
    if step == 1:
        os.kill(os.getpid(), signum)

runner.prepare_run, runner._check_output = (planned, signalled_after_step_1) if where == "between steps" else \
    (signalled_while_planning, checked)
fakes = t.FakeSteps(model)
t.run(t.common(out, model), fakes)
print("steps run:", [call[0] for call in fakes.calls])
"""


@pytest.mark.parametrize(("where", "signum", "said"), [
    ("between steps", "SIGTERM", ("step 1 finished and the next did not start; to go on, run the same train.py "
                                  "command (finished steps are skipped)")),
    ("while planning", "SIGINT", ("stopped while planning, before any step started; to go on, run the same train.py "
                                  "command")),
])
def test_a_stop_request_outside_a_step_ends_train_py_saying_how_to_go_on(tmp_path, tiny_model_dir, where, signum,
                                                                         said):
    """Between steps (train.py's own checks of a step's output) and while planning no handler took a stop request:
    a SIGTERM killed train.py without a word, a SIGINT ended it in a KeyboardInterrupt traceback."""
    env = {**step_env(), "PYTHONPATH": f"{REPO_ROOT / 'tests'}{os.pathsep}{step_env()['PYTHONPATH']}"}
    done = subprocess.run([sys.executable, "-c", SIGNALLED_OUTSIDE_A_STEP, where, signum, tiny_model_dir("llama"),
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == EXIT_INTERRUPTED, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"train.py stopped on {signum}: {said}"
    assert "Traceback" not in done.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "stopped"


READER_LEAVING = """
import sys, time
from pathlib import Path
import test_train_pipeline as t
from training.pipeline import runner
from training.reliability import signals

where, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
planned, checked = runner.prepare_run, runner._check_output

def until(taken):
    print("ready", flush=True)  # the reader reads up to this line, then leaves
    waited_until = time.monotonic() + 30
    while not taken() and time.monotonic() < waited_until:
        time.sleep(0.01)

def reader_left_while_planning(*args):
    prepared = planned(*args)
    until(lambda: signals._received is not None)
    return prepared

def reader_left_after_step(step):
    def check_output(config, checked_step):
        checked(config, checked_step)
        if checked_step == step:
            until(lambda: signals._received is not None)
    return check_output

def step_stopped_by_the_reader(argv):  # a real step's loop: it stops at its next step and saves
    with signals.GracefulInterrupt() as stop:
        until(lambda: stop.requested)
        stop.exit_for_resume(1, "checkpoints/step1")

class ReaderLeavingInStep2(t.FakeSteps):
    def main(self, step):
        return step_stopped_by_the_reader if step == 2 else super().main(step)

argv, fakes = t.common(out, model), t.FakeSteps(model)
if where == "dry run":
    runner.prepare_run, argv = reader_left_while_planning, argv + ["--dry-run"]
elif where == "during step 2":
    fakes = ReaderLeavingInStep2(model)
else:
    runner._check_output = reader_left_after_step(1 if where == "between steps" else 3)
try:
    t.run(argv, fakes)
finally:
    print("steps run:", [call[0] for call in fakes.calls], file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize(("where", "status", "steps_run"), [
    ("dry run", EXIT_BROKEN_PIPE, []),
    ("between steps", EXIT_BROKEN_PIPE, [1]),
    ("after the last step", EXIT_BROKEN_PIPE, [1, 2, 3]),
    ("during step 2", EXIT_INTERRUPTED, [1]),
])
def test_train_py_whose_output_reader_leaves_ends_as_sigpipe_would_unless_a_step_is_under_way(
        tmp_path, tiny_model_dir, where, status, steps_run):
    """`train.py --dry-run | head -1` exited 3 ('stopped after saving a checkpoint') and said 'received SIGTERM',
    which nobody sent: the output watch's own SIGTERM was taken as a stop request. Where no step is under way train.py
    now ends quietly with the shell's status for SIGPIPE; a step under way still stops and saves (status 3), and
    train.py says why on stderr, its stdout going nowhere. summary.json's `stopped.message` is what train.py said: it
    held 'train.py stopped as ...' where train.py, between steps, said nothing."""
    env = {**step_env(), "PYTHONPATH": f"{REPO_ROOT / 'tests'}{os.pathsep}{step_env()['PYTHONPATH']}"}
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        train_py = subprocess.Popen([sys.executable, "-c", READER_LEAVING, where, tiny_model_dir("llama"),
                                     str(tmp_path)], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        with train_py.stdout as output:
            next((line for line in output if line.strip() == "ready"), None)
        status_got = train_py.wait(timeout=120)
    said = errors.read_text()
    assert status_got == status, said[-3000:]
    assert f"steps run: {steps_run}" in said
    assert "received SIGTERM" not in said and "Traceback" not in said
    if status == EXIT_INTERRUPTED:
        unread = "train.py's output has no reader any more (the program it was piped into ended)"
        assert f"train.py stopped as {unread}: step 2 stopped before its first checkpoint" in said
        assert f"stopped as {unread} after step 1" in (tmp_path / "out" / "logs" / "step2.log").read_text()
    else:
        assert "train.py stopped" not in said
    assert (tmp_path / "out" / "summary.json").exists() == (where != "dry run")
    if where in ("between steps", "during step 2"):
        stopped = json.loads((tmp_path / "out" / "summary.json").read_text())["stopped"]
        assert stopped["signal"] == "SIGPIPE"
        assert (stopped["message"] is None) == (status == EXIT_BROKEN_PIPE)  # what train.py said: nothing if quiet


def _write_tiny_data(path: Path) -> str:
    rows = []
    for index in range(24):
        rows.append({
            "prompt": f" Human: What is {index} plus one? Assistant:",
            "chosen": f" {index} plus one is {index + 1}.",
            "rejected": " I do not know.",
        })
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
def test_train_py_runs_all_three_steps_then_the_chatbot_answers(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = _write_tiny_data(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    # the timeouts guard against a hang alone: three steps' start-ups on a loaded 2-core machine (two test workers)
    # take minutes, so a bound on the run's time would measure the load
    result = subprocess.run(
        [sys.executable, "train.py", "--actor-model", model, "--reward-model", model, "--output-dir", str(out),
         "--deployment-type", "cpu", "--data_path", data, "--data_output_path", str(tmp_path / "cache"),
         "--max_steps", "2", "--max_train_samples", "8", "--max_eval_samples", "4", "--dtype", "fp32"],
        cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for step in (1, 2, 3):
        assert (out / "logs" / f"step{step}.log").stat().st_size > 0
        assert (out / f"step{step}" / "summary.json").is_file()
    assert (out / "step3" / "actor" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["deployment"] == "cpu" and set(summary["steps"]) == {"1", "2", "3"}
    assert "total" in result.stdout.strip().splitlines()[-1]

    chat = subprocess.run(
        [sys.executable, "-m", "inference.chatbot", "--path", str(out), "--prompt", "What is 2 plus one?",
         "--greedy", "--max_new_tokens", "8"],
        cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=300,
    )
    assert chat.returncode == 0, chat.stderr
    assert "Human: What is 2 plus one?\nAssistant: " in chat.stdout


def test_a_finished_step_is_the_same_run_whatever_its_saving_logging_and_decoding_flags():
    """What decides whether a finished step is reused: the flags marked `same_result` may differ, any other
    (a learning rate too) may not."""
    from step3_rlhf.main import parse_args

    from training.core.args import flag_values, same_result_flags
    from training.reliability.run_records import changed_flags

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "run"]
    recorded = json.loads(json.dumps(flag_values(parse_args(base))))
    now = parse_args([*base, "--save_interval", "5", "--profile_calls",
                      "--disable_cuda_graph", "--resume", "--data_output_path", "elsewhere"])
    assert changed_flags(recorded, flag_values(now), same_result_flags(now)) == {}
    now = parse_args([*base, "--actor_learning_rate", "1e-3", "--save_interval", "5"])
    assert changed_flags(recorded, flag_values(now), same_result_flags(now)) == {
        "actor_learning_rate": (recorded["actor_learning_rate"], 1e-3)}


def test_the_settings_table_shows_what_each_step_runs_with_where_the_users_flags_change_the_plan(tmp_path, fakes,
                                                                                                 capsys):
    """`--dtype fp32` on a bf16 machine ran every step in fp32 while the table said bf16."""
    run(common(tmp_path, fakes.model_dir) + ["--dtype", "fp32", "--step3-args", "--max_answer_seq_len 64",
                                             "--dry-run"], fakes)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["dtype"].count("fp32 (planned bf16)") == 3
    assert rows["max_answer_seq_len"].split()[-3:] == ["64", "(planned", "48)"]
    assert "planned" not in rows["max_seq_len"] and rows["max_seq_len"].split()[1:] == ["256", "192", "-"]


def test_resuming_a_step_checkpointed_by_another_number_of_processes_is_refused_before_anything_runs(tmp_path,
                                                                                                     tiny_model_dir):
    """A multi-node run relaunched after a crash with a node fewer: the step was launched on every node, and each
    rank then refused the checkpoint. train.py refuses it first, naming both counts and the way out."""
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={step: ["--resume"] for step in (1, 2, 3)})
    out = tmp_path / "out"
    checkpoint = out / "step1" / CHECKPOINTS_SUBDIR / "step2"
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 2, "engines": ["model"], "world_size": 4}))
    argv = common(tmp_path, fakes.model_dir) + ["--resume"]
    for extra in (["--dry-run"], []):
        with pytest.raises(UserError, match=r"step 1 would resume from .*step2, written by 4 processes, but this "
                                            r"cpu run has 1; resume on 4 GPUs .*or delete .*checkpoints"):
            run(argv + extra, fakes)
    assert fakes.calls == []
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 2, "engines": ["model"], "world_size": 1}))
    run(argv, fakes)
    assert [(step, args.resume) for step, args, _ in fakes.calls] == [(1, True), (2, None), (3, None)]


def test_a_step_that_fails_after_a_checkpoint_says_how_to_go_on_from_it(tmp_path, tiny_model_dir):
    """A crash hours into a step (a node lost, an out-of-memory) ended in 'failed (exit status 1)' alone, and the
    same command again refused the step's folder for its checkpoints: the error now names the checkpoint and
    --resume."""
    fakes = FakeSteps(tiny_model_dir("llama"), extra_options={step: ["--resume"] for step in (1, 2, 3)}, fail_step=1)
    argv = common(tmp_path, fakes.model_dir)
    with pytest.raises(UserError) as failed:
        run(argv, fakes)
    assert "checkpoint" not in str(failed.value)  # none left: nothing to go on from
    checkpoint = tmp_path / "out" / "step1" / CHECKPOINTS_SUBDIR / "step3"
    checkpoint.mkdir(parents=True)
    (checkpoint / MARKER_FILE).write_text(json.dumps({"step": 3, "engines": ["model"], "world_size": 1}))
    with pytest.raises(UserError, match=r"^step 1 \(.*\): the data file is empty; pass a bigger one; step 1 left a "
                                        rf"checkpoint of its step 3 \({checkpoint}\): once the cause is fixed, the "
                                        r"same train.py command with --resume goes on from it$"):
        run(argv, fakes)
    with pytest.raises(UserError, match=r"once the cause is fixed, the same train.py command goes on from it$"):
        run(argv + ["--resume"], fakes)  # it said: with --resume


class LaunchedSteps:
    """`run_subprocess` for a GPU deployment on this CPU machine: reads the launcher command as DeepSpeed's launcher
    does, runs the fake step it names in this process, and records the master port it was given, which it then
    holds as another program would."""

    def __init__(self, fakes: FakeSteps):
        self.fakes = fakes
        self.ports: list[int] = []
        self.taken: list = []

    def __call__(self, command, log_path, label, env=None, stop_ranks=None, nodes=(), stop_status=None):
        import socket

        from deepspeed.launcher.runner import parse_args

        launched = parse_args(command[3:])
        self.ports.append(launched.master_port)
        step = next(number for number, script in ((1, "step1_sft"), (2, "step2_reward"), (3, "step3_rlhf"))
                    if script in launched.user_script)
        self.fakes.main(step).__wrapped__(launched.user_args)
        holder = socket.socket()
        holder.bind(("", launched.master_port))
        holder.listen()
        self.taken.append(holder)


def test_a_dry_run_plans_a_gpu_run_where_cuda_visible_devices_hides_the_gpus(tmp_path, fakes, monkeypatch):
    """A GPU run planned on a machine whose CUDA_VISIBLE_DEVICES hides every GPU (a login node) was refused at the
    dry run, over a launch it never makes; the run itself is still refused before step 1."""
    from training.pipeline import runner

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    launched = LaunchedSteps(fakes)
    monkeypatch.setattr(runner, "run_subprocess", launched)
    argv = common(tmp_path, fakes.model_dir) + ["--deployment-type", "single_gpu", "--step", "1", "2"]
    planned = run(argv + ["--dry-run"], fakes)
    assert all("--num_gpus" in command for command in planned["commands"].values())
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES='' lets this process see no GPU"):
        run(argv, fakes)
    assert fakes.calls == [] and launched.ports == []


def test_a_step_laying_conversations_out_otherwise_than_step_1_tuned_is_warned_of_by_a_dry_run(tmp_path, tiny_model_dir,
                                                                                              capsys):
    """Step 3 and DPO warned that step 1 had tuned their model under another --prompt_format only as they started,
    after the steps before them had run for hours; a dry run said nothing. Warned while planning now, from the flags
    step 1 runs with, or those its run recorded; not where the tokenizer lays both formats out alike."""
    model = tiny_model_dir("llama")  # its tokenizer has a chat template: auto is chat_template
    argv = ["--actor-model", model, "--reward-model", model, "--output-dir", str(tmp_path / "out"), "--dry-run"]

    def warned(*flags: str) -> str:
        run_pipeline(parse_config([*argv, *flags]), hardware=TWO_CORES)
        return capsys.readouterr().err

    said = warned("--step3-args", "--prompt_format human_assistant")
    assert said.count("warning: the model ") == 1
    assert f"warning: the model {tmp_path / 'out' / 'step1'} will be tuned (--prompt_format auto)" in said
    assert "but step 3 lays them out as ' Human:" in said
    assert 'Pass --step3-args "--prompt_format auto", the format it will be tuned under' in said
    assert "tuned (" not in warned("--step3-args", "--prompt_format chat_template")
    step1 = tmp_path / "step1"
    shutil.copytree(model, step1)
    save_run_args(step1, {"prompt_format": "human_assistant"})
    said = warned("--algorithm", "dpo", "--step", "4", "--step1-output", str(step1))
    assert f"warning: the model {step1} was tuned (--prompt_format human_assistant)" in said
    assert "but step 4 lays them out as " in said
    assert 'Pass --dpo-args "--prompt_format human_assistant", the format it was tuned under' in said
    assert "was tuned" not in warned("--algorithm", "dpo", "--step", "4", "--step1-output", str(step1),
                                     "--dpo-args", "--prompt_format human_assistant")


@pytest.mark.parametrize("flags, step", [
    (["--algorithm", "dpo", "--dpo-args", "--prompt_format chat_template"], 4),
    (["--algorithm", "dpo", "--step1-args", "--prompt_format chat_template"], 1),
    (["--algorithm", "grpo", "--reward_fn", "builtin:math", "--step3-args", "--prompt_format chat_template"], 3),
], ids=["dpo", "step_1", "step_3"])
def test_a_chat_template_format_step_1s_tokenizer_cannot_render_is_refused_as_its_steps(tmp_path, tiny_model_dir,
                                                                                     flags, step):
    """The step-1 layout check renders both formats with step 1's tokenizer: one without a chat template ended the
    plan in the formatter's bare '--prompt_format chat_template needs a tokenizer ...', naming no step, where the
    other plan refusals name the step whose flag it is."""
    model = tiny_model_dir("llama", chat_template=False)
    argv = ["--actor-model", model, "--output-dir", str(tmp_path / "out"), "--dry-run", *flags]
    with pytest.raises(UserError, match=rf"^step {step}: --prompt_format chat_template needs a tokenizer with a chat "
                                        "template; use auto or human_assistant$"):
        run_pipeline(parse_config(argv), hardware=TWO_CORES)


def test_a_dry_run_whose_step_1_tokenizer_is_not_at_hand_says_the_layout_check_was_skipped(tmp_path, tiny_model_dir,
                                                                                          hub_cache, capsys):
    """Where step 3's --prompt_format differs from step 1's, the plan reads step 1's tokenizer: offline, with a hub
    model whose config.json alone the cache holds, train.py failed there, where the dry run had planned before. It
    plans on now, saying the check was skipped and why."""
    model = tiny_model_dir("llama")
    hub_cache.put("some-org/tiny", json.loads((Path(model) / "config.json").read_text()))
    argv = ["--actor-model", "some-org/tiny", "--reward-model", model, "--output-dir", str(tmp_path / "out"),
            "--dry-run", "--step3-args", "--prompt_format human_assistant"]
    assert "commands" in run_pipeline(parse_config(argv), hardware=TWO_CORES)
    said = capsys.readouterr().err
    assert ("warning: step 3's --prompt_format human_assistant was not checked against step 1's (auto) for a layout "
            "unlike the one its model is tuned on, as the tokenizer does not load: tokenizer 'some-org/tiny' was not "
            "found locally and could not be fetched from the hub: the hub cannot be reached from here") in said


def test_a_reward_model_trained_on_another_layout_than_step_3_gives_it_is_warned_of_by_a_dry_run(
        tmp_path, tiny_model_dir, hub_cache, monkeypatch, capsys):
    """Step 3 warned that its reward model was trained on conversations laid out otherwise (another chat template:
    --reward-model of another family; or another --prompt_format) only as it started, after steps 1 and 2 had run for
    hours; a dry run said nothing. Warned while planning now, from step 2's flags in this run, or those its run
    recorded; the tokenizers are not read for one model under one format, and one that does not load is said."""
    from training.pipeline import runner

    chat = tiny_model_dir("llama")
    base = make_tiny_model_dir(tmp_path / "base", "llama", chat_template=False)  # the same vocabulary, no template
    loaded = []
    monkeypatch.setattr(runner, "load_tokenizer", lambda model, *args: loaded.append(model) or load_tokenizer(
        model, *args))

    def warned(actor: str, reward: str, *flags: str) -> str:
        argv = ["--actor-model", actor, "--reward-model", reward, "--output-dir", str(tmp_path / "out"), "--dry-run"]
        run_pipeline(parse_config([*argv, *flags]), hardware=TWO_CORES)
        return capsys.readouterr().err

    said = warned(chat, base)
    assert said.count("warning: the reward model ") == 1
    assert (f"warning: the reward model {tmp_path / 'out' / 'step2'} will be trained (--prompt_format auto) on "
            "conversations laid out as ' Human:") in said
    assert "but step 3 gives it the actor's answers laid out as '<|im_start|>user" in said
    assert "trained (" not in warned(chat, chat) and loaded == [chat, base]  # read for the first run alone
    step1, step2 = tmp_path / "step1", tmp_path / "step2"
    shutil.copytree(chat, step1)
    shutil.copytree(chat, step2)
    (step2 / "reward_model.json").write_text("{}")
    save_run_args(step2, {"prompt_format": "human_assistant"})
    recorded = ["--step", "3", "--step1-output", str(step1), "--step2-output", str(step2)]
    assert f"the reward model {step2} was trained (--prompt_format human_assistant)" in warned(chat, chat, *recorded)
    assert "trained (" not in warned(chat, chat, *recorded, "--step3-args", "--prompt_format human_assistant")
    hub_cache.put("some-org/tiny", json.loads((Path(base) / "config.json").read_text()))
    said = warned(chat, "some-org/tiny")
    assert ("warning: step 3's reward model was not checked for a vocabulary unlike the actor's, nor step 3's "
            "--prompt_format auto against step 2's (auto) for a layout unlike the one the reward model is trained on, "
            "as the tokenizer does not load: tokenizer 'some-org/tiny' was not found locally") in said


def test_a_reward_model_of_another_vocabulary_is_refused_by_a_dry_run_with_the_plans_other_problems(tmp_path,
                                                                                                     monkeypatch):
    """Step 3 refused a reward model whose tokenizer reads token ids otherwise than the actor's only as it started,
    after steps 1 and 2 had run for hours; a dry run planned it. Refused while planning now, in step 3's words, with
    the plan's other problems, from the tokenizers the layout check reads. Two models of one vocabulary without a pad
    token (loading adds one to each, and steps 1 and 2 save it) are not refused, nor are the outputs they save, as
    step 3 would not refuse them; one model under one format reads no tokenizer (the default run)."""
    from training.pipeline import runner
    from training.pipeline.cli import run as run_train_py

    actor = make_tiny_model_dir(tmp_path / "actor", "llama", with_unk=False)
    alike = make_tiny_model_dir(tmp_path / "alike", "llama", with_unk=False)
    other = make_tiny_model_dir(tmp_path / "other", "llama", vocab_size=300, with_unk=False)
    loaded = []
    monkeypatch.setattr(runner, "load_tokenizer", lambda model, *args: loaded.append(model) or load_tokenizer(
        model, *args))

    def planned(reward: str, *flags: str) -> dict:
        return run_train_py(["--actor-model", actor, "--reward-model", reward, "--output-dir", str(tmp_path / "out"),
                             "--deployment-type", "cpu", "--dry-run", *flags])

    with pytest.raises(UserError) as refused:
        planned(other, "--lora_learning_rate", "1e-3", "--step1-args", "--lora_dim 8")
    said = str(refused.value)
    assert said.startswith("2 steps can't run as given, before any step runs: step 2: --lora_learning_rate needs")
    assert (f"; step 3: the reward/critic model {other} uses a different tokenizer from the actor; train the reward "
            "model (step 2) from the same base model family as the actor") in said
    assert set(planned(alike)["commands"]) == {1, 2, 3} and loaded == [actor, other, actor, alike]
    step1, step2 = tmp_path / "step1", tmp_path / "step2"
    for base, output in ((actor, step1), (alike, step2)):
        shutil.copytree(base, output)
        load_tokenizer(base).save_pretrained(output)  # as steps 1 and 2 save the tokenizer they loaded
    (step2 / "reward_model.json").write_text("{}")
    assert set(planned(alike, "--step", "3", "--step1-output", str(step1), "--step2-output", str(step2))[
        "commands"]) == {3}
    loaded.clear()
    assert set(planned(actor)["commands"]) == {1, 2, 3} and loaded == []


def test_a_reward_model_of_another_vocabulary_is_refused_without_the_hint_on_flags(tmp_path):
    """The hint that train.py gives a flag to every step that takes it was added to the refusal of a reward model of
    another vocabulary wherever a flag went to every step (--max_steps 3), a refusal no flag causes; and several
    steps' problems were headed 'refuse their flags'. The hint comes with flag problems alone, under a header true
    of both kinds."""
    from training.pipeline.cli import run as run_train_py

    actor = make_tiny_model_dir(tmp_path / "actor", "llama")
    other = make_tiny_model_dir(tmp_path / "other", "llama", vocab_size=300)

    def refused(*flags: str) -> str:
        with pytest.raises(UserError) as error:
            run_train_py(["--actor-model", actor, "--reward-model", other, "--output-dir", str(tmp_path / "out"),
                          "--deployment-type", "cpu", "--dry-run", *flags])
        return str(error.value)

    hint = "train.py gives a flag to every step that takes it"
    said = refused("--max_steps", "3")
    assert said.startswith(f"step 3: the reward/critic model {other} uses a different tokenizer") and hint not in said
    said = refused("--lora_learning_rate", "1e-3", "--step1-args", "--lora_dim 8")
    assert said.startswith("2 steps can't run as given, before any step runs: step 2: --lora_learning_rate needs")
    assert said.endswith(f"{hint}: to give one to some steps only, pass it in {step_args_flags()}")


def test_a_reward_base_without_the_chat_template_step_2_is_given_is_refused_as_step_2s(tmp_path, tiny_model_dir):
    """Planning step 3's reward-model check refused any error inside it as step 3's: a template-less reward base
    given --step2-args "--prompt_format chat_template" was refused as 'step 3: --prompt_format chat_template needs a
    tokenizer with a chat template', naming the wrong step. It is step 2's."""
    chat = tiny_model_dir("llama")
    base = make_tiny_model_dir(tmp_path / "base", "llama", chat_template=False)  # the same vocabulary, no template
    argv = ["--actor-model", chat, "--reward-model", base, "--output-dir", str(tmp_path / "out"), "--dry-run",
            "--step2-args", "--prompt_format chat_template"]
    with pytest.raises(UserError, match=r"^step 2: --prompt_format chat_template needs a tokenizer with a chat "):
        run_pipeline(parse_config(argv), hardware=TWO_CORES)


def test_planning_reads_each_models_tokenizer_once(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Where step 3's --prompt_format differs from step 1's and the reward model is not the actor, both layout
    checks run, and each read the actor's tokenizer: read twice per planning. Once now."""
    from training.pipeline import runner

    chat = tiny_model_dir("llama")
    base = make_tiny_model_dir(tmp_path / "base", "llama", chat_template=False)
    loaded = []
    monkeypatch.setattr(runner, "load_tokenizer", lambda model, *args: loaded.append(model) or load_tokenizer(
        model, *args))
    argv = ["--actor-model", chat, "--reward-model", base, "--output-dir", str(tmp_path / "out"), "--dry-run",
            "--step3-args", "--prompt_format human_assistant"]
    run_pipeline(parse_config(argv), hardware=TWO_CORES)
    assert "warning: the model " in capsys.readouterr().err  # the step-1 check ran, and the reward one read `base`
    assert sorted(loaded) == sorted([chat, base])


@pytest.mark.parametrize("given_port", [False, True])
def test_each_launched_step_gets_a_master_port_free_when_it_starts(tmp_path, fakes, monkeypatch, capsys, given_port):
    """The free master port was chosen once, at planning, for every step: a step launched hours later, after another
    program took the port, failed as its ranks' store could not bind. A port train.py picks is picked free at each
    launch, and printed then (the commands printed before step 1 hold ports free at planning); a --master-port taken
    since is refused then, naming it."""
    from training.pipeline import runner
    from utils.dist import free_port

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched = LaunchedSteps(fakes)
    monkeypatch.setattr(runner, "run_subprocess", launched)
    argv = common(tmp_path, fakes.model_dir) + ["--deployment-type", "single_gpu", "--step", "1", "2"]
    try:
        if not given_port:
            run(argv, fakes)
            assert [call[0] for call in fakes.calls] == [1, 2] and len(set(launched.ports)) == 2
            out = capsys.readouterr().out
            assert "each step takes one free when it starts" in out
            assert all("launch: " in line and f"--master_port {port} " in line
                       for line, port in zip([line for line in out.splitlines() if line.startswith("launch: ")],
                                             launched.ports, strict=True))
            return
        port = free_port()
        with pytest.raises(UserError, match=rf"^--master-port {port} is taken on this machine"):
            run(argv + ["--master-port", str(port)], fakes)
        assert launched.ports == [port] and [call[0] for call in fakes.calls] == [1]
    finally:
        for holder in launched.taken:
            holder.close()


class CrashingSteps(FakeSteps):
    """Fake steps of which step 2 raises `error` mid-step, as a model's forward or a bad data row would."""

    def __init__(self, model_dir: str, error: Exception):
        super().__init__(model_dir)
        self.error = error

    def main(self, step: int):
        finished = super().main(step)
        if step != 2:
            return finished

        @run_cli
        def main(argv):
            raise self.error

        return main


@pytest.mark.parametrize("error, said", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     (r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate 2\.00 GiB; out of accelerator memory: .*"
      r"--offload, or LoRA \(--lora_dim 128[^)]*\)")),
    (KeyError("chosen"), r"KeyError: 'chosen'"),
])
def test_a_step_that_crashes_is_named_with_its_cause_log_and_way_on_and_recorded(tmp_path, tiny_model_dir, capsys,
                                                                                 error, said):
    """An exception mid-step (not a UserError) ended train.py in a traceback printed twice and exit status 1, naming
    neither the step nor its log, with no summary.json: now one error line (status 2), the traceback in the log."""
    fakes = CrashingSteps(tiny_model_dir("llama"), error)
    log = tmp_path / "out" / "logs" / "step2.log"
    with pytest.raises(SystemExit) as ended:
        run_cli(run)(common(tmp_path, fakes.model_dir), fakes)
    assert ended.value.code == 2
    error_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: step 2 \(reward model\) crashed: {said}; the traceback is in {re.escape(str(log))}; "
                        r"once the cause is fixed, the same train.py command runs step 2 again \(finished steps are "
                        r"skipped\)", error_line), error_line
    assert "Traceback (most recent call last)" in log.read_text()
    report = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(report["steps"]) == ["1"] and report["failed"]["step"] == 2
    assert "crashed" in report["failed"]["error"]


RANK_ENDING_IN_A_USER_ERROR = """\
from utils.errors import UserError, run_cli

@run_cli
def main():
    raise UserError("loss is not finite (nan) at step 3; stopping")

main()
"""


@pytest.mark.parametrize("rank, status, cause", [
    ("{}['chosen']", 1, "KeyError: 'chosen'"),
    (RANK_ENDING_IN_A_USER_ERROR, 2, r"loss is not finite \(nan\) at step 3; stopping"),
], ids=["exception", "user_error"])
def test_a_launched_step_that_fails_names_the_cause_its_ranks_printed(tmp_path, rank, status, cause):
    """A launched step ended in 'failed (exit status 1); its output is in ...' alone: the exception's line, or the
    `error:` line of a step's UserError (a NaN guard's, a bad data file's), is named."""
    from training.pipeline.launch import run_subprocess

    log = tmp_path / "step2.log"
    with pytest.raises(UserError, match=rf"^step 2 failed \(exit status {status}\): {cause}; its output is in "):
        run_subprocess([sys.executable, "-c", rank], log, "step 2", env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="needs pdsh")
def test_a_step_failing_on_another_node_names_the_node(tmp_path):
    """Through pdsh each line of a rank on another node begins with the node's name ('worker-1: KeyError: ...'),
    which the cause reader passed over: the failure named no cause there."""
    from training.pipeline.launch import run_subprocess

    rank = [sys.executable, "-c", "{}['chosen']"]
    with pytest.raises(UserError, match=r"^step 3 failed \(exit status \d+\): a rank on worker-1: KeyError: 'chosen';"):
        run_subprocess(["pdsh", "-S", "-R", "exec", "-w", "worker-1", *rank], tmp_path / "step3.log", "step 3",
                       nodes=("worker-0", "worker-1"))


RANK_TRAINING_UNTIL_STOPPED = """
import os, sys, time
from training.reliability.signals import GracefulInterrupt
with GracefulInterrupt() as stop:
    print("ready", os.getpid(), flush=True)
    waited_until = time.monotonic() + 60
    while not stop.requested and time.monotonic() < waited_until:
        print("step", file=sys.stderr, flush=True)  # a progress bar
        time.sleep(0.05)
    open(sys.argv[1], "w").write(stop.received.name if stop.requested else "no stop request")
    stop.exit_for_resume(1, "checkpoints/step1")
"""

TRAIN_PY_LAUNCHING_THROUGH_A_LAUNCHER = """
import sys
from pathlib import Path
from training.pipeline.launch import run_subprocess
from training.reliability.signals import GracefulInterrupt
# as DeepSpeed's: its ranks share its output
launcher = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
with GracefulInterrupt():
    run_subprocess([sys.executable, "-c", launcher, sys.executable, "-c", *sys.argv[1:3]], Path(sys.argv[3]), "step 1")
"""


def _launched_rank_pid(log: Path, train_py: subprocess.Popen) -> int:
    """The pid of the rank whose 'ready <pid>' line train.py copied into the step's `log`, once it has."""
    deadline = time.monotonic() + 300  # imports on 2 loaded cores
    while time.monotonic() < deadline and train_py.poll() is None:
        ready = re.search(r"^ready (\d+)$", log.read_text() if log.exists() else "", re.MULTILINE)
        if ready:
            return int(ready.group(1))
        time.sleep(0.2)
    raise AssertionError(f"the rank never got ready (train.py: {train_py.poll()}): {log.read_text()[-3000:]}")


def test_a_launched_step_stops_and_saves_when_train_py_is_killed_outright(tmp_path):
    """train.py killed outright (SIGKILL: a scheduler's hard kill, the OOM killer) does not leave its launched step
    running on unwatched, holding its run folder's lock and memory: the launcher's ranks write to the pipe train.py
    read, whose reader is gone, and take that as a stop request (their output's watch), so they save and end, for a
    --resume to go on from. Checked with DeepSpeed's launcher by hand (its rank stopped 0.6 s after the kill)."""
    import psutil

    from training.reliability.signals import OUTPUT_UNREAD

    got, log = tmp_path / "got", tmp_path / "step1.log"
    train_py = subprocess.Popen([sys.executable, "-c", TRAIN_PY_LAUNCHING_THROUGH_A_LAUNCHER,
                                 RANK_TRAINING_UNTIL_STOPPED, str(got), str(log)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=step_env())
    rank = psutil.Process(_launched_rank_pid(log, train_py))
    train_py.kill()
    assert train_py.wait(timeout=60) == -signal.SIGKILL
    rank.wait(timeout=60)
    assert got.read_text() == OUTPUT_UNREAD.name


LAUNCHER_LINE = ("[2026-11-27 21:51:45,360] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'main.py', "
                 "'--data_path', 'x'] exits with return code = {}")


@pytest.mark.parametrize("output, nodes, cause", [
    ("usage: main.py [-h]\nmain.py: error: unrecognized arguments: --foo", ("worker-1",),
     "main.py: unrecognized arguments: --foo"),
    ("worker-1: usage: main.py [-h]\nworker-1: main.py: error: unrecognized arguments: --foo", ("worker-1",),
     "a rank on worker-1: main.py: unrecognized arguments: --foo"),
    ("\n".join(["worker-1: KeyError: 'chosen'", f"worker-1: {LAUNCHER_LINE.format(1)}",
                "worker-2: RuntimeError: NCCL communicator was aborted", f"worker-2: {LAUNCHER_LINE.format(1)}"]),
     ("worker-1", "worker-2"),
     "a rank on worker-1: KeyError: 'chosen'"),
    (f"worker-1: {LAUNCHER_LINE.format(-9)}\nworker-2: {LAUNCHER_LINE.format(1)}", ("worker-1", "worker-2"),
     "a rank on worker-1 was killed (signal 9, SIGKILL)"),
    ("\n".join(["worker-1: Traceback (most recent call last):", "worker-1:     raise ValueError(value)",
                "worker-1: ValueError: bad reward", "worker-2: Segmentation fault (core dumped)",
                f"worker-2: {LAUNCHER_LINE.format(1)}", f"worker-1: {LAUNCHER_LINE.format(1)}"]),
     ("worker-1", "worker-2"),
     "a rank on worker-2 ended first (exit status 1) printing no error; worker-1's last: ValueError: bad reward"),
], ids=["argparse_here", "argparse_on_a_node", "cause_of_the_node_that_ended_first", "killed_on_a_node",
        "cause_of_another_node_where_the_first_printed_none"])
def test_a_cause_names_a_node_only_where_pdsh_does(output, nodes, cause):
    """argparse's 'main.py: error: ...' was read as pdsh's prefix of a node named main.py ('a rank on main.py: ...'); a
    node is one of the hostfile's, and the cause is the line of the node whose launcher saw a rank end first, not the
    last line of another node whose ranks failed after, their peer gone. Where the ranks of the node that ended first
    printed no cause line, the step said no cause at all, then named another node's last as a rank's cause: that node
    and its exit status are said first, the other node's line after."""
    from training.pipeline.failures import cause_in_output

    assert cause_in_output(output, nodes).startswith(cause)


def test_a_rerun_step_that_fails_names_its_own_cause_not_the_last_attempts(tmp_path):
    """A step's log holds every attempt at it (a rerun appends), and the cause was read from its whole tail: a rerun
    failing fast on "KeyError: 'chosen'" was said to have had a rank killed by SIGKILL, the earlier attempt's end."""
    from training.pipeline.launch import run_subprocess

    log = tmp_path / "step2.log"
    log.write_text(f"$ deepspeed main.py --data_path x\nloading\n{LAUNCHER_LINE.format(-9)}\n")
    with pytest.raises(UserError, match=r"^step 2 failed \(exit status 1\): KeyError: 'chosen'; its output is in "):
        run_subprocess([sys.executable, "-c", "{}['chosen']"], log, "step 2")
    assert log.read_text().count("exits with return code = -9") == 1


@pytest.mark.parametrize("through_deepspeed", [False, True])
def test_a_step_whose_rank_the_oom_killer_ends_says_so(tmp_path, through_deepspeed):
    """A rank SIGKILLed (the OS's out-of-memory killer) ended in 'failed (exit status 247)': DeepSpeed's launcher exits
    with -9 & 255. It is named as killed by signal 9, likely out of host memory. Through DeepSpeed's launcher as
    train.py starts it (--no_local_rank, the step's flags after its script), rank 0 of 2 killed: its launcher's line
    names the command of the last rank it started, not the one that ended, so the message names no local rank."""
    from training.pipeline.deployment import DeploymentType
    from training.pipeline.launch import Launcher, run_subprocess

    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    if through_deepspeed:
        script = tmp_path / "rank.py"
        script.write_text("import os, signal, time\nif os.environ['LOCAL_RANK'] == '0':\n"
                          "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
        launcher = Launcher(DeploymentType.SINGLE_NODE, num_gpus=2)
        killed = launcher.command_now(script, ["--data_path", "x", "--output_dir", str(tmp_path / "out")],
                                      check_gpus=False)
    who = "a rank was " if through_deepspeed else ""
    with pytest.raises(UserError, match=rf"^step 1 failed \(exit status -?\d+\): {who}killed \(signal 9, SIGKILL\), "
                                        r"likely out of host memory"):
        run_subprocess(killed, tmp_path / "step1.log", "step 1")


def torch_cpu_allocation_error() -> Exception:
    """What torch raises where the host refuses an allocation ('DefaultCPUAllocator: can't allocate memory ...')."""
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as error:
        return error
    raise AssertionError("torch allocated a PiB")


HOST_MEMORY_SAID = r"; out of host memory: run with fewer models offloaded, a smaller batch, or on a machine with more"


def numpy_exceptions_module() -> str:
    """Where the installed numpy keeps its exceptions: numpy._core since numpy 2, numpy.core in 1.x (which torch
    allows)."""
    import numpy

    return "numpy._core._exceptions" if int(numpy.__version__.split(".")[0]) >= 2 else "numpy.core._exceptions"


def numpy_allocation_error() -> MemoryError:
    """What numpy raises where the host refuses an array ('Unable to allocate 8.00 TiB for an array ...'): its own
    MemoryError subclass, made here rather than by asking for the memory."""
    import numpy

    array_memory_error = importlib.import_module(numpy_exceptions_module())._ArrayMemoryError
    return array_memory_error((2**40,), numpy.dtype("float64"))


class AllocationRefused(MemoryError):
    """A library's MemoryError whose name does not say memory."""


NUMPY_ALLOCATION_SAID = (r"numpy\._?core\._exceptions\._ArrayMemoryError: Unable to allocate 8\.00 TiB for an array "
                         r"with shape \(1099511627776,\) and data type float64")


@pytest.mark.parametrize("error, said", [
    (lambda: MemoryError(), r"MemoryError"),
    (lambda: OSError(12, "Cannot allocate memory"), r"OSError: \[Errno 12\] Cannot allocate memory"),
    (torch_cpu_allocation_error, r"RuntimeError: .*DefaultCPUAllocator: .*"),
    (numpy_allocation_error, NUMPY_ALLOCATION_SAID),
    (lambda: AllocationRefused("no room for the rollout buffer"),
     rf"{re.escape(__name__)}\.AllocationRefused: no room for the rollout buffer"),
], ids=["memory_error", "errno_12", "torch_cpu", "numpy", "memory_error_subclass"])
def test_a_step_out_of_host_memory_is_told_so(tmp_path, tiny_model_dir, error, said):
    """A step whose host refused an allocation (Python's MemoryError, errno 12, torch's CPU allocator) was named
    without a word of memory, while a rank the OOM killer ended was told it ran out of host memory and what to do.
    A MemoryError subclass (numpy's '_ArrayMemoryError: Unable to allocate ...') was told nothing of memory either."""
    fakes = CrashingSteps(tiny_model_dir("llama"), error())
    with pytest.raises(UserError, match=rf"step 2 \(reward model\) crashed: {said}{HOST_MEMORY_SAID}"):
        run(common(tmp_path, fakes.model_dir), fakes)


@pytest.mark.parametrize("rank, said", [
    ("raise MemoryError", "MemoryError"),
    ((f"import numpy\nfrom {numpy_exceptions_module()} import _ArrayMemoryError\n"
      "raise _ArrayMemoryError((2**40,), numpy.dtype('float64'))"), NUMPY_ALLOCATION_SAID),
], ids=["memory_error", "numpy"])
def test_a_launched_step_whose_rank_runs_out_of_host_memory_is_told_so(tmp_path, rank, said):
    """The same of a rank's last words: its traceback's 'MemoryError' line, or numpy's '_ArrayMemoryError' line."""
    from training.pipeline.launch import run_subprocess

    with pytest.raises(UserError, match=rf"^step 1 failed \(exit status 1\): {said}{HOST_MEMORY_SAID}"):
        run_subprocess([sys.executable, "-c", rank], tmp_path / "step1.log", "step 1")


@pytest.mark.parametrize("module", ["numpy.core._exceptions", "numpy._core._exceptions"], ids=["numpy_1", "numpy_2"])
def test_numpys_array_memory_error_in_a_ranks_output_is_told_of_host_memory_in_either_numpys_name(module):
    """numpy 1.x names its MemoryError numpy.core._exceptions._ArrayMemoryError, numpy 2 numpy._core._exceptions...;
    the launched-step test above raises the installed numpy's alone, so the other name, as a rank's traceback ends on
    it, was read by no test."""
    from training.pipeline.failures import cause_in_output

    said = (f"{module}._ArrayMemoryError: Unable to allocate 8.00 TiB for an array with shape (1099511627776,) and "
            "data type float64")
    output = "\n".join(["[rank0]: Traceback (most recent call last):",
                        '[rank0]:   File "main.py", line 9, in <module>', f"[rank0]: {said}", LAUNCHER_LINE.format(1)])
    assert re.fullmatch(rf"{re.escape(said)}{HOST_MEMORY_SAID}.*", cause_in_output(output))


def test_cudas_out_of_memory_error_is_not_told_of_host_memory():
    """torch.OutOfMemoryError is the accelerator's memory: the host memory markers leave its name alone."""
    from training.pipeline.failures import with_advice

    assert with_advice("torch.OutOfMemoryError") == "torch.OutOfMemoryError"
    assert "out of host memory" not in with_advice("torch.cuda.OutOfMemoryError: CUDA error")


def torch_save_error_on_a_full_disk(tmp_path: Path) -> Exception:
    """What torch.save raises where the disk is full: written to a path that is /dev/full, whose writes fail with
    ENOSPC, as a checkpoint is saved (by path, through torch's own writer)."""
    full = tmp_path / "full.pt"
    full.symlink_to("/dev/full")
    try:
        torch.save({"weight": torch.zeros(1000)}, full)
    except RuntimeError as error:
        return error
    raise AssertionError("torch.save to /dev/full did not fail")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("error", [lambda _: OSError(28, "No space left on device", "/out/step2/.tmp-model"),
                                   torch_save_error_on_a_full_disk], ids=["python_write", "torch_save"])
def test_a_step_that_fills_the_disk_is_told_to_free_space(tmp_path, tiny_model_dir, error):
    """A full disk during a save ended in torch's 'unexpected pos 576 vs 534' (or Errno 28) with no word of the disk."""
    fakes = CrashingSteps(tiny_model_dir("llama"), error(tmp_path))
    with pytest.raises(UserError, match=r"step 2 \(reward model\) crashed: .*; a write failed, most often as the disk "
                                        r"is full: free space where the run writes \(--output-dir\)"):
        run(common(tmp_path, fakes.model_dir), fakes)
