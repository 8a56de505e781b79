"""Phase shards, eval hold-out, blending, step-1-only sources, the on-disk cache, unsupervised blocks."""
import json
import os
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from datasets.data_files import SPLIT_KEYWORDS as DATASETS_SPLIT_KEYWORDS
from supervised_data import build_phase_datasets
from tiny_models import make_custom_code_model_dir, make_tokenizer

import utils.data.phases as phases
from utils.data import (
    DataArguments,
    build_unsupervised_dataset,
    phase_splits,
)
from utils.data.splits import parse_data_split
from utils.errors import EXIT_USER_ERROR, UserError, UserErrors


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(chat_template=True)


def write_pairs(path, count, tag, **extra):
    rows = [{"prompt": f"{tag} question {i}", "chosen": f"{tag} good {i}", "rejected": f"{tag} bad {i}", **extra}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prompts_of(samples):
    return [s.turns[-1]["content"] for s in samples]


def test_phase_shards_are_disjoint_cover_the_source_and_are_deterministic(tmp_path):
    path = write_pairs(tmp_path / "a.jsonl", 100, "a")
    shards = {}
    for phase in (1, 2, 3):
        (split,) = phase_splits(phase, [path], "2,4,4", seed=7, eval_fraction=0.1)
        shards[phase] = (prompts_of(split.train), prompts_of(split.eval))
        assert not set(shards[phase][0]) & set(shards[phase][1])
        (again,) = phase_splits(phase, [path], "2,4,4", seed=7, eval_fraction=0.1)
        assert (prompts_of(again.train), prompts_of(again.eval)) == shards[phase]
    sets = [set(train) | set(evaluation) for train, evaluation in shards.values()]
    assert [len(s) for s in sets] == [20, 40, 40]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert len(shards[1][1]) == 2
    (other_seed,) = phase_splits(1, [path], "2,4,4", seed=8, eval_fraction=0.1)
    assert prompts_of(other_seed.train) != shards[1][0]


@pytest.mark.parametrize("decimals", ["0.2,0.4,0.4", "0.1,0.2,0.7"])
def test_a_data_split_written_as_decimals_cuts_and_matches_as_its_proportions(decimals):
    """'2,4,4' and '0.2,0.4,0.4' are the same proportions: the shard check compared float sums (0.6000000000000001 is
    not 0.6) and refused them, and '0.1,0.2,0.7' cut a 15-record source otherwise than '1,2,7' (4.500000000000001
    rounds up)."""
    from utils.data.splits import phase_shard, same_shards

    integers = ",".join(str(round(float(part) * 10)) for part in decimals.split(","))
    assert same_shards(1, integers, 1, decimals)
    assert not same_shards(1, integers, 1, "0.2,0.4,0.5")
    for records in range(1, 60):
        for phase in (1, 2, 3):
            assert np.array_equal(phase_shard(records, integers, phase, 0), phase_shard(records, decimals, phase, 0))


def test_a_small_shard_holds_out_at_least_one_record_where_it_can():
    """round(3 x 0.1) is 0: a shard of two or more records still holds one out (with a positive --eval_fraction),
    a shard of one cannot, and --eval_fraction 0 holds out none."""
    from utils.data.splits import holdout

    train, held_out = holdout(np.arange(3), 0.1)
    assert held_out.tolist() == [0] and train.tolist() == [1, 2]
    assert holdout(np.arange(1), 0.1)[1].size == 0
    assert holdout(np.arange(3), 0.0)[1].size == 0


def test_copies_of_a_record_are_dropped_so_no_text_is_both_trained_on_and_held_out(tmp_path):
    """Shards and held-out parts are cut by record: a copy (another id, the same text) would land anywhere. Every
    record is kept once, the copies are counted as skipped, and the three steps' prompts stay disjoint."""
    rows = [{"id": copy, "prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"}
            for i in range(60) for copy in range(3)]
    path = tmp_path / "copies.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = []
    for phase in (1, 2, 3):
        (split,) = phase_splits(phase, [str(path)], "2,4,4", seed=7, eval_fraction=0.2)
        train, held_out = prompts_of(split.train), prompts_of(split.eval)
        assert len(set(train)) == len(train) and not set(train) & set(held_out)
        seen.append(set(train) | set(held_out))
        assert split.source.load_skips["duplicate"] == 120 and "duplicate=120" in split.summary(phase, "pairs")
    assert sum(len(prompts) for prompts in seen) == 60 and len(set().union(*seen)) == 60


def test_records_that_differ_only_in_whitespace_are_copies_so_the_steps_shards_stay_apart(tmp_path):
    """The copy test's records with the copies' prompts and replies written with Windows line ends, doubled and
    no-break spaces: the held-out check counts them as the same text, but the load kept them as records of their own,
    so a step's shard held text (up to whitespace) of another step's. They are copies at load now, as there."""
    rows = [{"prompt": f"question {i}\nplease", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(60)]
    rows += [{"prompt": f"question {i}\r\n  please ", "chosen": f"good\u00a0{i}", "rejected": f"bad  {i}"}
             for i in range(60)]
    path = tmp_path / "spaced.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = []
    for phase in (1, 2, 3):
        (split,) = phase_splits(phase, [str(path)], "2,4,4", seed=7, eval_fraction=0.2)
        assert split.source.load_skips["duplicate"] == 60
        seen.append({" ".join(s.turns[-1]["content"].split()) for s in split.train + split.eval})
    assert sum(len(prompts) for prompts in seen) == 60 and len(set().union(*seen)) == 60


@pytest.mark.parametrize("phase", [1, 3])
def test_no_held_out_sample_is_one_the_step_trains_on_from_another_record_or_source(tmp_path, phase):
    """Records that differ (other rejected replies) share a prompt and preferred reply: cut by record, step 3 held out
    prompts it trained on and step 1 (prompt, reply) texts, and a second source's copies were not looked for. The
    held-out copies are dropped and counted; the training samples stay as they were."""
    rows = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i} {j}"}
            for i in range(30) for j in range(3)]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps(row) + "\n" for row in rows))
    second.write_text("".join(json.dumps(row) + "\n" for row in rows[::3]))
    splits = phase_splits(phase, [str(first), str(second)], "1,1,1", seed=3, eval_fraction=0.3)
    trained = {(s.turns[-1]["content"], s.chosen if phase == 1 else None) for split in splits for s in split.train}
    held_out = [(s.turns[-1]["content"], s.chosen if phase == 1 else None) for split in splits for s in split.eval]
    assert held_out and not trained & set(held_out)
    dropped = sum(split.skipped[phases.HELD_OUT_IN_TRAINING] for split in splits)
    assert dropped > 0 and all(len(split.eval) + split.skipped[phases.HELD_OUT_IN_TRAINING] == split.held_out
                               for split in splits)
    assert [len(split.train) for split in splits] == [split.records - split.held_out for split in splits]
    assert f"{phases.HELD_OUT_IN_TRAINING}=" in "".join(split.summary(phase, "sft") for split in splits)


