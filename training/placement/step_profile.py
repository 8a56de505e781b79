"""The calibration's profiled step: a short real step 3 on this machine's ranks with every call timed, beside the
cost model's estimate of the same calls from the micro-benchmarks' constants.

A micro-benchmark times one kind of work alone. Inside a real step each call also pays for the step around it
(caches the previous call evicted, the allocator, DeepSpeed's hooks and bookkeeping, the other ranks' contention),
and the loop runs code that is no model call (batches, advantages, statistics). On the development CPU every kind
of call ran 10-60% slower in a step than its micro-benchmark said. The profiled step measures both: per call kind,
its time in the step over the estimate (`MachineSpec.call_time_factors`), and the step's time outside its calls
(`MachineSpec.step_overhead_s`).

The step runs co-located on random weights of a small Llama shape of its own (`PROFILE_MODEL`) at shapes of its
own (`PROFILE_SHAPE`), not on the models or settings a user plans for, so a prediction for those stays one.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from training.loops.call_times import CALL_TIMES_FILE
from utils.errors import UserError

if TYPE_CHECKING:
    from training.pipeline.hardware import ModelSize
    from training.placement.cost_model import StepEstimate
    from training.placement.machine import MachineSpec
    from training.placement.spec import Placement
    from training.placement.workload import Step3Workload

# a Llama of ~50M parameters (GQA, tied embeddings, the embedded tokenizer's vocabulary), unlike any model planned
PROFILE_MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": True}
# timed calls the cost model counts as part of another: the decoder's sampling loop in its decode steps, DeepSpeed's
# engine and mixed-precision wrapper steps in the optimizer step
MEASURED_AS = {"generate": "decode step", "engine step": "optimizer step", "inner optimizer step": "optimizer step",
               "weight copy-back": "optimizer step", "master-gradient accumulation": "optimizer step"}

# a worker's `run_cli` error line, or a traceback's last line (not the launcher's own, which only says a worker failed)
ERROR_LINE = re.compile(r"^(error: |(?![\w.]*ChildFailedError)[\w.]*(Error|Exception): )")


@dataclass(frozen=True)
class ProfileShape:
    """The profiled run's settings: `steps` PPO steps (the first is not used) of `batch` prompts per rank."""

    batch: int = 4
    prompt_len: int = 128
    answer_len: int = 32
    steps: int = 3


PROFILE_SHAPE = ProfileShape()


def cost_model_name(name: str) -> str:
    """A timed call's name ("actor/generate") as the cost model names it ("actor/decode step")."""
    role, _, kind = name.partition("/")
    return "exchange/all" if role == "exchange" else f"{role}/{MEASURED_AS.get(kind, kind)}"


def _timed_records(output_dir: Path) -> list[dict]:
    """call_times.jsonl's steps after the first (which pays first-call costs), or the only one."""
    records = [json.loads(line) for line in (output_dir / CALL_TIMES_FILE).read_text().splitlines()]
    return records[1:] or records


def _step_calls(rank: dict) -> dict[str, float]:
    step: dict[str, float] = defaultdict(float)
    for name, value in rank["calls"].items():
        step[cost_model_name(name)] += value["s"]
    return step


def measured_calls(output_dir: Path) -> list[dict[str, float]]:
    """Per rank: call name (as the cost model names it) -> its median seconds per step over the timed steps."""
    timed = _timed_records(output_dir)
    per_rank = []
    for rank in range(len(timed[0]["ranks"])):
        steps = [_step_calls(record["ranks"][rank]) for record in timed]
        names = sorted(set().union(*steps))
        per_rank.append({name: statistics.median(step.get(name, 0.0) for step in steps) for name in names})
    return per_rank


def measured_step_overhead_s(output_dir: Path) -> float:
    """The median over the timed steps of a step's time beyond its busiest rank's calls."""
    return statistics.median(max(0.0, record["step_s"] - max(sum(_step_calls(rank).values())
                                                             for rank in record["ranks"]))
                             for record in _timed_records(output_dir))


def predicted_calls(estimate: StepEstimate, layout: Placement) -> list[dict[str, float]]:
    """Per rank: the cost model's seconds per step of each call the rank runs, and its exchange and sync."""
    per_rank = []
    for rank in range(layout.world_size):
        calls: dict[str, float] = defaultdict(float)
        for call in estimate.calls:
            if layout.holds(call.role, rank):
                calls[f"{call.role}/{call.kind}"] += call.total_s
        if estimate.exchange_s or estimate.sync_s:
            calls["exchange/all"] = estimate.exchange_s + estimate.sync_s
        per_rank.append(dict(sorted(calls.items())))
    return per_rank


