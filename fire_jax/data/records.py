"""Typed FIRE conversations and instruction records: the schema, its parser and its writer, and loading files.

A FIRE record (the released FIRE files' schema, docs/data.md) is one conversation {I, q, gt, [(r_1, f_1), ...,
(r_n, f_n)]}; a LLaVA-665K-style instruction record is a list of human/gpt
messages about an optional image. Files are JSON arrays or JSONL
(:mod:`fire_jax.data.jsonl`). Records that cannot be used are skipped and counted by reason
(:class:`fire_jax.data.bad_records.BadRecords`), or raise
:class:`~fire_jax.data.bad_records.BadRecordError` naming file, record and field under
``on_bad_record="error"``. :func:`to_raw` writes the schema :func:`parse_record` reads.

Texts are stripped of surrounding whitespace, as Llama-3's chat template trims
message contents; the stripped text is what a labelled span decodes back to.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from fire_jax.core.config import InputError
from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import check_image
from fire_jax.data.jsonl import read_objects
from fire_jax.data.scores import feedback_text, parse_score

#: The most characters a record's field may hold (``oversize_field`` past it), and the most messages in its
#: ``conversations``; ``config.data.field_caps`` overrides any of them. A FIRE text is at most a few thousand
#: characters and training cuts sequences at ``data.max_len`` tokens: a field far past that is a broken record,
#: which would otherwise cost the tokenizer its whole length.
FIELD_CAPS = dict(id=1_024, image=4_096, question=65_536, groundtruth=65_536, message=65_536, messages=1_024)
_SURROGATE = re.compile("[\ud800-\udfff]")  # a byte that is not UTF-8, as surrogateescape decodes it

IMAGE_PLACEHOLDER = "<image>"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One refinement round: the student's response r_i and the teacher's feedback f_i."""

    response: str
    feedback: str  # whole feedback, score line included (what the teacher learns)
    score: float | None  # a_i parsed from the feedback

    @property
    def feedback_text(self) -> str:
        """What the student is shown: the feedback with its score line removed."""
        return feedback_text(self.feedback)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A FIRE conversation {I, q, gt, [(r_1, f_1), ..., (r_n, f_n)]}."""

    id: str
    image: str | None  # path relative to the image root
    question: str
    groundtruth: str
    turns: tuple[Turn, ...]
    source: str
    split: str


@dataclasses.dataclass(frozen=True)
class Instruction:
    """A LLaVA-665K-style record: alternating ("user", text) / ("assistant", text) messages."""

    id: str
    image: str | None
    messages: tuple[tuple[str, str], ...]
    source: str
    split: str


Record = Conversation | Instruction


def strip_image_placeholder(text: str) -> str:
    """The text without any "<image>" placeholder (it is re-inserted where the template wants it)."""
    return text.replace(IMAGE_PLACEHOLDER, "").strip()


# ---------------------------------------------------------------------------- parsing


def _text(value: Any) -> str | None:
    """A message's text: a plain string or a {"role", "value"} dict."""
    if isinstance(value, dict):
        value = value.get("value")
    return value if isinstance(value, str) else None


def _role(message: dict) -> str:
    role = message.get("role", message.get("from", ""))
    return role.lower() if isinstance(role, str) else ""


def field_caps(overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """:data:`FIELD_CAPS` with ``overrides`` (``config.data.field_caps``); an unknown name is an InputError."""
    overrides = dict(overrides.to_dict() if hasattr(overrides, "to_dict") else overrides or {})
    unknown = set(overrides) - set(FIELD_CAPS)
    if unknown:
        raise InputError(f"data.field_caps: unknown field(s) {sorted(unknown)}; known: {sorted(FIELD_CAPS)}")
    for name, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"data.field_caps.{name}: expected a positive integer, got {value!r}")
    return {**FIELD_CAPS, **overrides}


