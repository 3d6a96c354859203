"""The dialogue engine: a student and a teacher talk about items until a stop rule ends each dialogue.

Evaluation (FIRE-Bench free dialogues, Tables 4-6) and data generation (FIRE-1M-style records, Fig. 3b)
both run this loop; they differ in the :class:`StopRule` and in what they keep.

Per item: the student answers (r_k), the teacher scores it (f_k, a_k), and
:func:`stop_reason` decides whether the dialogue goes on:

- a_k is None (the teacher's reply has no score): stop, ``"no_score"`` (counts as 0);
- a_k >= threshold (8): stop, ``"solved"``;
- a_k = 0 with the release's score reading (``score_parser="official"``): stop, ``"zero_score"``;
- k > 1 and a_k <= a_{k-1}: stop, ``"no_increase"`` (free dialogues only);
- k = max_turns (5; 3 for generation): stop, ``"max_turns"``.

:func:`run_dialogues` keeps up to ``batch_size`` dialogues in flight: each
step is one batched student call and one batched teacher call over the live
dialogues, each at its own turn; a finished dialogue leaves the batch and the
next item takes its place. Agents on the continuous-batching engine keep each
dialogue's keys and values from one step to the next (prefix caching,
:mod:`fire_jax.infer.prefix_cache`): the student's prompt at turn k begins
with its prompt at turn k - 1 and r_{k-1}, the teacher's with everything but
the answer it scores, so each call prefills only what changed.

:func:`make_fire_records` is FIRE-1M-style generation: :data:`FIRE_1M_GENERATION`'s
rule (stop at 8 or after 3 turns, no "no_increase" stop); each dialogue is written as a raw record in the schema
of the FIRE release's data (docs/spec.md, "Records") and kept or dropped by
:func:`fire_jax.data.filters.drop_reason`, the rule FIRE-100K-style generation uses too: kept only if its last
score is higher than its first (dialogues solved at once teach no refinement) and it parses through
:func:`fire_jax.data.records.parse_record` (empty texts, feedback without "Feedback:" text, ... are dropped, by
reason).
Kept records go to a JSONL file, dropped dialogues (id, reason, scores) to
``<out>.dropped.jsonl``; a rerun skips the ids in either.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Callable, Iterable, Sequence

from fire_jax.data.items import Item
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.filters import drop_reason
from fire_jax.data.records import Turn, to_raw
from fire_jax.data.scores import SCORE_PARSERS, parse_score
from fire_jax.core.results import ResultStore


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a dialogue ends (solved, no score increase, or the turn limit: docs/spec.md), and how it reads the teacher's score.

    ``score_parser``: "robust" keeps the score the teacher agent read
    (:func:`fire_jax.data.scores.parse_score`'s default); "official" reads
    each reply as the release's free-dialogue loader does (MM-FIRE/FIRE,
    ``llava/eval/model_fire_chat_loader.py``): ``get_score`` (a failure is
    its score 0, here None), and a dialogue whose last score is 0 stops
    (``CustomDataset`` drops an item whose last score is >= 8 or == 0, or
    not above the one before, from the next round).

    The one owner of the stop threshold: the dialogue loop, the metrics (AT, RR, the accuracy curve), the
    exact judge's "the teacher says right" (:meth:`solves`), and every report, plot label and analysis read it
    from the rule they ran with. A free-dialogue config section sets every field (:meth:`from_config`;
    docs/fire_bench.md, "Settings"). The rule of the release's interactive chat (MM-FIRE/FIRE,
    ``llava/eval/feedback_chat.py``: ``Chat.chat`` runs ``num_round=3`` rounds and ``should_stop`` ends only on
    a score of 10) is ``StopRule(max_turns=3, threshold=10, stop_on_no_increase=False)``, in a config
    ``free.max_turns=3, free.threshold=10.0, free.stop_on_no_increase=False``.
    """

    max_turns: int = 5  # n_max
    threshold: float = 8.0  # a score >= threshold solves the item
    stop_on_no_increase: bool = True  # stop when a_k <= a_{k-1}
    score_parser: str = "robust"  # or "official" (above)

    @classmethod
    def from_config(cls, section) -> "StopRule":
        """The rule of a free-dialogue config section (``config.free``): each of this class's fields the section
        names, the defaults for the others; the section's other settings (``penalty_turns``, ...) are not the
        rule's."""
        return cls(**{field.name: section[field.name] for field in dataclasses.fields(cls) if field.name in section})

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.score_parser not in SCORE_PARSERS:
            raise ValueError(f"score_parser must be one of {list(SCORE_PARSERS)}, got {self.score_parser!r}")

    def solves(self, score: float | None) -> bool:
        """a_k solves the item (a score >= :attr:`threshold`; no score never does): the dialogue stops as
        ``"solved"``, the metrics count the item as solved, the exact judge reads it as the teacher saying
        "right"."""
        return score is not None and score >= self.threshold

    def score(self, feedback) -> float | None:
        """a_k of a teacher's reply (``feedback.text``, ``feedback.score``) under this rule's reading."""
        return feedback.score if self.score_parser == "robust" else parse_score(feedback.text, self.score_parser)


