"""FIRE-Bench runners: fixed and free dialogues, resume, stopping rules, reports, plots, FIRE-1M generation."""

import json
import math
import os

import numpy as np
import pytest

from fire_jax.core.config import load_config, resolve_path
from fire_jax.data.items import Item, load_conversations, load_triplets
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.records import load_records
from fire_jax.data.scores import feedback_text, parse_score
from fire_jax.eval import fixed, free, plots, report
from fire_jax.eval.fire_bench import agent_spec, build_agents, evaluate, model_config, split_statistics
from fire_jax.dialogue.agents import Feedback, from_spec
from fire_jax.dialogue.fire1m import make_fire_records
from fire_jax.dialogue.loop import run_dialogues
from fire_jax.dialogue.stop import FIRE_1M_GENERATION, FREE_DIALOGUE, STOP_REASONS, StopRule, stop_reason
from fire_jax.core.results import ResultStore

ROOT = os.path.join(os.path.dirname(__file__), "..")
TEST_JSON = resolve_path("assets:synthetic_fire/test.json")
IMAGES = resolve_path("assets:synthetic_fire/images")
IMAGE = os.path.join(IMAGES, "test_00000.png")


def eval_config(setting, **test):
    config = load_config(os.path.join(ROOT, "configs", f"eval_{setting}.py"))
    config.test.update(test)
    config.decode.update(batch_size=4, max_new_tokens=4)
    return config


# ---------------------------------------------------------------------------- scripted agents


class ScriptedStudent:
    """Answers "<question> #k"; records (image, question, k) of every row it is asked for."""

    def __init__(self):
        self.calls, self.rows = 0, []

    def respond(self, images, questions, histories, rng=None):
        self.calls += 1
        self.rows += [(image, q, len(h) + 1) for image, q, h in zip(images, questions, histories)]
        return [f"Thought: turn {len(h) + 1}.\nAnswer: {q} #{len(h) + 1}" for q, h in zip(questions, histories)]


class ScriptedTeacher:
    """Gives the scores script[question][k - 1] (None: a reply without a score); raises after ``fail_after`` calls."""

    def __init__(self, script=None, default=5, fail_after=None):
        self.script, self.default, self.fail_after = script or {}, default, fail_after
        self.calls, self.rows, self.answers = 0, [], []

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("killed")
        self.calls += 1
        out = []
        for image, question, answer, history in zip(images, questions, answers, histories):
            k = len(history) + 1
            self.rows.append((image, question, k))
            self.answers.append(answer)
            scores = self.script.get(question)
            score = self.default if scores is None else scores[k - 1]
            text = "Feedback: no score here." if score is None else f"Score: {score}.\nFeedback: look again ({k})."
            out.append(Feedback(text, parse_score(text)))
        return out


def synthetic_records(n):
    with open(TEST_JSON) as f:
        return json.load(f)[:n]


def items_of(script, source="synthetic"):
    return [Item(question, IMAGE, question, "gt", source) for question in script]


# Scores the teacher would give per turn -> (n_k, final scores, stop reason) under the free-dialogue rule.
FREE_CASES = {
    "solved on turn 3": ([3, 5, 9], [3, 5, 9], "solved"),
    "equal score": ([3, 3, 9], [3, 3], "no_increase"),
    "lower score": ([4, 2, 9], [4, 2], "no_increase"),
    "solved at once": ([9, 10], [9], "solved"),
    "eight solves": ([8], [8], "solved"),
    "no score first": ([None], [None], "no_score"),
    "no score later": ([2, None], [2, None], "no_score"),
    "five turns": ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5], "max_turns"),
    "solved on turn 5": ([1, 2, 3, 4, 8], [1, 2, 3, 4, 8], "solved"),
    "decimal scores": ([7.5, 7.5], [7.5, 7.5], "no_increase"),
}