def _first_undecodable(value: Any, path: str = "") -> str | None:
    """The path ("question", "conversations[2].value") of the first string of ``value`` holding bytes that are
    not UTF-8 (decoded with surrogateescape), or None."""
    if isinstance(value, str):
        return path or "<record>" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            found = _first_undecodable(key, name) or _first_undecodable(item, name)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_undecodable(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _check_size(where: str, field: str, text: str, caps: Mapping[str, int], cap_name: str) -> None:
    if len(text) > caps[cap_name]:
        raise BadRecordError("oversize_field", where, field,
                             f"{len(text):,} characters, over the cap of {caps[cap_name]:,} "
                             f"(data.field_caps.{cap_name})")


def parse_record(raw: Any, *, default_id: str, default_split: str = "", where: str | None = None,
                 require_scores: bool = True, caps: Mapping[str, int] | None = None) -> Record:
    """A typed record from one raw JSON object; raises BadRecordError (image not checked).

    ``require_scores``: a feedback without a score is a bad record (``no_score``). The teacher learns
    and is judged on scores; the student needs only the feedback text, so its data passes False and
    keeps such records (the turn's ``score`` is None). ``caps``: :func:`field_caps` (default
    :data:`FIELD_CAPS`); a longer field is ``oversize_field``.
    """
    where = where or default_id
    caps = FIELD_CAPS if caps is None else caps
    if not isinstance(raw, dict):
        raise BadRecordError("missing_field", where, "<record>", f"expected a JSON object, got {type(raw).__name__}")
    record_id = str(raw.get("id") or default_id)
    _check_size(where, "id", record_id, caps, "id")
    where = where if raw.get("id") is None else f"{where} (id {record_id!r})"
    undecodable = _first_undecodable(raw)
    if undecodable:
        raise BadRecordError("invalid_utf8", where, undecodable, "bytes that are not UTF-8")
    image = raw.get("image", raw.get("img_path"))
    if image is not None and not isinstance(image, str):
        raise BadRecordError("missing_field", where, "image", f"expected a path, got {image!r}")
    if image is not None:
        _check_size(where, "image", image, caps, "image")
    source = str(raw.get("source") or "unknown")
    split = str(raw.get("split") or default_split)
    messages = raw.get("conversations")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRecordError("missing_field", where, "conversations", "expected a non-empty list of messages")
    if len(messages) > caps["messages"]:
        raise BadRecordError("oversize_field", where, "conversations",
                             f"{len(messages):,} messages, over the cap of {caps['messages']:,} "
                             f"(data.field_caps.messages)")
    for i, message in enumerate(messages):
        if isinstance(_text(message), str):
            _check_size(where, f"conversations[{i}].value", _text(message), caps, "message")
    if "question" in raw:
        return _parse_fire(raw, messages, record_id, image, source, split, where, require_scores, caps)
    return _parse_instruction(messages, record_id, image, source, split, where)


def _parse_fire(raw, messages, record_id, image, source, split, where, require_scores, caps) -> Conversation:
    if image is None:
        raise BadRecordError("missing_field", where, "image")
    texts = {}
    for field in ("question", "groundtruth"):
        if field not in raw or _text(raw[field]) is None:
            raise BadRecordError("missing_field", where, field)
        _check_size(where, field, _text(raw[field]), caps, field)
        texts[field] = _text(raw[field]).strip()
        if field == "question":
            texts[field] = strip_image_placeholder(texts[field])
        if not texts[field]:
            raise BadRecordError("empty_text", where, field)
    if len(messages) % 2:
        raise BadRecordError("bad_turn_order", where, "conversations",
                             f"{len(messages)} messages; turns alternate student, teacher and end with feedback")
    expected = (("student", "response"), ("teacher", "feedback"))
    values = []
    for i, message in enumerate(messages):
        role, kind = expected[i % 2]
        if _role(message) != role or str(message.get("type", kind)).lower() != kind:
            raise BadRecordError("bad_turn_order", where, f"conversations[{i}].role",
                                 f"expected {role}/{kind}, got {_role(message) or None}/{message.get('type')}")
        value = _text(message)
        if value is None:
            raise BadRecordError("missing_field", where, f"conversations[{i}].value")
        if not value.strip():
            raise BadRecordError("empty_text", where, f"conversations[{i}].value")
        values.append(value.strip())
    turns = []
    for i in range(0, len(values), 2):
        score = parse_score(values[i + 1])
        if score is None and require_scores:
            raise BadRecordError("no_score", where, f"conversations[{i + 1}].value", repr(values[i + 1][:60]))
        if not feedback_text(values[i + 1]):
            raise BadRecordError("empty_text", where, f"conversations[{i + 1}].value", "no feedback after the score")
        turns.append(Turn(response=values[i], feedback=values[i + 1], score=score))
    return Conversation(id=record_id, image=image, question=texts["question"], groundtruth=texts["groundtruth"],
                        turns=tuple(turns), source=source, split=split)


def to_raw(record_id: str, image: str | None, question: str, groundtruth: str, turns: Sequence[Turn], *,
           source: str, split: str) -> dict:
    """A FIRE conversation as a raw record of the released schema (FIRE-train-100K.json): what
    :func:`parse_record` reads back. ``score`` lists each turn's parsed score (None where there is none)."""
    conversations = []
    for turn in turns:
        conversations += [{"role": "student", "type": "response", "value": turn.response},
                          {"role": "teacher", "type": "feedback", "value": turn.feedback}]
    return {"id": record_id, "image": image,
            "question": {"role": "user", "value": question},
            "groundtruth": {"role": "user", "value": groundtruth},
            "conversations": conversations, "source": source, "round": len(turns),
            "score": [t.score for t in turns], "split": split}


_INSTRUCTION_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _parse_instruction(messages, record_id, image, source, split, where) -> Instruction:
    parsed = []
    for i, message in enumerate(messages):
        role = _INSTRUCTION_ROLES.get(_role(message))
        if role != ("user", "assistant")[i % 2]:
            raise BadRecordError("bad_turn_order", where, f"conversations[{i}].from",
                                 f"expected {('human', 'gpt')[i % 2]}, got {_role(message) or None}")
        value = _text(message)
        if value is None:
            raise BadRecordError("missing_field", where, f"conversations[{i}].value")
        value = strip_image_placeholder(value) if role == "user" else value.strip()
        if not value:
            raise BadRecordError("empty_text", where, f"conversations[{i}].value")
        parsed.append((role, value))
    if parsed[-1][0] != "assistant":
        raise BadRecordError("bad_turn_order", where, "conversations", "the last message must be the assistant's")
    return Instruction(id=record_id, image=image, messages=tuple(parsed), source=source, split=split)


def load_records(
    paths: str | Sequence[str],
    image_root: str,
    *,
    on_bad_record: str = "skip",
    split: str = "",
    decode_images: bool = False,
    bad: BadRecords | None = None,
    require_scores: bool = True,
    caps: Mapping[str, int] | None = None,
) -> tuple[list[Record], BadRecords]:
    """Parse FIRE / instruction files into typed records, checking every image.

    Args:
      paths: JSON-array or JSONL files.
      image_root: directory the records' image paths are relative to.
      on_bad_record: "skip" (count by reason) or "error" (raise BadRecordError).
      split: the split of records that name none.
      decode_images: decode every image fully (slow) instead of reading its header.
      bad: a counter to add to.
      require_scores: skip conversations with an unscoreable feedback (``no_score``); False keeps them.
      caps: the most characters per field (:func:`field_caps`; default :data:`FIELD_CAPS`).

    Returns:
      (records, bad record counts).
    """
    bad = BadRecords() if bad is None else bad
    records = [record for record, _ in iter_records(paths, image_root, on_bad_record=on_bad_record, split=split,
                                                    decode_images=decode_images, bad=bad,
                                                    require_scores=require_scores, caps=caps)]
    return records, bad


def iter_records(paths, image_root, *, on_bad_record="skip", split="", decode_images=False, bad=None,
                 require_scores=True, caps=None):
    """Like :func:`load_records`, streaming (record, absolute image path or None)."""
    if on_bad_record not in ("skip", "error"):
        raise ValueError(f"on_bad_record must be 'skip' or 'error', got {on_bad_record!r}")
    bad = BadRecords() if bad is None else bad
    caps = field_caps(caps)

    def parse(raw: dict, where: str, default_id: str) -> tuple[Record, str | None]:
        record = parse_record(raw, default_id=default_id, default_split=split, where=where,
                              require_scores=require_scores, caps=caps)
        if record.id != default_id:
            where = f"{where} (id {record.id!r})"
        return record, check_image(record, image_root, where, decode=decode_images)

    for path in [paths] if isinstance(paths, str) else paths:
        yield from read_objects(path, parse, bad=bad, on_bad_record=on_bad_record)
