"""The exact judge: is the student's answer the groundtruth? (synthetic test sets, where the answer is known)

The teacher's score is a model's opinion. On a test set whose groundtruth is the
exact sentence the student should write after "Answer:" (the synthetic set of
:mod:`fire_jax.data.synthetic`), right and wrong can be decided exactly, and the
teacher can be checked against that decision. Everything here is a pure
function of the dialogue records the runners write:

- :func:`normalize` / :func:`is_right`: the judge itself, on the answer a response states
  (:func:`fire_jax.data.chat.answer_of`, which the exact teacher reads too);
- :func:`judged_free` : accuracy by turn, judged refinement, the teacher's
  agreement with the judge and its confusion table, "solved but wrong" and
  "stopped but right" counts, for free dialogues; on the synthetic set, also
  whether the teacher's feedback on a wrong answer points the right way and
  scores the distance, against the set's own rule (:func:`rule_check`), beside
  what a blind teacher gets on the same turns (:func:`blind_teacher`);
- :func:`judged_fixed`: the same judge on fixed-dialogue predictions (student
  accuracy by turn; teacher agreement on the ground-truth answers it scored).

"Agreement" is the free dialogues' solved rule (FIRE Tables 4-6) read as a classifier: the teacher says
"right" when the stop rule's :meth:`~fire_jax.dialogue.stop.StopRule.solves` its score (a score >= the rule's
threshold); a reply with no score says "wrong".
"""

from __future__ import annotations

import collections
import functools
import json
import re
from typing import Iterable, Mapping, Sequence

from fire_jax.data import synthetic
from fire_jax.data.chat import answer_of
from fire_jax.dialogue.stop import StopRule

#: The FD teacher's training turns in the main job (configs/main_job.py), which the blind teacher is fitted on.
TEACHER_TURNS = "assets:synthetic_fire/teacher_turns.json"
#: Trailing characters the judge ignores: final punctuation and quotes.
_TRAILING = " \t\n.!?;:,'\"`"


def normalize(text: str) -> str:
    """Case folded, runs of whitespace made one space, final punctuation dropped."""
    return re.sub(r"\s+", " ", text).strip().rstrip(_TRAILING).strip().casefold()


def is_right(response: str, groundtruth: str) -> bool:
    """True when the response's answer equals the groundtruth sentence, up to :func:`normalize`."""
    return bool(groundtruth.strip()) and normalize(answer_of(response)) == normalize(groundtruth)


