"""FIRE-Bench runners with scripted agents: every output is a known string, so every metric is known exactly.

Fixed dialogues: BLEU-1..4, CIDEr and MAE equal those of the known (prediction, reference) pairs, in that order
(BLEU and CIDEr are asymmetric, so a swap, a shifted turn or a kept "Score:" line gives other numbers).
Free dialogues: known score sequences give known stops, AT, ADR, ATR, RR and accuracy curve.
"""

import collections

import numpy as np
import pytest

from fire_jax.data.items import Item
from fire_jax.data.records import Conversation, Turn
from fire_jax.data.scores import parse_score
from fire_jax.eval import fixed, free
from fire_jax.eval.metrics import text_metrics
from fire_jax.dialogue.stop import FIRE_1M_GENERATION, StopRule, stop_reason
from fire_jax.dialogue.agents import Feedback

# ---------------------------------------------------------------------------- fixed dialogues

# Ground-truth conversations: two sources, three and two turns. Reference feedback carries its score line.
CONVERSATIONS = [
    Conversation("c1", "c1.png", "How many red triangles are there?", "There are 4 red triangles.", (
        Turn("Thought: I count them.\nAnswer: 2", "Score: 2.\nFeedback: Count the triangles on the left too.", 2),
        Turn("Thought: the left has two more.\nAnswer: 3", "Score: 5\nFeedback: Closer, one is hidden at the top.", 5),
        Turn("Thought: one at the top as well.\nAnswer: 4", "Score: 10\nFeedback: Correct, all four found.", 10),
    ), "count", "test"),
    Conversation("c2", "c2.png", "What colour is the square?", "The square is blue.", (
        Turn("Thought: the square looks dark.\nAnswer: black", "Score: 3\nFeedback: Look at the hue of the square.", 3),
        Turn("Thought: it has a blue tint.\nAnswer: blue", "Score: 9.\nFeedback: Right, the square is blue.", 9),
    ), "colour", "test"),
]

# What the scripted student says for r_k (k >= 2) and the teacher for f_k, per (conversation, k): texts that
# share some but not all words with the references and are shorter or longer, so BLEU/CIDEr are asymmetric.
STUDENT_SAYS = {
    ("c1", 2): "Thought: the left has more.\nAnswer: 3 triangles",
    ("c1", 3): "Thought: one at the top.\nAnswer: 4",
    ("c2", 2): "Thought: it has a tint of blue in it after all.\nAnswer: blue",
}
TEACHER_SAYS = {
    ("c1", 1): "Score: 3\nFeedback: Count the triangles on the right too.",
    ("c1", 2): "Score: 5\nFeedback: Closer, one is hidden somewhere at the top left.",
    ("c1", 3): "Score: 9\nFeedback: Correct.",
    ("c2", 1): "Feedback: Look at the square.",  # no score: costs 10 in the MAE
    ("c2", 2): "Score: 7\nFeedback: Right, blue.",
}


class FixedStudent:
    """r_k chosen by (question, k); checks that the history is the conversation's own ground truth."""

    def __init__(self):
        self.rows = []

    def respond(self, images, questions, histories, rng=None):
        out = []
        for image, question, history in zip(images, questions, histories):
            record = next(c for c in CONVERSATIONS if c.question == question)
            assert image == record.image and list(history) == list(record.turns[:len(history)])
            out.append(STUDENT_SAYS[record.id, len(history) + 1])
            self.rows.append((record.id, len(history) + 1))
        return out


class FixedTeacher:
    """f_k chosen by (question, k); checks the groundtruth, the answer r_k and the history it is given."""

    def __init__(self):
        self.rows = []

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None):
        out = []
        for image, question, groundtruth, answer, history in zip(images, questions, groundtruths, answers,
                                                                  histories):
            record = next(c for c in CONVERSATIONS if c.question == question)
            k = len(history) + 1
            assert image == record.image and groundtruth == record.groundtruth
            assert answer == record.turns[k - 1].response and list(history) == list(record.turns[:k - 1])
            text = TEACHER_SAYS[record.id, k]
            out.append(Feedback(text, parse_score(text)))
            self.rows.append((record.id, k))
        return out


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    pairs = [(c, c.image) for c in CONVERSATIONS]
    turns = fixed.labelled_turns(pairs)
    student, teacher = FixedStudent(), FixedTeacher()
    path = str(tmp_path_factory.mktemp("fixed") / "fixed.jsonl")
    records = fixed.run_fixed(turns, student, teacher, path, batch_size=2)
    return turns, records, fixed.fixed_results(records), student, teacher