@pytest.mark.parametrize("phase", [1, 2, 3])
def test_a_held_out_sample_that_differs_from_a_trained_one_only_in_whitespace_is_dropped(tmp_path, phase):
    """A second source copies the first's rows with their prompts and replies written with Windows line ends, doubled
    and no-break spaces: the same text to the model (copies across sources are not looked for at load). Compared
    exactly, such copies were held out beside the trained ones (steps 1, 2 and 3 alike); now no held-out sample is a
    trained one up to whitespace."""
    rows = [{"prompt": f"question {i}\nplease", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    spaced = [{"prompt": f"question {i}\r\n  please ", "chosen": f"good\u00a0{i}", "rejected": f"bad  {i}"}
              for i in reversed(range(120))]  # in another order: each source is permuted alike by the seed
    paths = [tmp_path / "plain.jsonl", tmp_path / "spaced.jsonl"]
    for path, source_rows in zip(paths, (rows, spaced)):
        path.write_text("".join(json.dumps(row) + "\n" for row in source_rows))
    splits = phase_splits(phase, [str(path) for path in paths], "1,1,1", seed=3, eval_fraction=0.5)

    def text(sample):
        return " ".join(f"{sample.turns[-1]['content']} {sample.chosen} {sample.rejected}".split())  # NBSP too

    trained = {text(sample) for split in splits for sample in split.train}
    held_out = {text(sample) for split in splits for sample in split.eval}
    assert held_out and not trained & held_out
    assert sum(split.skipped[phases.HELD_OUT_IN_TRAINING] for split in splits) > 0
    assert all(len(split.eval) + split.skipped[phases.HELD_OUT_IN_TRAINING] == split.held_out for split in splits)


def test_a_held_out_pair_that_swaps_a_training_pairs_replies_is_dropped(tmp_path):
    """A second source holds the first's pairs with their replies swapped (the opposite label): the reward model
    trained on that very comparison, yet a held-out copy with the replies the other way round was scored as unseen. A
    pair that shares its prompt and one reply with a training pair asks another comparison, and stays."""
    rows = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    # in another order: each source is permuted alike by the seed
    swapped = [{**row, "chosen": row["rejected"], "rejected": row["chosen"]} for row in reversed(rows)]
    other = [{**row, "rejected": f"other {i}"} for i, row in reversed(list(enumerate(rows)))]
    paths = [tmp_path / "plain.jsonl", tmp_path / "swapped.jsonl", tmp_path / "other.jsonl"]
    for path, source_rows in zip(paths, (rows, swapped, other)):
        path.write_text("".join(json.dumps(row) + "\n" for row in source_rows))
    splits = phase_splits(2, [str(path) for path in paths], "1,1,1", seed=3, eval_fraction=0.5)

    def compared(sample):
        return sample.turns[-1]["content"], frozenset((sample.chosen, sample.rejected))

    trained = {compared(sample) for split in splits for sample in split.train}
    assert splits[0].eval and not trained & {compared(sample) for split in splits[:2] for sample in split.eval}
    assert all(split.skipped[phases.HELD_OUT_IN_TRAINING] > 0 for split in splits[:2])
    assert len(splits[2].eval) == splits[2].held_out and not splits[2].skipped[phases.HELD_OUT_IN_TRAINING]


def test_a_pair_whose_replies_differ_only_in_whitespace_is_skipped_as_identical(tmp_path):
    """Replies the same but for a doubled space, a line end or a no-break space (the same text to a model, as the
    held-out and duplicate checks compare: `comparable_text`) were kept as a comparison, and the reward model learned
    to prefer one spacing. They are skipped as identical_replies, as exact copies were."""
    rows = [{"prompt": f"question {i}", "chosen": f"answer {i}", "rejected": f"answer {i}" if i % 3 == 0
             else f"answer\u00a0 {i}\r\n" if i % 3 == 1 else f"other {i}"} for i in range(30)]
    path = tmp_path / "spaced.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (split,) = phase_splits(2, [str(path)], "1,1,1", seed=3, eval_fraction=0.2)
    kept = split.train + split.eval
    assert kept and all(sample.rejected.startswith("other") for sample in kept)
    assert split.skipped["identical_replies"] == split.records - len(kept)


@pytest.mark.parametrize("bad", ["0,0,0", "1,2", "a,b,c", "-1,2,2", "nan,1,1", "inf,1,1", "1e308,1e308,1"])
def test_bad_data_split_is_a_user_error(bad):
    with pytest.raises(UserError, match="data_split"):
        parse_data_split(bad)


def test_a_data_split_of_finite_weights_whose_sum_overflows_says_so():
    """It was told its weights must be "all finite", which they are."""
    with pytest.raises(UserError, match=r"--data_split '1e308,1e308,1': its weights are finite, but their sum is past "
                                        r"the largest float .*scale them down"):
        parse_data_split("1e308,1e308,1")
    with pytest.raises(UserError, match="--data_split 'inf,1,1' must be three finite numbers"):
        parse_data_split("inf,1,1")


def test_two_sources_blend_into_one_seeded_mix(tmp_path, tok):
    a = write_pairs(tmp_path / "a.jsonl", 40, "alpha")
    b = write_pairs(tmp_path / "b.jsonl", 40, "beta")
    train, evaluation = build_phase_datasets(1, [a, b], "1,0,0", tok, 64, 3, str(tmp_path / "cache"), eval_fraction=0.1)
    assert len(train) == 72 and len(evaluation) == 8
    origins = ["alpha" in tok.decode(item["input_ids"]) for item in train]
    assert sum(origins) == 36
    first_beta = origins.index(False)
    assert any(origins[first_beta:]), "sources must be interleaved by the seeded shuffle, not concatenated"


def test_sft_only_sources_go_entirely_to_step_one(tmp_path):
    main = write_pairs(tmp_path / "main.jsonl", 30, "main")
    sft_only = write_pairs(tmp_path / "extra.jsonl", 10, "extra")
    (main_split, extra_split) = phase_splits(1, [main], "1,1,1", seed=0, eval_fraction=0.2, sft_only_data_paths=[sft_only])
    assert len(extra_split.train) + len(extra_split.eval) == 10 and len(extra_split.eval) == 2
    assert len(main_split.train) + len(main_split.eval) == 10
    assert len(phase_splits(2, [main], "1,1,1", seed=0, eval_fraction=0.2, sft_only_data_paths=[sft_only])) == 1


def test_zero_share_for_the_built_step_is_a_user_error(tmp_path, tok):
    path = write_pairs(tmp_path / "a.jsonl", 10, "a")
    with pytest.raises(UserError, match="no share"):
        build_phase_datasets(2, [path], "1,0,1", tok, 64, 0, str(tmp_path / "cache"))


def test_step_one_given_no_share_trains_on_its_step_one_only_sources_alone(tmp_path, tok):
    """--data_split 0,1,1 with --sft_only_data_path (step 1 on its own SFT data, steps 2 and 3 on the pairs, as
    DeepSpeed-Chat allows) was refused: 'gives step 1 no share of the data'. The pairs give step 1 nothing, the
    step-1-only source all it trains and holds out; an unusable one is still refused."""
    from training.pipeline.inspect_data import main

    pairs = write_pairs(tmp_path / "pairs.jsonl", 20, "pairs")
    sft_only = write_pairs(tmp_path / "sft.jsonl", 20, "sft")
    args = (1, [pairs], "0,1,1", tok, 64, 0, str(tmp_path / "cache"))
    train, evaluation = build_phase_datasets(*args, sft_only_data_paths=[sft_only], eval_fraction=0.1)
    assert (len(train), len(evaluation)) == (18, 2)
    assert all("sft question" in tok.decode(item["input_ids"]) for item in [*train, *evaluation])
    with pytest.raises(UserError, match=r"gives step 1 no share of the data; .* \(or step-1-only sources"):
        build_phase_datasets(*args)
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text(json.dumps({"prompt": "no reply"}) + "\n")
    with pytest.raises(UserError, match="unusable.jsonl' has no usable rows for step 1"):
        build_phase_datasets(*args, sft_only_data_paths=[str(unusable)])
    tok.save_pretrained(tmp_path / "tokenizer")
    reported = main(["--data_path", pairs, "--data_split", "0,1,1", "--sft_only_data_path", sft_only, "--seed", "0",
                     "--tokenizer", str(tmp_path / "tokenizer"), "--data_output_path", str(tmp_path / "cache")])
    assert reported["tokenized"][1] == {"train": 18, "eval": 2}


def test_a_shard_without_records_says_so(tmp_path, tok):
    """8,1,1 of six records gives step 2 none: the error said only "no usable rows; skipped: {}"."""
    path = write_pairs(tmp_path / "six.jsonl", 6, "six")
    with pytest.raises(UserError, match=r"its step-2 shard holds 0 of its 6 records \(--data_split 8,1,1\)"):
        build_phase_datasets(2, [path], "8,1,1", tok, 64, 0, str(tmp_path / "cache"))


@pytest.mark.parametrize("phase, hint, not_hint", [
    (1, "raise --max_seq_len", "--max_prompt_seq_len"),
    (2, "raise --max_seq_len", "--prompt_overflow"),
    (3, "raise --max_prompt_seq_len or use --prompt_overflow left_truncate", "--max_seq_len"),
])
def test_no_training_items_left_names_the_flag_that_limits_this_step(tmp_path, tok, phase, hint, not_hint):
    """Steps 1 and 2 drop a prompt at --max_seq_len; only step 3 reads --max_prompt_seq_len and --prompt_overflow,
    which every step's hint named."""
    rows = [{"prompt": f"question {i} " + "lorem ipsum " * 40, "chosen": "a", "rejected": "b"} for i in range(30)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match="no step-.* training items") as error:
        build_phase_datasets(phase, [str(tmp_path / "long.jsonl")], "1,1,1", tok, 64, 0, str(tmp_path / "cache"),
                             max_prompt_seq_len=64)
    assert hint in str(error.value) and not_hint not in str(error.value)


def test_an_empty_held_out_part_is_said_from_what_emptied_it():
    """The warning blamed --eval_fraction whenever a step had no held-out item, though held-out items dropped in
    tokenisation (prompt_too_long) emptied it: --eval_fraction is not what to change then."""
    from utils.data.phases import no_eval_items_note

    dropped = no_eval_items_note(2, 0.1, {"dropped:prompt_too_long": 3, "dropped:identical_after_truncation": 1,
                                          "items": 0})
    assert dropped.startswith("every held-out item of step 2 was dropped in tokenisation (dropped:prompt_too_long=3, "
                              "dropped:identical_after_truncation=1)")
    assert "raise --max_seq_len" in dropped and "--eval_fraction" not in dropped
    assert "raise --max_prompt_seq_len" in no_eval_items_note(3, 0.1, {"dropped:prompt_too_long": 1})
    none = no_eval_items_note(1, 0.1, {"items": 0})
    assert none.startswith("--eval_fraction 0.1 held out no usable item of step 1") and "held_out_in_training" in none


def test_no_training_items_left_when_eval_fraction_holds_out_the_whole_shard(tmp_path, tok):
    path = write_pairs(tmp_path / "six.jsonl", 6, "six")
    with pytest.raises(UserError, match="--eval_fraction 0.9 holds out every record") as error:
        build_phase_datasets(1, [path], "1,1,1", tok, 64, 1, str(tmp_path / "cache"), eval_fraction=0.9)
    assert "--max_seq_len" not in str(error.value)


def test_no_training_items_left_when_every_training_row_is_skipped(tmp_path, tok):
    path = tmp_path / "two.jsonl"  # seed 0 trains on the first record, which has no reply, and holds out the second
    path.write_text(json.dumps({"prompt": "p0"}) + "\n" + json.dumps({"prompt": "p1", "chosen": "c1"}) + "\n")
    with pytest.raises(UserError, match="no step-1 training items: every record left for training was skipped"):
        build_phase_datasets(1, [str(path)], "1,0,0", tok, 64, 0, str(tmp_path / "cache"), eval_fraction=0.5)


def test_a_chat_template_that_refuses_every_row_is_named_with_its_own_message(tmp_path, caplog):
    """Gemma-2's template raises on a system turn: every row was dropped as chat_template_error and the error
    blamed the lengths, without the template's message."""
    tokenizer = make_tokenizer(chat_template=True)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported')"
                               " }}{% endif %}" + tokenizer.chat_template)
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q {i}"},
                          {"role": "assistant", "content": f"a {i}"}]} for i in range(30)]
    (tmp_path / "system.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match="System role not supported") as error:
        build_phase_datasets(1, [str(tmp_path / "system.jsonl")], "1,1,1", tokenizer, 64, 0, str(tmp_path / "cache"))
    assert "--prompt_format human_assistant" in str(error.value) and "--max_seq_len" not in str(error.value)


@pytest.fixture
def count_builds(monkeypatch):
    calls = []
    real_build = phases._build

    def counting_build(*args, **kwargs):
        calls.append(args[0])
        return real_build(*args, **kwargs)

    monkeypatch.setattr(phases, "_build", counting_build)
    return calls


@pytest.mark.parametrize("flag, least", [("max_train_samples", 1), ("max_eval_samples", 0)])
def test_a_sample_cap_below_its_least_is_refused(tmp_path, tok, flag, least):
    """No training item is refused too: the step failed on it once it had loaded its model."""
    path = tmp_path / "a.jsonl"
    write_pairs(path, 10, "a")
    with pytest.raises(UserError, match=f"--{flag} must be {least} or more, not {least - 1}"):
        build_phase_datasets(phase=2, data_paths=[str(path)], data_split="1,1,1", tokenizer=tok, max_seq_len=64,
                             seed=0, data_output_path=str(tmp_path / "cache"), **{flag: least - 1})


def test_cache_hits_and_misses_on_every_key_input(tmp_path, tok, count_builds):
    path = tmp_path / "a.jsonl"
    write_pairs(path, 30, "a")
    cache = str(tmp_path / "cache")
    base = dict(phase=2, data_paths=[str(path)], data_split="1,1,1", tokenizer=tok, max_seq_len=64, seed=0,
                data_output_path=cache)

    def build(**changes):
        before = len(count_builds)
        train, _ = build_phase_datasets(**{**base, **changes})
        return len(count_builds) > before, train

    assert build()[0]
    hit, cached = build(max_train_samples=3)
    assert not hit and len(cached) == 3
    assert build(rebuild_cache=True)[0]
    for change in (dict(seed=1), dict(data_split="1,2,1"), dict(max_seq_len=63), dict(prompt_format="human_assistant"),
                   dict(tokenizer=make_tokenizer(chat_template=False)), dict(eval_fraction=0.2)):
        assert build(**change)[0], change
        assert not build(**change)[0], change
    assert not build(max_prompt_seq_len=9, whole_sequence_loss=True)[0], "options step 2 does not use must not miss"
    write_pairs(path, 31, "a")
    assert build()[0], "a changed source file must miss"
    assert build(phase=1)[0]
    assert build(phase=1, whole_sequence_loss=True)[0]


def test_answers_cut_at_max_seq_len_are_warned_of_once_a_step_also_from_the_cache(tmp_path, tok, caplog):
    """An answer cut at --max_seq_len (its EOS with it) was counted only inside the build's info line of stats, and
    not at all when the items came from the cache: the step trained on unfinished answers without a warning."""
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": f"q {i}", "chosen": "a long answer " * (1 + i % 2 * 6), "rejected": "no"} for i in range(20)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    base = {"data_paths": [str(path)], "data_split": "1,1,1", "tokenizer": tok, "seed": 0,
            "data_output_path": str(tmp_path / "cache")}

    def warnings(**settings) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="utils.data"):
            build_phase_datasets(**{**base, **settings})
        return [record.getMessage() for record in caplog.records if "end inside their answer" in record.getMessage()]

    for phase in (1, 2):
        (built,) = warnings(phase=phase, max_seq_len=48)
        assert warnings(phase=phase, max_seq_len=48) == [built]  # a cache hit says the same
        assert f"step {phase} data: " in built and "--max_seq_len 48" in built and " of the " in built
        assert warnings(phase=phase, max_seq_len=512) == []