def _share(hits: Sequence[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def _confusion(pairs: Iterable[tuple[bool, bool]]) -> dict:
    """{"right_solved", "right_unsolved", "wrong_solved", "wrong_unsolved"} counts of (judge, teacher) pairs."""
    counts = collections.Counter(pairs)
    return {"right_solved": counts[(True, True)], "right_unsolved": counts[(True, False)],
            "wrong_solved": counts[(False, True)], "wrong_unsolved": counts[(False, False)]}


def _agreement(pairs: Sequence[tuple[bool, bool]]) -> float | None:
    return _share([judge == teacher for judge, teacher in pairs])


def _feedback_text(feedback: str) -> str:
    """What follows "Feedback:" in a reply (the whole reply if it has none), :func:`normalize`d."""
    index = feedback.rfind("Feedback:")
    return normalize(feedback if index < 0 else feedback[index + len("Feedback:"):])


def rule_check(response: str, groundtruth: str, feedback: str, score) -> tuple[bool, bool] | None:
    """(direction, distance) of a teacher's reply on a wrong answer of the synthetic set, against the rule that
    wrote the set's feedback (:func:`fire_jax.data.synthetic.exact_feedback`): whether its feedback text is the
    rule's (the rule's text for a wrong answer says only which way to move: "Your count is too low. Count them
    again.") and whether its score is the rule's (the distance score, ``WRONG_SCORES``).

    None when there is nothing to point at: the answer is right, or it or the groundtruth is not a value on the
    same scale of a synthetic task (real data, a malformed answer).
    """
    answer = answer_of(response)
    truth, given = synthetic.parse_answer(groundtruth), synthetic.parse_answer(answer)
    if truth is None or given is None or given[0] != truth[0] or given[1] == truth[1]:
        return None
    text, rule_score = synthetic.exact_feedback(groundtruth, answer)
    return _feedback_text(feedback) == _feedback_text(text), score is not None and float(score) == rule_score


@functools.cache
def blind_teacher() -> dict[tuple[str, int], tuple[str, int]]:
    """:func:`fire_jax.data.synthetic.blind_feedback` fitted on the FD teacher's training turns as the main job
    ships them (``assets:synthetic_fire/teacher_turns.json``): the direction and distance score a teacher gets
    from the answer alone, without reading the groundtruth in its prompt or the image."""
    from fire_jax.core.config import resolve_path

    with open(resolve_path(TEACHER_TURNS), encoding="utf-8") as f:
        return synthetic.blind_feedback(json.load(f))


def blind_check(response: str, groundtruth: str) -> tuple[bool, bool] | None:
    """:func:`rule_check` of the blind teacher's feedback on ``response`` (no feedback and no score, so (False,
    False), for an answer it never saw wrong)."""
    text, score = blind_teacher().get(synthetic.parse_answer(answer_of(response)), ("", None))
    return rule_check(response, groundtruth, text, score)


def judged_free(records: Sequence[Mapping], *, rule: StopRule) -> dict:
    """Exact-judge metrics of free dialogues (records with ``groundtruth``, ``stop`` and
    ``turns[].response`` / ``turns[].score``, as :func:`fire_jax.dialogue.loop.dialogue_record` writes them).

    - ``accuracy_by_turn[t-1]``: share of items whose answer at turn t is right; a dialogue that ended
      earlier keeps its last answer (the judged counterpart of FIRE Fig. 7's accuracy curve);
      ``accuracy_turn1`` and ``accuracy_final`` (the last answer);
    - ``teacher_accuracy_by_turn``: the same curve by the teacher's score (solved by turn t), for Fig. 7;
    - ``refinement_rate``: of the items wrong at turn 1, the share right at the end (``refined`` of
      ``wrong_first``); ``regressions``: right at turn 1, wrong at the end;
    - ``agreement``: share of all turns where the teacher's verdict (``rule.solves`` its score) equals the judge's,
      ``agreement_by_turn`` and ``confusion`` (judge x teacher counts over all turns);
    - ``solved_but_wrong``: dialogues stopped as solved on a wrong answer (``solved_but_wrong_share`` of the
      solved ones); ``stopped_but_right``: dialogues that ended unsolved on a right answer;
    - on the synthetic set (:func:`rule_check`), over the ``wrong_turns_on_scale`` turns whose answer is a
      wrong value on the groundtruth's scale: ``teacher_direction``, the share whose feedback points the way
      the set's rule does, and ``teacher_distance_score``, the share scored as the rule scores that distance
      (None on data without the rule); ``blind_direction`` and ``blind_distance_score``, the same shares for
      the blind teacher's feedback on the same turns (:func:`blind_teacher`: the answer alone, neither
      groundtruth nor image), the floor the teacher's must clear to show it compared.

    ``rule``: the stop rule the dialogues ran with (its threshold and ``max_turns``).
    """
    n = len(records)
    right = [[is_right(turn["response"], record["groundtruth"]) for turn in record["turns"]] for record in records]
    verdicts = [[rule.solves(turn["score"]) for turn in record["turns"]] for record in records]
    first = [r[0] for r in right if r]
    final = [r[-1] for r in right if r]
    pairs = [(j, t) for rs, vs in zip(right, verdicts) for j, t in zip(rs, vs)]
    by_turn = [[(rs[k], vs[k]) for rs, vs in zip(right, verdicts) if len(rs) > k] for k in range(rule.max_turns)]
    wrong_first = sum(not r[0] for r in right if r)
    refined = sum((not r[0]) and r[-1] for r in right if r)
    solved = [record for record in records if record.get("stop") == "solved"]
    solved_but_wrong = sum(not rs[-1] for record, rs in zip(records, right) if record.get("stop") == "solved" and rs)
    stopped_but_right = sum(rs[-1] for record, rs in zip(records, right) if record.get("stop") != "solved" and rs)
    checks = [rule_check(turn["response"], record["groundtruth"], turn.get("feedback") or "", turn["score"])
              for record in records for turn in record["turns"]]
    checks = [c for c in checks if c is not None]
    blind = [blind_check(turn["response"], record["groundtruth"]) for record in records for turn in record["turns"]]
    blind = [b for b in blind if b is not None]  # the same turns: both are None exactly where rule_check is
    return {
        "items": n,
        "accuracy_by_turn": [_share([rs[min(t, len(rs) - 1)] for rs in right if rs]) for t in range(rule.max_turns)],
        "teacher_accuracy_by_turn": [_share([any(vs[:t + 1]) for vs in verdicts if vs]) for t in range(rule.max_turns)],
        "accuracy_turn1": _share(first),
        "accuracy_final": _share(final),
        "wrong_first": wrong_first,
        "refined": refined,
        "refinement_rate": refined / wrong_first if wrong_first else None,
        "regressions": sum(r[0] and not r[-1] for r in right if r),
        "turns_judged": len(pairs),
        "agreement": _agreement(pairs),
        "agreement_by_turn": [_agreement(p) for p in by_turn],
        "confusion": _confusion(pairs),
        "solved": len(solved),
        "solved_but_wrong": solved_but_wrong,
        "solved_but_wrong_share": solved_but_wrong / len(solved) if solved else None,
        "stopped_but_right": stopped_but_right,
        "wrong_turns_on_scale": len(checks),
        "teacher_direction": _share([direction for direction, _ in checks]),
        "teacher_distance_score": _share([distance for _, distance in checks]),
        "blind_direction": _share([direction for direction, _ in blind]),
        "blind_distance_score": _share([distance for _, distance in blind]),
    }


def judged_fixed(records: Sequence[Mapping], *, rule: StopRule) -> dict:
    """Exact-judge metrics of fixed-dialogue turn records (:func:`fire_jax.eval.fixed.turn_record`: each
    carries its conversation's ``groundtruth``). Student: ``accuracy`` of its generated r_k and
    ``accuracy_by_turn`` {k: share}. Teacher: its verdict on the ground-truth answer r_k (the record's
    ``answer``) against the judge's (``rule.solves`` its score): ``agreement``, ``agreement_by_turn``,
    ``confusion``.
    """
    out = {}
    student = [r for r in records if r["role"] == "student"]
    if student:
        hits = collections.defaultdict(list)
        for record in student:
            hits[record["turn"]].append(is_right(record["prediction"], record["groundtruth"]))
        out["student"] = {"accuracy": _share([h for v in hits.values() for h in v]),
                          "accuracy_by_turn": {k: _share(v) for k, v in sorted(hits.items())},
                          "n": len(student)}
    teacher = [r for r in records if r["role"] == "teacher"]
    if teacher:
        pairs = collections.defaultdict(list)
        for record in teacher:
            pairs[record["turn"]].append((is_right(record["answer"], record["groundtruth"]),
                                          rule.solves(record["predicted_score"])))
        everything = [p for v in pairs.values() for p in v]
        out["teacher"] = {"agreement": _agreement(everything),
                          "agreement_by_turn": {k: _agreement(v) for k, v in sorted(pairs.items())},
                          "confusion": _confusion(everything), "n": len(teacher)}
    return out
