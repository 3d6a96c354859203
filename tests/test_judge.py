"""The exact judge, its free/fixed-dialogue metrics, and the synthetic task's shortcut check (no model needed)."""

import collections
import json
import os
import re

import pytest

from fire_jax.data import synthetic
from fire_jax.eval import judge
from fire_jax.data.chat import answer_of
from fire_jax.dialogue.agents import ExactTeacher, from_spec
from fire_jax.dialogue.stop import FREE_DIALOGUE, StopRule, stop_reason

ASSETS = os.path.join(os.path.dirname(__file__), "..", "fire_jax", "assets", "synthetic_fire")
GT = "There are 3."


def reply(answer: str, thought: str = "I count the red circles in the image.") -> str:
    return f"Thought: {thought}\nAnswer: {answer}\n\n"


@pytest.mark.parametrize("answer, right", [
    ("There are 3.", True),
    ("THERE are 3", True),  # case, final punctuation
    ("  There  are\t3 !", True),  # spacing, final punctuation after a space
    ("There are 3.\nI am sure.", True),  # only the answer's line counts
    ("There are 4.", False),  # a wrong number
    ("There are 33.", False),
    ("There are 3 or 4.", False),
    ("There are three.", False),
    ("", False),
])
def test_judge_crafted_answers(answer, right):
    assert judge.is_right(reply(answer), GT) is right


def test_judge_colours():
    assert judge.is_right(reply("it is RED."), "It is red.")
    assert not judge.is_right(reply("It is orange."), "It is red.")  # a wrong colour
    assert not judge.is_right(reply("It is red and blue."), "It is red.")


def test_judge_reads_the_last_answer_and_bare_text():
    assert answer_of("Thought: Answer: no\nAnswer: The square is red.") == "The square is red."
    assert judge.is_right("The square is red", "The square is red.")  # no "Answer:": the whole text
    assert not judge.is_right("Answer: The square is red.", "")  # an empty groundtruth never matches
    assert judge.normalize("The Square  is RED!.") == "the square is red"


def dialogue(gt: str, answers: list[str], scores: list, stop: str | None = None) -> dict:
    stop = stop or stop_reason(scores, StopRule())
    return {"groundtruth": gt, "stop": stop, "source": "synthetic_count",
            "turns": [{"response": reply(a), "feedback": "", "score": s} for a, s in zip(answers, scores)]}


def n(k: int) -> str:
    return f"There are {k}."


def test_judged_free_hand_computed():
    records = [
        dialogue(n(3), [n(3)], [10]),  # right at once, solved
        dialogue(n(3), [n(1), n(2), n(3)], [4, 6, 10]),  # refined over 3 turns
        dialogue(n(3), [n(2), n(3)], [6, 6]),  # right at turn 2 but the teacher did not see it: stopped but right
        dialogue(n(3), [n(5), n(4)], [4, 10]),  # solved but wrong
        dialogue(n(3), [n(3), n(2)], [6, 4]),  # right first, wrong at the end (regression)
    ]
    m = judge.judged_free(records, rule=FREE_DIALOGUE)
    assert m["items"] == 5
    # turn 1: right in dialogues 0 and 4; turn 2: 0 (kept), 2, 4 -> no: 4 says n(2) at turn 2
    assert m["accuracy_by_turn"] == [2 / 5, 2 / 5, 3 / 5, 3 / 5, 3 / 5]
    assert m["accuracy_turn1"] == 2 / 5 and m["accuracy_final"] == 3 / 5
    assert (m["wrong_first"], m["refined"], m["refinement_rate"], m["regressions"]) == (3, 2, 2 / 3, 1)
    # all 11 turns: (judge, teacher) = (R,S) (W,U) (W,U) (R,S) (W,U) (R,U) (W,U) (W,S) (R,U) (W,U)
    assert m["confusion"] == {"right_solved": 2, "right_unsolved": 2, "wrong_solved": 1, "wrong_unsolved": 5}
    assert m["turns_judged"] == 10 and m["agreement"] == pytest.approx(7 / 10)
    assert m["agreement_by_turn"][:3] == [pytest.approx(4 / 5), pytest.approx(2 / 4), 1.0]
    assert m["agreement_by_turn"][3:] == [None, None]
    assert (m["solved"], m["solved_but_wrong"], m["stopped_but_right"]) == (3, 1, 1)
    assert m["solved_but_wrong_share"] == pytest.approx(1 / 3)
    assert m["teacher_accuracy_by_turn"] == [1 / 5, 2 / 5, 3 / 5, 3 / 5, 3 / 5]


