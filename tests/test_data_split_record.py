"""A step's run folder records how many records its build cut each source from; a later step started from that run
refuses a source its own build cut from another count: the seeded permutation is drawn over the count, so every
record moves and the shards overlap (a fixed malformed line put 53 of step 2's 400 pairs in step 1's shard). The
counts are the builds' own (kept with the cached data), compared where the later step's build reads the data, so the
check before the build reads no source, and a hub source, fingerprinted by its name, is checked as a file is."""
import json

import datasets
import pytest
from tiny_models import make_tokenizer

import utils.data.cache as cache
from training.reliability.validation import check_input_run_shards
from utils.data import DataArguments, write_split_record
from utils.data.split_record import SPLIT_RECORD_FILE
from utils.errors import UserError

ROWS = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(100)]
LINES = [json.dumps(row) for row in ROWS]
REFUSED = (r"--model_name_or_path {run} was trained on a shard of {source} cut from its {then} records, but it holds "
           r"{now} now .*restore the data as .*step1 read it, or retrain .*step1 on the data as it is now")
NAMED_OTHERWISE = (r"--model_name_or_path {run} was trained on a shard of {then}; this step's {now}, so its shard, "
                   r"cut from another count, would overlap the rows that model trained on; name the source as "
                   r".*step1 did \({named}\)$")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def run_step1(data: DataArguments, tok, run) -> None:
    """What step 1 does with its data: build, then record (after its model loads) in its run folder."""
    records = data.build(1, tok).records
    run.mkdir()
    (run / "args.json").write_text(json.dumps({key: getattr(data, key) for key in ("data_path", "seed", "data_split")}))
    write_split_record(run, records, 1)


def input_runs(run, data: DataArguments) -> list:
    """What step 2 started from `run` hands its data build (`check_input_run_shards`, none for an unchecked run)."""
    record = check_input_run_shards(str(run), data, 2)
    return [] if record is None else [record]


def recorded(run) -> list:
    return [entry["records"] for entry in json.loads((run / SPLIT_RECORD_FILE).read_text())["sources"]]


@pytest.fixture
def step1(tmp_path, tok):
    """Step 1's run folder, cut from a file with one malformed line, and its data arguments."""
    broken = list(LINES)
    broken[50] = broken[50][:-1]
    data = DataArguments(data_path=[write_lines(tmp_path / "pairs.jsonl", broken)], data_split="1,1,1",
                         data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    return tmp_path / "step1", data


def step2_data(step1_data: DataArguments, **changes) -> DataArguments:
    return DataArguments(**{"data_path": step1_data.data_path, "data_split": "1,1,1",
                            "data_output_path": step1_data.data_output_path, **changes})


def test_a_step_records_the_record_count_of_each_source_it_cut(step1):
    run, data = step1
    assert json.loads((run / SPLIT_RECORD_FILE).read_text()) == {"phase": 1, "sources": [
        {"source": data.data_path[0], "records": 99}]}


def test_a_source_whose_record_count_changed_since_the_input_run_cut_it_is_refused(step1, tmp_path, tok):
    run, data = step1
    write_lines(tmp_path / "pairs.jsonl", LINES)  # the malformed line fixed
    step2 = step2_data(data)
    runs = input_runs(run, step2)  # the settings match; the count is the build's to compare
    with pytest.raises(UserError, match=REFUSED.format(run=run, source=".*pairs.jsonl", then=99, now=100)):
        step2.build(2, tok, runs)
    (run / SPLIT_RECORD_FILE).unlink()  # a run folder from before the record: not checked
    step2 = step2_data(data)
    runs = input_runs(run, step2)
    step2.build(2, tok, runs)


def test_the_record_holds_the_count_the_build_cut_not_the_one_at_write_time(tmp_path, tok):
    """The record was counted when written (after the model loaded): a record added in between was recorded as what
    the step trained on, and a later step on the changed data passed."""
    source = tmp_path / "pairs.jsonl"
    data = DataArguments(data_path=[write_lines(source, LINES[:99])], data_split="1,1,1",
                         data_output_path=str(tmp_path / "cache"))
    records = data.build(1, tok).records  # step 1 cuts 99 records
    write_lines(source, LINES)  # ... and the file gains one while its model loads
    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "args.json").write_text(json.dumps({"data_path": data.data_path, "seed": data.seed,
                                                              "data_split": data.data_split}))
    write_split_record(tmp_path / "step1", records, 1)
    assert recorded(tmp_path / "step1") == [99]
    step2 = step2_data(data)
    runs = input_runs(tmp_path / "step1", step2)
    with pytest.raises(UserError, match=REFUSED.format(run=tmp_path / "step1", source=".*pairs.jsonl", then=99,
                                                        now=100)):
        step2.build(2, tok, runs)


