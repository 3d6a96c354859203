"""Streaming reads of JSON-array and JSONL record files: the one loop over a JSONL file's lines
(:func:`jsonl_lines`: every JSONL reader's, VLRMBench's tasks and batch_infer's prompts too), each record's raw
object, a broken one named by file, record and byte or line (:func:`iter_raw`), and the one loop every FIRE
record reader runs over them (:func:`read_objects`: FIRE and instruction records, triplets, VQA items)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from fire_jax.core.config import InputError, json_error_at
from fire_jax.data.bad_records import BadRecordError, BadRecords

T = TypeVar("T")

_JSON_WHITESPACE = " \t\n\r"


class JsonLine(NamedTuple):
    """One non-blank line of a JSONL file: its record index (blank lines skipped), its 1-based line number, and
    its JSON value, or why it is not JSON (``error``; ``value`` None)."""

    index: int
    line: int
    value: Any
    error: str | None


def jsonl_lines(path: str) -> Iterator[JsonLine]:
    """The records of a JSONL file as they are read, blank lines skipped, a leading BOM dropped. Bytes that are
    not UTF-8 are kept as surrogates (``surrogateescape``), so that a record's checks name the field; a line that
    is not JSON comes with its error (and, the file's last line without a newline, the hint that it was cut)."""
    index = 0
    with open(path, "rb") as f:
        for line_number, raw_line in enumerate(f, 1):
            line = raw_line.decode("utf-8", "surrogateescape")
            if line_number == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            try:
                yield JsonLine(index, line_number, json.loads(line), None)
            except json.JSONDecodeError as e:
                cut = "" if raw_line.endswith(b"\n") else ", the file's last line, cut short?"
                yield JsonLine(index, line_number, None, f"{e}{cut}")
            except RecursionError:
                yield JsonLine(index, line_number, None, "nested too deeply")
            index += 1


def iter_raw(path: str) -> Iterator[tuple[int, Any]]:
    """(index, raw object) of a JSON-array or JSONL file.

    Bytes that are not UTF-8 are kept as surrogates (``surrogateescape``), so that :func:`parse_record` names the
    record and field (``invalid_utf8``) and the other records stay good. An unparsable JSONL line gives a
    BadRecordError object (``invalid_json``, the next lines are read on); a JSON array that does not parse is
    an InputError naming the file, the byte offset and the record it stopped in.
    """
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf" + _JSON_WHITESPACE.encode())
    if head.startswith(b"["):
        yield from enumerate(_json_array(path))
        return
    for record in jsonl_lines(path):
        if record.error is None:
            yield record.index, record.value
        else:
            yield record.index, BadRecordError("invalid_json", f"{path}: record {record.index} (line {record.line})",
                                               "<line>", record.error)


def _json_array(path: str) -> list[Any]:
    """The records of a JSON-array file, parsed one by one so that an error names the record it is in."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", "surrogateescape").lstrip("\ufeff")
    decoder = json.JSONDecoder()
    records: list[Any] = []

    def fail(pos: int, message: str) -> None:
        offset = len(text[:pos].encode("utf-8", "surrogateescape")) + (len(data) - len(text.encode(
            "utf-8", "surrogateescape")))  # the byte in the file (a BOM counted)
        raise InputError(f"{path}: not a valid JSON array: {json_error_at(message, f'byte {offset:,}')} "
                         f"(in record {len(records)})")

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in _JSON_WHITESPACE:
            pos += 1
        return pos

    pos = skip(skip(0) + 1)  # past "["
    if pos < len(text) and text[pos] == "]":
        pos = skip(pos + 1)
        if pos < len(text):
            fail(pos, "extra data after the array")
        return records
    while True:
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            fail(e.pos, "the file ends inside a record" if e.pos >= len(text) else e.msg)
        except RecursionError:
            fail(pos, "a record nested too deeply")
        records.append(value)
        pos = skip(pos)
        if pos >= len(text):
            fail(pos, "the file ends before the array's closing ']'")
        if text[pos] == ",":
            pos = skip(pos + 1)
            continue
        if text[pos] == "]":
            pos = skip(pos + 1)
            if pos < len(text):
                fail(pos, "extra data after the array")
            return records
        fail(pos, "expected ',' or ']' after a record")


def read_objects(path: str, parse: Callable[[dict, str, str], T], *, bad: BadRecords,
                 on_bad_record: str = "skip") -> Iterator[T]:
    """``parse(raw, where, default_id)`` of every record of a JSON-array / JSONL file, in order, as it is read.

    ``where`` is ``"<path>: record <index>"``, ``default_id`` ``"<file stem>:<index>"``. A line that is not JSON
    or not an object, or a ``BadRecordError`` raised by ``parse``, is counted in ``bad`` by reason, or raised
    under ``on_bad_record="error"`` (:meth:`fire_jax.data.bad_records.BadRecords.handle`).
    """
    stem = os.path.splitext(os.path.basename(path))[0]
    for index, raw in iter_raw(path):
        where = f"{path}: record {index}"
        try:
            if isinstance(raw, BadRecordError):
                raise raw
            if not isinstance(raw, dict):
                raise BadRecordError("missing_field", where, "<record>",
                                     f"expected a JSON object, got {type(raw).__name__}")
            parsed = parse(raw, where, f"{stem}:{index}")
        except BadRecordError as e:
            bad.handle(e, on_bad_record)
            continue
        yield parsed