def _pairs(says, role, ids=("c1", "c2")):
    """The known (prediction, reference) pairs of one role, in turn order."""
    keys = [key for key in says if key[0] in ids]
    truth = {c.id: c for c in CONVERSATIONS}
    reference = (lambda t: t.feedback) if role == "teacher" else (lambda t: t.response)
    return [says[key] for key in keys], [reference(truth[key[0]].turns[key[1] - 1]) for key in keys]


def _close(got, expected):
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_fixed_generates_every_labelled_turn_once_from_the_true_history(fixed_run):
    turns, records, _, student, teacher = fixed_run
    assert sorted(set(student.rows)) == sorted(STUDENT_SAYS)  # r_k for k >= 2 only (Eq. 5)
    # Each turn is asked for once: a short batch is not padded by the runner (agents pad with inactive rows).
    assert len(student.rows) == len(STUDENT_SAYS) and len(teacher.rows) == len(TEACHER_SAYS)
    assert sorted(set(teacher.rows)) == sorted(TEACHER_SAYS)  # f_k for every k (Eq. 6)
    assert [r["key"] for r in records] == [t.key for t in turns]
    for record in records:
        says = STUDENT_SAYS if record["role"] == "student" else TEACHER_SAYS
        assert record["prediction"] == says[record["id"], record["turn"]]


def test_fixed_student_metrics_equal_the_known_pairs(fixed_run):
    results = fixed_run[2]["student"]
    predictions, references = _pairs(STUDENT_SAYS, "student")
    expected = text_metrics(predictions, references)
    _close(results["overall"], expected)
    assert results["overall"]["n"] == 3
    # BLEU-1 by hand: per pair, brevity penalty x clipped unigram precision; the mean over pairs.
    by_hand = []
    for prediction, reference in zip(predictions, references):
        p, r = prediction.split(), reference.split()
        matches = sum(min(c, r.count(w)) for w, c in collections.Counter(p).items())
        penalty = 1.0 if len(p) >= len(r) else np.exp(1 - len(r) / len(p))
        by_hand.append(penalty * matches / len(p))
    assert results["overall"]["BLEU-1"] == pytest.approx(np.mean(by_hand), rel=1e-9)
    # A swap of prediction and reference, or another pairing, would give other numbers.
    swapped = text_metrics(references, predictions)
    assert all(abs(swapped[m] - expected[m]) > 1e-3 for m in ("BLEU-1", "BLEU-2", "CIDEr"))
    rolled = text_metrics(predictions, references[1:] + references[:1])
    assert abs(rolled["BLEU-1"] - expected["BLEU-1"]) > 1e-3
    _close(results["per_source"]["count"], text_metrics(*_pairs(STUDENT_SAYS, "student", ("c1",))))
    assert results["per_source"]["colour"]["n"] == 1


def release_feedback(text):
    """The text analyze_feedback.py compares, written out for these replies: after "Feedback:" when the
    first line gives a score, else "" (eval_feedback.py reads score and feedback in one step)."""
    first = text.splitlines()[0]
    return text.split("Feedback:", 1)[1].strip() if "Score:" in first and "Feedback:" in text else ""