def test_teacher_direction_and_distance_against_the_rule_hand_computed():
    """On wrong answers of the synthetic scale: does the feedback point the rule's way, is the score the rule's
    for that distance? Right answers, malformed ones and real data have nothing to point at."""
    low = "Score: 6.\nFeedback: Your count is too low. Count them again."  # the rule's on 2 for 3
    high = "Score: 6.\nFeedback: Your count is too high. Count them again."
    assert judge.rule_check(reply(n(2)), GT, low, 6) == (True, True)
    assert judge.rule_check(reply(n(2)), GT, high, 6) == (False, True)  # the wrong way, the right distance
    assert judge.rule_check(reply(n(1)), GT, low, 6.0) == (True, False)  # 2 away: the rule scores 4
    assert judge.rule_check(reply(n(6)), GT, high.replace("6", "2"), 2) == (True, True)  # 3 away: the rule scores 2
    assert judge.rule_check(reply(n(6)), GT, "Score: 2. Your count is too high.", 2) == (False, True)  # no "Feedback:"
    assert judge.rule_check(reply(n(4)), GT, "Score: 6.\nFeedback: Correct! Your answer is right.", 6) == (False, True)
    assert judge.rule_check(reply(n(2)), GT, "", None) == (False, False)  # no reply, no score
    assert judge.rule_check(reply("It is red."), "It is orange.", "Score: 6.\nFeedback: The colour comes "
                            "LATER in the rainbow. Look again", 6) == (True, True)  # case, final punctuation
    for answer, truth in ((n(3), GT), ("It is red.", GT), ("three", GT), (n(2), "A cat on a mat.")):
        assert judge.rule_check(reply(answer), truth, low, 6) is None
    records = [dialogue(n(3), [n(1), n(2), n(3)], [4, 6, 10]), dialogue(n(3), [n(5), "three"], [6, 1]),
               dialogue(n(3), [n(3)], [10])]
    records[0]["turns"][0]["feedback"] = low.replace("6", "4")  # right way, right distance
    records[0]["turns"][1]["feedback"] = high  # wrong way, right distance
    records[1]["turns"][0]["feedback"] = high  # right way, wrong distance (2 away scores 4)
    m = judge.judged_free(records, rule=FREE_DIALOGUE)
    assert m["wrong_turns_on_scale"] == 3
    assert m["teacher_direction"] == pytest.approx(2 / 3) and m["teacher_distance_score"] == pytest.approx(2 / 3)
    # the blind teacher (fitted on the shipped teacher turns) says "too low" to 1 and 2 and "too high" to 5, all
    # with score 6: the rule's way on all three, the rule's score only for 2 (1 and 5 are 2 away: 4)
    assert [judge.blind_teacher()[("count", k)][1] for k in (0, 1, 4)] == [6, 6, 6]
    assert m["blind_direction"] == 1.0 and m["blind_distance_score"] == pytest.approx(1 / 3)
    real = judge.judged_free([dialogue("A cat on a mat.", ["A dog."], [6])], rule=FREE_DIALOGUE)
    assert real["wrong_turns_on_scale"] == 0 and real["teacher_direction"] is None


def test_blind_feedback_is_the_commonest_hint_and_score_of_each_wrong_answer():
    """Hand-made teacher turns: per (task, answer) the majority hint and score among its wrong turns (ties: the
    first sorted); right answers and answers off the task's scale are left out."""
    def turn(answer, score, hint):
        return {"conversations": [{"role": "user", "value": "q"}, {"role": "student", "value": reply(answer)},
                                  {"role": "teacher", "value": synthetic.feedback(score, hint)}], "score": [score]}

    low, high = "Your count is too low. Count them again.", "Your count is too high. Count them again."
    turns = [turn(n(2), 6, low), turn(n(2), 4, low), turn(n(2), 6, high), turn(n(5), 4, high), turn(n(5), 2, high),
             turn(n(3), 10, "Correct! Your answer is right."), turn("three", 1, "Answer with one sentence."),
             turn("It is red.", 6, "The colour comes later in the rainbow. Look again.")]
    assert synthetic.blind_feedback(turns) == {
        ("count", 1): (synthetic.feedback(6, low), 6), ("count", 4): (synthetic.feedback(2, high), 2),
        ("color", 0): (synthetic.feedback(6, "The colour comes later in the rainbow. Look again."), 6)}
    blind = synthetic.blind_feedback(json.load(open(os.path.join(ASSETS, "teacher_turns.json"))))
    # the ends of each scale can be wrong one way only
    for task, top in (("count", synthetic.MAX_COUNT - 1), ("bars", synthetic.NUM_BARS - 1),
                      ("color", len(synthetic.RAINBOW) - 1)):
        up, down = (synthetic.exact_feedback(synthetic.TASKS[task]().answer(v), synthetic.TASKS[task]().answer(w))[0]
                    for v, w in ((1, 0), (top - 1, top)))
        assert blind[(task, 0)][0].split("\n")[1] == up.split("\n")[1]
        assert blind[(task, top)][0].split("\n")[1] == down.split("\n")[1]


