"""The end-of-run picture of step 3: reward-model score and KL to the reference over PPO steps.

The two KL lines are different quantities: the rollout's is the log-ratio summed over sampled answers
(an unbiased estimate of the sequence KL), the held-out one the exact per-state KL summed along
greedy answers (see `PPOTrainer.evaluate_prompts`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def series(records: Iterable[Mapping], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, the last record winning when a resumed run logged a step twice."""
    by_step: dict[int, float] = {}
    for record in records:
        if key in record and record[key] is not None:
            by_step[int(record["step"])] = float(record[key])
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def plot_reward_kl(records: list[Mapping], path: str | os.PathLike) -> Path:
    """Two panels: rollout and held-out reward scores; rollout KL estimate and held-out exact KL. Returns the path."""
    figure, (reward_axis, kl_axis) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for axis, keys, ylabel in (
        (reward_axis, (("reward/score_mean", "rollout (sampled)"), ("eval/score_mean", "held-out (greedy)")),
         "reward-model score"),
        (kl_axis, (("reward/kl", "rollout (sampled): summed log-ratio"),
                   ("eval/kl_exact", "held-out (greedy): exact KL along the answer")),
         "KL to reference (nats per answer)"),
    ):
        for key, label in keys:
            steps, values = series(records, key)
            if steps:
                axis.plot(steps, values, marker="o" if key.startswith("eval/") else None, label=label)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
    kl_axis.set_xlabel("PPO step")
    reward_axis.set_title("Step 3 (PPO): reward and KL")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
