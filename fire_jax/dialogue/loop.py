"""The dialogue loop: a student and a teacher talk about items until a stop rule ends each dialogue.

Evaluation (FIRE-Bench free dialogues, Tables 4-6) and data generation (FIRE-1M-style records, Fig. 3b,
:mod:`fire_jax.dialogue.fire1m`) both run this loop; they differ in the :class:`fire_jax.dialogue.stop.StopRule`
and in what they keep.

Per item: the student answers (r_k), the teacher scores it (f_k, a_k), and
:func:`fire_jax.dialogue.stop.stop_reason` decides whether the dialogue goes on.

:func:`run_dialogues` keeps up to ``batch_size`` dialogues in flight: each
step is one batched student call and one batched teacher call over the live
dialogues, each at its own turn; a finished dialogue leaves the batch and the
next item takes its place. Agents on the continuous-batching engine keep each
dialogue's keys and values from one step to the next (prefix caching,
:mod:`fire_jax.infer.prefix_cache`): the student's prompt at turn k begins
with its prompt at turn k - 1 and r_{k-1}, the teacher's with everything but
the answer it scores, so each call prefills only what changed.

:func:`dialogue_record` is a finished dialogue as one line of the free-dialogue results file.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable

from fire_jax.data.items import Item
from fire_jax.data.records import Turn
from fire_jax.dialogue.stop import StopRule, stop_reason


@dataclasses.dataclass
class Dialogue:
    """One item's dialogue so far."""

    item: Item
    turns: list[Turn] = dataclasses.field(default_factory=list)
    stop: str | None = None  # one of fire_jax.dialogue.stop.STOP_REASONS once finished

    @property
    def scores(self) -> list[float | None]:
        return [turn.score for turn in self.turns]


def run_dialogues(items: Iterable[Item], student, teacher, rule: StopRule, *, batch_size: int,
                  on_finish: Callable[[Dialogue], None], rng=None) -> int:
    """Talk about every item until :func:`stop_reason` stops it; returns the number of steps.

    ``student.respond(images, questions, histories)`` gives r_k and
    ``teacher.feedback(images, questions, groundtruths, answers, histories)``
    gives f_k with its score (:class:`fire_jax.dialogue.Student` / ``Teacher``).
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