def test_the_exact_teacher_points_the_rules_way_on_every_wrong_answer():
    """The generator's rule as the teacher, on every wrong value of every shipped test question."""
    with open(os.path.join(ASSETS, "test.json")) as f:
        test = json.load(f)
    teacher, records = ExactTeacher(), []
    for record in test:
        truth = record["groundtruth"]["value"]
        task = synthetic.TASKS[synthetic.parse_answer(truth)[0]]()
        answers = [reply(task.answer(v)) for v in range(task.size)]
        feedback = teacher.feedback([None] * len(answers), [""] * len(answers), [truth] * len(answers), answers)
        records.append({"groundtruth": truth, "stop": "max_turns", "source": record["source"],
                        "turns": [{"response": a, "feedback": f.text, "score": f.score}
                                  for a, f in zip(answers, feedback)]})
    m = judge.judged_free(records, rule=StopRule(max_turns=7))
    assert m["wrong_turns_on_scale"] == sum(len(r["turns"]) - 1 for r in records) > 400
    assert m["teacher_direction"] == 1.0 and m["teacher_distance_score"] == 1.0


def test_a_teacher_that_scores_the_turn_fails_the_judge():
    """A teacher that says 10 at turn 2 whatever the answer: its agreement and solved-but-wrong give it away."""
    with open(os.path.join(ASSETS, "test.json")) as f:
        test = json.load(f)
    records = []
    for record in test:
        gt = record["groundtruth"]["value"]
        first = record["conversations"][0]["value"]
        second = first.replace("Answer: ", "Answer: Still ")  # a wrong refinement
        scores = [2, 10]
        records.append({"groundtruth": gt, "stop": "solved", "source": record["source"],
                        "turns": [{"response": first, "score": scores[0]}, {"response": second, "score": scores[1]}]})
    m = judge.judged_free(records, rule=FREE_DIALOGUE)
    assert m["agreement"] < 0.6
    assert m["solved_but_wrong_share"] == 1.0 and m["accuracy_final"] == 0.0
    assert 0.3 < m["accuracy_turn1"] < 0.7  # the shipped test set: about half the first answers are right


def test_judged_fixed():
    records = [
        {"role": "student", "id": "a", "turn": 2, "groundtruth": n(3), "prediction": reply(n(3))},
        {"role": "student", "id": "b", "turn": 2, "groundtruth": n(3), "prediction": reply(n(4))},
        {"role": "student", "id": "b", "turn": 3, "groundtruth": n(3), "prediction": reply(n(3))},
        {"role": "teacher", "id": "a", "turn": 1, "groundtruth": n(3), "answer": reply(n(3)), "predicted_score": 9},
        {"role": "teacher", "id": "b", "turn": 1, "groundtruth": n(3), "answer": reply(n(1)), "predicted_score": 8},
        {"role": "teacher", "id": "b", "turn": 2, "groundtruth": n(3), "answer": reply(n(2)), "predicted_score": None},
    ]
    m = judge.judged_fixed(records, rule=FREE_DIALOGUE)
    assert m["student"] == {"accuracy": 2 / 3, "accuracy_by_turn": {2: 0.5, 3: 1.0}, "n": 3}
    assert m["teacher"]["agreement"] == pytest.approx(2 / 3)
    assert m["teacher"]["agreement_by_turn"] == {1: 0.5, 2: 1.0}
    assert m["teacher"]["confusion"] == {"right_solved": 1, "right_unsolved": 0, "wrong_solved": 1,
                                         "wrong_unsolved": 1}