def test_free_dialogue_stopping_rules_batched_with_drop_out():
    script = {name: scores for name, (scores, _, _) in FREE_CASES.items()}
    student, teacher, finished = ScriptedStudent(), ScriptedTeacher(script), []
    steps = run_dialogues(items_of(script), student, teacher, FREE_DIALOGUE, batch_size=3,
                               on_finish=finished.append)
    got = {d.item.id: (d.scores, d.stop) for d in finished}
    assert got == {name: (scores, stop) for name, (_, scores, stop) in FREE_CASES.items()}
    assert len(finished) == len(FREE_CASES)
    # Each call carries the live dialogues (at most 3): the rows are exactly the dialogues' turns (the agents,
    # not the loop, pad a short call with inactive rows).
    turns = sum(len(scores) for _, scores, _ in FREE_CASES.values())
    assert student.calls == teacher.calls == steps
    assert len(teacher.rows) == len(student.rows) == turns and turns <= 3 * steps < turns + 3 * 3
    assert all(answer.endswith(f"#{k}") for (_, _, k), answer in zip(teacher.rows, teacher.answers))  # scores r_k
    for d in finished:
        assert [t.response for t in d.turns] == [f"Thought: turn {k}.\nAnswer: {d.item.id} #{k}"
                                                for k in range(1, len(d.turns) + 1)]


def test_fire_1m_rule_stops_at_three_turns_and_ignores_decreases():
    script = {"a": [3, 3, 9], "b": [3, 2, 1, 9], "c": [2, 9], "d": [9]}
    finished = []
    run_dialogues(items_of(script), ScriptedStudent(), ScriptedTeacher(script), FIRE_1M_GENERATION,
                       batch_size=2, on_finish=finished.append)
    assert {d.item.id: (d.scores, d.stop) for d in finished} == {
        "a": ([3, 3, 9], "solved"), "b": ([3, 2, 1], "max_turns"), "c": ([2, 9], "solved"), "d": ([9], "solved")}


def test_the_releases_chat_rule_runs_from_the_free_dialogue_config(tmp_path):
    """Every field of the stop rule comes from ``config.free``: the release's interactive chat
    (llava/eval/feedback_chat.py: stop only on a score of 10, at most 3 rounds) set by overrides stops the same
    scripted dialogues elsewhere than the paper's rule, and the report and the exact judge read its threshold."""
    from fire_jax.core.config import apply_overrides

    raw = synthetic_records(5)
    questions = [f"question {k}" for k in range(5)]  # the scripted teacher's keys
    for record, question in zip(raw, questions):
        record["question"]["value"] = question
    test_json = tmp_path / "test.json"
    test_json.write_text(json.dumps(raw))
    scores = [[9, 10], [4, 3, 6, 10], [10], [8, 8, 8, 8], [2, None]]
    script = dict(zip(questions, scores))
    expected = {"paper": [([9], "solved"), ([4, 3], "no_increase"), ([10], "solved"), ([8], "solved"),
                          ([2, None], "no_score")],
                "release": [([9, 10], "solved"), ([4, 3, 6], "max_turns"), ([10], "solved"), ([8, 8, 8], "max_turns"),
                            ([2, None], "no_score")]}
    for name, overrides in (("paper", []), ("release", ["free.max_turns=3", "free.threshold=10.0",
                                                        "free.stop_on_no_increase=False"])):
        config = eval_config("free", json=str(test_json), image_root=IMAGES)
        apply_overrides(config, overrides)
        results = evaluate(config, str(tmp_path / name), agents=(ScriptedStudent(), ScriptedTeacher(script)))
        by_question = {r["question"]: (r["scores"], r["stop"]) for r in ResultStore.read(results["outputs"]).values()}
        assert [by_question[q] for q in questions] == expected[name], name
        threshold = 10 if name == "release" else 8
        assert results["metrics"]["judged"]["threshold"] == threshold
        assert len(results["metrics"]["overall"]["accuracy_by_turn"]) == (3 if name == "release" else 5)
        markdown = open(tmp_path / name / "results.md").read()
        assert f"accuracy by turn (% of items with score >= {threshold})" in markdown
        assert f"the teacher says \"right\" when its score is >= {threshold}" in markdown
    # [9, 10] and [8, 8, 8] are solved by the paper's rule, not by the release's: the curves differ at turn 1
    assert results["metrics"]["overall"]["accuracy_by_turn"][0] == pytest.approx(1 / 5)
    assert StopRule.from_config(config.free) == StopRule(max_turns=3, threshold=10.0,
                                                                           stop_on_no_increase=False)