def call_time_factors(measured: list[dict[str, float]], predicted: list[dict[str, float]]) -> dict[str, float]:
    """Per call kind: its measured seconds over its predicted ones, each summed over the roles and ranks (the
    exchange is not a call kind: a co-located step has none)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for side, per_rank in enumerate((measured, predicted)):
        for calls in per_rank:
            for name, seconds in calls.items():
                role, _, kind = name.partition("/")
                if role != "exchange":
                    totals[kind][side] += seconds
    return {kind: measured_s / predicted_s for kind, (measured_s, predicted_s) in sorted(totals.items())
            if measured_s > 0 and predicted_s > 0}


def write_profile_models(root: Path, shape: dict = PROFILE_MODEL) -> tuple[Path, Path]:
    """Random weights of a Llama `shape` as the actor's folder and a reward model on another draw (the critic's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.core.model_loading import EMBEDDED_MODEL_NAME, load_tokenizer
    from training.core.reward_model import RewardModel

    tokenizer = load_tokenizer(EMBEDDED_MODEL_NAME)
    config = LlamaConfig(**shape, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folders = root / "actor", root / "reward"
    for seed, folder in enumerate(folders):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if folder.name == "reward":
            model = RewardModel.from_causal_lm(model, tokenizer)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folders


def profile_argv(actor: Path, reward: Path, output_dir: Path, dtype: str,
                 shape: ProfileShape = PROFILE_SHAPE) -> list[str]:
    """Step 3's flags for the profiled run: co-located, the hybrid engine, every call timed."""
    return ["--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(reward),
            "--output_dir", str(output_dir), "--data_path", "embedded", "--dtype", dtype,
            "--max_steps", str(shape.steps), "--per_device_generation_batch_size", str(shape.batch),
            "--per_device_training_batch_size", str(shape.batch), "--max_prompt_seq_len", str(shape.prompt_len),
            "--max_answer_seq_len", str(shape.answer_len), "--eval_samples", "1", "--enable_hybrid_engine",
            "--placement", "colocate", "--profile_calls"]


def profile_workload(actor: ModelSize, critic: ModelSize, dtype: str,
                     shape: ProfileShape = PROFILE_SHAPE) -> Step3Workload:
    """The profiled run's step as the cost model sees it (`profile_argv`'s settings, on this machine's CPU)."""
    from training.placement.workload import Step3Workload

    return Step3Workload(actor=actor, critic=critic, reward=critic, prompts_per_rank=shape.batch,
                         samples_per_prompt=1, prompt_len=shape.prompt_len, answer_len=shape.answer_len,
                         train_micro_batch=shape.batch, dtype=dtype, hybrid_engine=True, device="cpu")


def launch_env(threads: int) -> dict[str, str]:
    """The launched steps' environment (`launcher_env`, without the variables of a launcher that started this
    process) for a launcher of its own, each worker on `threads` torch threads."""
    from training.pipeline.launch import REPO_ROOT, launcher_env

    return launcher_env(REPO_ROOT) | {"OMP_NUM_THREADS": str(threads)}


def run_step3(argv: list[str], world_size: int, threads: int, log: Path) -> None:
    """Step 3 under torch.distributed.run on `world_size` local ranks; its output in `log`, whose end a failure
    shows."""
    from training.pipeline.launch import REPO_ROOT
    from utils.dist import free_port

    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_port", str(free_port()), str(REPO_ROOT / "step3_rlhf" / "main.py"), *argv]
    with open(log, "w") as out:
        finished = subprocess.run(command, cwd=REPO_ROOT, env=launch_env(threads), stdout=out,
                                  stderr=subprocess.STDOUT)
    if finished.returncode != 0:
        lines = log.read_text().splitlines()
        errors = list(dict.fromkeys(line for line in lines if ERROR_LINE.match(line))) or lines[-20:]
        raise UserError(f"step 3 failed under torch.distributed.run (exit {finished.returncode}):\n"
                        + "\n".join(errors) + f"\nits whole log: {log}")


def profile_corrections(machine: MachineSpec, dtype: str, threads: int, world_size: int,
                        model: dict = PROFILE_MODEL, shape: ProfileShape = PROFILE_SHAPE) -> dict:
    """Run the profiled step (`model`'s shape at `shape`'s settings) and return the `MachineSpec` fields it
    measures (`call_time_factors`, `step_overhead_s`), the factors relative to `machine`'s estimates. The step's
    log is kept beside the calibration cache."""
    from training.pipeline.hardware import model_size
    from training.placement.calibration import cache_path
    from training.placement.cost_model import estimate_step
    from training.placement.spec import build_placement

    # the log outlives the step's temporary folder: a failure's message names it for the user to read
    log = cache_path(dtype, threads, world_size).with_suffix(".profiled-step3.log")
    with tempfile.TemporaryDirectory(prefix="rlhf-calibration-") as folder:
        root = Path(folder)
        actor, reward = write_profile_models(root, model)
        run_step3(profile_argv(actor, reward, root / "run", dtype, shape), world_size, threads, log)
        layout = build_placement("colocate", world_size, ["actor", "critic", "reference", "reward"])
        workload = profile_workload(model_size(str(actor)), model_size(str(reward)), dtype, shape)
        predicted = predicted_calls(estimate_step(workload, layout, machine), layout)
        return {"call_time_factors": call_time_factors(measured_calls(root / "run"), predicted),
                "step_overhead_s": measured_step_overhead_s(root / "run")}