def test_synthetic_task_has_no_surface_shortcut():
    """Turn position, the response's first words, its thought and its length predict "right" at about chance."""
    with open(os.path.join(ASSETS, "train.json")) as f:
        train = json.load(f)
    with open(os.path.join(ASSETS, "test.json")) as f:
        test = json.load(f)
    report = synthetic.shortcut_report(train, test)
    assert set(report["predictors"]) == set(synthetic.SURFACE_FEATURES)
    for name, accuracy in report["predictors"].items():
        assert accuracy <= report["chance"] + 0.06, (name, accuracy, report["chance"])
    for turn in (1, 2, 3):  # right and wrong about equally common at every turn that has many examples
        assert 0.4 <= report["right_share_by_turn"][turn] <= 0.65, report["right_share_by_turn"]


def _direction(text: str) -> str:
    return next(w for w in ("low", "high", "right", "left", "later", "earlier") if re.search(rf"\b{w}\b", text))


def test_teacher_turns_need_the_comparison():
    """The teacher's training turns: each feedback is the exact rule's for its answer; the direction of a wrong
    answer's feedback is not the one its thought names (as it always is in the dialogues as generated) more
    often than chance, and every distance score is common."""
    with open(os.path.join(ASSETS, "teacher_turns.json")) as f:
        turns = json.load(f)
    with open(os.path.join(ASSETS, "train.json")) as f:
        dialogues = json.load(f)
    assert len(turns) == sum(r["round"] for r in dialogues)
    same, refined, scores = 0, 0, collections.Counter()
    for record in turns:
        response, feedback = (m["value"] for m in record["conversations"][-2:])
        answer = response.split("Answer:")[-1].strip()
        assert (feedback, record["score"][-1]) == synthetic.exact_feedback(record["groundtruth"]["value"], answer)
        scores[record["score"][-1]] += 1
        thought = response.split("\nAnswer:")[0]
        if record["score"][-1] != 10 and "feedback says" in thought:
            refined += 1
            same += _direction(thought) == _direction(feedback.split("Feedback:")[1])
    assert refined > 200 and 0.35 <= same / refined <= 0.65, (same, refined)
    assert 0.45 <= scores[10] / len(turns) <= 0.55 and min(scores[s] for s in (6, 4, 2, 1)) > 80, scores
    assert turns == synthetic.turn_records(dialogues, seed=0)
    with open(os.path.join(ASSETS, "teacher_turns_quarter_right.json")) as f:  # the comparison lineage's
        assert json.load(f) == synthetic.turn_records(dialogues, seed=0, right_share=0.25)


def test_teacher_turns_right_share():
    """A smaller share of right answers gives the teacher more wrong ones to learn the direction from; every
    feedback is still the rule's, and the share is checked."""
    with open(os.path.join(ASSETS, "train.json")) as f:
        dialogues = json.load(f)[:300]
    for share in (0.0, 0.25, 1.0):
        turns = synthetic.turn_records(dialogues, seed=0, right_share=share)
        assert len(turns) == sum(r["round"] for r in dialogues)
        right = sum(t["score"][-1] == 10 for t in turns) / len(turns)
        assert abs(right - share) <= 0.05, (share, right)
        for record in turns:
            answer = record["conversations"][-2]["value"].split("Answer:")[-1].strip()
            assert (record["conversations"][-1]["value"], record["score"][-1]) == synthetic.exact_feedback(
                record["groundtruth"]["value"], answer)
    with pytest.raises(ValueError, match="right_share"):
        synthetic.turn_records(dialogues, right_share=1.5)


def test_comparisons_are_the_rules_feedback_beside_the_groundtruth():
    """The comparison records (the main job's comparison stage): two per training record, each a
    wrong answer on the groundtruth's scale, the groundtruth beside it in one user message and the rule's
    feedback as the reply; both sides and every distance score occur, an end of a scale only points inwards;
    the same seed draws the same records."""
    with open(os.path.join(ASSETS, "train.json")) as f:
        dialogues = json.load(f)
    records = synthetic.comparison_records(dialogues, seed=0)
    assert records == synthetic.comparison_records(dialogues, seed=0) != synthetic.comparison_records(dialogues, seed=1)
    with open(os.path.join(ASSETS, "comparisons.json")) as f:
        assert json.load(f) == records  # the shipped file the main job's comparison stage trains on
    assert len(records) == 2 * len(dialogues) and "image" not in records[0]
    assert records[0]["conversations"] == [  # hand-checked: 7 is three above 4, score 2, "too high"
        {"from": "human", "value": "Groundtruth: There are 4.\nAnswer: There are 7."},
        {"from": "gpt", "value": "Score: 2.\nFeedback: Your count is too high. Count them again.\n"}]
    sides, scores = collections.Counter(), collections.Counter()
    for record, dialogue in zip(records, [d for d in dialogues for _ in range(2)]):
        question, reply = (m["value"] for m in record["conversations"])
        groundtruth = dialogue["groundtruth"]["value"]
        head, answer = question.split("\nAnswer: ")
        assert head == f"Groundtruth: {groundtruth}" and record["source"] == dialogue["source"]
        assert reply == synthetic.exact_feedback(groundtruth, answer)[0]
        (task, truth), (answer_task, given) = synthetic.parse_answer(groundtruth), synthetic.parse_answer(answer)
        assert answer_task == task and given != truth and abs(given - truth) <= synthetic.MAX_OFFSET
        if truth == 0:
            assert given > truth
        sides[given > truth] += 1
        scores[synthetic.exact_feedback(groundtruth, answer)[1]] += 1
    assert min(sides.values()) > 0.4 * len(records), sides
    assert set(scores) == {6, 4, 2, 1} and scores[10] == 0, scores