def test_the_free_dialogue_config_gives_the_papers_rule():
    assert StopRule.from_config(eval_config("free").free) == FREE_DIALOGUE


def test_free_metrics_per_source_and_baseline_normalisation(tmp_path):
    records = [{"source": "x", "scores": [3, 5, 9], "stop": "solved"},  # t = 3
               {"source": "x", "scores": [3, 3], "stop": "no_increase"},  # t = p = 10
               {"source": "y", "scores": [9], "stop": "solved"},  # n = 1: not in K
               {"source": "y", "scores": [2, None], "stop": "no_score"}]  # last counts 0, t = 10
    results = free.free_results(records)
    overall = results["overall"]
    assert overall["K"] == 3 and overall["items"] == 4 and overall["AT"] == 1.0
    assert overall["mean_turns"] == pytest.approx(23 / 3)
    assert overall["ADR"] == pytest.approx((6 + 0 - 2) / 3)
    assert overall["ATR"] == pytest.approx((3 + 0 - 2) / 3)
    assert overall["RR"] == pytest.approx(1 / 3)
    assert overall["accuracy_by_turn"] == [0.25, 0.25, 0.5, 0.5, 0.5]
    assert results["per_source"]["y"]["K"] == 1 and results["per_source"]["y"]["mean_turns"] == 10
    baseline = {"name": "base", "overall": 5.0, "per_source": {"x": 4.0}}
    normalised = free.free_results(records, baseline=baseline)
    assert normalised["overall"]["AT"] == pytest.approx(23 / 3 / 5)
    assert normalised["per_source"]["x"]["AT"] == pytest.approx(6.5 / 4)
    assert math.isnan(normalised["per_source"]["y"]["AT"])  # the baseline has no such source
    assert normalised["baseline"] == "base"


def test_free_run_killed_midway_resumes_without_redoing(tmp_path):
    script = {f"q{i}": scores for i, scores in enumerate([[3, 9], [9], [2, 4, 6, 8], [5, 5], [None], [1, 9], [7, 9]])}
    items = items_of(script)
    path = str(tmp_path / "free.jsonl")
    with pytest.raises(RuntimeError, match="killed"):
        free.run_free(items, ScriptedStudent(), ScriptedTeacher(script, fail_after=3), path, batch_size=2)
    with ResultStore(path) as store:
        done = {record["id"] for record in store}
    assert 0 < len(done) < len(items)
    with open(path, "a") as f:
        f.write('{"key": "q6", "id": "q6", "sco')  # a kill while writing leaves a partial line
    student, teacher = ScriptedStudent(), ScriptedTeacher(script)
    records = free.run_free(items, student, teacher, path, batch_size=2)
    assert [r["id"] for r in records] == list(script)
    assert {q for _, q, k in student.rows if k == 1} == set(script) - done  # no finished dialogue restarts
    assert student.calls == teacher.calls
    # Only the unfinished dialogues were run again: the turns generated are theirs (plus batch padding).
    needed = sum(len(r["scores"]) for r in records if r["id"] not in done)
    assert needed <= len(teacher.rows) < needed + 2 * 2
    expected = {"q0": [3, 9], "q1": [9], "q2": [2, 4, 6, 8], "q3": [5, 5], "q4": [None], "q5": [1, 9],
                "q6": [7, 9]}
    assert {r["id"]: r["scores"] for r in records} == expected
    assert all(len(r["turns"]) == len(r["scores"]) for r in records)
    with open(path) as f:
        assert len([json.loads(line) for line in f]) == len(items)  # nothing lost, nothing twice
    again = ScriptedTeacher(script)
    free.run_free(items, ScriptedStudent(), again, path, batch_size=2)
    assert again.calls == 0


