"""Records: score parsing, the real FIRE demo records, bad records counted by reason or raising."""

import json
import os

import pytest
from PIL import Image

from fire_jax.data import image_files, scores
from fire_jax.data import records as records_lib
from fire_jax.data.bad_records import BadRecordError
from fire_jax.data.records import Conversation, Instruction, load_records
from fire_jax.data.scores import parse_score

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "fire")
FIXTURE_FILES = [os.path.join(FIXTURES, f) for f in ("fire_100k_demo.json", "fire_1m_demo.json")]
IMAGES = os.path.join(FIXTURES, "images")


@pytest.mark.parametrize("feedback, score", [
    ("Score: 8/10.\nFeedback: good", 8),
    ("Score: 7.5\nFeedback: ok", 7.5),
    ("Score: 4.\nFeedback: no", 4),
    ("Score: 10.", 10),
    ("Score: 0. Feedback: wrong", 0),
    ("Overall Score: 9 out of 10", 9),
    ("Thanks.\nScore: 6.\nFeedback: x", 6),  # first line that contains "Score:"
    ("Score: none\nScore: 5", None),  # that line has no number
    ("Score: 11.\nFeedback: x", None),  # outside 0..10
    ("Score: -1", None),
    ("score: 5", None),  # "Score:" is case-sensitive
    ("Feedback: no score here", None),
    ("", None),
])
def test_parse_score(feedback, score):
    parsed = parse_score(feedback)
    assert parsed == score and type(parsed) is type(score)


# The release's get_score (MM-FIRE/FIRE llava/eval/feedback_chat.py): the first line must hold "Score:", its first
# run of digits is the score, no range check. Beside each, what the robust reader gives.
@pytest.mark.parametrize("feedback, official, robust", [
    ("Score: 8/10.\nFeedback: good", 8, 8),
    ("Score: 7.5\nFeedback: ok", 7, 7.5),  # digits only: 7
    ("Score: 11.\nFeedback: x", 11, None),  # no range check
    ("Score: -1", 1, None),  # no sign
    ("Score: 0. Feedback: wrong", 0, 0),
    ("Thanks.\nScore: 6.\nFeedback: x", None, 6),  # only the first line counts
    ("Overall Score: 9 out of 10", 9, 9),
    ("Step 1 Score: 9", 1, 1),  # the first number of the line, both
    ("Score: none\nScore: 5", None, None),
    ("score: 5", None, None),
    ("", None, None),
])
def test_parse_score_as_the_release(feedback, official, robust):
    assert parse_score(feedback, parser="official") == official and parse_score(feedback) == robust
    assert official is None or type(parse_score(feedback, parser="official")) is int
    with pytest.raises(ValueError, match="score parser"):
        parse_score(feedback, parser="lenient")


def test_feedback_text():
    assert scores.feedback_text("Score: 3.\nFeedback: Look again.\n") == "Look again."
    assert scores.feedback_text("Score: 3.\nLook again.") == "Look again."


@pytest.fixture(scope="module")
def fixture_records():
    return load_records(FIXTURE_FILES, IMAGES)


def test_real_records_parse(fixture_records):
    records, bad = fixture_records
    assert len(records) == 188 and dict(bad) == {"missing_image": 1}
    assert "fire_1m_demo.json: record 19" in bad.first["missing_image"]
    assert all(isinstance(r, Conversation) for r in records)
    first = records[0]
    assert first.id == "fire_100k_demo:0" and first.source == "gqa" and first.split == "fire_100k"
    assert first.question == "Is the container made of wicker?"
    assert first.groundtruth == "Yes, the container is made of wicker."
    assert [t.score for t in first.turns] == [3, 10]
    assert first.turns[1].response == ("Thought: The container does have a woven texture, which is a "
                                       "characteristic of wicker. \nAnswer: Yes, the container is made of wicker.")
    raw = json.load(open(FIXTURE_FILES[0])) + json.load(open(FIXTURE_FILES[1]))
    raw_scores = {f"{os.path.basename(f)[:-5]}:{i}": r["score"]
                  for f in FIXTURE_FILES for i, r in enumerate(json.load(open(f)))}
    mismatched = {r.id: [t.score for t in r.turns] for r in records if [t.score for t in r.turns] != raw_scores[r.id]}
    # The release's own "score" list agrees with the feedback texts except in one record ("Score: 8/10."
    # then "Score: 10/10." stored as [0, 1]); fire_jax parses the text.
    assert mismatched == {"fire_1m_demo:89": [8, 10]}
    assert len(raw) == 189