def test_a_source_named_twice_is_warned_of_once_a_step(tmp_path, tok, caplog):
    """--data_path X X (also X and ./X:FORMAT) cut and read X twice: every step trained and evaluated on each of its
    records twice over, without a word. It still does (no flag weighs a source otherwise), and a warning names it."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", 40, "dsc")
    other = write_pairs(tmp_path / "other.jsonl", 40, "other")
    stated = f"{os.path.relpath(pairs)}:deepspeed_chat"

    def warnings(phase, data_paths, sft_only=()) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="utils.data"):
            build_phase_datasets(phase, data_paths, "1,1,1", tok, 64, 0, str(tmp_path / "cache"),
                                 sft_only_data_paths=sft_only)
        return [record.getMessage() for record in caplog.records if " times: " in record.getMessage()]

    assert warnings(2, [pairs, other]) == []
    (said,) = warnings(2, [pairs, other, stated])
    assert said.startswith(f"--data_path names '{pairs}' 2 times: each step that reads it trains and evaluates on "
                           "each of its records 2 times over")
    (said,) = warnings(1, [pairs], sft_only=[other, other, other])
    assert said.startswith(f"--sft_only_data_path names '{other}' 3 times")
    assert len(build_phase_datasets(2, [pairs, pairs], "1,1,1", tok, 64, 0, str(tmp_path / "cache"))[0]) == 2 * len(
        build_phase_datasets(2, [pairs], "1,1,1", tok, 64, 0, str(tmp_path / "cache"))[0])


def write_shp(path, labels):
    rows = [{"history": f"question {i}", "human_ref_A": f"answer A{i}", "human_ref_B": f"answer B{i}", "labels": label}
            for i, label in enumerate(labels)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("settled", [False, True], ids=["just_written", "settled"])
def test_a_same_size_edit_that_keeps_the_mtime_misses_the_cache(tmp_path, tok, count_builds, monkeypatch, settled):
    """SHP labels flipped in place (same size), the mtime restored: the cache, keyed by size and mtime, served the
    old pairs. `settled`: every file counts as long unchanged, so its hash comes from the process's memo."""
    import time

    from utils.data import sources

    if settled:
        monkeypatch.setattr(sources, "_SETTLED_NS", -(10**12))
    path = tmp_path / "shp.jsonl"
    labels = [i % 2 for i in range(30)]
    args = (2, [write_shp(path, labels)], "1,1,1", tok, 64, 0, str(tmp_path / "cache"))
    old, _ = build_phase_datasets(*args)
    stat = path.stat()
    time.sleep(0.05)  # past the file system's time resolution: the rewrite gets another ctime
    write_shp(path, [1 - label for label in labels])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    builds = len(count_builds)
    flipped, _ = build_phase_datasets(*args)
    assert len(count_builds) == builds + 1, "the edited file must miss the cache"
    fresh, _ = build_phase_datasets(*args, rebuild_cache=True)
    assert flipped.digest() == fresh.digest() != old.digest()


