"""Where resumable jobs keep what they finished: one JSONL store, one settings guard, one results writer.

Every job that can be killed and rerun (fixed and free FIRE-Bench dialogues,
VQA, VLRMBench tasks and analyses, FIRE-1M-style data generation,
``fire_jax.batch_infer``) writes through these:

- :class:`ResultStore`: an append-only JSONL file of finished units keyed by
  one field, flushed as it goes, so a killed run loses at most the unit in
  flight. Policy on opening: a partial last line (a kill while writing) is
  cut, and noted in :attr:`ResultStore.cut`; a line that is not a record stops
  the job (``unreadable="error"``, naming the file and line) or is counted in
  :attr:`ResultStore.unreadable` (``"skip"``). The last line of a key wins.
- :func:`check_settings`: a workdir's ``settings.json`` (or one key of it)
  records what the outputs depend on; a rerun with other settings stops before
  it mixes outputs.
- :func:`finite` / :func:`write_json`: results as strict JSON (NaN and inf
  become null);
- :func:`markdown_table`: every Markdown table of the reports (FIRE-Bench,
  the main job's summary, VQA, VLRMBench and its analyses).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

from fire_jax.core.config import InputError, WriteFailed, json_error_at, writing
from fire_jax.core.files import output_file


class ResultStore:
    """Append-only JSONL of finished units, each a JSON object with a unique key (field ``key_field``)."""

    def __init__(self, path: str | os.PathLike, key_field: str = "key", *, unreadable: str = "error",
                 repair: bool = True):
        """``repair=False`` reads a partial last line past without cutting it from the file (a reader's view)."""
        if unreadable not in ("error", "skip"):
            raise ValueError(f"unreadable must be 'error' or 'skip', got {unreadable!r}")
        self.path, self.key_field = str(path), key_field
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._records: dict[str, dict] = {}
        self.cut = False  # a partial last line was cut on opening (or, with repair=False, read past)
        self.cut_line: bytes | None = None  # what it held
        self.unreadable = 0  # lines that were not records (unreadable="skip")
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
            if data and not data.endswith(b"\n"):
                data = self._last_line(data, repair)
            first_unreadable = None
            for line_number, raw in enumerate(data.split(b"\n")[:-1], 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                    self._records[str(record[key_field])] = record
                except UnicodeDecodeError as e:
                    why = f"byte {e.start + 1} of the line is not UTF-8"
                except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
                    why = f"{type(e).__name__}: {e}" if isinstance(e, RecursionError) else str(e)
                else:
                    continue
                if unreadable == "error":
                    raise InputError(f"{self.path}: line {line_number} is not a result record ({why}); "
                                     "remove it or use another workdir")
                self.unreadable += 1
                first_unreadable = first_unreadable or f"line {line_number}: {why}"
            if self.unreadable:
                print(f"{self.path}: {self.unreadable} line(s) that are not result records skipped "
                      f"(first: {first_unreadable})", file=sys.stderr)
        # A writer's file exists from the start (an empty run leaves an empty file); a reader's is not created.
        self._failed = False
        self._fd = self._open() if repair else None

    def _last_line(self, data: bytes, repair: bool) -> bytes:
        """``data`` (the file, its last line without a newline) with that line kept when it is a whole record
        (written without its newline: one is added) or dropped when it is cut short (a kill while writing),
        saying so on stderr; with ``repair`` the file is changed to match."""
        start = data.rfind(b"\n") + 1
        tail = data[start:]
        try:
            record = json.loads(tail.decode("utf-8"))
            whole = isinstance(record, dict) and self.key_field in record
        except (ValueError, RecursionError):
            whole = False
        if whole:
            if repair:
                with open(self.path, "ab") as f:
                    f.write(b"\n")
            return data + b"\n"
        self.cut, self.cut_line = True, tail
        line_number = data.count(b"\n") + 1
        if repair:
            with open(self.path, "r+b") as f:
                f.truncate(start)
        print(f"{self.path}: line {line_number} was cut short ({len(tail):,} bytes, a run stopped while writing "
              f"it): {'dropped, its unit runs again' if repair else 'not read'}", file=sys.stderr)
        return data[:start]

    @classmethod
    def read(cls, path: str | os.PathLike, key_field: str = "key", *, unreadable: str = "skip") -> dict[str, dict]:
        """{key: its last record} of a store file (empty if there is none), read without opening it for writing."""
        if not os.path.exists(path):
            return {}
        return dict(cls(path, key_field, unreadable=unreadable, repair=False)._records)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __getitem__(self, key: str) -> dict:
        return self._records[key]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict]:
        return iter(self._records.values())

    @property
    def records(self) -> dict[str, dict]:
        return self._records

    def add(self, record: dict) -> None:
        self.add_many([record])

    def add_many(self, records: Iterable[dict]) -> None:
        """Append records in one write (a batch of units finished together). A write that fails (a full disk)
        raises :class:`fire_jax.core.config.WriteFailed` naming the file and the space left; the file is cut back
        to its last whole line, and the store writes nothing more (closing it does not write again)."""
        records = list(records)
        data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
        if self._failed:
            raise WriteFailed(f"{self.path}: a write has failed, the store is closed for writing")
        with writing(self.path):
            if self._fd is None:
                self._fd = self._open()
            start = os.fstat(self._fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError:
                self._failed = True
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                self.close()
                raise
        for record in records:
            self._records[str(record[self.key_field])] = record

    def _open(self) -> int:
        """The file, for appending with unbuffered writes (created empty when absent)."""
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        """Close the file; every record was written when it was added (unbuffered), so nothing is written here."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's value; a file that is not JSON (or not UTF-8) raises :class:`fire_jax.core.config.InputError`
    naming the file, line and column (a CLI then ends in that one line)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise InputError(f"{path}: not valid JSON: byte {e.start} (line {line}) is not UTF-8") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise InputError(f"{path}: not valid JSON: {json_error_at(e.msg, where)}") from None


def read_json_object(path: str | os.PathLike) -> dict:
    """:func:`read_json` of a file that must hold a JSON object (a config, an index, settings): anything else
    raises :class:`fire_jax.core.config.InputError` naming the file."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as read back


def check_settings(path: str | os.PathLike, settings: dict, *, key: str | None = None,
                   outputs: Iterable[str | os.PathLike] | None = None, where: str | None = None) -> None:
    """Record ``settings`` in the JSON file ``path`` (under ``key`` when given), or stop when the file holds
    other settings and there are outputs they produced: outputs of two settings would mix. The one settings guard
    of every resumable job (FIRE-Bench runs, VLRMBench tasks and analyses).

    ``outputs``: the files those settings wrote; the recorded settings bind only while one of them is non-empty
    (an empty or missing file: the new settings are recorded). None: they always bind. The error names ``where``
    (default: the file's folder) and each changed field, before -> now.
    """
    path = str(path)
    has_outputs = outputs is None or any(os.path.exists(p) and os.path.getsize(p) for p in outputs)
    settings = _plain(settings)
    recorded = {}
    if os.path.exists(path):
        recorded = read_json(path)
        if not isinstance(recorded, dict):
            raise InputError(f"{path}: expected a JSON object of settings, got {type(recorded).__name__}")
    before = recorded.get(key) if key is not None else (recorded or None)
    if before is not None and has_outputs and before != settings:
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        what = f"the outputs of {key}" if key is not None else "its outputs"
        raise ValueError(f"{where or os.path.dirname(path)}: {what} were generated with other settings ("
                         + "; ".join(f"{k}: {before.get(k)!r} -> {settings.get(k)!r}" for k in changed)
                         + "); use another --workdir or remove it")
    if key is not None:
        recorded[key] = settings
    else:
        recorded = settings
    with output_file(path) as temporary, open(temporary, "w") as f:
        json.dump(recorded, f, indent=2)


def finite(value: Any) -> Any:
    """NaN/inf -> None everywhere (dict keys as strings), so the result is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: str | os.PathLike, value: Any, *, indent: int = 2) -> Any:
    """Write ``finite(value)`` as indented strict JSON (the results of every job), whole or not at all
    (:func:`fire_jax.core.files.output_file`); returns what was written."""
    value = finite(value)
    with output_file(path) as temporary, open(temporary, "w") as f:
        json.dump(value, f, indent=indent, allow_nan=False)
    return value


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], *, align: str = "",
                   cell: Callable[[Any], str] = str) -> str:
    """A Markdown table (no newline after the last row): the one table writer of every report.

    ``align``: one letter per column, "l" (the default alignment, ``---``) or "r" (right, ``---:``: numbers);
    "" leaves every column at the default. A string cell is written as it is, any other value as ``cell(value)``
    (each report's number format).
    """
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of 'l' / 'r' per column of {list(header)}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(v if isinstance(v, str) else cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
