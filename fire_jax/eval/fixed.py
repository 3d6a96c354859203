"""Fixed dialogues: generate each labelled turn from the ground-truth history (SPEC 6, Tables 2-3).

For a test conversation {I, q, gt, [(r_1, f_1), ..., (r_n, f_n)]}:

- the student generates r_k for k >= 2 (the turns its loss labels, Eq. 5;
  ``student_first_turn`` adds k = 1) from I, q and the true (r_j, f_j), j < k;
- the teacher generates f_k for k >= 1 (Eq. 6) from I, q, gt, the true
  earlier turns (``history="full"``, as trained) and the true r_k.

Student predictions are compared with r_k, teacher predictions with f_k
(``teacher_text="whole"``, the default: as written, score line included, as
the paper compares with GPT-4V's feedback; ``"feedback"``: only what follows
"Feedback:" on both sides): BLEU-1..4 and CIDEr, plus the teacher's score MAE
(a reply with no score costs 10). Overall and per source dataset. Every generated turn is
appended to a JSONL file as its batch finishes; a rerun skips those keys.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from fire_jax.data.records import Conversation, feedback_text
from fire_jax.eval.metrics import score_mae, text_metrics
from fire_jax.results import ResultStore

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

    Batches hold one role and at most ``batch_size`` rows (agents built with that ``batch_size`` pad a
    short one with inactive rows: one compiled shape). ``rng``: a JAX key for sampling, folded with the
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


#: What of the teacher's feedback BLEU/CIDEr compare (``fixed.teacher_text``): "whole" (default) compares f_k as
#: written, score line included, as the paper compares FD-LLaVA's feedback with GPT-4V's; "feedback" compares
#: only the text after "Feedback:" on both sides (the score is measured apart, by the MAE).
TEACHER_TEXTS = ("whole", "feedback")


def _role_metrics(records: Sequence[Mapping], teacher_text: str = "whole") -> dict:
    teacher = records[0]["role"] == "teacher"
    compared = feedback_text if teacher and teacher_text == "feedback" else (lambda text: text)
    metrics = text_metrics([compared(r["prediction"]) for r in records], [compared(r["reference"]) for r in records])
    if teacher:
        metrics["teacher_text"] = teacher_text
        metrics["MAE"] = score_mae([r["predicted_score"] for r in records], [r["reference_score"] for r in records])
        metrics["no_score"] = sum(r["predicted_score"] is None for r in records)
    metrics["n"] = len(records)
    return metrics


def fixed_results(records: Sequence[Mapping], *, teacher_text: str = "whole") -> dict:
    """{role: {"overall": metrics, "per_source": {source: metrics}}} for each role with turns (SPEC 6).

    metrics: BLEU-1..4, CIDEr and n (turns); the teacher adds MAE, no_score (replies without a score) and
    ``teacher_text`` (:data:`TEACHER_TEXTS`: what its BLEU/CIDEr compared).
    """
    if teacher_text not in TEACHER_TEXTS:
        raise ValueError(f"fixed.teacher_text must be one of {TEACHER_TEXTS}, got {teacher_text!r}")
    results = {}
    for role in ROLES:
        mine = [r for r in records if r["role"] == role]
        if not mine:
            continue
        by_source = collections.defaultdict(list)
        for record in mine:
            by_source[record["source"]].append(record)
        results[role] = {"overall": _role_metrics(mine, teacher_text),
                         "per_source": {s: _role_metrics(group, teacher_text) for s, group in sorted(by_source.items())}}
    return results
