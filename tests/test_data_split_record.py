"""A step's run folder records how many records each source held when it was cut; a later step started from that run
refuses a source whose count changed since: the seeded permutation is drawn over the count, so every record moves and
the shards overlap (a fixed malformed line put 53 of step 2's 400 pairs in step 1's shard)."""
import json

import pytest
from tiny_models import make_tokenizer

import utils.data.split_record as split_record
from utils.data import DataArguments
from utils.data.shard_match import check_same_shards
from utils.data.split_record import SPLIT_RECORD_FILE, record_count
from utils.errors import UserError

LINES = [json.dumps({"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"}) for i in range(100)]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def step1(tmp_path):
    """Step 1's run folder, cut from a file with one malformed line, and its data arguments."""
    broken = list(LINES)
    broken[50] = broken[50][:-1]
    data = DataArguments(data_path=[write_lines(tmp_path / "pairs.jsonl", broken)], data_split="1,1,1",
                         data_output_path=str(tmp_path / "cache"))
    data.build(1, make_tokenizer())
    run = tmp_path / "step1"
    run.mkdir()
    (run / "args.json").write_text(json.dumps(vars(data)))
    data.record_split(run)
    return run, data


def test_a_step_records_the_record_count_of_each_source_it_cut(step1):
    run, data = step1
    assert json.loads((run / SPLIT_RECORD_FILE).read_text()) == {"sources": [{"source": data.data_path[0],
                                                                              "records": 99}]}


def test_a_source_whose_record_count_changed_since_the_input_run_cut_it_is_refused(step1, tmp_path):
    run, data = step1
    write_lines(tmp_path / "pairs.jsonl", LINES)  # the malformed line fixed
    with pytest.raises(UserError, match=r"--model_name_or_path step1 was trained on a shard of .*pairs.jsonl cut from "
                                        r"its 99 records, but it holds 100 now .*restore the data as .*step1 read it, "
                                        r"or retrain .*step1 on the data as it is now"):
        check_same_shards(vars(data), vars(data), "--model_name_or_path step1", str(run))
    (run / SPLIT_RECORD_FILE).unlink()  # a run folder from before the record: not checked
    check_same_shards(vars(data), vars(data), "--model_name_or_path step1", str(run))


def test_an_unchanged_source_passes_without_being_read_again(step1, monkeypatch):
    """The build remembered the count beside its cache: the check does not read the whole source again."""
    run, data = step1
    monkeypatch.setattr(split_record, "load_source", lambda spec: pytest.fail("the remembered count was not used"))
    check_same_shards(vars(data), vars(data), "--model_name_or_path step1", str(run))
    assert record_count(data.data_path[0], data.data_output_path) == 99