FREE_DIALOGUE = StopRule()  # free dialogues (Tables 4-6)
FIRE_1M_GENERATION = StopRule(max_turns=3, stop_on_no_increase=False)  # FIRE-1M-style data (Fig. 3b)
STOP_REASONS = ("no_score", "solved", "zero_score", "no_increase", "max_turns")


def stop_reason(scores: Sequence[float | None], rule: StopRule = FREE_DIALOGUE) -> str | None:
    """Why the dialogue with teacher scores a_1..a_k stops after turn k, or None if it goes on."""
    score = scores[-1]
    if score is None:
        return "no_score"
    if rule.solves(score):
        return "solved"
    if rule.score_parser == "official" and score == 0:
        return "zero_score"
    if rule.stop_on_no_increase and len(scores) > 1 and score <= scores[-2]:
        return "no_increase"
    if len(scores) >= rule.max_turns:
        return "max_turns"
    return None


@dataclasses.dataclass
class Dialogue:
    """One item's dialogue so far."""

    item: Item
    turns: list[Turn] = dataclasses.field(default_factory=list)
    stop: str | None = None  # one of STOP_REASONS once finished

    @property
    def scores(self) -> list[float | None]:
        return [turn.score for turn in self.turns]


def run_dialogues(items: Iterable[Item], student, teacher, rule: StopRule, *, batch_size: int,
                  on_finish: Callable[[Dialogue], None], rng=None) -> int:
    """Talk about every item until :func:`stop_reason` stops it; returns the number of steps.

    ``student.respond(images, questions, histories)`` gives r_k and
    ``teacher.feedback(images, questions, groundtruths, answers, histories)``
    gives f_k with its score (:class:`fire_jax.infer.Student` / ``Teacher``).
    Calls carry the live dialogues, at most ``batch_size`` (agents built with that ``batch_size`` keep one
    engine of that many slots for every call). ``on_finish`` gets each dialogue as it ends.
    ``rng``: a JAX key for sampling, folded with the step (None: greedy decoding needs none).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pending, active, step = iter(items), [], 0
    while True:
        active += [Dialogue(item) for item in _take(pending, batch_size - len(active))]
        if not active:
            return step
        images = [d.item.image for d in active]
        questions = [d.item.question for d in active]
        histories = [list(d.turns) for d in active]
        keys = (None, None) if rng is None else _step_keys(rng, step)
        responses = student.respond(images, questions, histories, rng=keys[0])
        feedbacks = teacher.feedback(images, questions, [d.item.groundtruth for d in active], responses, histories,
                                     rng=keys[1])
        for dialogue, response, feedback in zip(active, responses, feedbacks):
            dialogue.turns.append(Turn(response, feedback.text, rule.score(feedback)))
            dialogue.stop = stop_reason(dialogue.scores, rule)
            if dialogue.stop:
                on_finish(dialogue)
        active = [d for d in active if not d.stop]
        step += 1


def _take(iterator, n: int) -> list:
    """The next ``n`` (or fewer, at the end) entries of an iterator."""
    return list(itertools.islice(iterator, max(n, 0)))


def _step_keys(rng, step: int):
    import jax

    key = jax.random.fold_in(rng, step)
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def dialogue_record(dialogue: Dialogue) -> dict:
    """A finished dialogue as one JSON object of the free-dialogue results file."""
    item = dialogue.item
    return {"key": item.id, "id": item.id, "source": item.source, "image": item.image_path,
            "question": item.question, "groundtruth": item.groundtruth, "scores": dialogue.scores,
            "stop": dialogue.stop,
            "turns": [{"response": t.response, "feedback": t.feedback, "score": t.score} for t in dialogue.turns]}


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