def test_fixed_teacher_text_compares_the_feedback_as_the_release(fixed_run):
    results = fixed_run[2]["teacher"]
    predictions, references = _pairs(TEACHER_SAYS, "teacher")
    expected = text_metrics([release_feedback(p) for p in predictions], [release_feedback(r) for r in references])
    _close(results["overall"], expected)
    assert release_feedback(references[0]) == "Count the triangles on the left too."
    assert fixed.release_reading(references[0]) == (2, "Count the triangles on the left too.")
    # The reply with no score line compares as "" (the release's feedback_predictions entry for it).
    assert fixed.release_reading(TEACHER_SAYS["c2", 1]) == (None, "")
    assert fixed.release_reading("Score: 7.\nLooks right.") == (None, "")  # no "Feedback:": nothing either
    assert fixed.release_reading("Score: 6\nFeedback:  Fine. \nFeedback: again") == (6, "Fine. \nFeedback: again")
    # Kept on either side (or swapped), the "Score:" line changes every number.
    for other in (text_metrics(predictions, references),
                  text_metrics([release_feedback(p) for p in predictions], references),
                  text_metrics(predictions, [release_feedback(r) for r in references]),
                  text_metrics([release_feedback(r) for r in references], [release_feedback(p) for p in predictions])):
        assert abs(other["BLEU-1"] - expected["BLEU-1"]) > 1e-3 or abs(other["CIDEr"] - expected["CIDEr"]) > 1e-3
    _close(results["per_source"]["colour"], text_metrics(*[[release_feedback(t) for t in side] for side in
                                                            _pairs(TEACHER_SAYS, "teacher", ("c2",))]))


def test_fixed_teacher_text_switch_whole_keeps_the_score_line(fixed_run):
    """``teacher_text="whole"`` compares the feedback as written on both sides; the switch is recorded."""
    records = fixed_run[1]
    whole = fixed.fixed_results(records, teacher_text="whole")["teacher"]
    predictions, references = _pairs(TEACHER_SAYS, "teacher")
    _close({k: v for k, v in whole["overall"].items() if k.startswith(("BLEU", "CIDEr"))},
           text_metrics(predictions, references))
    assert whole["overall"]["teacher_text"] == "whole" and fixed_run[2]["teacher"]["overall"]["teacher_text"] == "feedback"
    assert whole["overall"]["BLEU-1"] != fixed_run[2]["teacher"]["overall"]["BLEU-1"]
    assert whole["overall"]["MAE"] == fixed_run[2]["teacher"]["overall"]["MAE"]  # the score is measured apart
    with pytest.raises(ValueError, match="teacher_text"):
        fixed.fixed_results(records, teacher_text="score")


def test_fixed_teacher_score_mae_by_hand(fixed_run):
    results = fixed_run[2]["teacher"]
    assert results["overall"]["score_parser"] == "robust"
    # c1: |3-2|, |5-5|, |9-10|; c2: no score (10), |7-9|.
    assert results["overall"]["MAE"] == pytest.approx((1 + 0 + 1 + 10 + 2) / 5)
    assert results["overall"]["no_score"] == 1 and results["overall"]["n"] == 5
    assert results["per_source"]["count"]["MAE"] == pytest.approx(2 / 3)
    assert results["per_source"]["colour"]["MAE"] == pytest.approx(6.0)
    records = [r for r in fixed_run[1] if r["role"] == "teacher"]
    assert [(r["predicted_score"], r["reference_score"]) for r in records] == [
        (3, 2), (None, 3), (5, 5), (7, 9), (9, 10)]


# Replies the two readers read differently: (prediction, reference, robust |a - â|, official |a - â|).
READ_APART = [
    ("Score: 7.5\nFeedback: ok", "Score: 9\nFeedback: fine", 1.5, 2),  # official reads 7
    ("Score: 11\nFeedback: too high", "Score: 9\nFeedback: fine", 10, 2),  # robust: out of range; official: 11
    ("Score: 7.", "Score: 7\nFeedback: fine", 0, 10),  # no "Feedback:": the release has no score
    ("Great.\nScore: 8\nFeedback: ok", "Score: 8\nFeedback: fine", 0, 10),  # the score is not on line 1
    ("Score: 4\nFeedback: ok", "Feedback: fine\nScore: 6", 2, 5),  # the release reads the reference as -1
]


def test_fixed_teacher_mae_with_the_release_score_reading():
    records = [{"role": "teacher", "source": "s", "prediction": p, "reference": r, "predicted_score": parse_score(p),
                "reference_score": parse_score(r)} for p, r, _, _ in READ_APART]
    robust = fixed.fixed_results(records)["teacher"]["overall"]
    official = fixed.fixed_results(records, score_parser="official")["teacher"]["overall"]
    assert robust["MAE"] == pytest.approx((1.5 + 10 + 0 + 0 + 2) / 5) and robust["no_score"] == 1
    assert official["MAE"] == pytest.approx((2 + 2 + 10 + 10 + 5) / 5) and official["no_score"] == 2
    assert official["score_parser"] == "official" and official["teacher_text"] == "feedback"
    # The text compared is the same under both readers: the release's feedback, "" where it reads none.
    compared = [fixed.release_reading(t)[1] for t in [p for p, _, _, _ in READ_APART]]
    assert compared == ["ok", "too high", "", "", "ok"]
    _close(official, text_metrics(compared, [fixed.release_reading(r)[1] for _, r, _, _ in READ_APART]))
    with pytest.raises(ValueError, match="score_parser"):
        fixed.fixed_results(records, score_parser="strict")


