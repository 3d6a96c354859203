"""Fixed dialogues: generate each labelled turn from the ground-truth history (FIRE Tables 2-3).

For a test conversation {I, q, gt, [(r_1, f_1), ..., (r_n, f_n)]}:

- the student generates r_k for k >= 2 (the turns its loss labels, Eq. 5;
  ``student_first_turn`` adds k = 1) from I, q and the true (r_j, f_j), j < k;
- the teacher generates f_k for k >= 1 (Eq. 6) from I, q, gt, the true
  earlier turns (``history="full"``, as trained) and the true r_k.

Student predictions are compared with r_k, teacher predictions with f_k:
BLEU-1..4 and CIDEr, plus the teacher's score MAE (a reply with no score
costs 10). Overall and per source dataset. Every generated turn is appended
to a JSONL file as its batch finishes; a rerun skips those keys.

Two switches, both applied when the metrics are computed (no new generation):

- ``teacher_text``: what of f_k the teacher's BLEU/CIDEr compare (:data:`TEACHER_TEXTS`).
- ``score_parser``: how the MAE reads a score. "robust" (default) is
  :func:`fire_jax.data.scores.parse_score`; "official" is the release's
  ``eval_feedback.py`` (MM-FIRE/FIRE, ``llava/eval/``), which reads a reply
  with ``get_score`` and ``get_feedback`` in one step (:func:`release_reading`):
  a reply without a "Feedback:" has no score either (it costs 10), and a
  reference it cannot read scores -1, as the release's label list holds.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from fire_jax.data.records import Conversation
from fire_jax.data.scores import SCORE_PARSERS, parse_score
from fire_jax.eval.metrics import score_mae, text_metrics
from fire_jax.core.results import ResultStore

ROLES = ("student", "teacher")


@dataclasses.dataclass(frozen=True)
class FixedTurn:
    """One labelled turn k of a test conversation, for one role."""

    record: Conversation
    image: str | bytes
    role: str  # "student": generate r_k; "teacher": generate f_k
    turn: int  # k, from 1

    @property
    def key(self) -> str:
        return f"{self.record.id}/{self.role}/{self.turn}"


def labelled_turns(pairs: Sequence[tuple[Conversation, str | bytes]], roles: Sequence[str] = ROLES, *,
                   student_first_turn: bool = False) -> list[FixedTurn]:
    """Every (conversation, role, k) to generate, grouped by role, then turn (similar prompt lengths batch)."""
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"fixed.roles: unknown role(s) {sorted(unknown)}; known: {ROLES}")
    first = {"student": 1 if student_first_turn else 2, "teacher": 1}
    turns = [FixedTurn(record, image, role, k)
             for role in roles for record, image in pairs for k in range(first[role], len(record.turns) + 1)]
    return sorted(turns, key=lambda t: (ROLES.index(t.role), t.turn))


def _generate(turns: Sequence[FixedTurn], student, teacher, rng) -> list[tuple[str, float | None]]:
    """(prediction, its parsed score for the teacher) of one batch of turns of one role."""
    images = [t.image for t in turns]
    questions = [t.record.question for t in turns]
    histories = [t.record.turns[:t.turn - 1] for t in turns]
    if turns[0].role == "student":
        return [(text, None) for text in student.respond(images, questions, histories, rng=rng)]
    answers = [t.record.turns[t.turn - 1].response for t in turns]
    feedbacks = teacher.feedback(images, questions, [t.record.groundtruth for t in turns], answers, histories,
                                 rng=rng)
    return [(f.text, f.score) for f in feedbacks]


def turn_record(turn: FixedTurn, prediction: str, predicted_score: float | None) -> dict:
    """One generated turn as a JSON object: the prediction beside the ground truth."""
    truth = turn.record.turns[turn.turn - 1]
    teacher = turn.role == "teacher"
    return {"key": turn.key, "id": turn.record.id, "source": turn.record.source, "role": turn.role,
            "turn": turn.turn, "groundtruth": turn.record.groundtruth,
            "answer": truth.response if teacher else None,  # the r_k the teacher scored
            "prediction": prediction, "reference": truth.feedback if teacher else truth.response,
            "predicted_score": predicted_score if teacher else None,
            "reference_score": truth.score if teacher else None}


def run_fixed(turns: Sequence[FixedTurn], student, teacher, path: str, *, batch_size: int = 8,
              rng=None) -> list[dict]:
    """Generate every turn not yet in the JSONL file ``path``; returns all turn records in ``turns`` order.

    Batches hold one role and at most ``batch_size`` rows (agents built with that ``batch_size`` keep one
    engine of that many slots for every batch). ``rng``: a JAX key for sampling, folded with the
    batch index (None for greedy decoding).
    """
    from tqdm.auto import tqdm

    with ResultStore(path) as store:
        todo = [t for t in turns if t.key not in store]
        print(f"fixed dialogues: {len(turns)} turns, {len(turns) - len(todo)} already in {path}, "
              f"{len(todo)} to generate")
        batches = [chunk for role in ROLES for chunk in _chunks([t for t in todo if t.role == role], batch_size)]
        with tqdm(total=len(turns), initial=len(turns) - len(todo), desc="fixed dialogues", unit="turn",
                  dynamic_ncols=True) as progress:
            for index, batch in enumerate(batches):
                key = None if rng is None else _fold(rng, index)
                for turn, (text, score) in zip(batch, _generate(batch, student, teacher, key), strict=True):
                    store.add(turn_record(turn, text, score))
                progress.update(len(batch))
        return [store[t.key] for t in turns]


def _chunks(values: list, size: int) -> list[list]:
    return [values[i:i + size] for i in range(0, len(values), size)]


def _fold(rng, index: int):
    import jax

    return jax.random.fold_in(rng, index)


#: What of the teacher's feedback BLEU/CIDEr compare (``fixed.teacher_text``): "feedback" (default) the text after
#: "Feedback:", as the release's ``analyze_feedback.py`` compares the ``feedback_predictions`` / ``feedback_labels``
#: that ``eval_feedback.py`` wrote (:func:`release_reading`; "" for a reply it cannot read); "whole" the reply as
#: written, score line included.
TEACHER_TEXTS = ("feedback", "whole")


def release_reading(text: str) -> tuple[float | None, str]:
    """(score, feedback) of a teacher reply as the release's fixed-dialogue evaluation reads it.

    ``eval_feedback.py`` calls ``get_score`` (:func:`parse_score` with
    ``parser="official"``) and ``get_feedback`` (the text after the first
    "Feedback:", stripped) in one ``try``; when either fails the turn gets
    score -1 (MAE 10) and feedback "". So (None, "") unless the first line
    gives a score and the reply has a "Feedback:".
    """
    score = parse_score(text, "official")
    _, marker, feedback = text.partition("Feedback:")
    if score is None or not marker:
        return None, ""
    return score, feedback.strip()


def _role_metrics(records: Sequence[Mapping], teacher_text: str = "feedback", score_parser: str = "robust") -> dict:
    teacher = records[0]["role"] == "teacher"
    compared = (lambda text: release_reading(text)[1]) if teacher and teacher_text == "feedback" else (lambda t: t)
    metrics = text_metrics([compared(r["prediction"]) for r in records], [compared(r["reference"]) for r in records])
    if teacher:
        if score_parser == "official":
            predicted = [release_reading(r["prediction"])[0] for r in records]
            reference = [release_reading(r["reference"])[0] for r in records]
            reference = [-1 if score is None else score for score in reference]  # the release's label -1
        else:
            predicted = [r["predicted_score"] for r in records]
            reference = [r["reference_score"] for r in records]
        metrics["teacher_text"], metrics["score_parser"] = teacher_text, score_parser
        metrics["MAE"] = score_mae(predicted, reference)
        metrics["no_score"] = sum(score is None for score in predicted)
    metrics["n"] = len(records)
    return metrics


def fixed_results(records: Sequence[Mapping], *, teacher_text: str = "feedback", score_parser: str = "robust") -> dict:
    """{role: {"overall": metrics, "per_source": {source: metrics}}} for each role with turns (FIRE Tables 2-3).

    metrics: BLEU-1..4, CIDEr and n (turns); the teacher adds MAE, no_score (replies without a score),
    ``teacher_text`` (:data:`TEACHER_TEXTS`: what its BLEU/CIDEr compared) and ``score_parser`` (how the MAE
    read the scores; see the module's docstring).
    """
    if teacher_text not in TEACHER_TEXTS:
        raise ValueError(f"fixed.teacher_text must be one of {TEACHER_TEXTS}, got {teacher_text!r}")
    if score_parser not in SCORE_PARSERS:
        raise ValueError(f"fixed.score_parser must be one of {SCORE_PARSERS}, got {score_parser!r}")
    results = {}
    for role in ROLES:
        mine = [r for r in records if r["role"] == role]
        if not mine:
            continue
        by_source = collections.defaultdict(list)
        for record in mine:
            by_source[record["source"]].append(record)
        results[role] = {"overall": _role_metrics(mine, teacher_text, score_parser),
                         "per_source": {s: _role_metrics(group, teacher_text, score_parser)
                                        for s, group in sorted(by_source.items())}}
    return results
