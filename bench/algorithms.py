"""Step 3's algorithms on the embedded verifiable task, side by side on this machine.

    python bench/algorithms.py --output bench/results/algorithms_cpu.json

One step-1 model (SmolLM2-135M fine-tuned on the task's step-1 shard) is the actor and reference of
every run; each algorithm then trains on the same step-3 prompts with the same rows per PPO step,
learning rate, KL coefficient and wall-clock budget (`--max_train_minutes`), and is scored on the same
held-out prompts (greedy answers, exact match of the final number: `builtin:math`) before and after.
PPO gets its reward from the same verifier (`--reward_fn builtin:math`), its critic a new value head on
the actor's model. Each run is a child process, so its peak memory (max RSS) is its own.
Rows: `algorithm`, `accuracy_before`, `accuracy_after`, `seconds_per_step` (median of the PPO steps'
generation + scoring + training time), `peak_memory_gb`, `ppo_steps`, `kl_exact_last`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

from common import REPO_ROOT, child_main, print_table, run_child, write_report

from training.loops.metrics import read_metrics
from utils.errors import UserError, run_cli

SCRIPT = Path(__file__)
ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "remax")
PHASES = ("time/generation_s", "time/scoring_s", "time/training_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--difficulty", type=int, default=2, help="task:arithmetic difficulty (1-5)")
    parser.add_argument("--task_size", type=int, default=2000, help="problems generated (shared by the three shards)")
    parser.add_argument("--sft_steps", type=int, default=16, help="step-1 optimizer steps (batch 8)")
    parser.add_argument("--sft_learning_rate", type=float, default=3e-5)
    # step 3's own flags, passed on; the second spelling is the one the committed results' commands use
    parser.add_argument("--max_train_minutes", "--time_budget_minutes", type=float, default=9.0,
                        help="training time per algorithm")
    parser.add_argument("--rows_per_step", type=int, default=32, help="answers per PPO step, every algorithm")
    parser.add_argument("--per_device_training_batch_size", "--training_batch_size", type=int, default=16,
                        help="PPO micro-batch (rows)")
    parser.add_argument("--actor_learning_rate", type=float, default=1e-5)
    parser.add_argument("--kl_ctl", type=float, default=0.05)
    parser.add_argument("--max_answer_seq_len", type=int, default=32)
    parser.add_argument("--eval_samples", type=int, default=80, help="held-out prompts scored before and after")
    parser.add_argument("--eval_interval", type=int, default=0, help="also score them every N PPO steps")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work_dir", default=str(REPO_ROOT / "runs" / "bench_algorithms"))
    parser.add_argument("--output", default=str(REPO_ROOT / "bench" / "results" / "algorithms_cpu.json"))
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sft_steps < 1:
        raise UserError(f"--sft_steps {args.sft_steps}: step 1 needs at least one optimizer step; pass 1 or more")
    check_rows_per_step(args.rows_per_step, args.algorithms)
    return args


def check_rows_per_step(rows: int, algorithms: list[str]) -> None:
    """Refuse rows a PPO step of some algorithm cannot hold: its generation batch is whole prompts (rows over its
    answers per prompt, rounded down), so below that count it would be 0 prompts and between multiples fewer rows
    than the others get."""
    from training.algorithms import get_rl_algorithm

    answers = {algorithm: get_rl_algorithm(algorithm).n_samples_per_prompt for algorithm in algorithms}
    unit = math.lcm(*answers.values())
    if rows < unit or rows % unit:
        per_prompt = ", ".join(f"{algorithm} {count}" for algorithm, count in answers.items())
        raise UserError(f"--rows_per_step {rows}: a PPO step takes whole prompts' answers (per prompt: {per_prompt}), "
                        f"so every algorithm gets these rows only at a multiple of {unit}; pass e.g. "
                        f"{max(unit, rows - rows % unit)}")


def task_source(args: argparse.Namespace) -> str:
    return f"task:arithmetic?difficulty={args.difficulty}&size={args.task_size}"


def common_flags(args: argparse.Namespace) -> list[str]:
    return ["--data_path", task_source(args), "--data_output_path", str(Path(args.work_dir) / "data"),
            "--seed", str(args.seed), "--dtype", args.dtype]


def step1_flags(args: argparse.Namespace) -> list[str]:
    return ["--model_name_or_path", "smollm2-135m", *common_flags(args), "--max_seq_len", "128",
            "--per_device_train_batch_size", "8", "--learning_rate", str(args.sft_learning_rate),
            "--num_warmup_steps", str(min(2, args.sft_steps - 1)),  # fewer than the run's: the step refuses more
            "--max_steps", str(args.sft_steps), "--max_eval_samples", "32"]


def step1_folder(args: argparse.Namespace) -> Path:
    """Step 1's run folder, named by its flags: a finished one is reused only by a run asking for the same."""
    digest = hashlib.sha256(json.dumps(step1_flags(args)).encode()).hexdigest()[:8]
    return Path(args.work_dir) / f"step1-{digest}"