def test_cached_data_matches_a_fresh_build(tmp_path, tok):
    path = write_pairs(tmp_path / "a.jsonl", 30, "a")
    args = (3, [path], "1,1,1", tok, 64, 0)
    fresh, _ = build_phase_datasets(*args, str(tmp_path / "c1"))
    cached, _ = build_phase_datasets(*args, str(tmp_path / "c1"))
    other_dir, _ = build_phase_datasets(*args, str(tmp_path / "c2"))
    for a, b, c in zip(fresh, cached, other_dir):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["input_ids"], c["input_ids"])
    assert not list((tmp_path / "c1").glob(".*tmp*")), "no temporary files may remain"


@dataclass
class _DataCLI:
    data: DataArguments


def test_data_args_round_trip_and_defaults(tmp_path, monkeypatch):
    """Local paths come back absolute (a run's records name the files it read), a stated format kept; hub names,
    tasks and the embedded default as given."""
    from training.core.args import SettingsParser

    monkeypatch.chdir(tmp_path)
    parser = SettingsParser(_DataCLI)
    args = parser.parse_args(["--data_path", "a.jsonl", "b.jsonl:hh_rlhf", "Dahoas/rm-static", "task:arithmetic",
                              "--data_split", "1,1,1", "--max_seq_len", "128"])
    data = args.data
    assert data.data_path == [str(tmp_path / "a.jsonl"), f"{tmp_path / 'b.jsonl'}:hh_rlhf", "Dahoas/rm-static",
                              "task:arithmetic"]
    assert data.max_seq_len == 128 and data.seed == 1234
    defaults = parser.parse_args([]).data
    assert defaults.data_path == ["embedded"] and defaults.data_split == "2,4,4"


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_cut_shards_with_is_refused_with_the_flags(seed):
    """numpy's RandomState takes [0, 2**32): such a --seed was parsed, and the data build died in a bare ValueError."""
    from training.core.args import SettingsParser

    with pytest.raises(UserError, match=rf"--seed must be between 0 and 4294967295, not {seed}"):
        SettingsParser(_DataCLI).parse_args(["--seed", str(seed)])


def test_a_run_that_rebuilds_the_data_cache_is_the_same_run():
    """A rebuilt cache holds what the build makes (a resumed run checks its items): train.py rerun with
    --rebuild_data_cache refused the steps it had finished as runs with other flags, and --resume the checkpoint."""
    from training.core.args import SettingsParser, flag_values, resume_fixed_flags, same_result_flags
    from training.reliability.run_records import changed_flags

    parser = SettingsParser(_DataCLI)
    before, rebuilding = parser.parse_args([]), parser.parse_args(["--rebuild_data_cache"])
    assert changed_flags(flag_values(before), flag_values(rebuilding), same_result_flags(rebuilding)) == {}
    assert resume_fixed_flags(before) == resume_fixed_flags(rebuilding)
    assert changed_flags(flag_values(before), flag_values(parser.parse_args(["--seed", "1"])),
                         same_result_flags(rebuilding)) == {"seed": (1234, 1)}


def test_the_data_path_help_names_every_row_format():
    """--help listed six formats: chat_preference and chat_prompt, which PATH:FORMAT takes, were missing."""
    from training.core.args import SettingsParser

    from utils.data.readers import FORMATS

    help_text = " ".join(SettingsParser(_DataCLI).format_help().split())
    assert f"state the row format ({', '.join(FORMATS)})" in help_text
    assert {"chat_preference", "chat_prompt"} <= set(FORMATS)


def test_every_data_flag_refusal_is_reported_at_once():
    """The data checks of a step's flags stopped at their first refusal: a command line with seven mistakes here took
    seven runs to learn of them, though each step reports its other flag checks' refusals at once (`refuse_all`)."""
    data = DataArguments(data_split="1,2", eval_fraction=2.0, max_seq_len=1, max_prompt_seq_len=0, max_train_samples=0,
                         max_eval_samples=-1, sft_only_data_path=["only.jsonl"])
    with pytest.raises(UserErrors) as refused:
        data.check_flags(2)
    assert [message.split()[0] for message in refused.value.messages] == [
        "--data_split", "--eval_fraction", "--max_seq_len", "--max_prompt_seq_len", "--max_train_samples",
        "--max_eval_samples", "--sft_only_data_path"]


