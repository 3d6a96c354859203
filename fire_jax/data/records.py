"""Typed FIRE conversations and instruction records, parsed from released files.

A FIRE record (the released FIRE files' schema, docs/data.md) is one conversation {I, q, gt, [(r_1, f_1), ...,
(r_n, f_n)]}; a LLaVA-665K-style instruction record is a list of human/gpt
messages about an optional image. Files are JSON arrays or JSONL. Records that
cannot be used are skipped and counted by reason (:class:`BadRecords`), or
raise :class:`BadRecordError` naming file, record and field under
``on_bad_record="error"``.

Texts are stripped of surrounding whitespace, as Llama-3's chat template trims
message contents; the stripped text is what a labelled span decodes back to.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import re
from typing import Any, Iterator, Mapping, Sequence

from PIL import Image

from fire_jax.config import InputError, json_error_at

# Reasons a record is skipped at parse time: invalid_json, invalid_utf8, oversize_field, missing_field,
# missing_image, image_outside_root, unreadable_image, bad_turn_order, empty_text, and no_score where scores are
# required (the teacher's data, the evaluations); the pipeline adds image_cut, no_labelled_token (and no_score for
# a teacher reading a built split).

#: The most characters a record's field may hold (``oversize_field`` past it), and the most messages in its
#: ``conversations``; ``config.data.field_caps`` overrides any of them. A FIRE text is at most a few thousand
#: characters and training cuts sequences at ``data.max_len`` tokens: a field far past that is a broken record,
#: which would otherwise cost the tokenizer its whole length.
FIELD_CAPS = dict(id=1_024, image=4_096, question=65_536, groundtruth=65_536, message=65_536, messages=1_024)
_SURROGATE = re.compile("[\ud800-\udfff]")  # a byte that is not UTF-8, as surrogateescape decodes it

IMAGE_PLACEHOLDER = "<image>"
_SCORE_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


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


class BadRecordError(InputError):
    """A record that cannot be used, under ``on_bad_record="error"``."""

    def __init__(self, reason: str, where: str, field: str, detail: str = ""):
        self.reason, self.where, self.field = reason, where, field
        super().__init__(f"{where}: field {field!r}: {reason}" + (f" ({detail})" if detail else ""))


class BadRecords(collections.Counter):
    """Counts of skipped records by reason, with the first offender of each reason."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first: dict[str, str] = {}

    def add(self, error: BadRecordError) -> None:
        self[error.reason] += 1
        self.first.setdefault(error.reason, str(error))

    def handle(self, error: BadRecordError, on_bad_record: str) -> None:
        """The one skip-or-raise rule: raise ``error`` under ``on_bad_record="error"``, else count it."""
        if on_bad_record == "error":
            raise error
        if on_bad_record != "skip":
            raise ValueError(f"on_bad_record must be 'skip' or 'error', got {on_bad_record!r}")
        self.add(error)

    def merge(self, other: "BadRecords") -> None:
        self.update(other)
        for reason, example in getattr(other, "first", {}).items():
            self.first.setdefault(reason, example)

    def report(self, title: str = "bad records") -> str:
        if not self:
            return f"{title}: none"
        lines = [f"{title}: {sum(self.values())}"]
        for reason, count in sorted(self.items()):
            example = self.first.get(reason)
            lines.append(f"  {reason:<18} {count:>8}" + (f"   e.g. {example}" if example else ""))
        return "\n".join(lines)


#: How a score is read from a feedback text (:func:`parse_score`): "robust" (default) or "official" (the release's).
SCORE_PARSERS = ("robust", "official")
_RELEASE_SCORE = re.compile(r"\d+")


def parse_score(feedback: str, parser: str = "robust") -> float | None:
    """The score a_i of a feedback text (docs/spec.md, "Records and scores").

    robust (default): the first number (integer or decimal) on the first line
    that contains "Score:"; no such line, or a number outside 0..10, gives
    None. "Score: 8/10." gives 8, "Score: 7.5" gives 7.5.

    official: the release's ``get_score`` (MM-FIRE/FIRE,
    ``llava/eval/feedback_chat.py``): the text's first line must contain
    "Score:" and the first run of digits on it (``re.findall(r"\\d+", ...)[0]``)
    is the score, with no range check; else None. "Score: 7.5" gives 7,
    "Score: 11" gives 11, "Score: -2" gives 2, a score line after another
    line gives None. What the release's evaluations add to it (a "Feedback:"
    the fixed dialogues need, a failure read as 0 that stops a free dialogue)
    is in :mod:`fire_jax.eval.fixed` and :class:`fire_jax.infer.dialogue.StopRule`.
    """
    if parser == "official":
        lines = feedback.splitlines()
        numbers = _RELEASE_SCORE.findall(lines[0]) if lines and "Score:" in lines[0] else []
        return int(numbers[0]) if numbers else None
    if parser != "robust":
        raise ValueError(f"score parser must be one of {list(SCORE_PARSERS)}, got {parser!r}")
    for line in feedback.splitlines():
        if "Score:" in line:
            match = _SCORE_NUMBER.search(line)
            if match is None:
                return None
            value = float(match.group())
            if not 0 <= value <= 10:
                return None
            return int(value) if value.is_integer() else value
    return None


def feedback_text(feedback: str) -> str:
    """The part of a feedback shown to the student: what follows "Feedback:".

    Without a "Feedback:" marker, the feedback minus its score line.
    """
    head, marker, tail = feedback.partition("Feedback:")
    if marker:
        return tail.strip()
    return "\n".join(line for line in feedback.splitlines() if "Score:" not in line).strip()


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


