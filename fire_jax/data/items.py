"""Items: the (I, q, gt) triplets that dialogues are about, and the readers of the files that hold them.

- :class:`Item`: one triplet with its id and source dataset, the unit of free
  dialogues (FIRE Tables 4-6) and of FIRE-1M-style generation.
- :func:`load_conversations`: the FIRE conversations of a test source, read
  through :func:`fire_jax.data.sources.open_source` (raw JSON or a built TFDS
  split, bad records counted by reason).
- :func:`load_triplets`: plain triplet files without conversations (or FIRE
  records, their conversations ignored), for generation.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Sequence

from fire_jax.core.config import resolve_path
from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import check_image
from fire_jax.data.jsonl import read_objects
from fire_jax.data.records import Conversation, strip_image_placeholder
from fire_jax.data.sources import open_source, subset_indices


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