def test_fixed_run_resumes_and_scores_against_the_ground_truth(tmp_path):
    pairs = load_conversations(dict(json=TEST_JSON, image_root=IMAGES, max_examples=5))
    turns = fixed.labelled_turns(pairs)
    n_turns = [len(record.turns) for record, _ in pairs]
    assert len(turns) == sum(n - 1 for n in n_turns) + sum(n_turns)  # student r_k, k >= 2; teacher f_k, k >= 1
    path = str(tmp_path / "fixed.jsonl")
    with pytest.raises(RuntimeError, match="killed"):
        fixed.run_fixed(turns, ScriptedStudent(), ScriptedTeacher(fail_after=1), path, batch_size=3)
    with ResultStore(path) as store:
        first = {record["key"] for record in store}
    student, teacher = ScriptedStudent(), ScriptedTeacher()
    records = fixed.run_fixed(turns, student, teacher, path, batch_size=3)
    assert [r["key"] for r in records] == [t.key for t in turns]
    generated = {role: {(image, k) for image, _, k in agent.rows}
                 for role, agent in (("student", student), ("teacher", teacher))}
    redone = {t.key for t in turns if (t.image, t.turn) in generated[t.role]}
    assert redone == {t.key for t in turns} - first  # nothing generated twice
    results = fixed.fixed_results(records)
    teacher_records = [r for r in records if r["role"] == "teacher"]
    assert results["teacher"]["overall"]["MAE"] == pytest.approx(
        np.mean([abs(5 - r["reference_score"]) for r in teacher_records]))
    assert results["teacher"]["overall"]["n"] == len(teacher_records)
    assert all(r["reference"] == dict(zip([p[0].id for p in pairs], [p[0] for p in pairs]))[r["id"]]
               .turns[r["turn"] - 1].feedback for r in teacher_records)
    assert feedback_text(teacher_records[0]["prediction"]).startswith("look again")
    sources = {"teacher": {record.source for record, _ in pairs},  # every turn; the student's from turn 2 only
               "student": {record.source for record, _ in pairs if len(record.turns) > 1}}
    for role in ("student", "teacher"):
        assert set(results[role]["per_source"]) == sources[role]
        assert sum(m["n"] for m in results[role]["per_source"].values()) == results[role]["overall"]["n"]
        assert all(0 <= results[role]["overall"][f"BLEU-{n}"] <= 1 for n in range(1, 5))


def load_model(config, section):
    """The model of an agent section, built as the runners build it (agent_spec -> from_spec)."""
    spec, init = agent_spec(section)
    return from_spec(spec, "student", config=model_config(config), init=init).backend.model


def test_a_backend_is_any_generator_of_texts_for_prompt_messages():
    """Student and Teacher are one prompt builder each, over any backend with generate(images, prompts, sampling,
    rng): here a test double that replies with the last message's text. The teacher's history mode decides what it
    sees."""
    from fire_jax.data.records import Turn
    from fire_jax.dialogue.agents import Student, Teacher

    class Echo:
        def __init__(self):
            self.calls = []

        def generate(self, images, prompts, sampling=None, rng=None):
            self.calls.append((list(images), prompts, rng))
            return [f"Score: {len(p)}. {p[-1].text}" for p in prompts]

    echo = Echo()
    history = [Turn("Answer: 2.", "Score: 4.\nFeedback: Too low.", 4.0)]
    assert Student(echo).respond(["img"], ["How many?"], [history]) == ["Score: 3. Too low."]  # feedback text only
    (_, [messages], _), = echo.calls
    assert [(m.role, m.images) for m in messages] == [("user", 1), ("assistant", 0), ("user", 0)]
    assert messages[0].text == "How many?" and messages[1].text == "Answer: 2."
    for mode, length in (("latest", 3), ("full", 5)):
        (feedback,) = Teacher(echo, mode).feedback(["img"], ["How many?"], ["3"], ["Answer: 3."], [history])
        assert (feedback.text, feedback.score) == (f"Score: {length}. Answer: 3.", length)
    assert Student(echo).description == ""