def test_uniform_comparisons_draw_every_other_value_alike():
    """comparison_records(uniform=True): the wrong answer drawn among all the task's other values, so the
    distance scores come more evenly than the first answers' distances give them (shipped: 625 of 1,440 are 6)."""
    with open(os.path.join(ASSETS, "train.json")) as f:
        dialogues = json.load(f)
    records = synthetic.comparison_records(dialogues, seed=0, uniform=True)
    assert records != synthetic.comparison_records(dialogues, seed=0)
    pairs, scores = collections.Counter(), collections.Counter()
    for record in records:
        question, reply = (m["value"] for m in record["conversations"])
        groundtruth, answer = question.removeprefix("Groundtruth: ").split("\nAnswer: ")
        text, score = synthetic.exact_feedback(groundtruth, answer)
        assert reply == text and score != 10
        (task, truth), (_, given) = synthetic.parse_answer(groundtruth), synthetic.parse_answer(answer)
        pairs[task, truth, given] += 1
        scores[score] += 1
    # Every ordered pair of two values occurs, counts 1..7 six apart too (distance 6 scores as 4 and over: 1).
    assert len(pairs) == 7 * 6 + 5 * 4 + 6 * 5 and ("count", 0, 6) in pairs
    assert scores == {6: 478, 4: 399, 2: 276, 1: 287}
    with open(os.path.join(ASSETS, "comparisons.json")) as f:
        shipped = collections.Counter(r["conversations"][1]["value"].split("\n")[0]
                                      for r in json.load(f))
    assert shipped["Score: 6."] == 625 > scores[6]


def test_comparisons_with_a_share_of_right_answers():
    """comparison_records(right_share=s): the groundtruth itself as the answer in about a share s of the
    comparisons, with the rule's "Correct!" reply; every other one is wrong and scored by the rule."""
    with open(os.path.join(ASSETS, "train.json")) as f:
        dialogues = json.load(f)
    records = synthetic.comparison_records(dialogues, seed=0, right_share=0.25)
    scores = collections.Counter()
    for record in records:
        question, reply = (m["value"] for m in record["conversations"])
        groundtruth, answer = question.removeprefix("Groundtruth: ").split("\nAnswer: ")
        text, score = synthetic.exact_feedback(groundtruth, answer)
        assert reply == text and (score == 10) == (answer == groundtruth)
        scores[score] += 1
    assert len(records) == 1440 and scores == {10: 363, 6: 464, 4: 289, 2: 200, 1: 124}
    with pytest.raises(ValueError, match="right_share"):
        synthetic.comparison_records(dialogues[:1], right_share=1.0)


def test_captions_say_what_was_drawn_on_training_images_only():
    with open(os.path.join(ASSETS, "captions.json")) as f:
        captions = {r["image"]: r["caption"] for r in json.load(f)}
    with open(os.path.join(ASSETS, "train.json")) as f:
        train = json.load(f)
    assert sorted(captions) == sorted(r["image"] for r in train)  # no test image
    for record in train:
        caption, question = captions[record["image"]], record["question"]["value"]
        truth = record["groundtruth"]["value"]
        if record["source"] == "synthetic_count":
            thing = question[len("How many "):-len(" are in the image?")]  # "red triangles"
            count = int(truth.split()[-1].rstrip("."))
            assert f"{count} {thing if count > 1 else thing[:-1]}" in caption, (caption, question, truth)
        elif record["source"] == "synthetic_bars":
            assert caption.endswith(f"{truth.split(' is')[0].lower()} is the tallest."), (caption, truth)
        else:
            shape = question.split()[-1].rstrip("?")
            assert f"{truth.split()[-1].rstrip('.')} {shape}" in caption, (caption, question, truth)


