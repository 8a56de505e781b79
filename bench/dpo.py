"""DPO beside a reward model on the same preference pairs: held-out accuracy before and after.

    python bench/dpo.py --output bench/results/dpo_cpu.json

For each pair source (the embedded pairs, and `../shared/data/hh-rlhf-harmless/pairs.jsonl` when it is
there), the same starting model (the embedded SmolLM2-135M-Instruct, standing in for a step-1 model)
trains twice on the same training pairs for the same steps: DPO (`step2_reward/dpo/main.py`, the policy
against its frozen copy) and a reward model (`step2_reward/main.py`). Both are scored on the same held-out
pairs (the step-2 shard's eval split, its first `--max_eval_samples`): DPO's accuracy is the share of pairs whose
implicit reward beta * (log pi - log pi_ref) ranks chosen above rejected (0 before training, when every
implicit reward is 0: ties count as wrong), the reward model's the share it scores chosen above rejected.
Each run is a child process, so its peak memory is its own.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import REPO_ROOT, child_main, print_table, run_child, write_report

from utils.errors import UserError, run_cli

HH_PAIRS = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless" / "pairs.jsonl"
SOURCES = {"embedded": "embedded", "hh_rlhf_harmless": f"{HH_PAIRS}:hh_rlhf"}
METHODS = {"dpo": "step2_reward.dpo.main", "reward_model": "step2_reward.main"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    # the runs' own flags, passed on; the second spelling is the one the committed result's command uses
    parser.add_argument("--max_steps", "--steps", type=int, default=60,
                        help="optimizer steps of each run (batch 8 pairs)")
    parser.add_argument("--max_eval_samples", "--eval_pairs", type=int, default=64, help="held-out pairs scored")
    parser.add_argument("--dpo_learning_rate", type=float, default=5e-6)
    parser.add_argument("--dpo_beta", type=float, default=0.1)
    parser.add_argument("--reward_learning_rate", type=float, default=2e-4)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work_dir", default=str(REPO_ROOT / "runs" / "bench_dpo"))
    parser.add_argument("--output", default=str(REPO_ROOT / "bench" / "results" / "dpo_cpu.json"))
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_steps < 1:
        raise UserError(f"--max_steps {args.max_steps}: each run needs at least one optimizer step; pass 1 or more")
    return args


def method_flags(args: argparse.Namespace, method: str) -> list[str]:
    if method == "dpo":
        return ["--learning_rate", str(args.dpo_learning_rate), "--dpo_beta", str(args.dpo_beta)]
    return ["--learning_rate", str(args.reward_learning_rate)]


def warmup_steps(steps: int) -> int:
    """A tenth of the run, at least one step, but fewer than the run's (a warm-up as long as the run is refused)."""
    return min(max(1, steps // 10), steps - 1)


def run_flags(args: argparse.Namespace, source: str, out: Path) -> list[str]:
    return ["--model_name_or_path", "smollm2-135m", "--output_dir", str(out), "--data_path", SOURCES[source],
            "--data_split", "0,1,0", "--data_output_path", str(Path(args.work_dir) / "data"), "--seed", str(args.seed),
            "--dtype", args.dtype, "--max_seq_len", str(args.max_seq_len), "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "16", "--num_warmup_steps", str(warmup_steps(args.max_steps)),
            "--max_steps", str(args.max_steps), "--max_train_samples", str(args.max_steps * 8),
            "--max_eval_samples", str(args.max_eval_samples)]


def result_row(source: str, method: str, outcome: dict) -> dict:
    summary = outcome["summary"]
    return {"source": source, "method": method, "accuracy_before": summary["eval_accuracy_before"],
            "accuracy_after": summary["eval_accuracy_after"], "margin_before": summary["eval_margin_before"],
            "margin_after": summary["eval_margin_after"], "eval_pairs": summary["eval_pairs"],
            "optimizer_steps": summary["optimizer_steps"],
            "seconds_per_step": round(summary["wall_time_s"] / max(summary["optimizer_steps"], 1), 2),
            "peak_memory_gb": round(outcome["peak_memory_gb"], 2)}


COLUMNS = ("source", "method", "accuracy_before", "accuracy_after", "margin_before", "margin_after",
           "seconds_per_step", "peak_memory_gb")


@run_cli
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return {}
    sources = [source for source in args.sources if source != "hh_rlhf_harmless" or HH_PAIRS.is_file()]
    if len(sources) < len(args.sources):
        print(f"skipping hh_rlhf_harmless: {HH_PAIRS} is not there (the shared data folder beside the repository)")
    if not sources:  # a report of no rows would replace the committed one
        raise SystemExit(f"no source left to compare on; nothing written to {args.output}")
    started = time.time()
    rows = []
    for source in sources:
        for method, module in METHODS.items():
            out = Path(args.work_dir) / source / method
            outcome = run_child(Path(__file__), module, run_flags(args, source, out) + method_flags(args, method),
                                Path(args.work_dir) / f"{source}_{method}_result.json")
            rows.append(result_row(source, method, outcome))
            print_table(rows, COLUMNS)
    report = write_report("dpo", args, rows, started)
    print_table(rows, COLUMNS)
    return report


if __name__ == "__main__":
    main()