def train_step1(args: argparse.Namespace) -> Path:
    out = step1_folder(args)
    if not (out / "model" / "config.json").is_file():
        run_child(SCRIPT, "step1_sft.main", [*step1_flags(args), "--output_dir", str(out)],
                  out.with_name(f"{out.name}_result.json"))
    return out


def step3_flags(args: argparse.Namespace, algorithm: str, actor: Path, out: Path) -> list[str]:
    from training.algorithms import get_rl_algorithm

    samples = get_rl_algorithm(algorithm).n_samples_per_prompt
    return ["--actor_model_name_or_path", str(actor), "--output_dir", str(out), *common_flags(args),
            "--algorithm", algorithm, "--reward_fn", "builtin:math",
            "--per_device_generation_batch_size", str(args.rows_per_step // samples),
            "--per_device_training_batch_size", str(args.per_device_training_batch_size),
            "--actor_learning_rate", str(args.actor_learning_rate), "--kl_ctl", str(args.kl_ctl),
            "--max_answer_seq_len", str(args.max_answer_seq_len), "--max_prompt_seq_len", "64",
            "--eval_samples", str(args.eval_samples), "--eval_interval", str(args.eval_interval),
            "--max_train_minutes", str(args.max_train_minutes),
            "--enable_hybrid_engine", "--num_train_epochs", "100"]


def seconds_per_step(run_dir: Path) -> float:
    rows = read_metrics(run_dir)
    steps = [sum(row[key] for key in PHASES) for row in rows if all(key in row for key in PHASES)]
    return statistics.median(steps) if steps else float("nan")


def result_row(algorithm: str, run_dir: Path, outcome: dict) -> dict:
    summary = outcome["summary"]
    return {"algorithm": algorithm, "accuracy_before": summary["reward_fn_first"],
            "accuracy_after": summary["reward_fn_last"], "ppo_steps": summary["ppo_steps"],
            "seconds_per_step": round(seconds_per_step(run_dir), 2),
            "peak_memory_gb": round(outcome["peak_memory_gb"], 2), "kl_exact_last": summary["kl_exact_last"],
            "wall_time_s": summary["wall_time_s"],
            "accuracy_by_step": [[record["step"], record.get("reward_fn_mean")] for record in summary["evaluations"]]}


COLUMNS = ("algorithm", "accuracy_before", "accuracy_after", "ppo_steps", "seconds_per_step", "peak_memory_gb",
           "kl_exact_last")


@run_cli
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return {}
    started = time.time()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    actor = train_step1(args)
    rows = []
    for algorithm in args.algorithms:
        run_dir = Path(args.work_dir) / algorithm
        outcome = run_child(SCRIPT, "step3_rlhf.main", step3_flags(args, algorithm, actor, run_dir),
                            Path(args.work_dir) / f"{algorithm}_result.json")
        rows.append(result_row(algorithm, run_dir, outcome))
        print_table(rows, COLUMNS)
    report = write_report("algorithms", args, rows, started, task=task_source(args))
    print_table(rows, COLUMNS)
    return report


if __name__ == "__main__":
    main()