def test_from_spec_builds_every_kind_of_agent_and_checks_roles():
    """One factory: endpoint, exact-teacher and in-process specs; roles naming one checkpoint share its model;
    a bad role or teacher history, and an exact student, are refused."""
    from fire_jax.dialogue.agents import ExactTeacher, Student, Teacher, from_specs
    from fire_jax.infer.api import ApiBackend
    from fire_jax.infer.backends import InProcess

    config = eval_config("fixed")
    agents, descriptions = from_specs(model_config(config), {"student": None, "teacher": "random"})
    assert agents["student"].backend.model is agents["teacher"].backend.model and agents["teacher"].history == "latest"
    assert isinstance(agents["student"], Student) and isinstance(agents["teacher"].backend, InProcess)
    assert descriptions["student"] == descriptions["teacher"] and "random" in descriptions["student"]
    endpoint = from_spec("api:http://127.0.0.1:1/v1#m", "teacher", teacher_history="full")
    assert isinstance(endpoint, Teacher) and isinstance(endpoint.backend, ApiBackend) and endpoint.history == "full"
    assert endpoint.description == "endpoint api:http://127.0.0.1:1/v1#m"
    student = from_spec("api:http://127.0.0.1:1/v1#m", "student")
    assert isinstance(student, Student) and isinstance(student.backend, ApiBackend)
    assert isinstance(from_spec("exact:synthetic", "teacher"), ExactTeacher)
    assert agent_spec(dict(init="exact:synthetic", adapter="x")) == ("exact:synthetic", "")
    with pytest.raises(ValueError, match="not a student"):
        from_spec("exact:synthetic", "student")
    with pytest.raises(ValueError, match="teacher history"):
        from_spec("api:http://127.0.0.1:1/v1#m", "teacher", teacher_history="all")
    with pytest.raises(ValueError, match="role"):
        from_spec(None, "judge", config=model_config(config))


@pytest.fixture(scope="module")
def tiny_models():
    """One tiny random model shared by the student and the teacher."""
    config = eval_config("fixed")
    student, teacher = build_agents(config, "full")
    assert student.backend.model is teacher.backend.model
    return student, teacher


def test_fixed_evaluation_with_tiny_models_writes_complete_results(tmp_path, tiny_models):
    config = eval_config("fixed", max_examples=2)
    results = evaluate(config, str(tmp_path), agents=tiny_models)
    with open(tmp_path / "results.json") as f:
        assert json.load(f) == results
    pairs = load_conversations(config.test)
    with open(results["outputs"]) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == len(fixed.labelled_turns(pairs)) == sum(2 * len(r.turns) - 1 for r, _ in pairs)
    for role in ("student", "teacher"):
        overall = results["metrics"][role]["overall"]
        assert all(isinstance(overall[k], float) for k in report.FIXED_COLUMNS)
    assert results["metrics"]["teacher"]["overall"]["MAE"] <= 10
    markdown = (tmp_path / "results.md").read_text()
    assert "| FIRE-LLaVA (paper) | 0.54 | 0.46 | 0.39 | 0.34 | 2.36 |" in markdown
    assert "| FD-LLaVA (paper) | 0.55 | 0.45 | 0.39 | 0.33 | 2.27 | 0.30 |" in markdown
    assert "**random init (fire_jax)**" in markdown
    assert os.path.getsize(tmp_path / "data_statistics.png") > 1000


def test_free_evaluation_with_tiny_models_accounts_for_every_item(tmp_path, tiny_models):
    from fire_jax.dialogue.agents import Teacher

    student, teacher = tiny_models
    latest = Teacher(teacher.backend, history="latest")
    results = evaluate(eval_config("free", max_examples=3), str(tmp_path), agents=(student, latest))
    with open(results["outputs"]) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == results["metrics"]["overall"]["items"] == 3
    for record in records:
        assert record["stop"] in STOP_REASONS and len(record["turns"]) == len(record["scores"]) >= 1
        assert record["stop"] == stop_reason(record["scores"])
    assert len(results["metrics"]["overall"]["accuracy_by_turn"]) == 5
    assert os.path.getsize(tmp_path / "accuracy_by_turn.png") > 1000