def test_shortcut_check_catches_a_task_with_one():
    """The check must be able to fail: the previous task (wrong first answers, right refinements) had one."""
    records, *_ = synthetic.synthesize(300, seed=1, split="train")
    leaky = []
    for record in records:
        gt = record["groundtruth"]["value"]
        wrong = "Thought: I look.\nAnswer: Something else.\n\n"
        right = f"Thought: The feedback says so.\nAnswer: {gt}\n\n"
        leaky.append(dict(record, conversations=[{"role": "student", "value": wrong}, {"role": "teacher", "value": ""},
                                                 {"role": "student", "value": right}, {"role": "teacher", "value": ""}]))
    report = synthetic.shortcut_report(leaky[:200], leaky[200:])
    assert report["predictors"]["turn index"] == 1.0 and report["predictors"]["the thought"] == 1.0


def test_synthetic_dialogues_step_towards_the_truth():
    records, *_ = synthetic.synthesize(60, seed=2, split="train")
    for record in records:
        scores = record["score"]
        assert scores[-1] == 10 and all(a < b for a, b in zip(scores, scores[1:]))  # every refinement scores higher
        responses = [m["value"] for m in record["conversations"] if m["role"] == "student"]
        feedbacks = [m["value"] for m in record["conversations"] if m["role"] == "teacher"]
        gt = record["groundtruth"]["value"]
        assert [judge.is_right(r, gt) for r in responses] == [False] * (len(responses) - 1) + [True]
        for text in feedbacks[:-1]:  # wrong answers' feedback points the way without quoting the answer
            value = [w for w in gt.rstrip(".").split() if w.isdigit() or w in synthetic.RAINBOW]
            assert len(value) == 1 and value[0] not in text.split("Feedback:")[1].split()


def test_exact_teacher_is_the_generators_rule():
    """The exact teacher reproduces every feedback of generated dialogues, and its verdict is the judge's."""
    records, *_ = synthetic.synthesize(90, seed=4, split="train")
    teacher = from_spec("exact:synthetic", "teacher")
    assert isinstance(teacher, ExactTeacher) and teacher.description == "exact:synthetic"
    for record in records:
        gt = record["groundtruth"]["value"]
        responses = [m["value"] for m in record["conversations"][0::2]]
        feedbacks = [m["value"].strip() for m in record["conversations"][1::2]]
        out = teacher.feedback([None] * len(responses), [""] * len(responses), [gt] * len(responses), responses)
        assert [f.text for f in out] == feedbacks
        assert [FREE_DIALOGUE.solves(f.score) for f in out] == [judge.is_right(r, gt) for r in responses]
    odd = teacher.feedback([None], [""], ["It is red."], ["Answer: There are 2."])[0]
    assert odd.score == 1 and "Score: 1." in odd.text
    with pytest.raises(ValueError, match="not a synthetic groundtruth"):
        synthetic.exact_feedback("A cat on a mat.", "It is red.")


