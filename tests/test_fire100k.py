"""python -m fire_jax.make_fire100k against a loopback fire_jax.serve scripted model (docs/fire100k.md):
the strict parse, every filter and drop reason, sharding, resume after a kill, and the Fig. 5 statistics."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fire_jax.data.records import load_records
from fire_jax.serving.demo import EXAMPLES_DIR
from fire_jax.data.items import Item
from fire_jax.dialogue.fire100k import MAX_TURNS, Malformed, parse_conversation, to_record
from fire_jax.make_fire100k import main
from loopback import child_env, get_json, server

IMAGE_ROOT = os.path.join(EXAMPLES_DIR, "images")


def conversation(*turns):
    """A model output: turns as (score, answer)."""
    return json.dumps({"turns": [{"thought": f"I look again ({k}).", "answer": answer, "score": score,
                                  "feedback": f"Check part {k} of your answer."}
                                 for k, (score, answer) in enumerate(turns, 1)]})


#: question -> (source, the scripted model's output, expected outcome: "kept" or a drop reason)
CASES = {
    "Q-two-turns": ("count", conversation((4, "There are 3."), (9, "There are 2.")), "kept"),
    "Q-three-turns": ("count", "```json\n" + conversation((2, "Red."), (5, "Blue."), (8, "Green.")) + "\n```", "kept"),
    "Q-half-points": ("bars", conversation((6.5, "Bar 2."), (10, "Bar 3.")), "kept"),
    "Q-no-gain": ("bars", conversation((5, "Bar 1."), (5, "Bar 4.")), "no_improvement"),
    "Q-one-turn": ("bars", conversation((9, "Bar 3.")), "no_improvement"),
    "Q-seven-turns": ("count", conversation(*[(k, f"There are {k}.") for k in range(1, 8)]), "too_many_turns"),
    "Q-prose": ("count", "Sure! Here is a conversation: the student says 3...", "not_json"),
    "Q-wrong-keys": ("color", json.dumps({"turns": [{"response": "Red.", "score": 3}]}), "bad_structure"),
    "Q-score-11": ("color", conversation((3, "Red."), (11, "Green.")), "bad_score"),
    "Q-empty": ("color", conversation((3, "Red."), (7, " ")), "empty_text"),
}


def test_parse_conversation_is_strict():
    turns = parse_conversation("```json\n" + conversation((4, "There are 3."), (7.5, "There are 2.")) + "\n```")
    assert [t.response for t in turns] == ["Thought: I look again (1).\nAnswer: There are 3.",
                                           "Thought: I look again (2).\nAnswer: There are 2."]
    assert [t.feedback for t in turns] == ["Score: 4.\nFeedback: Check part 1 of your answer.",
                                           "Score: 7.5.\nFeedback: Check part 2 of your answer."]
    assert [t.score for t in turns] == [4, 7.5] and turns[1].feedback_text == "Check part 2 of your answer."
    for question, (source, output, outcome) in CASES.items():
        item = Item(question, "test_00000.png", question, "The answer.", source)
        record, drop = to_record(item, output, image_root="", split="fire_100k", max_turns=MAX_TURNS)
        assert (drop["reason"] if drop else "kept") == outcome, question
        assert (record is None) == (drop is not None) and (drop is None or drop["id"] == question)
        if outcome not in ("kept", "no_improvement", "too_many_turns"):
            with pytest.raises(Malformed) as e:
                parse_conversation(output)
            assert e.value.reason == outcome, question
    for output, reason in [("[]", "bad_structure"), ('{"turns": []}', "bad_structure"),
                           (conversation((True, "x"), (9, "y")), "bad_score"),
                           (conversation(("7", "x"), (9, "y")), "bad_score")]:
        with pytest.raises(Malformed, match=reason):
            parse_conversation(output)


@pytest.fixture(scope="module")
def triplets(tmp_path_factory):
    """The CASES as triplets on shipped images, plus a slow one (the model takes 30 s) last, and one bad input."""
    root = tmp_path_factory.mktemp("fire100k")
    rules = [{"contains": f"Question: {q}\n", "reply": output} for q, (_, output, _) in CASES.items()]
    rules.append({"contains": "Question: Q-slow\n", "reply": CASES["Q-two-turns"][1], "delay_s": 30})
    (root / "model.json").write_text(json.dumps({"rules": rules}))
    lines = [{"id": q, "image": f"test_{i:05d}.png", "question": q, "groundtruth": "The answer.", "source": source}
             for i, (q, (source, _, _)) in enumerate(CASES.items())]
    lines.append({"id": "Q-slow", "image": "test_00011.png", "question": "Q-slow", "groundtruth": "The answer.",
                  "source": "slow"})
    lines.append({"id": "no-image", "image": "missing.png", "question": "Q", "groundtruth": "A"})
    (root / "triplets.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return root


@pytest.fixture(scope="module")
def model(triplets):
    with server("fire_jax.serve", ["--plugin", "scripted_model", "--model",
                                    f"scripted=scripted:{triplets / 'model.json'}"], "/health") as (_, base):
        yield base


def args(triplets, model, out, *extra):
    return ["--model", f"api:{model}/v1#scripted", "--input", str(triplets / "triplets.jsonl"), "--image_root",
            IMAGE_ROOT, "--out", str(out), "--concurrency", "4", *extra]


def test_generate_kill_resume_filters_and_statistics(triplets, model, tmp_path, capsys):
    out = tmp_path / "fire100k.jsonl"
    counts = lambda: get_json(f"{model}/health")["models"]["scripted"]["requests"]
    before = counts()  # the fixture's model is shared by the module's tests
    served = lambda: {rule: n - before[rule] for rule, n in counts().items()}  # requests made by this test
    env = child_env()
    process = subprocess.Popen([sys.executable, "-m", "fire_jax.make_fire100k",
                                *args(triplets, model, out, "--concurrency", "1")],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    written = lambda: sum(len(p.read_text().splitlines()) for p in (out, tmp_path / "fire100k.jsonl.dropped.jsonl")
                          if p.exists())
    deadline = time.time() + 60
    # poll: every fast triplet is done and the slow one has reached the model (in flight); the client writes the
    # last fast result before it sends the slow request, so waiting on the files alone can kill it too early
    in_flight = lambda: served().get("Question: Q-slow\n", 0) == 1
    while written() < len(CASES) or not in_flight():
        assert process.poll() is None and time.time() < deadline, "generation stopped early"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert served()["Question: Q-slow\n"] == 1 and all(v == 1 for v in served().values())

    # the rerun asks only for the triplet in flight at the kill; it times out: api_error, counted, not stored
    stats = main(args(triplets, model, out, "--timeout", "1", "--retries", "0"))
    assert all(v == 1 for k, v in served().items() if k != "Question: Q-slow\n")
    assert served()["Question: Q-slow\n"] == 2
    expected = {}
    for _, _, outcome in CASES.values():
        expected[outcome] = expected.get(outcome, 0) + 1
    expected.pop("kept")
    assert stats["dropped"] == {**expected, "api_error": 1}
    assert stats["per_source"] == {
        "bars": {"triplets": 3, "done": 3, "kept": 1, "yield": 1 / 3},
        "color": {"triplets": 3, "done": 3, "kept": 0, "yield": 0.0},
        "count": {"triplets": 4, "done": 4, "kept": 2, "yield": 0.5},
        "slow": {"triplets": 1, "done": 0, "kept": 0, "yield": None}}

    records, bad = load_records(str(out), IMAGE_ROOT)  # what tools/build_dataset.py reads
    assert not bad and sorted(r.id for r in records) == ["Q-half-points", "Q-three-turns", "Q-two-turns"] == sorted(
        json.loads(line)["id"] for line in out.read_text().splitlines())  # no duplicates after the resume
    by_id = {r.id: r for r in records}
    assert [t.score for t in by_id["Q-three-turns"].turns] == [2, 5, 8] and by_id["Q-three-turns"].source == "count"
    assert by_id["Q-two-turns"].turns[1].response == "Thought: I look again (2).\nAnswer: There are 2."
    assert by_id["Q-two-turns"].image == "test_00000.png" and by_id["Q-two-turns"].split == "fire_100k"
    raw = json.loads(out.read_text().splitlines()[0])
    assert raw["round"] == len(raw["conversations"]) // 2 and raw["score"][-1] > raw["score"][0]
    dropped = {d["id"]: d["reason"] for d in map(json.loads, (tmp_path / "fire100k.jsonl.dropped.jsonl").open())}
    assert dropped == {q: o for q, (_, _, o) in CASES.items() if o != "kept"}

    # Fig. 5 of the kept: first scores 4, 2, 6.5 (bin 7); gains turn 2: (5 + 3 + 3.5) / 3, turn 3: 3
    statistics = stats["statistics"]
    assert statistics["first_score"] == [0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0]
    assert statistics["score_gain"] == pytest.approx({2: 11.5 / 3, 3: 3.0}) and statistics["turns"] == {2: 2, 3: 1}
    assert json.loads((tmp_path / "fire100k.jsonl.stats.json").read_text())["dropped"]["api_error"] == 1
    assert (tmp_path / "fire100k.jsonl.stats.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "input bad records: 1" in printed and "count" in printed and "50%" in printed
    assert "first-turn scores 0..10: [0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0]" in printed


def test_shards_split_the_triplets(triplets, model, tmp_path):
    out = tmp_path / "sharded.jsonl"
    done = []
    for index in range(2):
        main(args(triplets, model, out, "--process_index", str(index), "--process_count", "2", "--timeout", "1",
                  "--retries", "0"))
        path = tmp_path / f"sharded-{index:05d}-of-00002.jsonl"
        done.append({json.loads(line)["id"] for p in (path, f"{path}.dropped.jsonl") for line in open(p)})
    ids = list(CASES)  # the slow triplet (index 10, shard 0) times out and is in neither file
    assert done == [set(ids[0::2]), set(ids[1::2])]


def test_scripted_model_replies_and_refuses(model):
    import openai

    client = openai.OpenAI(base_url=f"{model}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="scripted", messages=[
        {"role": "user", "content": "Question: Q-prose\nGroundtruth: x"}])
    assert reply.choices[0].message.content == CASES["Q-prose"][1]
    chunks = client.chat.completions.create(model="scripted", stream=True, messages=[
        {"role": "user", "content": "Question: Q-prose\nGroundtruth: x"}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == CASES["Q-prose"][1]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "no rule matches"}])
    assert e.value.status_code == 400 and e.value.code == "no_scripted_reply"
