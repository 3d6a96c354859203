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
  become null).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Iterator


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
        self.cut = False  # a partial last line was cut on opening
        self.unreadable = 0  # lines that were not records (unreadable="skip")
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
            if data and not data.endswith(b"\n"):
                data = data[:data.rfind(b"\n") + 1]
                if repair:
                    with open(self.path, "wb") as f:
                        f.write(data)
                    self.cut = True
            for line_number, line in enumerate(data.decode("utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    self._records[str(record[key_field])] = record
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    if unreadable == "skip":
                        self.unreadable += 1
                        continue
                    raise ValueError(f"{self.path}: line {line_number} is not a result record ({e}); "
                                     "remove it or use another workdir") from None
        # A writer's file exists from the start (an empty run leaves an empty file); a reader's is not created.
        self._file = open(self.path, "a", encoding="utf-8") if repair else None

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
        """Append records and flush once (a batch of units finished together)."""
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        for record in records:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._records[str(record[self.key_field])] = record
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's value; a file that is not JSON raises :class:`fire_jax.config.InputError` naming the file,
    line and column (a CLI then ends in that one line)."""
    from fire_jax.config import InputError

    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as read back


def check_settings(path: str | os.PathLike, settings: dict, *, key: str | None = None, has_outputs: bool = True,
                   where: str | None = None) -> None:
    """Record ``settings`` in the JSON file ``path`` (under ``key`` when given), or stop when the file holds
    other settings and there are outputs they produced (``has_outputs``): outputs of two settings would mix.

    The error names ``where`` (default: the file's folder) and each changed field, before -> now.
    """
    path = str(path)
    settings = _plain(settings)
    recorded = {}
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
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
    """Write ``finite(value)`` as indented strict JSON (the results of every job); returns what was written."""
    value = finite(value)
    with open(path, "w") as f:
        json.dump(value, f, indent=indent, allow_nan=False)
    return value