def test_a_source_in_both_data_path_and_sft_only_data_path_is_refused(tmp_path):
    """Step 1 trained on such a source's step-1 shard twice (as a --data_path shard and within the whole source) and
    on the other steps' shards, and train.py's step 2 refused the model only once step 1 had trained it. Refused
    before any data is read, whichever way the source is written (here a stated format)."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", 10, "a")
    other = write_pairs(tmp_path / "other.jsonl", 10, "b")
    DataArguments(data_path=[pairs], sft_only_data_path=[other]).check_flags(1)
    with pytest.raises(UserError, match=r"--sft_only_data_path .*pairs.jsonl:deepspeed_chat is in --data_path too: "
                                        r"step 1 would train on its step-1 shard twice"):
        DataArguments(data_path=[other, pairs], sft_only_data_path=[f"{pairs}:deepspeed_chat"]).check_flags(1)


def test_unsupervised_text_becomes_fixed_blocks(tmp_path, tok, caplog):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("The quick brown fox.\n\nJumps over the lazy dog.\n\n" * 20)
    blocks = build_unsupervised_dataset(str(text_file), tok, 16, 0, str(tmp_path / "cache"))
    docs = 40
    total = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in ["The quick brown fox.", "Jumps over the lazy dog."] * 20)
    assert len(blocks) == total // 16 and blocks.stats["documents"] == docs
    item = blocks[0]
    assert item["input_ids"].shape == (16,) and torch.equal(item["labels"], item["input_ids"])
    assert (torch.cat([b["input_ids"] for b in blocks]) == tok.eos_token_id).sum() >= docs - 2
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "Human feedback trains a reward model."}) + "\n" for _ in range(10)) + '{"text": 5}\n')
    with caplog.at_level("WARNING", logger="utils.data"):
        capped = build_unsupervised_dataset(str(jsonl), tok, 8, 0, str(tmp_path / "cache"), max_blocks=3)
    assert len(capped) == 3 and capped.stats["skipped:wrong_type:text"] == 1
    assert "skipped: wrong_type:text=1 (corpus.jsonl line 11)" in caplog.text  # the row to fix, named
    with pytest.raises(UserError, match="no block"):
        build_unsupervised_dataset(str(jsonl), tok, 10_000, 0, str(tmp_path / "cache"))
    wrong_column = tmp_path / "wrong_column.jsonl"
    wrong_column.write_text("".join(json.dumps({"content": "Some text.", "id": i}) + "\n" for i in range(5)))
    with pytest.raises(UserError, match=r"has no 'text' column in any row \(its rows have \['content', 'id'\]\)"):
        build_unsupervised_dataset(str(wrong_column), tok, 8, 0, str(tmp_path / "cache"))


@pytest.mark.parametrize("split", ["train", "data"])
def test_a_json_object_of_text_rows_is_read_as_those_documents(tmp_path, split):
    """{"train": [{"text": ...}, ...]} (or "data") was read as one row whose column is the split, as no row format reads
    a text row, and refused 'has no 'text' column in any row (its rows have ['train'])'. A row of its own, an id beside
    its messages, is still one row."""
    from utils.data.unsupervised import load_texts

    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({split: [{"text": "first document"}, {"text": "second document"}], "version": 2}))
    assert load_texts(str(corpus))[0] == ["first document", "second document"]
    corpus.write_text(json.dumps({"id": 1, "turns": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(UserError, match=r"has no 'text' column in any row \(its rows have \['id', 'turns'\]\)"):
        load_texts(str(corpus))


def test_a_folder_of_text_files_is_read_as_a_text_file_is_each_file_in_name_order(tmp_path):
    """A folder of .txt files (a corpus of one document a file) was refused as holding no .json/.jsonl/.parquet files;
    a .csv beside them is refused as in any data folder, and an edited file changes the source's fingerprint."""
    from utils.data.unsupervised import load_texts, text_source_fingerprint

    corpus = tmp_path / "corpus"
    (corpus / "part2").mkdir(parents=True)
    (corpus / "b.txt").write_text("second file, one paragraph\n")
    (corpus / "a.txt").write_text("first file, first paragraph\n\nfirst file, second paragraph")
    (corpus / "part2" / "c.txt").write_text("nested file")
    (corpus / ".notes.txt").write_text("hidden")
    texts, skipped = load_texts(str(corpus))
    assert (texts, dict(skipped)) == (["first file, first paragraph", "first file, second paragraph",
                                       "second file, one paragraph", "nested file"], {})
    before = text_source_fingerprint(str(corpus))
    (corpus / "part2" / "c.txt").write_text("nested file, edited")
    assert text_source_fingerprint(str(corpus)) != before
    (corpus / "table.csv").write_text("text\nx\n")
    with pytest.raises(UserError, match=r"holds table.csv, which would not be read"):
        load_texts(str(corpus))


def test_a_text_folders_files_are_counted_and_its_notes_and_licence_files_warned_of(tmp_path, caplog):
    """A folder's README.txt and LICENSE.txt were read as pretraining text like its other .txt files, unsaid, and the
    log gave no count of the files read. They are still read (a name alone does not say what a file holds), warned
    of by name; a file passed alone is not, and each file is split at blank lines as a .txt file alone is."""
    from utils.data.unsupervised import load_texts

    corpus = tmp_path / "corpus"
    (corpus / "docs").mkdir(parents=True)
    (corpus / "a.txt").write_text("first paragraph\n\nsecond paragraph")
    (corpus / "docs" / "README.txt").write_text("How this corpus was made.")
    (corpus / "LICENSE.txt").write_text("CC BY 4.0")
    with caplog.at_level("INFO", logger="utils.data"):
        texts, _ = load_texts(str(corpus))
    assert texts == ["CC BY 4.0", "first paragraph", "second paragraph", "How this corpus was made."]
    assert f"unsupervised source '{corpus}': 4 documents (text between blank lines) from 3 .txt files" in caplog.text
    assert (f"unsupervised source '{corpus}' reads LICENSE.txt, docs/README.txt as pretraining text, as it reads every "
            ".txt file of the folder; move them out of it if they are not text to train on") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="utils.data"):
        assert load_texts(str(corpus / "a.txt"))[0] == texts[1:3]
    assert "from 1 .txt file\n" in caplog.text + "\n" and "move" not in caplog.text


def test_each_unsupervised_document_begins_as_its_tokenizer_begins_a_text(tmp_path):
    """Documents were tokenised without special tokens: a Llama-style tokenizer's BOS, which the model read at the
    start of every pretraining document, was missing, so the mixture trained it on documents that begin mid-stream.
    A tokenizer that adds no BOS (GPT-2's, SmolLM2's) keeps its tokens; EOS still ends each document."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n\n" * 3)
    plain, opening = make_tokenizer(chat_template=False), make_tokenizer(chat_template=False)
    opening.add_bos_token = True
    body = plain("the quick brown fox", add_special_tokens=False)["input_ids"]
    block_size = len(body) + 2

    def stream(tokenizer) -> list[int]:
        blocks = build_unsupervised_dataset(str(corpus), tokenizer, block_size, 0, str(tmp_path / "cache"))
        return torch.cat([block["input_ids"] for block in blocks]).tolist()

    assert stream(opening) == [opening.bos_token_id, *body, opening.eos_token_id] * 3
    plain_stream = [*body, plain.eos_token_id] * 3
    assert stream(plain) == plain_stream[: len(plain_stream) // block_size * block_size]


def test_a_hub_text_sources_skipped_rows_name_their_row(monkeypatch):
    """The pretraining mixture's hub rows without their text were counted (missing:text=1) with no place to find
    them; they are named by the dataset, its split and the row there, as a local file's are by file and line."""
    import datasets

    from utils.data.unsupervised import load_texts

    documents = datasets.Dataset.from_list([{"text": "One."}, {"text": None}, {"text": "Three."}])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: documents)
    texts, skipped = load_texts("someone/corpus")
    assert texts == ["One.", "Three."]
    assert skipped.report() == "missing:text=1 (someone/corpus[train] row 2)"