@pytest.fixture
def hub(monkeypatch):
    """A hub dataset `someone/pairs` whose rows the test changes, and the reads of it."""
    state = {"rows": ROWS[:99], "reads": 0}

    def load_dataset(name, config_name=None, split=None):
        state["reads"] += 1
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(state["rows"])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return state


def test_a_hub_source_that_changed_since_the_input_run_is_refused_on_every_rank(tmp_path, tok, hub, monkeypatch):
    """A hub source is fingerprinted by its name: the count remembered for it passed the check, step 2's build cut
    the new count (23 of its 101 prompts were in step 1's shard) and recorded it as the one step 1 cut."""
    data = DataArguments(data_path=["someone/pairs"], data_split="1,1,1", data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    assert recorded(tmp_path / "step1") == [99]
    hub["rows"] = ROWS  # the hub copy gains a record
    refused = REFUSED.format(run=tmp_path / "step1", source="someone/pairs", then=99, now=100)
    for rebuild in (False, True):
        hub["reads"] = 0
        step2 = step2_data(data, rebuild_data_cache=rebuild)
        runs = input_runs(tmp_path / "step1", step2)
        assert hub["reads"] == 0  # the check before the build reads no source
        with pytest.raises(UserError, match=refused):
            step2.build(2, tok, runs)
    # another local rank loads what local rank 0 built (or found cached) and refuses as it does, past the barrier
    monkeypatch.setattr(cache, "get_local_rank", lambda: 1)
    hub["reads"] = 0
    step2 = step2_data(data)
    runs = input_runs(tmp_path / "step1", step2)
    with pytest.raises(UserError, match=refused):
        step2.build(2, tok, runs)
    assert hub["reads"] == 0


def test_a_cached_build_is_checked_as_the_count_its_items_were_cut_from(tmp_path, tok, hub):
    """Step 2's data cached before the hub copy changed holds the items cut from step 1's count: it passes, reads no
    source, and the run records that count; a step 1 run on the new copy is refused it."""
    data = DataArguments(data_path=["someone/pairs"], data_split="1,1,1", data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    step2_data(data).build(2, tok)  # cached from 99 records
    hub["rows"], hub["reads"] = ROWS, 0
    step2 = step2_data(data)
    runs = input_runs(tmp_path / "step1", step2)
    records = step2.build(2, tok, runs).records
    assert hub["reads"] == 0
    (tmp_path / "step2").mkdir()
    write_split_record(tmp_path / "step2", records, 2)
    assert recorded(tmp_path / "step2") == [99]
    retrained = DataArguments(data_path=["someone/pairs"], data_split="1,1,1", rebuild_data_cache=True,
                              data_output_path=str(tmp_path / "cache"))
    run_step1(retrained, tok, tmp_path / "step1_new")
    assert recorded(tmp_path / "step1_new") == [100]
    step2 = step2_data(data)
    runs = input_runs(tmp_path / "step1_new", step2)
    with pytest.raises(UserError, match="step1_new was trained on a shard of someone/pairs cut from its 100 records, "
                                        "but it holds 99 now"):
        step2.build(2, tok, runs)


def test_the_check_before_the_build_reads_no_source_and_each_step_reads_it_once(tmp_path, tok, hub):
    """The check read every shared source whole, in every process, before the processes started: a second read
    with --rebuild_data_cache or another --data_output_path."""
    data = DataArguments(data_path=["someone/pairs"], data_split="1,1,1", data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    assert hub["reads"] == 1
    for changes in ({"rebuild_data_cache": True}, {"data_output_path": str(tmp_path / "cache2")}):
        hub["reads"] = 0
        step2 = step2_data(data, **changes)
        runs = input_runs(tmp_path / "step1", step2)
        assert hub["reads"] == 0
        records = step2.build(2, tok, runs).records
        (tmp_path / "step2").mkdir(exist_ok=True)
        write_split_record(tmp_path / "step2", records, 2)
        assert hub["reads"] == 1 and recorded(tmp_path / "step2") == [99]


def test_step_1_from_a_step_1_run_refuses_a_step_1_only_source_whose_count_changed(tmp_path, tok):
    """Step 1 started from a step-1 run compared the --seed of their --sft_only_data_path sources alone: such a source
    that gained a row was permuted anew (100 -> 101 records at --seed 1234, --eval_fraction 0.1: 5 of the 10 held-out
    records had been trained on), unrefused, as only --data_path counts were recorded. A count that dropped also says
    that this version leaves a dataset's evaluation splits out."""
    whole = write_lines(tmp_path / "sft.jsonl", LINES)
    data = DataArguments(data_path=["embedded"], sft_only_data_path=[whole], data_split="1,1,1",
                         data_output_path=str(tmp_path / "cache"))
    run = tmp_path / "step1"
    records = data.build(1, tok).records
    run.mkdir()
    (run / "args.json").write_text(json.dumps({key: getattr(data, key) for key in
                                               ("data_path", "sft_only_data_path", "seed", "data_split")}))
    write_split_record(run, records, 1)
    assert recorded(run)[1:] == [100]
    for lines, now in ((LINES + [json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"})], 101), (LINES[:99], 99)):
        write_lines(tmp_path / "sft.jsonl", lines)
        again = DataArguments(data_path=["embedded"], sft_only_data_path=[whole], data_split="1,1,1",
                              data_output_path=str(tmp_path / "cache"))
        record = check_input_run_shards(str(run), again, 1)
        with pytest.raises(UserError, match=REFUSED.format(run=run, source=".*sft.jsonl", then=100, now=now)) as err:
            again.build(1, tok, [record])
        assert ("this version leaves them out" in str(err.value)) == (now < 100)


@pytest.mark.parametrize("splits, counted", [(("train", "test"), True), (("train", "extra"), False)])
def test_a_later_step_naming_the_train_split_is_checked_as_the_source_its_input_run_read(tmp_path, tok, monkeypatch,
                                                                                           splits, counted):
    """X[train] and X were two sources to the shard checks, though they read the same rows of a dataset of train and
    test splits: step 2 on someone/pairs[train] after a step 1 on someone/pairs was cut with any --seed, unchecked,
    its shard overlapping step 1's. They are one source: another --seed is refused, and the counts are compared,
    equal where train is the one training split, refused where another training split adds to X's (the two read
    rows in common)."""
    published = datasets.DatasetDict({splits[0]: datasets.Dataset.from_list(ROWS[:90]),
                                      splits[1]: datasets.Dataset.from_list(ROWS[90:])})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: published)
    data = DataArguments(data_path=["someone/pairs"], data_split="1,1,1", data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    with pytest.raises(UserError, match=r"trained on someone/pairs\[train\] cut with --seed 1234 --data_split 1,1,1, "
                                        r"but this step cuts it with --seed 7"):
        check_input_run_shards(str(tmp_path / "step1"), step2_data(data, data_path=["someone/pairs[train]"], seed=7), 2)
    step2 = step2_data(data, data_path=["someone/pairs[train]"])
    runs = input_runs(tmp_path / "step1", step2)
    assert runs[0].records == {"someone/pairs": 90 if counted else 100}
    if counted:
        step2.build(2, tok, runs)
    else:
        with pytest.raises(UserError, match=NAMED_OTHERWISE.format(
                run=tmp_path / "step1", then=r"someone/pairs \(100 records: all its training splits\)",
                now=r"someone/pairs\[train\] reads 90 records \(its train split alone\)", named="someone/pairs")):
            step2.build(2, tok, runs)


def test_a_later_step_naming_its_source_otherwise_than_its_input_run_is_told_to_name_it_alike(tmp_path, tok,
                                                                                          monkeypatch):
    """Where X has training splits besides train, X and X[train] read different counts, and a step naming the source
    otherwise than its input run did is refused, either way round. No record changed: the refusal said one was
    "fixed, added or removed" and to restore the data or retrain; it says the two name different splits and to name
    the source as that run did."""
    published = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:90]),
                                      "extra": datasets.Dataset.from_list(ROWS[90:])})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: published)
    data = DataArguments(data_path=["someone/pairs[train]"], data_split="1,1,1",
                         data_output_path=str(tmp_path / "cache"))
    run_step1(data, tok, tmp_path / "step1")
    step2 = step2_data(data, data_path=["someone/pairs"])
    with pytest.raises(UserError, match=NAMED_OTHERWISE.format(
            run=tmp_path / "step1", then=r"someone/pairs\[train\] \(90 records: its train split alone\)",
            now=r"someone/pairs reads 100 records \(all its training splits\)", named=r"someone/pairs\[train\]")) as err:
        step2.build(2, tok, input_runs(tmp_path / "step1", step2))
    assert "fixed, added or removed" not in str(err.value) and "evaluation splits" not in str(err.value)