def test_free_report_has_paper_rows_per_source_and_baseline(tmp_path):
    raw = synthetic_records(6)
    for record, source in zip(raw, ["textvqa", "textvqa", "MathVista", "mm-vet", "synthetic", "synthdog-en"]):
        record["source"] = source
    test_json = tmp_path / "test.json"
    test_json.write_text(json.dumps(raw))
    script = {record["question"]["value"]: [4, 6, 9] for record in raw}
    base_config = eval_config("free", json=str(test_json), image_root=IMAGES)
    base = evaluate(base_config, str(tmp_path / "base"), agents=(ScriptedStudent(), ScriptedTeacher(default=4)))
    assert base["metrics"]["overall"]["stops"] == {"no_increase": 6}  # scores 4, 4: t = p = 10 each
    assert base["metrics"]["overall"]["mean_turns"] == 10
    config = eval_config("free", json=str(test_json), image_root=IMAGES)
    config.free.baseline_results = str(tmp_path / "base" / "results.json")
    config.student.name = "scripted"
    results = evaluate(config, str(tmp_path / "run"), agents=(ScriptedStudent(), ScriptedTeacher(script)))
    overall = results["metrics"]["overall"]
    assert overall["K"] == 6 and overall["ADR"] == 5 and overall["RR"] == 1
    assert overall["AT"] == pytest.approx(3 / 10)  # 3 turns, the baseline's t = p = 10 (never solved)
    assert overall["accuracy_by_turn"] == [0, 0, 1, 1, 1]
    markdown = (tmp_path / "run" / "results.md").read_text()
    assert "| FIRE-LLaVA-8B (paper) | 0.84 | 1.56 | 0.66 | 0.39 |  |  |" in markdown
    assert "| **scripted (fire_jax)** | 0.30 | 5.00 | 2.50 | 1.00 | 6 | 6 |" in markdown
    assert "| TextVQA: FIRE-LLaVA (paper) | 0.77 | 1.51 | 0.56 | 0.42 |  |  |" in markdown
    assert "| Synthdog: LLaVA-NeXT (paper) |" in markdown and "Table 5" in markdown
    assert "| MathVista: FIRE100K-LLaVA (paper) | 0.89 | 1.09 | 0.68 | 0.29 |  |  |" in markdown
    assert "| MM-Vet: **scripted (fire_jax)** [mm-vet] |" in markdown and "Table 6" in markdown
    assert "| synthetic | 0.30 |" in markdown  # not in the paper: ours only
    assert "| FIRE-LLaVA (paper) | 49.60 | – | – | – | 69.19 |" in markdown
    with pytest.raises(ValueError, match="other settings"):
        config.free.max_turns = 4
        evaluate(config, str(tmp_path / "run"), agents=(ScriptedStudent(), ScriptedTeacher(script)))


def test_generated_fire_1m_records_load_with_zero_bad_records(tmp_path):
    raw = synthetic_records(6)
    triplets = [{"id": f"t{i}", "image": r["image"], "question": r["question"]["value"],
                 "groundtruth": r["groundtruth"], "source": r["source"]} for i, r in enumerate(raw)]
    triplets.append({"id": "broken", "image": "missing.png", "question": "q", "groundtruth": "g"})
    (tmp_path / "triplets.jsonl").write_text("\n".join(json.dumps(t) for t in triplets) + "\n")
    bad = BadRecords()
    items = load_triplets(str(tmp_path / "triplets.jsonl"), IMAGES, bad=bad)
    assert len(items) == 6 and dict(bad) == {"missing_image": 1}
    # Teacher scores keyed by question; questions repeat in the synthetic set, so give each item its own.
    items = [Item(item.id, item.image, f"{item.question} ({item.id})", item.groundtruth, item.source)
             for item in items]
    scripts = [[3, 9], [9], [3, 3, 3], [None], [2, 4, 5], [4, 2, 6]]
    script = {item.question: s for item, s in zip(items, scripts)}
    out = str(tmp_path / "fire_1m.jsonl")
    kept, dropped = make_fire_records(items, ScriptedStudent(), ScriptedTeacher(script), out, image_root=IMAGES,
                                     batch_size=4)
    assert kept == 3 and dict(dropped) == {"no_improvement": 2, "no_score": 1}
    records, bad = load_records(out, IMAGES, on_bad_record="error")
    assert not bad
    assert {r.id: [t.score for t in r.turns] for r in records} == {"t0": [3, 9], "t4": [2, 4, 5], "t5": [4, 2, 6]}
    assert all(r.split == "fire_1m" and not os.path.isabs(r.image) for r in records)
    assert records[0].turns[0].feedback_text == "look again (1)."
    again = ScriptedTeacher(script)
    assert make_fire_records(items, ScriptedStudent(), again, out, image_root=IMAGES)[0] == 3 and again.calls == 0


