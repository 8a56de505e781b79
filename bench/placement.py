"""Step 3 under each placement on this machine's gloo ranks: measured step time and peak memory beside the
planner's prediction from this machine's calibrated constants, and which placement the planner puts first.

    python bench/placement.py                       # the quick run's step-1/2 models in runs/default
    python bench/placement.py --ranks 2 --steps 4 --output bench/results/placement_cpu.json
    python bench/placement.py --breakdown           # + each rank's per-call times beside the cost model's

Each placement runs `step3_rlhf/main.py` under `torch.distributed.run` (same seed, same settings), three of them
also with stage fusion (`+fusion`: `--enable_stage_fusion`); the measured
step time is the median of `time/step_s` after the first step, the peak memory the largest rank's peak RSS.
With `--breakdown` the runs time every model call (`--profile_calls`) and the report lists, per placement and
rank, each call's measured seconds per step (median over the timed steps) beside the cost model's.
The published setups' predictions are `bench/placement_published.py`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_report  # noqa: E402
from training.loops.call_times import CALL_TIMES_FILE  # noqa: E402
from training.placement.step_profile import measured_calls, predicted_calls, run_step3  # noqa: E402
from utils.cpu import cpu_cores  # noqa: E402
from utils.errors import UserError, run_cli  # noqa: E402

# a "+fusion" suffix runs the placement with --enable_stage_fusion
PLACEMENTS = ("colocate", "interleave", "disaggregate", "interleave:actor=0.5,critic=0.5", "colocate+fusion",
              "disaggregate+fusion", "interleave:actor=0.5,critic=0.5+fusion")
FUSION_SUFFIX = "+fusion"
GB_PER_GIB = 1024**3 / 1e9


def variant(placement: str) -> tuple[str, bool]:
    """(the placement[:ratio], whether stage fusion is on) of a PLACEMENTS entry."""
    return placement.removesuffix(FUSION_SUFFIX), placement.endswith(FUSION_SUFFIX)


def step3_argv(args: argparse.Namespace, placement: str, output_dir: Path) -> list[str]:
    placement, fusion = variant(placement)
    name, _, ratio = placement.partition(":")
    return ["--actor_model_name_or_path", args.actor, "--critic_model_name_or_path", args.critic,
            "--output_dir", str(output_dir), "--dtype", args.dtype, "--max_steps", str(args.steps),
            "--per_device_generation_batch_size", str(args.batch), "--per_device_training_batch_size", str(args.batch),
            "--max_prompt_seq_len", str(args.prompt_len), "--max_answer_seq_len", str(args.answer_len),
            "--eval_samples", "1", "--enable_hybrid_engine", "--data_path", "embedded",
            "--placement", name, *(["--placement_ratio", ratio] if ratio else []),
            *(["--enable_stage_fusion"] if fusion else []),
            *(["--profile_calls"] if getattr(args, "breakdown", False) else [])]


def measured_rank_peaks(output_dir: Path) -> list[float]:
    """Each rank's peak resident memory (GB) by the last step."""
    last = json.loads((output_dir / CALL_TIMES_FILE).read_text().splitlines()[-1])
    return [rank["peak_rss_gb"] for rank in last["ranks"]]


def print_breakdown(row: dict) -> None:
    print(f"\n{row['placement']}: per-call seconds per step, measured / predicted")
    for rank, (measured, predicted) in enumerate(zip(row["measured_calls"], row["predicted_calls"])):
        print(f"  rank {rank}: peak {row['measured_rank_peak_gb'][rank]:.2f} GB / "
              f"{row['predicted_rank_peak_gb'][rank]:.2f} GB")
        for name in sorted(set(measured) | set(predicted)):
            print(f"    {name:<40} {measured.get(name, 0.0):7.3f} {predicted.get(name, 0.0):7.3f}")


def threads_per_rank(ranks: int) -> int:
    """This process's cores shared out over `ranks`, as train.py shares them: a container pinned to a few of a big
    host's cores would otherwise run each rank with the host's count of threads (and calibrate for it)."""
    return max(1, cpu_cores() // ranks)


def measure(args: argparse.Namespace, placement: str) -> dict:
    output_dir = Path(args.work_dir) / placement.replace(":", "_").replace(",", "_").replace("=", "").replace("+", "_")
    shutil.rmtree(output_dir, ignore_errors=True)  # each run starts from an empty folder
    argv = step3_argv(args, placement, output_dir)
    print("$ torch.distributed.run --nproc_per_node", args.ranks, "step3_rlhf/main.py", " ".join(argv), flush=True)
    run_step3(argv, args.ranks, threads_per_rank(args.ranks), output_dir / "launcher.log")
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "time/step_s" in row]
    timed = steps[1:] or steps
    calls = {"measured_calls": measured_calls(output_dir),
             "measured_rank_peak_gb": measured_rank_peaks(output_dir)} if args.breakdown else {}
    return {**calls, "measured_step_s": statistics.median(row["time/step_s"] for row in timed),
            "measured_peak_gb": max(row["memory/peak_rss_gb"] for row in steps),
            "measured_phases_s": {phase: statistics.median(row[f"time/{phase}_s"] for row in timed)
                                  for phase in ("generation", "scoring", "training")}}