def test_no_step_trains_on_a_hub_datasets_test_or_validation_split(tmp_path, monkeypatch, caplog):
    """A hub dataset's splits were joined before the shards were cut, so Anthropic/hh-rlhf's and Dahoas/rm-static's
    test rows landed in the steps' training shards; its evaluation splits are left out (said), unless it has no
    other, and --eval_fraction holds out part of the rest. So are those of a saved DatasetDict and of a local .json
    object of splits."""
    import datasets

    from utils.data.sources import load_source, parse_source_spec

    def pairs(*prompts: str) -> datasets.Dataset:
        return datasets.Dataset.from_list([{"prompt": p, "chosen": "yes", "rejected": "no"} for p in prompts])

    published = {"someone/pairs": datasets.DatasetDict({"train": pairs("a", "b"), "test": pairs("c"),
                                                        "validation": pairs("d"), "test_prefs": pairs("e")}),
                 "someone/benchmark": datasets.DatasetDict({"test": pairs("f", "g")})}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: published[name])
    with caplog.at_level("INFO", logger="utils.data"):
        assert [row["prompt"] for row in load_source(parse_source_spec("someone/pairs")).records] == ["a", "b"]
        assert [row["prompt"] for row in load_source(parse_source_spec("someone/benchmark")).records] == ["f", "g"]
    assert "its evaluation splits test, test_prefs, validation left out" in caplog.text
    assert "data source 'someone/benchmark' holds evaluation splits alone (test): the steps train on them" in caplog.text
    (split,) = phase_splits(1, ["someone/pairs"], "1,0,0", seed=0, eval_fraction=0.5)
    assert sorted(sample.turns[0]["content"] for sample in split.train + split.eval) == ["a", "b"]
    published["someone/pairs"].save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "splits.json").write_text(json.dumps({name: split.to_list()
                                                      for name, split in published["someone/pairs"].items()}))
    for local in ("saved", "splits.json"):
        assert [row["prompt"] for row in load_source(parse_source_spec(str(tmp_path / local))).records] == ["a", "b"]


def test_a_source_names_the_split_it_reads_and_rw_eval_reads_the_evaluation_splits(tmp_path, monkeypatch, caplog):
    """A hub source could not name a split, so rw_eval.py --input_file on a hub name scored its training split alone
    and no step could read a split left out as an evaluation split. NAME[split] reads that split (an evaluation
    split too; with :FORMAT after it), of a hub dataset, a saved DatasetDict and a .json object of splits; rw_eval
    (read_rows evaluating) reads a dataset's evaluation splits where no split is named, and says so."""
    import datasets

    from utils.data.rows import read_rows
    from utils.data.sources import load_source, parse_source_spec, source_identity

    def pairs(*prompts: str) -> datasets.Dataset:
        return datasets.Dataset.from_list([{"prompt": p, "chosen": "yes", "rejected": "no"} for p in prompts])

    published = datasets.DatasetDict({"train": pairs("a", "b", "c"), "test": pairs("d", "e"), "dev": pairs("f")})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: published)
    published.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "splits.json").write_text(json.dumps({name: split.to_list() for name, split in published.items()}))

    def prompts(entry: str) -> list[str]:
        return [row["prompt"] for row in load_source(parse_source_spec(entry)).records]

    for source in ("someone/rm-static", str(tmp_path / "saved"), str(tmp_path / "splits.json")):
        assert prompts(f"{source}[test]") == ["d", "e"]
        assert prompts(f"{source}[dev]:deepspeed_chat") == ["f"]
        assert prompts(source) == ["a", "b", "c"]
        with pytest.raises(UserError, match="has no split 'tset': its splits are dev, test, train"):
            prompts(f"{source}[tset]")
    assert parse_source_spec("someone/rm-static[test]:hh_rlhf").split == "test"
    assert source_identity("someone/rm-static[test]") != source_identity("someone/rm-static")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "yes", "rejected": "no"}) + "\n")
    with pytest.raises(UserError, match=r"holds no splits.*drop \[test\]"):
        prompts(str(tmp_path / "rows.jsonl[test]"))
    with caplog.at_level("INFO", logger="utils.data"):
        assert [row["prompt"] for row in read_rows("someone/rm-static", evaluating=True)] == \
            [" Human: f Assistant:", " Human: d Assistant:", " Human: e Assistant:"]
        assert len(read_rows("someone/rm-static[train]", evaluating=True)) == 3
    assert "its evaluation splits dev, test are read" in caplog.text


def test_a_folder_of_per_split_files_is_read_less_its_evaluation_splits(tmp_path, caplog):
    """A folder of a split's files each (a cloned hub repository's data/train-00000-of-00001.parquet beside
    data/test-...) was read whole, so the steps trained on its test split; its evaluation splits' files are left out,
    as a hub dataset's splits are, said, and a folder of evaluation splits alone is read whole, with a warning."""
    from utils.data.sources import load_source, parse_source_spec

    def write(name: str, *prompts: str) -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p, "chosen": "yes", "rejected": "no"}) + "\n"
                                             for p in prompts))

    def prompts(entry: str) -> list[str]:
        return [row["prompt"] for row in load_source(parse_source_spec(entry)).records]

    write("repo/data/train-00000-of-00002.jsonl", "a", "b")
    write("repo/data/train-00001-of-00002.jsonl", "c")
    write("repo/data/test-00000-of-00001.jsonl", "d", "e")
    write("only_test/test.jsonl", "f")
    with caplog.at_level("INFO", logger="utils.data"):
        assert prompts(str(tmp_path / "repo")) == ["a", "b", "c"]
        assert prompts(str(tmp_path / "only_test")) == ["f"]
    assert "its splits train are read, its evaluation splits test left out" in caplog.text
    assert "holds evaluation splits alone (test): the steps train on them" in caplog.text
    assert prompts(str(tmp_path / "repo[test]")) == ["d", "e"]
    assert prompts(str(tmp_path / "repo" / "data" / "test-00000-of-00001.jsonl")) == ["d", "e"]  # a file, named


@pytest.mark.parametrize("kept, left_out", [
    (["train/part0.jsonl"], ["test/part0.jsonl"]),
    (["default/train/0000.jsonl"], ["default/test/0000.jsonl", "default/validation/0000.jsonl"]),
    (["hh-rlhf-train.jsonl"], ["hh-rlhf-test.jsonl"]),
    (["rm_static_train.jsonl"], ["rm_static_test.jsonl", "my-test-data.jsonl", "dev 2.jsonl"]),
    (["train(1).jsonl", "training/0.jsonl"], ["hh+test.jsonl", "Test.jsonl", "testing/0.jsonl"]),
    (["data/holdout-00000-of-00001.jsonl", "data/train-00000-of-00001.jsonl"], ["data/test-00000-of-00001.jsonl"]),
])
def test_a_folder_names_its_splits_in_its_folders_or_anywhere_in_a_files_name(tmp_path, kept, left_out):
    """A file's split was its name's part before the first '-' or '.', so a split given by a subfolder
    (default/test/0000.jsonl, the hub's parquet-export layout) or after a prefix (hh-rlhf-test.jsonl: 'hh') was
    trained on; a split word is found as datasets finds one, in a folder or between separators of the name, and
    between any other non-letters too (hh+test.jsonl and testing/, whose word datasets has but this did not, were
    trained on); datasets' sharded layout names a split by the name before the shard's number (holdout)."""
    write_split_files(tmp_path, kept + left_out)
    assert folder_prompts(tmp_path) == sorted(kept)


def write_split_files(folder, names) -> None:
    """A file of one pair at each of `names` under `folder`, its prompt the file's name."""
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps({"prompt": name, "chosen": "yes", "rejected": "no"}) + "\n")


def folder_prompts(entry) -> list[str]:
    from utils.data.sources import load_source, parse_source_spec

    return [row["prompt"] for row in load_source(parse_source_spec(str(entry))).records]


def test_a_folder_of_files_naming_splits_beside_files_naming_none_is_refused_naming_them(tmp_path):
    """A file naming no split beside files naming one (data.jsonl beside test.jsonl) was read as train, where
    datasets' load_dataset leaves it unread: which split it holds is not known (a heldout.jsonl), so it is refused,
    naming the files."""
    write_split_files(tmp_path, ["data.jsonl", "heldout.jsonl", "test.jsonl", "train.jsonl"])
    with pytest.raises(UserError, match=r"holds files naming a split \(test.jsonl, train.jsonl\) beside files naming "
                                        r"none \(data.jsonl, heldout.jsonl\).*put their split in their names"):
        folder_prompts(tmp_path)


@pytest.mark.parametrize("names", [["data/my-split-00000-of-00001.jsonl", "data/train-00000-of-00001.jsonl"],
                                   ["data/my-split-00000-of-00001.jsonl"], ["data/my..split-00000-of-00001.jsonl"]],
                         ids=["beside_train", "alone", "empty_part"])
