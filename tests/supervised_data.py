"""Tiny preference/SFT data files for the step-1 and step-2 tests: arithmetic questions whose chosen
answer is right and whose rejected answer is a refusal, so a tiny model learns them in a few steps."""
from __future__ import annotations

import json
from pathlib import Path

from utils.data import TokenizedDataset, build_phase_data


def arithmetic_rows(count: int) -> list[dict]:
    """`count` distinct questions (a copy would be dropped at load)."""
    rows = []
    for index in range(count):
        a, b = index % 7, index % 5 + 5 * (index // 35)
        rows.append({
            "prompt": f"Human: What is {a} plus {b}? Assistant:",
            "chosen": f"{a} plus {b} is {a + b}.",
            "rejected": "I do not know.",
        })
    return rows


def write_arithmetic_jsonl(path: str | Path, count: int = 48) -> str:
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_rows(count)))
    return str(path)


def build_phase_datasets(*args, **kwargs) -> tuple[TokenizedDataset, TokenizedDataset]:
    """`build_phase_data`'s tokenised (train, eval) datasets, without the record counts the steps write."""
    data = build_phase_data(*args, **kwargs)
    return data.train, data.eval