# ---------------------------------------------------------------------------- free dialogues

# Per item: the teacher's scores a_1..a_n, the stop, and the source.
FREE = {
    "solved_late": ([3, 5, 9], "solved", "x"),
    "solved_first": ([9], "solved", "x"),
    "flat": ([4, 4], "no_increase", "x"),
    "long": ([2, 3, 4, 5, 6], "max_turns", "y"),
    "silent": ([5, None], "no_score", "y"),
    "drop": ([6, 2], "no_increase", "y"),
}


class FreeStudent:
    """r_k = "Answer: {item} #{k}"; checks that the history holds the item's own earlier turns."""

    def respond(self, images, questions, histories, rng=None):
        out = []
        for image, question, history in zip(images, questions, histories):
            assert image == f"{question}.png"
            for j, turn in enumerate(history, 1):
                assert turn.response == f"Answer: {question} #{j}" and turn.feedback.endswith(f"{question} #{j}")
            out.append(f"Answer: {question} #{len(history) + 1}")
        return out


class FreeTeacher:
    """Scores answer r_k of an item with the k-th score of its script (read from the answer text itself)."""

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None):
        out = []
        for question, groundtruth, answer, history in zip(questions, groundtruths, answers, histories):
            item, k = answer.removeprefix("Answer: ").split(" #")
            assert item == question and int(k) == len(history) + 1 and groundtruth == f"gt {question}"
            score = FREE[item][0][int(k) - 1]
            text = (f"Score: {score}\n" if score is not None else "") + f"Feedback: try {item} #{k}"
            out.append(Feedback(text, parse_score(text)))
        return out


@pytest.fixture(scope="module")
def free_records(tmp_path_factory):
    items = [Item(name, f"{name}.png", name, f"gt {name}", source) for name, (_, _, source) in FREE.items()]
    path = str(tmp_path_factory.mktemp("free") / "free.jsonl")
    return free.run_free(items, FreeStudent(), FreeTeacher(), path, batch_size=4)


def test_free_dialogues_stop_where_the_scores_say(free_records):
    assert [r["id"] for r in free_records] == list(FREE)
    assert {r["id"]: (r["scores"], r["stop"]) for r in free_records} == {
        name: (scores, stop) for name, (scores, stop, _) in FREE.items()}
    for r in free_records:
        assert [t["response"] for t in r["turns"]] == [f"Answer: {r['id']} #{k}" for k in range(1, len(r["scores"]) + 1)]


# The same replies read two ways: (texts per turn, robust scores and stop, official scores and stop).
FREE_READ_APART = {
    "zero": (["Score: 0\nFeedback: a", "Score: 5\nFeedback: b", "Score: 9\nFeedback: c"],
             ([0, 5, 9], "solved"), ([0], "zero_score")),  # the release stops on a real 0
    "half": (["Score: 7.5\nFeedback: a", "Score: 7.9\nFeedback: b", "Score: 9\nFeedback: c"],
             ([7.5, 7.9, 9], "solved"), ([7, 7], "no_increase")),
    "eleven": (["Score: 11\nFeedback: a"], ([None], "no_score"), ([11], "solved")),
    "late": (["Good try.\nScore: 6\nFeedback: a", "Score: 8\nFeedback: b"], ([6, 8], "solved"),
             ([None], "no_score")),
}


class ReadApartTeacher:
    """Replies with FREE_READ_APART's k-th text of an item, named as FreeStudent checks (its score read by the
    robust reader, as agents do)."""

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None):
        texts = [f"{FREE_READ_APART[q][0][len(h)]} {q} #{len(h) + 1}" for q, h in zip(questions, histories)]
        return [Feedback(text, parse_score(text)) for text in texts]