def test_data_statistics_and_plots(tmp_path):
    stats = split_statistics(os.path.join(ROOT, "fire_jax", "assets", "synthetic_fire", "train.json"), str(tmp_path))
    records, _ = load_records(resolve_path("assets:synthetic_fire/train.json"), IMAGES)
    assert stats["dialogues"] == len(records) == sum(stats["first_score"]) == sum(stats["turns"].values())
    gains = [r.turns[1].score - r.turns[0].score for r in records if len(r.turns) > 1]
    assert stats["score_gain"][2] == pytest.approx(np.mean(gains))
    assert os.path.getsize(tmp_path / "data_statistics.png") > 1000
    own = plots.data_statistics([[2, 5, 9], [9], {"scores": [4, None]}])
    assert own["first_score"][2] == own["first_score"][9] == own["first_score"][4] == 1
    assert own["score_gain"] == {2: pytest.approx((3 - 4) / 2), 3: 4.0} and own["turns"] == {1: 1, 2: 1, 3: 1}
    out = str(tmp_path / "accuracy.png")
    plots.plot_accuracy_by_turn({"ours": [0.2, 0.4, 0.5, 0.5, 0.6]}, out,
                                paper=report.paper_results()["figure7_accuracy_by_turn"])
    assert os.path.getsize(out) > 1000


def test_load_agent_from_a_peft_adapter(tmp_path):
    import jax

    from fire_jax.convert.hf import save_peft_adapter
    from fire_jax.models import LoRAParam
    from flax import nnx

    config = eval_config("fixed")
    config.model.lora = dict(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v"))
    trained = load_model(config, {})
    state = nnx.state(trained, LoRAParam)
    leaves = jax.tree.leaves(state)
    nnx.update(trained, jax.tree.unflatten(jax.tree.structure(state),
                                           [np.full(x.shape, i + 1.0, x.dtype) for i, x in enumerate(leaves)]))
    save_peft_adapter(trained, str(tmp_path / "adapter"))
    config.model.lora = dict(rank=8, alpha=32.0, dropout=0.05, targets=("q", "k"))  # the adapter's own wins
    loaded = load_model(config, dict(adapter=str(tmp_path / "adapter")))
    assert loaded.cfg.lora.targets == ("q", "v") and loaded.cfg.lora.rank == 4
    for a, b in zip(jax.tree.leaves(nnx.state(loaded, LoRAParam)), jax.tree.leaves(nnx.state(trained, LoRAParam))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_agent_restores_a_training_workdir_as_its_exported_adapter(tmp_path):
    import jax
    from flax import nnx

    from fire_jax.models import LoRAParam
    from fire_jax.train import loop

    train_config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    train_config.data.update(batch_size=2, buckets=(256,), max_len=256)
    train_config.train.update(batch_size=2, total_steps=2, warmup_frac=0.0, lr=1e-2)
    train_config.mesh.shape = (1, 1, 1)
    workdir = str(tmp_path / "train")
    loop.train(train_config, workdir)
    config = eval_config("fixed")
    restored = load_model(config, dict(adapter=workdir))  # the orbax checkpoint
    exported = load_model(config, dict(adapter=os.path.join(workdir, "export", "peft_adapter")))
    lora_b = restored.language_model.model.layers[0].self_attn.q_proj.lora_b[...]
    assert np.abs(np.asarray(lora_b)).max() > 0  # trained, not the B = 0 init
    for a, b in zip(jax.tree.leaves(nnx.state(restored, LoRAParam)), jax.tree.leaves(nnx.state(exported, LoRAParam))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
