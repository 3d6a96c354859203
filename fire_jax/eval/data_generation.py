"""FIRE-1M-style data: the student and the teacher talk about (I, q, gt) triplets (SPEC 6, Fig. 3b).

The free-dialogue loop (:func:`fire_jax.eval.free.run_dialogues`) with
:data:`fire_jax.eval.free.FIRE_1M_GENERATION`'s rule: stop when a score is
>= 8 or after 3 turns (or when a reply has no score). A dialogue is kept
only if its last score is higher than its first (dialogues solved at once
teach no refinement); each kept one is written as a raw record in the schema
of SPEC section 3 and must parse through :func:`fire_jax.data.records.parse_record`
(empty texts, feedback without "Feedback:" text, ... are dropped, by reason).

Kept records go to a JSONL file, dropped dialogues (id, reason, scores) to
``<out>.dropped.jsonl``; a rerun skips the ids in either.
"""

from __future__ import annotations

import os
from typing import Sequence

from fire_jax.data.records import BadRecordError, BadRecords, parse_record
from fire_jax.eval.bench_io import Item, ResultStore
from fire_jax.eval.free import FIRE_1M_GENERATION, Dialogue, StopRule, run_dialogues


def fire_record(dialogue: Dialogue, *, split: str = "fire_1m", image_root: str = "") -> dict:
    """A dialogue as a raw FIRE record (SPEC 3); the image path relative to ``image_root``."""
    item = dialogue.item
    image = os.path.relpath(item.image, image_root) if image_root and item.image_path else item.image_path
    conversations = []
    for turn in dialogue.turns:
        conversations += [{"role": "student", "type": "response", "value": turn.response},
                          {"role": "teacher", "type": "feedback", "value": turn.feedback}]
    return {"id": item.id, "image": image,
            "question": {"role": "user", "value": item.question},
            "groundtruth": {"role": "user", "value": item.groundtruth},
            "conversations": conversations, "source": item.source, "round": len(dialogue.turns),
            "score": dialogue.scores, "split": split}


def drop_reason(dialogue: Dialogue, record: dict) -> BadRecordError | None:
    """Why a generated dialogue is not kept: no score, no improvement, or what the record parser rejects."""
    scores = dialogue.scores
    if scores[-1] is None:
        return BadRecordError("no_score", f"id {record['id']!r}", f"conversations[{2 * len(scores) - 1}].value",
                              f"scores {scores}")
    if not scores[-1] > scores[0]:
        return BadRecordError("no_improvement", f"id {record['id']!r}", "score", f"scores {scores}")
    try:
        parse_record(record, default_id=record["id"])
    except BadRecordError as e:
        return e
    return None


def generate_records(items: Sequence[Item], student, teacher, out_path: str, *, image_root: str = "",
                     split: str = "fire_1m", rule: StopRule = FIRE_1M_GENERATION, batch_size: int = 8,
                     rng=None) -> tuple[int, BadRecords]:
    """Talk about every item not yet done; returns (records kept in total, dropped dialogues by reason).

    ``out_path``: JSONL of kept records (SPEC 3 schema); ``out_path + ".dropped.jsonl"``: the dropped ones.
    """
    from tqdm.auto import tqdm

    dropped = BadRecords()
    with ResultStore(out_path, key_field="id") as kept, ResultStore(out_path + ".dropped.jsonl",
                                                                   key_field="id") as rejected:
        for record in rejected:
            dropped[record["reason"]] += 1
        todo = [item for item in items if item.id not in kept and item.id not in rejected]
        print(f"FIRE-1M-style generation: {len(items)} triplets, {len(items) - len(todo)} already done "
              f"({len(kept)} kept), {len(todo)} to run")
        with tqdm(total=len(items), initial=len(items) - len(todo), desc="generate", unit="dialogue",
                  dynamic_ncols=True) as progress:
            def finish(dialogue: Dialogue) -> None:
                record = fire_record(dialogue, split=split, image_root=image_root)
                reason = drop_reason(dialogue, record)
                if reason is None:
                    kept.add(record)
                else:
                    dropped.add(reason)
                    rejected.add({"id": record["id"], "reason": reason.reason, "scores": dialogue.scores})
                progress.update(1)
                progress.set_postfix(kept=len(kept))

            run_dialogues(todo, student, teacher, rule, batch_size=batch_size, on_finish=finish, rng=rng)
        return len(kept), dropped

