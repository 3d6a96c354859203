"""What FIRE-Bench runs read and where their finished results go (SPEC section 6).

- :class:`Item`: one (I, q, gt) triplet with its id and source dataset, the
  unit of free dialogues and of FIRE-1M-style generation. Test sets are read
  through :func:`fire_jax.data.sources.open_source` (raw JSON or a built TFDS
  split, bad records counted by reason); generation inputs may also be plain
  triplet files without conversations (:func:`load_triplets`).
- :class:`ResultStore`: an append-only JSONL file of finished units (a fixed
  dialogue turn, a free dialogue, a generated record), flushed line by line,
  so a killed run loses at most the unit in flight and a rerun skips every
  key already there.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Iterator, Mapping, Sequence

from fire_jax.config import resolve_path

from fire_jax.data.sources import open_source
from fire_jax.data.records import (BadRecordError, BadRecords, Conversation, check_image, iter_raw,
                                   strip_image_placeholder)


@dataclasses.dataclass(frozen=True)
class Item:
    """One (I, q, gt) triplet."""

    id: str
    image: str | bytes  # absolute path, or encoded bytes from a TFDS split
    question: str
    groundtruth: str
    source: str  # the source dataset ("textvqa", "mathvista", ...)

    @property
    def image_path(self) -> str | None:
        """The image path to write into results (None for encoded bytes)."""
        return self.image if isinstance(self.image, str) else None


def item_of(record: Conversation, image: str | bytes) -> Item:
    return Item(record.id, image, record.question, record.groundtruth, record.source)


def subset_indices(total: int, size: int) -> list[int]:
    """A fixed random subset of ``size`` of ``range(total)``, in order (all when size is 0 or >= total)."""
    import numpy as np

    if not size or size >= total:
        return list(range(total))
    return sorted(int(i) for i in np.random.default_rng(0).permutation(total)[:size])


def load_conversations(source: Mapping[str, Any], *, on_bad_record: str = "skip",
                       bad: BadRecords | None = None) -> list[tuple[Conversation, str | bytes]]:
    """(conversation, image) pairs of a test source (``config.test``: json + image_root, or tfds + split).

    ``source.max_examples`` keeps a fixed random subset (the same one as the
    training pipeline's). Instruction records, if any, are skipped and counted
    as ``not_fire``.
    """
    bad = BadRecords() if bad is None else bad
    pairs = []
    for record, image in open_source(source, on_bad_record=on_bad_record, bad=bad):
        if not isinstance(record, Conversation):
            bad.add(BadRecordError("not_fire", record.id, "question", "an instruction record in a FIRE test set"))
            continue
        pairs.append((record, image))
    counts = collections.Counter(record.id for record, _ in pairs)
    duplicates = sorted(i for i, n in counts.items() if n > 1)[:5]
    if duplicates:
        raise ValueError(f"test set has duplicate record ids, e.g. {duplicates}: results are keyed by id")
    return pairs


def _text(raw: Mapping[str, Any], field: str, where: str) -> str:
    value = raw.get(field)
    value = value.get("value") if isinstance(value, dict) else value
    if not isinstance(value, str):
        raise BadRecordError("missing_field", where, field)
    value = strip_image_placeholder(value) if field == "question" else value.strip()
    if not value:
        raise BadRecordError("empty_text", where, field)
    return value


def load_triplets(paths: str | Sequence[str], image_root: str, *, on_bad_record: str = "skip",
                  bad: BadRecords | None = None, max_examples: int = 0) -> list[Item]:
    """(I, q, gt) items of JSON-array / JSONL files: FIRE records (their conversations ignored) or plain
    ``{"id"?, "image", "question", "groundtruth", "source"?}`` objects (question/groundtruth as strings or
    ``{"role", "value"}``). Bad ones are counted by reason (missing_field, empty_text, missing_image,
    unreadable_image, invalid_json) or raise under ``on_bad_record="error"``.
    """
    bad = BadRecords() if bad is None else bad

    def parse(raw: dict, where: str, default_id: str) -> Item:
        image = raw.get("image", raw.get("img_path"))
        if not isinstance(image, str) or not image:
            raise BadRecordError("missing_field", where, "image")
        item = Item(str(raw.get("id") or default_id), image, _text(raw, "question", where),
                    _text(raw, "groundtruth", where), str(raw.get("source") or "unknown"))
        return dataclasses.replace(item, image=check_image(item, resolve_path(image_root), where))

    items = [item for path in ([paths] if isinstance(paths, str) else paths)
             for item in read_objects(resolve_path(path), parse, bad=bad, on_bad_record=on_bad_record)]
    return [items[i] for i in subset_indices(len(items), max_examples)]


def read_objects(path: str, parse, *, bad: BadRecords, on_bad_record: str = "skip") -> list:
    """``parse(raw, where, default_id)`` of every record of a JSON-array / JSONL file, in order.

    A line that is not JSON or not an object, or a ``BadRecordError`` raised by ``parse``, is counted in
    ``bad`` by reason, or raised under ``on_bad_record="error"``. ``default_id`` is ``"<file stem>:<index>"``.
    """
    if on_bad_record not in ("skip", "error"):
        raise ValueError(f"on_bad_record must be 'skip' or 'error', got {on_bad_record!r}")
    stem = os.path.splitext(os.path.basename(path))[0]
    out = []
    for index, raw in iter_raw(path):
        where = f"{path}: record {index}"
        try:
            if isinstance(raw, BadRecordError):
                raise raw
            if not isinstance(raw, dict):
                raise BadRecordError("missing_field", where, "<record>", "expected a JSON object")
            out.append(parse(raw, where, f"{stem}:{index}"))
        except BadRecordError as e:
            if on_bad_record == "error":
                raise
            bad.add(e)
    return out


class ResultStore:
    """Append-only JSONL of finished units, each a JSON object with a unique key (field ``key_field``).

    Opening cuts a partial last line (a kill while writing) and reads what is
    there (the last line of a key wins); :meth:`add` appends and flushes one line.
    """

    def __init__(self, path: str, key_field: str = "key"):
        self.path, self.key_field = path, key_field
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._records: dict[str, dict] = {}
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            if data and not data.endswith(b"\n"):
                data = data[:data.rfind(b"\n") + 1]
                with open(path, "wb") as f:
                    f.write(data)
            for line_number, line in enumerate(data.decode("utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        self._records[str(record[key_field])] = record
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"{path}: line {line_number} is not a result record ({e}); "
                                         "remove it or use another workdir") from None
        self._file = open(path, "a", encoding="utf-8")

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __getitem__(self, key: str) -> dict:
        return self._records[key]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict]:
        return iter(self._records.values())

    def add(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self._records[str(record[self.key_field])] = record

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