def test_a_sharded_file_whose_split_datasets_refuses_as_no_split_name_is_refused_saying_so(tmp_path, names):
    """datasets refuses data/my-split-00000-of-00001 (its split name holds a '-'); here it was a file naming no split:
    refused as one beside train's shards, read whole as train alone. It is refused as the split name it is, with a
    name datasets takes: data/my..split-... was told to rename to the same name (a part between dots is empty)."""
    write_split_files(tmp_path, names)
    name = names[0]
    split = name.removeprefix("data/").removesuffix("-00000-of-00001.jsonl")
    with pytest.raises(UserError, match=rf"holds {re.escape(name)}, of datasets' sharded layout .*split "
                                        rf"'{re.escape(split)}' is no split name .*"
                                        r"\(data/my_split-00000-of-00001.jsonl\)"):
        folder_prompts(tmp_path)


def test_the_split_words_are_datasets_own():
    from utils.data.eval_splits import SPLIT_KEYWORDS

    assert SPLIT_KEYWORDS == {str(split): tuple(words) for split, words in DATASETS_SPLIT_KEYWORDS.items()}


@pytest.mark.parametrize("word", [*DATASETS_SPLIT_KEYWORDS["validation"], *DATASETS_SPLIT_KEYWORDS["test"]])
def test_each_of_datasets_evaluation_split_words_names_a_split_no_step_trains_on(tmp_path, monkeypatch, word):
    """datasets reads a folder's file named by `testing` into its test split, but `testing` named no evaluation
    split here: a folder's testing.jsonl, and a hub dataset's split `testing`, were trained on. The words are
    datasets' own (data_files.SPLIT_KEYWORDS), each leaving its split out."""
    import datasets

    write_split_files(tmp_path, ["train.jsonl", f"{word}.jsonl"])
    assert folder_prompts(tmp_path) == ["train.jsonl"]
    published = datasets.DatasetDict({split: datasets.Dataset.from_list([{"prompt": split, "chosen": "y", "rejected":
                                                                          "n"}]) for split in ("train", word)})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: published)
    assert folder_prompts("someone/pairs") == ["train"]


def test_a_folder_whose_files_name_no_split_is_read_whole(tmp_path):
    """A folder of files naming no split (part-0.jsonl, shard_1.jsonl) is one split, read whole."""
    from utils.data.sources import load_source, parse_source_spec

    names = ["a/part-0.jsonl", "shard_1.jsonl", "shard_2.parquet"]
    for name in names[:2]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"prompt": name, "chosen": "yes", "rejected": "no"}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": names[2], "chosen": "yes", "rejected": "no"}]), tmp_path / names[2])
    assert [row["prompt"] for row in load_source(parse_source_spec(str(tmp_path))).records] == names


def test_other_ranks_wait_and_load_what_local_rank_zero_built(tmp_path, monkeypatch):
    import utils.data.cache as cache

    target = tmp_path / "cache" / "x.pt"
    monkeypatch.setattr(cache, "get_local_rank", lambda: 1)
    with pytest.raises(UserError, match="local rank 0"):
        cache.build_or_load(target, lambda: pytest.fail("only local rank 0 builds"))
    monkeypatch.setattr(cache, "get_local_rank", lambda: 0)
    assert cache.build_or_load(target, lambda: {"value": torch.tensor([1])}) == ({"value": torch.tensor([1])}, True)
    monkeypatch.setattr(cache, "get_local_rank", lambda: 1)
    state, built = cache.build_or_load(target, lambda: pytest.fail("only local rank 0 builds"))
    assert state["value"].tolist() == [1] and not built