def test_exact_specs_need_no_import_of_the_judge():
    """``exact:`` is known to the one factory where the exact teacher is defined: a process that imports only
    fire_jax.dialogue.agents builds it, and nothing of fire_jax.eval is loaded."""
    import subprocess
    import sys

    code = ("import sys; from fire_jax.dialogue.agents import from_spec; teacher = from_spec('exact:synthetic', "
            "'teacher'); print(type(teacher).__name__, sorted(m for m in sys.modules if m.startswith('fire_jax.eval')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert out.stdout.split("\n")[-2] == "ExactTeacher []"


def _experiment(name: str):
    """The module experiments/<name>.py (experiments/ is not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_plateau_items_are_balanced_and_labelled_by_the_rule():
    """experiments/compare_plateau.py's isolated comparison: "Yes." exactly when the answer is the groundtruth,
    the direction the generator's own hint gives, right about half the time, fillers as asked."""
    module = _experiment("compare_plateau")
    from fire_jax.core.config import resolve_path

    with open(resolve_path("assets:synthetic_fire/train.json")) as f:
        shipped = json.load(f)
    items = module.compare_records(shipped, 400, seed=3)
    later = {"count": "too low", "bars": "to the right", "color": "later"}
    for item in items:
        prompt, reply = (m["value"] for m in item["conversations"])
        lines = prompt.split("\n")
        truth, answer = lines[0][len("Groundtruth: "):], lines[-2][len("Answer: "):]
        assert 3 <= len(lines) - 1 <= 6 and lines[-1] == module.QUESTION
        text, score = synthetic.exact_feedback(truth, answer)
        assert (reply == "Yes.") == (score == synthetic.RIGHT_SCORE)
        if score != synthetic.RIGHT_SCORE:
            task = synthetic.parse_answer(truth)[0]
            assert ("later" in reply) == (later[task] in text), (truth, answer, reply, text)
    right = sum(item["conversations"][1]["value"] == "Yes." for item in items) / len(items)
    assert 0.42 <= right <= 0.58
    assert all(len(i["conversations"][0]["value"].split("\n")) == 3
               for i in module.compare_records(shipped, 20, seed=3, max_filler=0))


def test_the_protocols_stop_rule_is_the_judges_one_threshold():
    """FIRE-Bench's protocols: the free one builds its StopRule from config.free, and the exact judge reads the
    threshold from that rule alone (a score of 7 solves at threshold 7, not at the default 8); the fixed one has
    the rule's default."""
    import ml_collections

    from fire_jax.eval.fire_bench import PROTOCOLS, FixedProtocol, FreeProtocol

    section = ml_collections.ConfigDict(dict(max_turns=3, threshold=7.0, teacher_history="latest",
                                             penalty_turns=2, baseline_results=""))
    free_protocol = PROTOCOLS["free"](section)
    assert isinstance(free_protocol, FreeProtocol)
    assert free_protocol.rule == StopRule(max_turns=3, threshold=7.0, score_parser="robust")
    records = [dialogue(n(3), [n(3)], [7], stop="solved"), dialogue(n(3), [n(2)], [7], stop="solved")]
    judged = free_protocol.judged(records)
    assert judged["threshold"] == 7.0
    assert judged["overall"]["confusion"] == {"right_solved": 1, "right_unsolved": 0, "wrong_solved": 1,
                                              "wrong_unsolved": 0}
    assert judged["overall"]["accuracy_by_turn"] == [0.5, 0.5, 0.5]  # max_turns from the same rule
    fixed_protocol = PROTOCOLS["fixed"](ml_collections.ConfigDict(dict(roles=("student", "teacher"))))
    assert isinstance(fixed_protocol, FixedProtocol) and fixed_protocol.rule.threshold == 8.0


def test_teacher_curve_scores_replies_against_the_rule():
    """experiments/teacher_curve.py's held-out score: agreement over every turn, direction and distance score over
    the wrong answers, per task, on four hand-made replies."""
    from fire_jax.dialogue.agents import Feedback

    module = _experiment("teacher_curve")

    def turn(source, truth, answer):
        return {"source": source, "groundtruth": {"value": truth},
                "conversations": [{"value": f"Thought: I look.\nAnswer: {answer}"}, {"value": ""}]}

    turns = [turn("synthetic_count", "There are 5.", "There are 5."),   # right, scored 10: agrees
             turn("synthetic_count", "There are 5.", "There are 5."),   # right, scored 6: disagrees
             turn("synthetic_count", "There are 5.", "There are 3."),   # wrong by 2: the rule's reply
             turn("synthetic_color", "It is red.", "It is blue.")]      # wrong: other way, wrong score
    rule = synthetic.exact_feedback("There are 5.", "There are 3.")
    assert rule[1] == 4 and "too low" in rule[0]
    replies = [Feedback("Score: 10.\nFeedback: Correct! Your answer is right.", 10.0),
               Feedback("Score: 6.\nFeedback: Your count is too high. Count them again.", 6.0),
               Feedback(rule[0], float(rule[1])),
               Feedback("Score: 6.\nFeedback: The colour comes later in the rainbow. Look again.", 6.0)]
    assert "earlier" in synthetic.exact_feedback("It is red.", "It is blue.")[0]
    result = module.score(turns, replies)
    assert result == {"turns": 4, "agreement": 3, "wrong": 2, "direction": 1, "distance": 1,
                      "wrong count": 1, "direction count": 1, "wrong color": 1, "direction color": 0,
                      # the blind teacher: "too low", 4 to 3 (both the rule's); "earlier", 6 to blue (4 away: 1)
                      "blind direction": 2, "blind distance": 1}, result
    assert len(module.held_out_turns(120)) == 120


def test_short_teacher_renders_drop_the_instruction_and_the_thought():
    """data.short_teacher_share (experiments/teacher_curve.py --short_share): the chosen training turns lose the
    instruction message and the judged response's thought, nothing else (image, question, groundtruth, the
    labelled feedback); the others keep the paper's prompt; the choice is drawn per id, so a rerun shortens the
    same turns."""
    from fire_jax.core.config import resolve_path
    from fire_jax.data import chat
    from fire_jax.data.records import parse_record

    with open(resolve_path("assets:synthetic_fire/train.json"), encoding="utf-8") as f:
        turns = synthetic.turn_records(json.load(f)[:100], seed=0, right_share=0.25)

    def render(turn, share):
        return chat.training_messages(parse_record(turn, default_id="x"), "teacher", teacher_history="latest",
                                      short_teacher_share=share)

    short = 0
    for t in turns:
        messages, before = render(t, 0.5), render(t, 0.0)
        assert [m.text for m in before][1] == chat.TEACHER_INSTRUCTION and len(before) == 4
        if len(messages) == 4:
            assert messages == before
            continue
        short += 1
        response = t["conversations"][-2]["value"]
        assert messages[0] == before[0] and messages[0].images == 1 and "Groundtruth: " in messages[0].text
        assert messages[1].role == "user" and messages[1].text == f"Answer: {answer_of(response)}"
        assert messages[2] == before[3] and messages[2].turn > 0  # the feedback, labelled as before
    assert 0.35 * len(turns) < short < 0.65 * len(turns), short
    chosen = {t["id"] for t in turns if len(render(t, 0.5)) == 3}
    # drawn per id, not per position: the same turns in another order (another epoch's shuffle) are the same
    assert {t["id"] for t in reversed(turns) if len(render(t, 0.5)) == 3} == chosen
    assert all(len(render(t, 0.0)) == 4 for t in turns)


def test_teacher_order_contrast_batches_differ_only_by_the_groundtruth():
    """experiments/teacher_order.py --contrast: a step's examples share the task and the answer, and their
    groundtruths alternate above and below it where the scale has both sides (hand-checked: a count answer of 1
    (0-based 0) has groundtruths above only)."""
    module, rng = _experiment("teacher_order"), __import__("random").Random(0)
    items = module.pairs(["count", "bars", "color"])
    assert ("count", 4, 0) in items and ("count", 5, 0) not in items  # at most MAX_OFFSET apart
    for _ in range(200):
        batch = module.batch_items(items, 4, True, rng)
        assert len({(name, given) for name, _, given in batch}) == 1 and all(b in items for b in batch)
        name, _, given = batch[0]
        above = [truth > given for _, truth, _ in batch]
        if 0 < given < synthetic.TASKS[name].size - 1:
            assert above == [True, False, True, False]
    assert {t for _, t, _ in module.batch_items([("count", t, 0) for t in (1, 2)], 4, True, rng)} == {1, 2}
    assert len(module.batch_items(items, 3, False, rng)) == 3


def test_compare_probe_checks_every_ordered_pair_against_the_rule():
    """experiments/compare_probe.py: 92 ordered pairs of two different values (counts 7 x 6, bars 5 x 4, colours
    6 x 5); the rule's own replies pass both checks on all of them; "Score: 6." with "too high" to every pair
    passes the direction exactly where the answer is above the groundtruth, and the distance score where it is
    also one step off."""
    module = _experiment("compare_probe")
    todo = module.pairs()
    assert len(todo) == len(set(todo)) == 42 + 20 + 30
    assert ("count", "There are 1.", "There are 7.") in todo and ("color", "It is red.", "It is purple.") in todo
    rows = module.checked(todo, [synthetic.exact_feedback(truth, answer)[0] for _, truth, answer in todo])
    assert all(row["direction"] and row["distance"] for row in rows)
    high = "Score: 6.\nFeedback: Your count is too high. Count them again.\n"
    rows = module.checked(todo, [high] * len(todo))
    counts = [row for row in rows if row["task"] == "count"]
    assert sum(row["direction"] for row in counts) == 21  # the 21 pairs whose answer is the larger count
    assert sum(row["distance"] for row in counts) == 12  # distance 1 scores 6: 6 pairs each side
    assert sum(row["direction"] for row in rows if row["task"] != "count") == 0  # the count hint fits no other task
    assert sum(row["distance"] for row in rows) == 12 + 8 + 10  # the score alone is checked: every distance-1 pair