def improved(scores: Sequence[float | None]) -> bool:
    """The paper's filter on generated conversations (FIRE Sec. 3.2): the last score is higher than the first."""
    return scores[-1] is not None and scores[0] is not None and scores[-1] > scores[0]


#: Why a generated conversation is not kept, checked in this order before the schema (then :func:`parse_record`'s
#: reasons): its last feedback has no score, it has more turns than allowed, its last score is not above its first.
FILTER_REASONS = ("no_score", "too_many_turns", "no_improvement")


def drop_reason(record: dict, *, max_turns: int | None = None) -> BadRecordError | None:
    """Why a generated conversation is not kept, or None: the one keep/drop rule of FIRE-1M-style dialogues
    (:func:`fire_jax.infer.dialogue.make_fire_records`) and FIRE-100K-style conversations
    (:mod:`fire_jax.make_fire100k`).

    ``record``: a raw record of :func:`to_raw` (its turns' scores under ``score``). The paper's filters (FIRE
    Sec. 3.2; :data:`FILTER_REASONS`: ``max_turns`` None sets no turn limit), then what :func:`parse_record`
    rejects (empty texts, feedback without text after the score, oversize fields, ...).
    """
    scores, where = record["score"], f"id {record['id']!r}"
    if scores[-1] is None:
        return BadRecordError("no_score", where, f"conversations[{2 * len(scores) - 1}].value", f"scores {scores}")
    if max_turns is not None and len(scores) > max_turns:
        return BadRecordError("too_many_turns", where, "conversations", f"{len(scores)} turns > {max_turns}")
    if not improved(scores):
        return BadRecordError("no_improvement", where, "score", f"scores {scores}")
    try:
        parse_record(record, default_id=record["id"])
    except BadRecordError as e:
        return e
    return None


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


def image_size_of(path_or_bytes: str | bytes, *, decode: bool = False) -> tuple[int, int]:
    """(height, width) of an image file, reading the header (or everything with ``decode``)."""
    stream = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with Image.open(stream) as image:
        if decode:
            image.load()
        return image.height, image.width


def outside_root(image_root: str, image: str) -> str | None:
    """Why ``image`` (a path relative to ``image_root``) leads out of the root, or None when it does not: the one
    check of every tool that reads images named by its input (training and evaluation data, batch prompts,
    VLRMBench records). An absolute path or one whose ``..`` climbs out is refused by its name, before anything
    is looked at; one that leads out through a symbolic link (``images/x.jpg -> /elsewhere/x.jpg``, or a linked
    folder on the way) by where it resolves to (``os.path.realpath``), compared with the resolved root."""
    root = os.path.normpath(os.path.abspath(image_root or "."))
    path = os.path.normpath(os.path.join(root, image))
    if os.path.isabs(image) or os.path.commonpath([root, path]) != root:
        return f"{image!r} is not inside the image root {root}"
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        return f"{image!r} is a symbolic link out of the image root {root} (to {real})"
    return None


def image_path(image_root: str, image: str, where: str) -> str:
    """``image`` joined to ``image_root``; ``image_outside_root`` when it leads out of the root
    (:func:`outside_root`)."""
    if "\0" in image:
        raise BadRecordError("missing_field", where, "image", "the path holds a NUL character")
    why = outside_root(image_root, image)
    if why:
        raise BadRecordError("image_outside_root", where, "image", why)
    return os.path.normpath(os.path.join(os.path.abspath(image_root or "."), image))


def check_image(record: Record, image_root: str, where: str, *, decode: bool = False) -> str | None:
    """The absolute image path of a record; raises image_outside_root / missing_image / unreadable_image."""
    if record.image is None:
        return None
    path = image_path(image_root, record.image, where)
    if not os.path.isfile(path):
        raise BadRecordError("missing_image", where, "image", path)
    try:
        image_size_of(path, decode=decode)
    except Exception as e:  # PIL raises many types for broken files
        raise BadRecordError("unreadable_image", where, "image", f"{path}: {e}") from None
    return path


_JSON_WHITESPACE = " \t\n\r"


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
    index = 0
    with open(path, "rb") as f:
        for line_number, raw_line in enumerate(f, 1):
            line = raw_line.decode("utf-8", "surrogateescape")
            if line_number == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as e:
                where = f"{path}: record {index} (line {line_number})"
                cut = "" if raw_line.endswith(b"\n") else ", the file's last line, cut short?"
                yield index, BadRecordError("invalid_json", where, "<line>", f"{e}{cut}")
            except RecursionError:
                yield index, BadRecordError("invalid_json", f"{path}: record {index} (line {line_number})", "<line>",
                                            "nested too deeply")
            index += 1


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
    for path in [paths] if isinstance(paths, str) else paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        for index, raw in iter_raw(path):
            try:
                if isinstance(raw, BadRecordError):
                    raise raw
                where = f"{path}: record {index}"
                record = parse_record(raw, default_id=f"{stem}:{index}", default_split=split, where=where,
                                      require_scores=require_scores, caps=caps)
                if record.id != f"{stem}:{index}":
                    where = f"{where} (id {record.id!r})"
                image_path = check_image(record, image_root, where, decode=decode_images)
            except BadRecordError as e:
                bad.handle(e, on_bad_record)
                continue
            yield record, image_path