def test_a_damaged_cache_file_is_built_again_with_a_warning(tmp_path, tok, caplog, monkeypatch):
    """A cache file cut short (a disk that filled, a copy interrupted) or emptied ended the run in a bare
    OSError / EOFError from torch.load."""
    import utils.data.cache as cache

    args = (1, [write_pairs(tmp_path / "a.jsonl", 20, "a")], "1,1,1", tok, 64, 0, str(tmp_path / "cache"))
    first, _ = build_phase_datasets(*args)
    (cached,) = (tmp_path / "cache").glob("*.pt")
    for damaged in (cached.read_bytes()[: cached.stat().st_size // 2], b""):
        cached.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level("WARNING", logger="utils.data"):
            again, _ = build_phase_datasets(*args)
        assert again.digest() == first.digest()
        assert f"the data cache file {cached} is damaged" in caplog.text
    cached.write_bytes(b"")
    monkeypatch.setattr(cache, "get_local_rank", lambda: 1)  # which loads what local rank 0 built (or left)
    with pytest.raises(UserError, match=f"the data cache {cached} cannot be read .*--rebuild_data_cache"):
        build_phase_datasets(*args)


def test_a_damaged_cache_file_whose_rebuild_fails_is_gone_for_the_other_ranks(tmp_path, monkeypatch):
    """Local rank 0 warned of the damaged file and its rebuild failed: the file stayed, and the other ranks told the
    user to rerun with --rebuild_data_cache, which failed the same way. With it gone they point at local rank 0's
    error; likewise a --rebuild_data_cache build that fails leaves no old file for them to load."""
    import utils.data.cache as cache

    def failing_build():
        raise UserError("no step-1 training items are left after tokenisation; raise --max_seq_len")

    target = tmp_path / "step1_sft_x.pt"
    for rebuild, old in ((False, b"PK\x03\x04 cut short"), (True, None)):
        monkeypatch.setattr(cache, "get_local_rank", lambda: 0)
        if old is None:  # a sound file, to be replaced
            cache.build_or_load(target, lambda: {"value": torch.tensor([1])})
        else:
            target.write_bytes(old)
        with pytest.raises(UserError, match="no step-1 training items"):
            cache.build_or_load(target, failing_build, rebuild=rebuild)
        assert not target.exists()
        monkeypatch.setattr(cache, "get_local_rank", lambda: 1)  # past the barrier
        with pytest.raises(UserError, match=f"the data cache {target} was not built; see the error reported by local "
                                            "rank 0"):
            cache.build_or_load(target, lambda: pytest.fail("only local rank 0 builds"), rebuild=rebuild)


def test_a_failed_cache_write_leaves_no_partial_file_and_a_finished_one_is_fsynced(tmp_path, monkeypatch):
    import os

    import utils.data.cache as cache

    target = tmp_path / "cache" / "x.pt"
    real_save, real_fsync = torch.save, os.fsync

    def failing_save(obj, path):
        open(path, "wb").write(b"half a tensor")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        cache.build_or_load(target, lambda: {"value": torch.tensor([1])})
    assert [path.name for path in target.parent.iterdir() if path.name != "x.pt.lock"] == []

    synced_inodes = []
    monkeypatch.setattr(torch, "save", real_save)
    monkeypatch.setattr(os, "fsync", lambda fd: (synced_inodes.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    cache.build_or_load(target, lambda: {"value": torch.tensor([1])})
    assert target.stat().st_ino in synced_inodes, "the cache file must reach the disk before it is renamed into place"


@pytest.mark.parametrize("special", ["add_bos_token", "add_eos_token"])
def test_tokenizers_that_insert_special_tokens_differently_get_their_own_cache(tmp_path, special):
    """The prompts of the human_assistant format are encoded with the tokenizer's special tokens."""
    path = write_pairs(tmp_path / "a.jsonl", 20, "a")
    plain, inserting = make_tokenizer(chat_template=False), make_tokenizer(chat_template=False)
    setattr(inserting, special, True)
    args = (3, [path], "1,1,1")
    cache = tmp_path / "cache"
    build_phase_datasets(*args, plain, 64, 0, str(cache))
    cached, _ = build_phase_datasets(*args, inserting, 64, 0, str(cache))
    fresh, _ = build_phase_datasets(*args, inserting, 64, 0, str(tmp_path / "fresh"))
    assert len(list(cache.glob("*.pt"))) == 2
    assert [item["input_ids"].tolist() for item in cached] == [item["input_ids"].tolist() for item in fresh]
    special_id = inserting.bos_token_id if special == "add_bos_token" else inserting.eos_token_id
    assert all(special_id in item["input_ids"].tolist() for item in fresh)


def test_a_tokenizer_changed_where_its_vocabulary_and_probes_do_not_show_gets_its_own_cache(tmp_path):
    """A tokenizer.json updated in place (here an NFKC normalizer; as well other merges or pre-tokenizer) under the same
    name, vocabulary and special tokens, encoding the probe text alike: the cache served the old tokens."""
    from tokenizers import normalizers

    from utils.data.cache import tokenizer_fingerprint

    rows = [{"prompt": f"ｆｕｌｌ width ﬁle {i}", "chosen": f"ﬁne {i}", "rejected": f"ｂａｄ {i}"} for i in range(20)]
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    before, after = make_tokenizer(with_pad=True), make_tokenizer(with_pad=True)
    after.backend_tokenizer.normalizer = normalizers.NFKC()
    args = (3, [str(path)], "1,1,1")
    build_phase_datasets(*args, before, 64, 0, str(tmp_path / "cache"))
    cached, _ = build_phase_datasets(*args, after, 64, 0, str(tmp_path / "cache"))
    fresh, _ = build_phase_datasets(*args, after, 64, 0, str(tmp_path / "fresh"))
    assert [item["input_ids"].tolist() for item in cached] == [item["input_ids"].tolist() for item in fresh]
    fingerprint = tokenizer_fingerprint(after)
    after(["a padded", "batch"], padding=True, truncation=True, max_length=2)  # sets the backend's per-call state
    assert tokenizer_fingerprint(after) == fingerprint


def test_the_cache_key_follows_the_data_code(tmp_path):
    import shutil

    import utils.data.cache as cache

    copy = tmp_path / "data_code"
    shutil.copytree(cache.DATA_CODE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.source_version(copy) == cache.source_version() == cache.code_version()["data_code"]
    tokenization = copy / "tokenization.py"
    tokenization.write_text(tokenization.read_text().replace("IGNORE_INDEX = -100", "IGNORE_INDEX = -1"))
    assert cache.source_version(copy) != cache.source_version()


def test_the_cache_key_follows_the_libraries_that_read_and_encode_the_rows(tmp_path, monkeypatch):
    """A datasets or pyarrow upgrade that reads a source's rows otherwise reused the items built from the old reading:
    their versions were no part of the key (the tokenizer libraries' were)."""
    from importlib.metadata import version

    import utils.data.cache as cache

    keys = set()
    for library in ("datasets", "pyarrow", "transformers", "tokenizers"):
        monkeypatch.setattr(cache, "version", lambda name, bumped=library: "0.0.0" if name == bumped else version(name))
        cache.code_version.cache_clear()
        keys.add(cache.cache_file(tmp_path, "pairs", {"source": "a"}))
    monkeypatch.undo()
    cache.code_version.cache_clear()
    keys.add(cache.cache_file(tmp_path, "pairs", {"source": "a"}))
    assert len(keys) == 5


def test_inspect_data_counts_tokenised_items_and_names_each_sources_format_and_skipped_rows(tmp_path, tok, capsys):
    """`inspect_data --tokenizer` (README's command) stopped with 'too many values to unpack' once the build returned
    the records too; without it the report said neither a source's format nor why its rows were skipped."""
    from training.pipeline.inspect_data import main

    tok.save_pretrained(tmp_path / "tokenizer")
    pairs = write_pairs(tmp_path / "pairs.jsonl", 30, "dsc")
    chat = [[{"role": "user", "content": f"chat question {i}"}, {"role": "assistant", "content": f"chat good {i}"}]
            for i in range(30)]
    rows = [{"chosen": turns, "rejected": [turns[0], {"role": "assistant", "content": f"chat bad {i}"}]}
            for i, turns in enumerate(chat)]
    rows[0]["rejected"][0] = {"role": "user", "content": "another question"}
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    reported = main(["--data_path", pairs, str(tmp_path / "chat.jsonl"), "--data_split", "1,1,1", "--seed", "0",
                     "--tokenizer", str(tmp_path / "tokenizer"), "--data_output_path", str(tmp_path / "cache")])
    printed = capsys.readouterr().out
    assert reported["tokenized"][2] == {"train": 18, "eval": 2} == reported["raw"][2]["pairs"]
    lines = [line for line in printed.splitlines() if line.startswith("data source")]
    assert len(lines) == 6 and sum("(format chat_preference)" in line for line in lines) == 3
    assert sum(line.endswith("skipped: prompt_mismatch=1 (chat.jsonl line 1)") for line in lines) == 1
    assert "(format deepspeed_chat), step 3 prompts: 10 records -> 9 train / 1 eval samples; skipped: none" in printed


def test_inspect_data_says_which_splits_of_a_source_it_leaves_out(tmp_path):
    """inspect_data logged at WARNING alone, so it counted a folder less its test split's files without saying so."""
    import subprocess
    import sys

    for split, count in (("train", 30), ("test", 5)):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{split} {i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(count)))
    done = subprocess.run([sys.executable, "-m", "training.pipeline.inspect_data", "--data_path", str(tmp_path),
                           "--data_output_path", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600, check=True)
    assert "its splits train are read, its evaluation splits test left out" in done.stderr


def test_inspect_data_counts_with_a_tokenizer_that_ships_its_own_code(tmp_path, capsys):
    """inspect_data had no --trust_remote_code: the tokenizer of a model that ships its own code, which the steps
    load with that flag, could not count the items they train on."""
    from training.pipeline.inspect_data import main

    tokenizer = make_custom_code_model_dir(tmp_path / "custom")
    argv = ["--data_path", write_pairs(tmp_path / "pairs.jsonl", 20, "dsc"), "--tokenizer", tokenizer,
            "--data_output_path", str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == EXIT_USER_ERROR and "runs only with --trust_remote_code" in capsys.readouterr().err
    assert main([*argv, "--trust_remote_code"])["tokenized"][1]["train"] > 0


def test_inspect_data_refuses_the_flags_the_steps_refuse_before_reading_any_data(tmp_path, capsys):
    """inspect_data counted a source given in both --data_path and --sft_only_data_path (which step 1 refuses) and
    took a --max_seq_len no step takes, without a word; it runs the steps' data checks first now, every refusal at
    once, as step 1 (the step given the step-1-only sources) runs them."""
    from training.pipeline.inspect_data import main

    pairs = write_pairs(tmp_path / "pairs.jsonl", 20, "dsc")
    with pytest.raises(SystemExit) as exited:
        main(["--data_path", pairs, "--sft_only_data_path", pairs, "--max_seq_len", "1"])
    printed = capsys.readouterr()
    assert exited.value.code == EXIT_USER_ERROR and printed.out == ""
    assert "error: 2 problems: (1) --max_seq_len must be at least 2" in printed.err
    assert f"(2) --sft_only_data_path {pairs} is in --data_path too" in printed.err


def test_inspect_data_counts_tokenised_items_of_a_split_that_gives_a_step_no_share(tmp_path, tok):
    """--data_split 1,0,1 (steps 1 and 3, a reward function scoring) stopped inspect_data --tokenizer with the build's
    'gives step 2 no share of the data'."""
    from training.pipeline.inspect_data import main

    tok.save_pretrained(tmp_path / "tokenizer")
    pairs = write_pairs(tmp_path / "pairs.jsonl", 20, "dsc")
    reported = main(["--data_path", pairs, "--data_split", "1,0,1", "--seed", "0", "--tokenizer",
                     str(tmp_path / "tokenizer"), "--data_output_path", str(tmp_path / "cache")])
    assert reported["tokenized"] == {1: {"train": 9, "eval": 1}, 2: {"train": 0, "eval": 0}, 3: {"train": 9, "eval": 1}}
