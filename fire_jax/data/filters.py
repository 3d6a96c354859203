"""Which generated conversations are kept: the one keep/drop rule of FIRE-1M-style and FIRE-100K-style data."""

from __future__ import annotations

from typing import Sequence

from fire_jax.data.bad_records import BadRecordError
from fire_jax.data.records import parse_record


def improved(scores: Sequence[float | None]) -> bool:
    """The paper's filter on generated conversations (FIRE Sec. 3.2): the last score is higher than the first."""
    return scores[-1] is not None and scores[0] is not None and scores[-1] > scores[0]


#: Why a generated conversation is not kept, checked in this order before the schema (then :func:`parse_record`'s
#: reasons): its last feedback has no score, it has more turns than allowed, its last score is not above its first.
FILTER_REASONS = ("no_score", "too_many_turns", "no_improvement")


def drop_reason(record: dict, *, max_turns: int | None = None) -> BadRecordError | None:
    """Why a generated conversation is not kept, or None: the one keep/drop rule of FIRE-1M-style dialogues
    (:func:`fire_jax.dialogue.fire1m.make_fire_records`) and FIRE-100K-style conversations
    (:mod:`fire_jax.make_fire100k`).

    ``record``: a raw record of :func:`fire_jax.data.records.to_raw` (its turns' scores under ``score``). The paper's filters (FIRE
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