def predictions(args: argparse.Namespace) -> tuple[dict, list[str], str]:
    """The calibrated cost model's step time and peak memory per placement, and the planner's ranking of them."""
    from step3_rlhf.main import parse_args
    from step3_rlhf.placement_setup import placement_roles
    from training.pipeline.hardware import model_size
    from training.placement.calibration import load_or_calibrate
    from training.placement.cost_model import estimate_step
    from training.placement.spec import build_placement, parse_placement_ratio
    from training.placement.workload import step3_model_paths, step3_workload

    settings = parse_args(step3_argv(args, "colocate", Path(args.work_dir) / "plan"))
    threads = threads_per_rank(args.ranks)
    machine = load_or_calibrate(settings.run.dtype_name, threads, args.ranks, recalibrate=args.calibrate)
    paths = step3_model_paths(settings)
    sizes = {role: model_size(path) if path else None for role, path in paths.items()}
    workload = step3_workload(settings, sizes["actor"], sizes["critic"], sizes["reward"])
    roles = placement_roles(settings)
    predicted = {}
    for placement in PLACEMENTS:
        spec, fusion = variant(placement)
        name, _, ratio = spec.partition(":")
        layout = build_placement(name, args.ranks, roles, parse_placement_ratio(ratio) if ratio else None)
        estimate = estimate_step(replace(workload, stage_fusion=fusion), layout, machine)
        calls = {"predicted_calls": predicted_calls(estimate, layout),
                 "predicted_rank_peak_gb": [gib * GB_PER_GIB for gib in estimate.per_rank_memory_gib]} \
            if args.breakdown else {}
        predicted[placement] = {**calls, "predicted_step_s": estimate.step_s,
                                "predicted_peak_gb": estimate.peak_memory_gib * GB_PER_GIB,
                                "predicted_phases_s": {"generation": estimate.generation_s,
                                                       "scoring": estimate.scoring_s,
                                                       "training": estimate.training_s}}
    ranking = sorted(PLACEMENTS, key=lambda placement: predicted[placement]["predicted_step_s"])
    return predicted, ranking, machine.name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actor", default="runs/default/step1", help="the step-1 run folder (the actor)")
    parser.add_argument("--critic", default="runs/default/step2", help="the step-2 run folder (reward and critic)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="PPO steps per placement (the first is not timed)")
    parser.add_argument("--batch", type=int, default=2, help="prompts per rank per step")
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--answer_len", type=int, default=32)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's constants again")
    parser.add_argument("--breakdown", action="store_true",
                        help="time every model call on every rank and print it beside the cost model's call")
    parser.add_argument("--work_dir", default="runs/bench_placement")
    parser.add_argument("--output", default="bench/results/placement_cpu.json")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up, left out of the measured step time")
    return args


@run_cli
def main(argv: list[str] | None = None) -> dict:
    """Measure every placement, print the table and write the report; returns the report."""
    args = parse_args(argv)
    for folder in (args.actor, args.critic):
        if not Path(folder).is_dir():
            raise UserError(f"{folder} is missing: run `python train.py` first (its step-1/2 models are benched)")
    started = time.time()
    predicted, ranking, machine = predictions(args)
    rows = []
    for placement in PLACEMENTS:
        row = {"placement": placement, "ranks": args.ranks, **measure(args, placement), **predicted[placement]}
        row["step_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        row["peak_error"] = row["predicted_peak_gb"] / row["measured_peak_gb"] - 1
        rows.append(row)
        if args.breakdown:
            print_breakdown(row)
    fastest = min(rows, key=lambda row: row["measured_step_s"])["placement"]
    print_table(rows, ("placement", "ranks", "measured_step_s", "predicted_step_s", "step_error", "measured_peak_gb",
                       "predicted_peak_gb", "peak_error"))
    print(f"planner's first choice: {ranking[0]}; measured fastest: {fastest}")
    return write_report("placement", args, rows, started, machine_constants=machine,
                        planner_ranking=ranking, planner_first_choice=ranking[0], measured_fastest=fastest,
                        first_choice_is_fastest=ranking[0] == fastest,
                        all_predictions_within_25_percent=all(abs(row["step_error"]) <= 0.25
                                                              and abs(row["peak_error"]) <= 0.25 for row in rows))


if __name__ == "__main__":
    main()