@pytest.mark.parametrize("parser", ["robust", "official"])
def test_free_dialogues_read_scores_as_the_rule_says(tmp_path, parser):
    items = [Item(name, f"{name}.png", name, f"gt {name}", "x") for name in FREE_READ_APART]
    rule = StopRule(score_parser=parser)
    records = free.run_free(items, FreeStudent(), ReadApartTeacher(), str(tmp_path / "free.jsonl"), rule=rule)
    column = 1 if parser == "robust" else 2
    assert {r["id"]: (r["scores"], r["stop"]) for r in records} == {
        name: spec[column] for name, spec in FREE_READ_APART.items()}
    overall = free.free_results(records, rule=rule)["overall"]
    if parser == "robust":  # K = 3 (eleven has one turn): t 3, 3, 2; ADR (9 + 1.5 + 2) / 3; RR 1
        assert (overall["K"], overall["mean_turns"], overall["RR"]) == (3, pytest.approx(8 / 3), 1)
        assert overall["ADR"] == pytest.approx(12.5 / 3)
    else:  # only half [7, 7] has two turns: unsolved, t = p = 10
        assert (overall["K"], overall["mean_turns"], overall["ADR"], overall["RR"]) == (1, 10, 0, 0)
    assert free.free_results(records, rule=rule)["score_parser"] == parser


def test_stop_reason_rules():
    assert stop_reason([None]) == "no_score"
    assert stop_reason([8]) == "solved" and stop_reason([7.5]) is None
    assert stop_reason([3, 3]) == "no_increase" and stop_reason([3, 4]) is None
    assert stop_reason([1, 2, 3, 4, 5]) == "max_turns" and stop_reason([1, 2, 3, 4]) is None
    assert stop_reason([1, 2, 3, 4, 8]) == "solved"
    assert stop_reason([3, 3], FIRE_1M_GENERATION) is None
    assert stop_reason([3, 3, 2], FIRE_1M_GENERATION) == "max_turns"
    official = StopRule(score_parser="official")
    assert stop_reason([0]) is None and stop_reason([0], official) == "zero_score"
    assert stop_reason([None], official) == "no_score" and stop_reason([11], official) == "solved"
    assert stop_reason([2, 3], official) is None and stop_reason([3, 2], official) == "no_increase"
    with pytest.raises(ValueError, match="score_parser"):
        StopRule(score_parser="lenient")


def test_free_metrics_by_hand(free_records):
    results = free.free_results(free_records, baseline={"name": "base", "overall": 5.5, "per_source": {"x": 4.0}})
    overall = results["overall"]
    # Refined items (n > 1): solved_late [3, 5, 9], flat [4, 4], long [2..6], silent [5, 0], drop [6, 2].
    # t_k: 3, 10, 10, 10, 10 (p = 10 unless the last score >= 8).
    assert overall["K"] == 5 and overall["items"] == 6
    assert overall["mean_turns"] == pytest.approx(43 / 5)
    assert overall["AT"] == pytest.approx(43 / 5 / 5.5)
    assert overall["ADR"] == pytest.approx((6 + 0 + 4 - 5 - 4) / 5)
    assert overall["ATR"] == pytest.approx((6 / 2 + 0 + 4 / 4 - 5 - 4) / 5)
    assert overall["RR"] == pytest.approx(1 / 5)
    assert overall["accuracy_by_turn"] == pytest.approx([1 / 6, 1 / 6, 2 / 6, 2 / 6, 2 / 6])
    assert overall["stops"] == {"max_turns": 1, "no_increase": 2, "no_score": 1, "solved": 2}
    assert overall["turns"] == {1: 1, 2: 3, 3: 1, 5: 1}
    x, y = results["per_source"]["x"], results["per_source"]["y"]
    assert x["K"] == 2 and x["mean_turns"] == pytest.approx(6.5) and x["AT"] == pytest.approx(6.5 / 4)
    assert x["ADR"] == pytest.approx(3.0) and x["ATR"] == pytest.approx(1.5) and x["RR"] == pytest.approx(0.5)
    assert y["K"] == 3 and y["ADR"] == pytest.approx(-5 / 3) and y["ATR"] == pytest.approx(-8 / 3)
    assert np.isnan(y["AT"]) and y["RR"] == 0