def _write_image(path, data=None):
    if data is None:
        Image.new("RGB", (40, 30), (10, 200, 30)).save(path)
    else:
        with open(path, "wb") as f:
            f.write(data)


def _fire(image="ok.png", **changes):
    record = {"image": image, "question": {"role": "user", "value": "How many?"},
              "groundtruth": {"role": "user", "value": "Two."},
              "conversations": [{"role": "student", "type": "response", "value": "Thought: x\nAnswer: 1\n\n"},
                                {"role": "teacher", "type": "feedback", "value": "Score: 3.\nFeedback: More.\n"}],
              "source": "toy"}
    record.update(changes)
    return record


def _turns(*pairs):
    return [{"role": role, "value": value} for role, value in pairs]


BAD = {
    "invalid_json": "{not json",
    "missing_field": json.dumps(_fire(groundtruth=None)),
    "missing_image": json.dumps(_fire(image="absent.png")),
    "unreadable_image": json.dumps(_fire(image="broken.jpg")),
    "bad_turn_order": json.dumps(_fire(conversations=_turns(("teacher", "Score: 3."), ("student", "x")))),
    "empty_text": json.dumps(_fire(conversations=_turns(("student", "  \n"), ("teacher", "Score: 3.\nFeedback: y")))),
    "no_score": json.dumps(_fire(conversations=_turns(("student", "x"), ("teacher", "Feedback: try again")))),
}
FIELDS = {"invalid_json": "<line>", "missing_field": "groundtruth", "missing_image": "image",
          "unreadable_image": "image", "bad_turn_order": "conversations[0].role",
          "empty_text": "conversations[0].value", "no_score": "conversations[1].value"}


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    _write_image(root / "ok.png")
    _write_image(root / "broken.jpg", b"\xff\xd8 this is not a jpeg")
    good = [_fire(), _fire(conversations=_turns(("Student", "a"), ("Teacher", "Score: 7.5\nFeedback: b"),
                                                ("STUDENT", "c"), ("TEACHER", "Score: 9/10. Feedback: d")))]
    lines = [json.dumps(good[0]), *BAD.values(), "", json.dumps(good[1])]
    (root / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_bad_records_counted_by_reason(bad_dir):
    records, bad = load_records(str(bad_dir / "mixed.jsonl"), str(bad_dir))
    assert dict(bad) == {reason: 1 for reason in BAD}
    assert [r.id for r in records] == ["mixed:0", "mixed:8"]  # JSONL indices skip blank lines
    assert [t.score for t in records[1].turns] == [7.5, 9]
    assert all(reason in bad.report() for reason in BAD)


@pytest.mark.parametrize("reason", sorted(BAD))
def test_bad_record_raises_under_error(bad_dir, reason):
    path = bad_dir / f"{reason}.jsonl"
    path.write_text(json.dumps(_fire()) + "\n" + BAD[reason] + "\n")
    with pytest.raises(BadRecordError) as error:
        load_records(str(path), str(bad_dir), on_bad_record="error")
    message = str(error.value)
    assert error.value.reason == reason and error.value.field == FIELDS[reason]
    assert str(path) in message and "record 1" in message and FIELDS[reason] in message


def test_error_names_record_id(bad_dir):
    path = bad_dir / "with_id.json"
    path.write_text(json.dumps([_fire(id="abc-7", image="absent.png")]))
    with pytest.raises(BadRecordError, match=r"with_id.json: record 0 \(id 'abc-7'\): field 'image': missing_image"):
        load_records(str(path), str(bad_dir), on_bad_record="error")


def test_instruction_records(bad_dir):
    path = bad_dir / "llava.json"
    path.write_text(json.dumps([
        {"id": "000001", "image": "ok.png", "conversations": [
            {"from": "human", "value": "What is this?\n<image>"}, {"from": "gpt", "value": "A square."},
            {"from": "human", "value": "Colour?"}, {"from": "gpt", "value": "Green."}]},
        {"id": "text-only", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {"id": "bad", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
    ]))
    records, bad = load_records(str(path), str(bad_dir))
    assert dict(bad) == {"bad_turn_order": 1}
    assert all(isinstance(r, Instruction) for r in records)
    assert records[0].messages == (("user", "What is this?"), ("assistant", "A square."),
                                   ("user", "Colour?"), ("assistant", "Green."))
    assert records[1].image is None


def test_invalid_json_array_file_raises(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"a": 1},')
    with pytest.raises(ValueError, match="broken.json: not a valid JSON array"):
        load_records(str(path), str(tmp_path))


def _line(record) -> bytes:
    return json.dumps(record).encode() + b"\n"


def test_undecodable_truncated_and_oversize_records_are_bad_and_the_good_ones_kept(bad_dir, tmp_path):
    """One JSONL file: a record with a byte that is not UTF-8, a question over its cap, an image path outside the
    root (absolute, and climbing out with ..), a last line cut short; the good records before and after stay."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _write_image(outside / "ok.png")
    path = bad_dir / "hostile.jsonl"
    path.write_bytes(_line(_fire(id="good-1"))
                     + _line(_fire(id="latin1", groundtruth="Zwei.")).replace(b"Zwei.", b"Zw\xe9i.")
                     + _line(_fire(id="huge", question="x" * (records_lib.FIELD_CAPS["question"] + 1)))
                     + _line(_fire(id="abs", image=str(outside / "ok.png")))
                     + _line(_fire(id="climb", image="../../../../etc/passwd"))
                     + _line(_fire(id="good-2"))
                     + _line(_fire(id="cut"))[:40])
    records, bad = load_records(str(path), str(bad_dir))
    assert [r.id for r in records] == ["good-1", "good-2"]
    assert dict(bad) == {"invalid_utf8": 1, "oversize_field": 1, "image_outside_root": 2, "invalid_json": 1}
    assert bad.first["invalid_utf8"] == (f"{path}: record 1 (id 'latin1'): field 'groundtruth': invalid_utf8 "
                                         "(bytes that are not UTF-8)")
    assert bad.first["oversize_field"] == (f"{path}: record 2 (id 'huge'): field 'question': oversize_field "
                                           "(65,537 characters, over the cap of 65,536 (data.field_caps.question))")
    assert bad.first["image_outside_root"].startswith(f"{path}: record 3 (id 'abs'): field 'image': "
                                                      f"image_outside_root ('{outside / 'ok.png'}' is not inside")
    assert bad.first["invalid_json"].startswith(f"{path}: record 6 (line 7): field '<line>': invalid_json")
    assert "cut short" in bad.first["invalid_json"]
    with pytest.raises(BadRecordError, match=r"record 1 \(id 'latin1'\): field 'groundtruth': invalid_utf8"):
        load_records(str(path), str(bad_dir), on_bad_record="error")


def test_an_image_outside_the_root_is_not_looked_at(bad_dir, monkeypatch):
    looked = []
    isfile = os.path.isfile
    monkeypatch.setattr(image_files.os.path, "isfile", lambda p: looked.append(p) or isfile(p))
    monkeypatch.setattr(image_files, "image_size_of", lambda p, **_: looked.append(p) or (1, 1))
    path = bad_dir / "climb.json"
    path.write_text(json.dumps([_fire(image="../../../../etc/passwd"), _fire(image="/etc/passwd"),
                                _fire(image="sub/../ok.png")]))
    records, bad = load_records(str(path), str(bad_dir))
    assert dict(bad) == {"image_outside_root": 2} and len(records) == 1
    assert not any("passwd" in p for p in looked) and looked == [str(bad_dir / "ok.png")] * 2


def test_a_json_array_keeps_its_good_records_around_an_undecodable_one(bad_dir):
    path = bad_dir / "array.json"
    raw = json.dumps([_fire(id="a"), _fire(id="b", question="Wie viele?"), _fire(id="c")]).encode()
    path.write_bytes(raw.replace(b"Wie viele?", b"Wie vi\xffle?"))
    records, bad = load_records(str(path), str(bad_dir))
    assert [r.id for r in records] == ["a", "c"] and dict(bad) == {"invalid_utf8": 1}
    assert bad.first["invalid_utf8"].startswith(f"{path}: record 1 (id 'b'): field 'question': invalid_utf8")


@pytest.mark.parametrize("text, message", [
    ('[{"a": 1},', "the file ends inside a record at byte 10 (in record 1)"),
    ('[{"a": 1}, {"b" 2}]', "Expecting ':' delimiter at byte 16 (in record 1)"),
    ('[{"a": "\xe9"} {"b": 2}]', "expected ',' or ']' after a record at byte 13 (in record 1)"),
    ('[{"a": 1}] x', "extra data after the array at byte 11 (in record 1)"),
    ('[{"a": 1}, {"b": "cut}]', "Unterminated string starting at byte 17 (in record 1)"),  # not "at at byte"
])
def test_a_json_array_that_does_not_parse_names_the_file_and_byte(tmp_path, text, message):
    from fire_jax.core.config import InputError

    path = tmp_path / "broken.json"
    path.write_bytes(text.encode("utf-8"))
    with pytest.raises(InputError) as e:
        load_records(str(path), str(tmp_path))
    assert str(e.value) == f"{path}: not a valid JSON array: {message}"


def test_field_caps_are_set_in_the_data_config(bad_dir):
    from fire_jax.core.config import InputError

    path = bad_dir / "caps.jsonl"
    path.write_bytes(_line(_fire(id="short")) + _line(_fire(id="long", question="What is shown here?"))
                     + _line(_fire(id="turns", conversations=_turns(*[("student", "x"), ("teacher", "Score: 1.")] * 3))))
    records, bad = load_records(str(path), str(bad_dir), caps={"question": 10, "messages": 4})
    assert [r.id for r in records] == ["short"] and dict(bad) == {"oversize_field": 2}
    assert "field 'question': oversize_field (19 characters, over the cap of 10" in bad.first["oversize_field"]
    with pytest.raises(InputError, match=r"data.field_caps: unknown field\(s\) \['questions'\]"):
        load_records(str(path), str(bad_dir), caps={"questions": 10})
    with pytest.raises(InputError, match=r"data.field_caps.question: expected a positive integer, got 0"):
        load_records(str(path), str(bad_dir), caps={"question": 0})


def test_to_raw_writes_what_parse_record_reads_and_improved_is_the_papers_filter():
    """One writer of raw FIRE records (generation, FIRE-100K-style data, the demo): parse_record reads it back
    to the same conversation; ``improved`` keeps a conversation whose last score is above its first."""
    from fire_jax.data.filters import improved
    from fire_jax.data.records import Turn, parse_record, to_raw

    turns = [Turn("Thought: one.\nAnswer: 3", "Score: 4.\nFeedback: count again.", 4.0),
             Turn("Thought: two.\nAnswer: 2", "Score: 10.\nFeedback: correct.", 10.0)]
    raw = to_raw("r1", "a/b.png", "How many?", "There are 2.", turns, source="synthetic", split="fire_1m")
    assert raw["round"] == 2 and raw["score"] == [4.0, 10.0] and raw["split"] == "fire_1m"
    assert [m["role"] for m in raw["conversations"]] == ["student", "teacher"] * 2
    back = parse_record(json.loads(json.dumps(raw)), default_id="x")
    assert isinstance(back, Conversation) and back.id == "r1" and back.image == "a/b.png"
    assert back.question == "How many?" and back.groundtruth == "There are 2." and back.source == "synthetic"
    assert list(back.turns) == turns
    assert improved([4.0, 10.0]) and improved([1, 5, 2])
    assert not improved([7.0]) and not improved([6, 9, 6]) and not improved([8, 3])
    assert not improved([None, 9.0]) and not improved([3.0, None])


def test_drop_reason_is_one_rule_in_one_order():
    """The keep/drop rule of generated conversations (FIRE-1M-style dialogues and FIRE-100K-style outputs): no
    score, too many turns, no improvement, then the schema; the first that applies names the drop."""
    from fire_jax.data.filters import FILTER_REASONS, drop_reason
    from fire_jax.data.records import Turn, to_raw

    def record(*scores, response="Answer: 3"):
        turns = [Turn(response, f"Score: {s}.\nFeedback: look." if s is not None else "Feedback: look.", s)
                 for s in scores]
        return to_raw("r1", "a.png", "How many?", "There are 3.", turns, source="s", split="x")

    assert drop_reason(record(4, 9)) is None and drop_reason(record(4, 9), max_turns=2) is None
    reasons = lambda r, **kw: getattr(drop_reason(r, **kw), "reason", None)
    assert reasons(record(4, None), max_turns=1) == "no_score"  # before too_many_turns
    assert reasons(record(9, 4, 5), max_turns=2) == "too_many_turns"  # before no_improvement
    assert reasons(record(9, 4, 5)) == "no_improvement"  # no turn limit
    assert reasons(record(5, 5, response=" ")) == "no_improvement"  # before the schema's empty_text
    assert reasons(record(4, 9, response=" ")) == "empty_text"
    error = drop_reason(record(6, 6))
    assert str(error) == "id 'r1': field 'score': no_improvement (scores [6, 6])"
    assert FILTER_REASONS == ("no_score", "too_many_turns", "no_improvement")


def test_a_symlink_out_of_the_image_root_is_refused_one_inside_is_read(tmp_path):
    """The image root is checked on the path resolved through symbolic links (one check, image_files.outside_root,
    for the data loaders, batch prompts and VLRMBench records): a link to a file elsewhere, or a linked folder
    leading out, is image_outside_root; a link to another file inside the root is read."""
    root, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    _write_image(elsewhere / "secret.png")
    _write_image(root / "ok.png")
    os.symlink(elsewhere / "secret.png", root / "link.png")
    os.symlink(elsewhere, root / "linked_folder")
    os.symlink(root / "ok.png", root / "alias.png")
    path = tmp_path / "links.json"
    path.write_text(json.dumps([_fire(id="out", image="link.png"), _fire(id="folder", image="linked_folder/secret.png"),
                                _fire(id="in", image="alias.png")]))
    records, bad = load_records(str(path), str(root))
    assert [r.id for r in records] == ["in"] and dict(bad) == {"image_outside_root": 2}
    assert bad.first["image_outside_root"] == (
        f"{path}: record 0 (id 'out'): field 'image': image_outside_root ('link.png' is a symbolic link out of the "
        f"image root {root} (to {elsewhere / 'secret.png'}))")
    assert image_files.image_path(str(root), "alias.png", "here") == str(root / "alias.png")
    assert image_files.outside_root(str(root), "linked_folder/secret.png") == (
        f"'linked_folder/secret.png' is a symbolic link out of the image root {root} (to {elsewhere / 'secret.png'})")
    # a root that is itself a link is resolved too: the files under it are inside
    os.symlink(root, tmp_path / "root_link")
    assert image_files.outside_root(str(tmp_path / "root_link"), "ok.png") is None
    assert image_files.outside_root(str(tmp_path / "root_link"), "link.png").startswith("'link.png' is a symbolic")


def test_jsonl_lines_is_the_one_line_loop_of_every_jsonl_reader(tmp_path):
    """jsonl_lines (the loop under read_objects, VLRMBench's tasks and batch_infer's prompts): a BOM dropped,
    blank lines skipped but counted in line numbers, a line that is not JSON carried with its error, the last
    line cut short said so, bytes that are not UTF-8 kept as surrogates."""
    from fire_jax.data.jsonl import jsonl_lines

    path = tmp_path / "x.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 1}\n\n{"id": "caf\xe9"}\nnot json\n{"id": 3')
    lines = list(jsonl_lines(str(path)))
    assert [(r.index, r.line) for r in lines] == [(0, 1), (1, 3), (2, 4), (3, 5)]
    assert lines[0].value == {"id": 1} and lines[0].error is None
    assert lines[1].value == {"id": "caf\udce9"}
    assert lines[2].value is None and lines[2].error.startswith("Expecting value: line 1 column 1")
    assert lines[3].error.endswith(", the file's last line, cut short?")
