"""`train.py` end to end: each step's seconds and quality, beside a reference run's.

    python bench/pipeline.py --output bench/results/pipeline_cpu_quick.json
    python bench/pipeline.py --output pipeline_gpu.json --reference bench/results/pipeline_cpu_quick.json \
        -- --deployment-type single_gpu --data_path pairs.jsonl

Everything after `--` goes to train.py (nothing: its quick run on this machine), into a fresh run folder unless
it names one (`--output-dir`; a folder that already holds a run would be resumed, not timed). The JSON names the
device, versions and command, the actor and reward models, each step's dtype, ZeRO stage and batch size (from the
step's args.json) and, per step, its seconds and its quality: step 1 the held-out loss and perplexity before and
after, step 2 (and DPO, step 4 under `--algorithm dpo`) the held-out accuracy and margin before and after, step 3
the reward and exact KL of its evaluations, the answer length, and the median seconds of a PPO step with its generation / scoring / training
split. With `--reference` (an earlier JSON of this script, e.g. the CPU quick run's), each figure sits beside that
run's; the runs may differ in data and sizes (the command of each says how), so the comparison is of outcomes,
not a parity check.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO_ROOT, device_name, write_report
from training.loops.metrics import read_metrics
from training.pipeline.cli import parse_config, run
from training.pipeline.config import PipelineConfig
from training.pipeline.steps import STEPS
from training.reliability.checkpointing import CheckpointManager
from utils.dist import current_device
from utils.errors import UserError, run_cli

# held-out pairs ranked right and the mean margin: the reward model's (step 2) and DPO's implicit reward's (step 4)
PAIR_QUALITY = ("eval_accuracy_before", "eval_accuracy_after", "eval_margin_before", "eval_margin_after",
                "final_train_loss", "optimizer_steps")
# per step: the summary figures reported (those a step's summary holds)
QUALITY = {
    "1": ("eval_loss_before", "eval_loss_after", "eval_perplexity_before", "eval_perplexity_after", "final_train_loss",
          "optimizer_steps"),
    "2": PAIR_QUALITY,
    "3": ("reward_first", "reward_last", "kl_exact_last", "response_length_last", "ppo_steps"),
    "4": PAIR_QUALITY,
}
PPO_PHASES = ("time/step_s", "time/generation_s", "time/scoring_s", "time/training_s")
BATCH_SIZES = ("per_device_train_batch_size", "per_device_generation_batch_size")  # a step's rows per step, by step
SETTINGS = ("dtype", "zero_stage", "actor_zero_stage", "critic_zero_stage", *BATCH_SIZES,
            "per_device_training_batch_size")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="where to write the JSON")
    parser.add_argument("--reference", default=None, help="an earlier JSON of this script to set beside the figures")
    return parser.parse_args(own), train_argv


def fresh_run_argv(train_argv: list[str]) -> list[str]:
    """train.py's flags with an output folder that holds no run yet."""
    config = parse_config(train_argv)
    if any(flag == "--output-dir" or flag.startswith("--output-dir=") for flag in train_argv):
        if holds_a_run(config):
            raise UserError(f"{config.output_dir} already holds a run, which train.py would resume instead of timing: "
                            "pass a new --output-dir")
        return train_argv
    folder = REPO_ROOT / "runs" / f"pipeline_bench_{time.strftime('%Y%m%d_%H%M%S')}"
    return [*train_argv, "--output-dir", str(folder)]


def holds_a_run(config: PipelineConfig) -> bool:
    """Whether a step's run folder (DPO's `dpo/` included) holds what train.py would go on from instead of timing
    the step: a finished run (its summary.json), which it skips, or a checkpoint, which `--resume` goes on from.
    `<output-dir>/summary.json` alone is neither: train.py writes it (`running`) before step 1, so a run stopped or
    killed before a step finished or saved leaves one."""
    return any((config.run_dir(step) / "summary.json").exists()
               or CheckpointManager(config.run_dir(step)).latest() is not None for step in STEPS)


def ppo_step_seconds(step_dir: Path) -> dict[str, float]:
    """The median seconds of a PPO step and of its phases (step 3's metrics.jsonl)."""
    records = read_metrics(step_dir)
    return {f"median_{key.removeprefix('time/')}": round(statistics.median(r[key] for r in records if key in r), 3)
            for key in PPO_PHASES if any(key in r for r in records)}


def step_report(step: str, result: dict, step_dir: Path) -> dict:
    """One step's settings (its args.json), seconds and quality figures."""
    args = json.loads((step_dir / "args.json").read_text())
    figures = {key: result["summary"][key] for key in QUALITY.get(step, ()) if key in result["summary"]}
    if step == "3":
        figures.update(ppo_step_seconds(step_dir))
    return {"title": result["title"], "seconds": round(result["seconds"], 1),
            "settings": {key: args[key] for key in SETTINGS if key in args}, "figures": figures}


def rows_beside(steps: dict[str, dict], reference: dict | None) -> list[dict]:
    """One row per figure (and per step's seconds): this run's value and the reference run's (None: not there)."""
    rows = []
    for step, report in steps.items():
        theirs = (reference or {}).get("steps", {}).get(step, {})
        for name, value in {"seconds": report["seconds"], **report["figures"]}.items():
            other = theirs.get("seconds") if name == "seconds" else theirs.get("figures", {}).get(name)
            rows.append({"step": step, "figure": name, "value": value, "reference": other})
    return rows


@run_cli
def main(argv: list[str] | None = None) -> dict:
    args, train_argv = parse_args(argv)
    reference = json.loads(Path(args.reference).read_text()) if args.reference else None
    started = time.time()
    train_argv = fresh_run_argv(train_argv)
    config = parse_config(train_argv)
    summary = run(train_argv)
    steps = {step: step_report(step, result, config.run_dir(int(step))) for step, result in summary["steps"].items()}
    rows = rows_beside(steps, reference)
    settings = [report["settings"] for report in steps.values()]
    report = write_report(
        "pipeline", args, rows, started, device=device_name(current_device()),
        train_command=shlex.join(["train.py", *train_argv]), deployment=summary["deployment"],
        model=config.actor_model, reward_model=config.reward_model,
        dtype=sorted({s["dtype"] for s in settings if "dtype" in s}),
        batch_size={step: next((report["settings"][k] for k in BATCH_SIZES if k in report["settings"]), None)
                    for step, report in steps.items()},
        total_seconds=round(summary["total_seconds"], 1), steps=steps,
        reference=None if reference is None else {key: reference.get(key) for key in ("device", "command",
                                                                                        "train_command")})
    print(f"{'step':<5} {'figure':<28} {'value':>12} {'reference':>12}")
    for row in rows:
        print(f"{row['step']:<5} {row['figure']:<28} {_number(row['value']):>12} {_number(row['reference']):>12}")
    return report


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
