"""FIRE-1M-style generation (FIRE Fig. 3b): a student and a teacher talk about (I, q, gt) triplets in the dialogue
loop (:func:`fire_jax.dialogue.loop.run_dialogues`) under :data:`fire_jax.dialogue.stop.FIRE_1M_GENERATION`'s rule
(stop at 8 or after 3 turns, no "no_increase" stop); each dialogue is written as a raw record in the schema of the
FIRE release's data (:func:`fire_record`, docs/spec.md, "Records") and kept or dropped by
:func:`fire_jax.data.filters.drop_reason`, the rule FIRE-100K-style generation (:mod:`fire_jax.dialogue.fire100k`)
uses too: kept only if its last score is higher than its first (dialogues solved at once teach no refinement) and
it parses through :func:`fire_jax.data.records.parse_record` (empty texts, feedback without "Feedback:" text, ...
are dropped, by reason).

Kept records go to a JSONL file, dropped dialogues (id, reason, scores) to ``<out>.dropped.jsonl``; a rerun skips
the ids in either.
"""

from __future__ import annotations

import os
from typing import Sequence

from fire_jax.core.results import ResultStore
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.filters import drop_reason
from fire_jax.data.items import Item
from fire_jax.data.records import to_raw
from fire_jax.dialogue.loop import Dialogue, run_dialogues
from fire_jax.dialogue.stop import FIRE_1M_GENERATION, StopRule


def fire_record(dialogue: Dialogue, *, split: str = "fire_1m", image_root: str = "") -> dict:
    """A dialogue as a raw FIRE record (the release's JSON schema, docs/spec.md); the image path relative to ``image_root``."""
    item = dialogue.item
    image = os.path.relpath(item.image, image_root) if image_root and item.image_path else item.image_path
    return to_raw(item.id, image, item.question, item.groundtruth, dialogue.turns, source=item.source, split=split)


def make_fire_records(items: Sequence[Item], student, teacher, out_path: str, *, image_root: str = "",
                     split: str = "fire_1m", rule: StopRule = FIRE_1M_GENERATION, batch_size: int = 8,
                     rng=None) -> tuple[int, BadRecords]:
    """Talk about every item not yet done; returns (records kept in total, dropped dialogues by reason).

    ``out_path``: JSONL of kept records (the FIRE record schema); ``out_path + ".dropped.jsonl"``: the dropped ones.
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
                reason = drop_reason(record)  # the rule's max_turns already ended the dialogue
                if reason is None:
                    kept.add(record)
                else:
                    dropped.add(reason)
                    rejected.add({"id": record["id"], "reason": reason.reason, "scores": dialogue.scores})
                progress.update(1)
                progress.set_postfix(kept=len(kept))

            run_dialogues(todo, student, teacher, rule, batch_size=batch_size, on_finish=finish, rng=rng)
        return len(kept), dropped
