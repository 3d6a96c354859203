"""VLRMBench loading, prompts, parsers, metrics and the Table 3 report (no model)."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import f1_score

from fire_jax import vlrmbench as vb
from fire_jax.vlrmbench.tasks import JUDGE_PROMPTS, TASK_PROMPTS, TASKS, task_info

FIXTURES = Path(__file__).parent / "fixtures" / "vlrmbench"
IC_FILE = FIXTURES / "image_ref_error.jsonl"


def ic_records():
    return [json.loads(line) for line in IC_FILE.read_text(encoding="utf-8").splitlines()]


def make_images(root, records):
    for record in records:
        for image in record["image"]:
            path = root / image
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (200, 30, 30)).save(path)


def sample(task="step_correctness", id="s", task_gt=(0, 1), step_list=("STEP1: a\n\n", "STEP2: b"),
           reasoning_error="STEP1: a\nSTEP2: wrong b"):
    return vb.Sample(task=task_info(task).file, id=id, images=("x.png",), question="Q?", step_list=step_list,
                     reasoning_error=reasoning_error, task_gt=task_gt, category=task, line=1)


# ---------------------------------------------------------------- prompts

def test_prompts_are_the_release_verbatim():
    release = json.loads((FIXTURES / "prompts.json").read_text(encoding="utf-8"))
    ours = {**TASK_PROMPTS, **{f"judge/{k}": v for k, v in JUDGE_PROMPTS.items()}}
    assert ours == release
    assert list(TASK_PROMPTS) == [t.file for t in TASKS]


def test_task_table():
    assert [(t.short, t.file, t.theme) for t in TASKS] == [
        ("SC", "step_correctness", "step"), ("RD", "redundant_det", "step"), ("CM", "most_confidence", "step"),
        ("EH", "existence_hallucination", "step"), ("AH", "attribute_hallucination", "step"),
        ("DE", "detail_error", "step"), ("SR", "location_error", "step"), ("IC", "image_ref_error", "step"),
        ("MJ", "multi_solution", "outcome"), ("FF", "foresight", "outcome"),
        ("ERA", "error_reason_analysis", "criticism"), ("EC", "error_correction", "criticism")]
    assert {t.metric for t in TASKS if t.theme == "step"} == {"weighted_f1"}
    assert task_info("IC") is task_info("image_ref_error")
    with pytest.raises(ValueError, match="unknown VLRMBench task"):
        task_info("XX")


def test_step_prompt_uses_reasoning_error_verbatim():
    s = sample()
    assert vb.build_prompt(s, "SC") == TASK_PROMPTS["step_correctness"].format(
        question="Q?", reasoning_process="STEP1: a\nSTEP2: wrong b")
    with pytest.raises(ValueError, match="order"):
        vb.build_prompt(s, "SC", order=1)


def test_mj_prompt_both_orders_and_renders():
    record = ic_records()[0]
    s = sample("MJ", step_list=tuple(record["step_list"]), reasoning_error=record["reasoning_error"])
    official = [vb.build_prompt(s, "MJ", render="official", order=o) for o in range(vb.num_orders("MJ"))]
    template = TASK_PROMPTS["multi_solution"]
    assert official[0] == template.format(question="Q?", ai_respond_1=record["step_list"],
                                          ai_respond_2=record["reasoning_error"])
    assert official[1] == template.format(question="Q?", ai_respond_1=record["reasoning_error"],
                                          ai_respond_2=record["step_list"])
    assert "['STEP1: So I\\'ve got" in official[0] and "\\n\\n', \"STEP2: First" in official[0]

    plain = vb.build_prompt(s, "MJ")
    good = plain.split("## AI Assistant's Response 1\n")[1].split("\n\n## AI Assistant's Response 2")[0]
    assert good.startswith("STEP1: So I've got") and "['" not in good and "\\n" not in good
    assert good.count("\nSTEP") == len(record["step_list"]) - 1
    swapped = vb.build_prompt(s, "MJ", order=1)
    assert swapped.index(record["reasoning_error"]) < swapped.index(good)


def test_plain_render_matches_reasoning_error_layout():
    # Unchanged steps (label 0) read the same in the plain render and in
    # reasoning_error, up to the whitespace IC's reasoning_error adds; steps
    # with an inner colon are cut at it in reasoning_error, so they are left out.
    compared = 0
    for record in ic_records():
        plain = vb.render_steps(record["step_list"])
        assert vb.count_steps(plain) == len(record["step_list"])
        ours = re.split(r"(?:^|\n)STEP\d+:", plain)[1:]
        theirs = re.split(r"(?:^|\n)STEP\d+:", record["reasoning_error"])[1:]
        for step, mine, released, label in zip(record["step_list"], ours, theirs, record["task_gt"]):
            if label == 0 and step.count(":") == 1:
                assert " ".join(mine.split()) == " ".join(released.split())
                compared += 1
    assert compared > 300
    assert vb.render_steps(["STEP1: a\n\n", "b"], "official") == "['STEP1: a\\n\\n', 'b']"
    assert vb.render_steps(["STEP1: a\n\n", "b"]) == "STEP1: a\nSTEP2: b"


def test_foresight_prompt_takes_the_records_partial_process():
    partial = sample("FF", task_gt=True, step_list=("STEP1: a\n\n", "STEP2: b"), reasoning_error=None)
    assert "## AI Assistant's Partial Reasoning Process\nSTEP1: a\nSTEP2: b\n" in vb.build_prompt(partial, "FF")
    assert "['STEP1: a\\n\\n', 'STEP2: b']" in vb.build_prompt(partial, "FF", render="official")
    wrong = sample("FF", task_gt=False, reasoning_error="STEP1: a\nSTEP2: c")
    assert "Process\nSTEP1: a\nSTEP2: c\n" in vb.build_prompt(wrong, "FF", render="official")


def test_judge_prompts_both_orders():
    era = sample("ERA", task_gt="The reference analysis.")
    first = vb.build_judge_prompt(era, "ERA", "My analysis.", order=0)
    assert first == JUDGE_PROMPTS["error_reason_analysis"].format(
        question="Q?", reasoning_error=era.reasoning_error, ai_respond_1="The reference analysis.",
        ai_respond_2="My analysis.")
    second = vb.build_judge_prompt(era, "ERA", "My analysis.", order=1)
    assert second.index("My analysis.") < second.index("The reference analysis.")
    ec = sample("EC", task_gt=("STEP1: a", "STEP2: b"))
    assert vb.build_judge_prompt(ec, "EC", "fixed", order=0) == JUDGE_PROMPTS["error_correction"].format(
        question="Q?", ai_respond_1="STEP1: a\nSTEP2: b", ai_respond_2="fixed")
    assert "['STEP1: a', 'STEP2: b']" in vb.build_judge_prompt(ec, "EC", "fixed", render="official")
    with pytest.raises(ValueError, match="only ERA and EC"):
        vb.build_judge_prompt(sample(), "SC", "x")


# ---------------------------------------------------------------- loader

def test_loader_reads_the_58_ic_records(tmp_path):
    records = ic_records()
    make_images(tmp_path, records)
    data = vb.load_task(FIXTURES, "IC", image_root=tmp_path)
    assert len(data) == 58 and not data.skipped and data.task == "image_ref_error"
    assert sum(len(s.images) for s in data) == 86
    first = data[0]
    assert first.images == (str(tmp_path / "hallusion_bench/VD/video/7_0.png"),)
    assert first.task_gt == (0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert first.step_list == tuple(records[0]["step_list"]) and first.line == 1
    assert all(len(s.task_gt) == vb.count_steps(s.reasoning_error) == len(s.step_list) for s in data)
    assert sum(sum(s.task_gt) for s in data) == sum(sum(r["task_gt"]) for r in records)
    assert vb.load_task(IC_FILE, "image_ref_error")[0].images == ("hallusion_bench/VD/video/7_0.png",)


def test_count_steps():
    assert vb.count_steps("STEP1: a\n\n\nSTEP2: b: c\nSTEP3:  d, see STEP 1: above") == 3
    assert vb.count_steps("no steps") == 0


def test_loader_skips_and_counts_bad_records(tmp_path):
    records = ic_records()[:6]
    make_images(tmp_path / "img", records)
    bad_length = dict(records[1], task_gt=records[1]["task_gt"][:-1])
    no_question = {k: v for k, v in records[2].items() if k != "question"}
    bad_label = dict(records[3], task_gt=[2] + records[3]["task_gt"][1:])
    missing_image = dict(records[4], image=["nowhere/missing.png"])
    lines = [json.dumps(records[0]), '{"id": "broken", ', json.dumps(bad_length), "",
             json.dumps(no_question), json.dumps(bad_label), json.dumps(missing_image),
             json.dumps(records[5]), json.dumps(records[0])]
    path = tmp_path / "image_ref_error.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    data = vb.load_task(tmp_path, "IC", image_root=tmp_path / "img")
    # A record whose labels count differently from its STEP markers is kept (as the release) and counted.
    assert [s.id for s in data] == [records[0]["id"], records[1]["id"], records[5]["id"]]
    assert data[1].task_gt == tuple(records[1]["task_gt"][:-1])
    assert data.skipped == {"malformed_json": 1, "missing_field": 1, "bad_field": 1,
                            "missing_image": 1, "duplicate_id": 1}
    assert data.kept == {"step_count_mismatch": 1}
    assert "skipped 5 bad records" in data.describe() and "kept 1 odd records (step_count_mismatch: 1)" in data.describe()
    # Without an image root the image paths are not checked.
    assert len(vb.load_task(path, "IC")) == 4
    # An image that leads out of the root, by its name or through a symbolic link, is refused unread.
    os.symlink(tmp_path / "image_ref_error.jsonl", tmp_path / "img" / "link.png")
    for image, why in (("../image_ref_error.jsonl", "is not inside the image root"),
                       ("link.png", "is a symbolic link out of the image root")):
        path.write_text(json.dumps(dict(records[0], image=[image])) + "\n", encoding="utf-8")
        with pytest.raises(vb.BadRecord, match=rf"image_ref_error\.jsonl:1: field 'image': image_outside_root: "
                                               rf"'{re.escape(image)}' {why}"):
            vb.load_task(path, "IC", image_root=tmp_path / "img", on_bad_record="error")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    with pytest.raises(vb.BadRecord) as error:
        vb.load_task(path, "IC", image_root=tmp_path / "img", on_bad_record="error")
    assert error.value.line == 2 and error.value.reason == "malformed_json"
    assert str(error.value).startswith(f"{path}:2: malformed_json")
    path.write_text("\n".join([json.dumps(records[0]), json.dumps(bad_label)]) + "\n", encoding="utf-8")
    with pytest.raises(vb.BadRecord, match=r"image_ref_error\.jsonl:2: field 'task_gt': bad_field"):
        vb.load_task(path, "IC", on_bad_record="error")
    path.write_text(json.dumps(missing_image) + "\n", encoding="utf-8")
    with pytest.raises(vb.BadRecord, match=r":1: field 'image': missing_image: no file .*missing\.png"):
        vb.load_task(path, "IC", image_root=tmp_path / "img", on_bad_record="error")


def test_missing_image_of_a_shipped_record_is_skipped_or_sent_without(tmp_path):
    """The release's clients log a missing image and send the request without it; "send_without" keeps the
    record (its images minus the missing one) and counts it; "skip" drops it as a bad record."""
    records = ic_records()[:3]
    make_images(tmp_path, [records[0], records[2]])  # records[1]'s one image is not there
    path = tmp_path / "image_ref_error.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    skipped = vb.load_task(path, "IC", image_root=tmp_path)
    assert [s.id for s in skipped] == [records[0]["id"], records[2]["id"]]
    assert skipped.skipped == {"missing_image": 1} and skipped.kept == {}
    kept = vb.load_task(path, "IC", image_root=tmp_path, missing_images="send_without")
    assert [s.id for s in kept] == [r["id"] for r in records] and kept.skipped == {}
    assert kept.kept == {"missing_image": 1} and "kept 1 odd records (missing_image: 1)" in kept.describe()
    assert kept[1].images == () and kept[1].missing_images == (str(tmp_path / records[1]["image"][0]),)
    assert kept[0].images == (str(tmp_path / records[0]["image"][0]),) and kept[0].missing_images == ()
    assert vb.build_prompt(kept[1], "IC") == TASK_PROMPTS["image_ref_error"].format(
        question=records[1]["question"], reasoning_process=records[1]["reasoning_error"])  # the same text
    with pytest.raises(ValueError, match="missing_images"):
        vb.load_task(path, "IC", image_root=tmp_path, missing_images="drop")


def test_loader_checks_task_gt_by_theme(tmp_path):
    record = ic_records()[0]
    ff = dict(record, task_gt=True, category="foresight")
    del ff["reasoning_error"]
    ff_bad = dict(record, id="b", task_gt=[0, 1], category="foresight")
    ec = dict(record, id="c", task_gt=["STEP1: fixed"], category="error_correction")
    (tmp_path / "foresight.jsonl").write_text(json.dumps(ff) + "\n" + json.dumps(ff_bad) + "\n")
    (tmp_path / "error_correction.jsonl").write_text(json.dumps(ec) + "\n")
    data = vb.load_task(tmp_path, "FF")
    assert len(data) == 1 and data[0].task_gt is True and data[0].reasoning_error is None
    assert data.skipped == {"bad_field": 1}
    assert vb.load_task(tmp_path, "EC")[0].task_gt == ("STEP1: fixed",)


# ---------------------------------------------------------------- metrics

def test_weighted_f1_by_hand():
    # pos: tp 1, fp 1, fn 0 -> 2/3; neg: tp 2, fp 0, fn 1 -> 4/5; weights 3/4 and 1/4.
    assert vb.f1_per_class([1, 0, 0, 0], [1, 1, 0, 0]) == pytest.approx((2 / 3, 4 / 5))
    assert vb.weighted_f1([1, 0, 0, 0], [1, 1, 0, 0]) == pytest.approx(0.75 * 2 / 3 + 0.25 * 0.8)
    # pos: tp 1, fp 1, fn 1 -> 1/2; neg: no true negative -> 0; weights 1/3 and 2/3.
    assert vb.weighted_f1([1, 1, 0], [0, 1, 1]) == pytest.approx(1 / 6)
    assert vb.weighted_f1([1, 0, 1, 0], [1, 0, 1, 0]) == 1.0
    assert vb.weighted_f1([0, 1, 0, 1], [1, 0, 1, 0]) == 0.0


def test_weighted_f1_degenerate_cases():
    assert vb.weighted_f1([0, 0, 0], [0, 0, 0]) == 0.0  # no erroneous step: the weight is on the absent class
    assert vb.weighted_f1([1, 1], [1, 1]) == 0.0
    with pytest.raises(ValueError):
        vb.weighted_f1([], [])
    with pytest.raises(ValueError):
        vb.weighted_f1([0, 1], [0])
    with pytest.raises(ValueError):
        vb.weighted_f1([0, 2], [0, 1])


def test_weighted_f1_matches_sklearn_per_class_with_inverse_weights():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(2, 60))
        labels = (rng.random(n) < rng.uniform(0.05, 0.6)).astype(int)
        predictions = (rng.random(n) < rng.uniform(0.0, 1.0)).astype(int)
        f1_pos, f1_neg = f1_score(labels, predictions, labels=[1, 0], average=None, zero_division=0)
        assert vb.f1_per_class(labels, predictions) == pytest.approx((f1_pos, f1_neg))
        n_pos = labels.sum()
        expected = ((n - n_pos) * f1_pos + n_pos * f1_neg) / n if 0 < n_pos < n else 0.0
        assert vb.weighted_f1(labels, predictions) == pytest.approx(expected)
    # The inverse weights are not scikit-learn's "weighted".
    labels, predictions = [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]
    assert vb.weighted_f1(labels, predictions) != pytest.approx(f1_score(labels, predictions, average="weighted"))


def test_weighted_average_reproduces_the_papers_w_avg():
    paper = vb.load_paper_results()
    counts = {t.short: paper["samples"][t.short] for t in TASKS}
    for model, row in paper["rows"].items():
        cells = dict(zip(paper["columns"], row))
        for theme, column in (("step", "Step W-Avg"), ("outcome", "Outcome W-Avg")):
            values = {t.short: cells[t.short] for t in TASKS if t.theme == theme}
            assert vb.weighted_average(values, counts) == pytest.approx(cells[column], abs=0.15), (model, column)


# ---------------------------------------------------------------- parsers

def test_official_step_parser_quirks_and_robust_reading():
    pairs = "STEP 1: 0, STEP 2: 1, STEP 3: 0"
    assert vb.parse_step_labels(pairs, 3, parser="official") == [1, 0, 1]
    assert vb.parse_step_labels(pairs, 3) == [0, 1, 0]

    counted = "The process has 3 steps; step 2 is wrong.\n[0, 1, 0]"
    assert vb.parse_step_labels(counted, 3, parser="official") == [1, 1, 0]
    assert vb.parse_step_labels(counted, 3) == [0, 1, 0]

    restated = "[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n['0', '0', '1']"
    assert vb.parse_step_labels(restated, 3, parser="official") == [1, 1, 0]
    assert vb.parse_step_labels(restated, 3) == [0, 0, 1]

    assert vb.parse_step_labels("STEP 10: 1\n**Step 2**: 1", 10) == [0, 1] + [0] * 7 + [1]
    assert vb.try_parse_step_labels("[0, 0, 1, 0]", 4, parser="official") == ([0, 0, 1, 0], True)
    assert vb.try_parse_step_labels("[1, 0, 0, 1]", 4) == ([1, 0, 0, 1], True)


# Step-label outputs as models write them: the form the prompt asks for, the shipped records' "STEPk:"
# style, and the ways chat models format lists. Each reads as [0, 1, 0] for a 3-step process.
STEP_LABEL_FORMS = {
    "bracketed list (the prompt's format)": "[0, 1, 0]",
    "quoted items": "['0', '1', '0']",
    "step pairs with full stops": "STEP 1: 0.\nSTEP 2: 1.\nSTEP 3: 0.",
    "lower case step pairs": "step 1: 0\nstep 2: 1\nstep 3: 0",
    "step pairs on one line": "STEP 1: 0, STEP 2: 1, STEP 3: 0",
    "markdown bold step": "**Step 1:** 0\n**Step 2:** 1\n**Step 3:** 0",
    "markdown bold label": "Step 1: **0**\nStep 2: **1**\nStep 3: **0**",
    "bold step, verdict words": "**STEP 1**: Correct\n**STEP 2**: Incorrect\n**STEP 3**: Correct",
    "JSON object of labels": '{"STEP1": 0, "STEP2": 1, "STEP3": 0}',
    "JSON object of verdicts": '{"step_1": "correct", "step_2": "incorrect", "step_3": "correct"}',
    "labels followed by explanations": "STEP 1: 0 (the setup is right)\nSTEP 2: 1 - it counts 4, the image has 3\n"
                                       "STEP 3: 0",
    "dash and verdict": "Step 1 - correct\nStep 2 - incorrect\nStep 3 - correct",
    "reasoning before the labels": "Let me check each step. Step 2 claims 4 shapes, but the image shows 3.\n"
                                   "So the answer is [0, 1, 0].",
    "reasoning after the labels": "[0, 1, 0]\nExplanation: STEP 2: 1 shape is counted twice.",
    "markdown table with step names": "| Step | Label |\n|---|---|\n| Step 1 | 0 |\n| Step 2 | 1 |\n| Step 3 | 0 |",
    "markdown table of numbers": "| Step | Label |\n|---|---|\n| 1 | 0 |\n| 2 | 1 |\n| 3 | 0 |",
    "numbered list": "1. 0\n2. 1\n3. 0",
    "numbered verdicts with reasons": "1) Correct. The setup is fine.\n2) Wrong: it miscounts.\n3) Correct.",
    "bare comma list": "0, 1, 0",
    "bare labels after a lead": "Answer: 0 1 0",
    "parenthesised tuple": "(0, 1, 0)",
    "fenced JSON code": "```json\n[0, 1, 0]\n```",
    "check marks": "STEP 1: ✓\nSTEP 2: ✗\nSTEP 3: ✓",
    "arrows": "STEP 1 -> 0\nSTEP 2 -> 1\nSTEP 3 -> 0",
    "equals signs": "STEP1=0, STEP2=1, STEP3=0",
    "no error / error": "Step 1: No error\nStep 2: Error - miscounted\nStep 3: No error",
    "restated format then the list": "[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n"
                                     "['0', '1', '0']",
    "counted steps then the list": "The reasoning has 3 steps and step 2 is wrong.\n[0, 1, 0]",
}


@pytest.mark.parametrize("form", list(STEP_LABEL_FORMS))
def test_robust_parser_reads_real_output_forms(form):
    assert vb.try_parse_step_labels(STEP_LABEL_FORMS[form], 3) == ([0, 1, 0], True)


def test_robust_parser_form_count_and_the_full_stop_bug():
    assert len(STEP_LABEL_FORMS) >= 15 and len(set(STEP_LABEL_FORMS.values())) == len(STEP_LABEL_FORMS)
    # A misreading once fixed: a label followed by a full stop was rejected and pooled as zeros.
    assert vb.try_parse_step_labels("STEP 1: 0.\nSTEP 2: 1.\nSTEP 3: 0.", 3) == ([0, 1, 0], True)
    # The official parser is the release's: every integer is a label, whatever the form.
    assert vb.try_parse_step_labels("STEP 1: 0.\nSTEP 2: 1.\nSTEP 3: 0.", 3, parser="official") == ([1, 0, 1], True)
    assert vb.try_parse_step_labels("Step 1 - correct\nStep 2 - incorrect\nStep 3 - correct", 3,
                                   parser="official") == ([1, 1, 1], True)
    assert vb.try_parse_step_labels("1) Correct.\n2) Wrong.", 3, parser="official") == ([1, 1, 0], False)
    # Not labels: a decimal, a step 10 read as step 1, a numbered list of prose.
    assert vb.try_parse_step_labels("STEP 1: 0.5\nSTEP 2: 1.5", 2) == ([0, 0], False)
    assert vb.try_parse_step_labels("There are 3 steps.\n1. The first step counts.", 3) == ([0, 0, 0], False)


def test_step_parser_failures():
    assert vb.try_parse_step_labels(None, 3) == ([0, 0, 0], False)
    assert vb.try_parse_step_labels(None, 3, parser="official") == ([0, 0, 0], False)
    assert vb.try_parse_step_labels("I cannot tell.", 2) == ([0, 0], False)
    assert vb.try_parse_step_labels("I cannot tell.", 2, parser="official") == ([0, 0], False)
    assert vb.try_parse_step_labels("[1]", 3) == ([1, 0, 0], False)  # too short: padded, a failure
    assert vb.try_parse_step_labels("[1, 0, 1, 1]", 3) == ([1, 0, 1], False)  # too long: cut, a failure
    assert vb.try_parse_step_labels("STEP 1: 1, STEP 3: 1", 3) == ([1, 0, 1], False)  # step 2 missing
    with pytest.raises(ValueError, match="parser"):
        vb.parse_step_labels("[0]", 1, parser="lenient")


def test_score_parsers():
    said = '["8", "6"]\nResponse 1 is better.'
    assert vb.parse_scores(said, parser="official") == (6, 1)
    assert vb.parse_scores(said) == (8, 6)
    spelled = "Score for Response 1: 8/10\nScore for Response 2: 6/10"
    assert vb.parse_scores(spelled, parser="official") == (6, 10)
    assert vb.parse_scores(spelled) == (8, 6)
    assert vb.parse_scores('["Score for Response 1", "Score for Response 2"]\n[7.5, 9/10]') == (7.5, 9)
    assert vb.try_parse_scores("7", parser="official") == ((7, 0), False)
    assert vb.try_parse_scores("no idea") == ((0, 0), False)
    assert vb.try_parse_scores(None, parser="official") == ((0, 0), False)


def test_foresight_parser_on_hedged_answers():
    hedged = "I think yes, but no, it will not reach the answer."
    assert vb.parse_foresight(hedged, parser="official") == {True, False}
    assert vb.parse_foresight(hedged) == {True}
    assert vb.parse_foresight("No. Although it looks true at first.") == {False}
    assert vb.parse_foresight("No. Although it looks true at first.", parser="official") == {True, False}
    assert vb.parse_foresight("Yesterday's note is not enough.", parser="official") == frozenset()
    assert vb.parse_foresight("**YES**") == {True}
    assert vb.parse_foresight(None) == frozenset()


# ---------------------------------------------------------------- scoring

def test_step_task_scoring_pools_steps_and_counts_failures():
    samples = [sample(id="a", task_gt=(0, 1, 0)), sample(id="b", task_gt=(1, 0)), sample(id="c", task_gt=(0, 0, 1))]
    outputs = {"a": "[0, 1, 0]", "b": "STEP 1: 0, STEP 2: 1"}  # "c" failed to generate
    # ours: c counts wrong, every label flipped. Pooled labels [0,1,0 | 1,0 | 0,0,1], predictions
    # [0,1,0 | 0,1 | 1,1,0]: TP 1, FN 2, FP 3, TN 2; F1_pos 2/7, F1_neg 4/9; (5 * 2/7 + 3 * 4/9) / 8.
    result = vb.score_task("SC", samples, outputs)
    assert result.scores["f1"] == pytest.approx(58 / 168)
    assert (result.scores["f1_pos"], result.scores["f1_neg"]) == pytest.approx((2 / 7, 4 / 9))
    assert (result.num_samples, result.num_outputs, result.failures, result.num_scored) == (3, 3, 1, 3)
    assert result.failed_samples == {"generation_failed": 1} and result.accounting == "ours"
    # official: c left out. Labels [0,1,0,1,0], predictions [0,1,0,0,1]: F1_pos 1/2, F1_neg 2/3; (3/2 + 4/3) / 5.
    official = vb.score_task("SC", samples, outputs, accounting="official")
    assert official.scores["f1"] == pytest.approx(17 / 30) and official.num_scored == 2
    assert official.failed_samples == {"generation_failed": 1} and official.failures == 1
    # The official parser reads b as [1, 0] (the step numbers): labels [0,1,0,1,0], predictions [0,1,0,1,0].
    both = vb.score_accountings("SC", samples, outputs, parser="official")
    assert both["official"].scores["f1"] == 1.0 and both["official"].parser == "official"
    assert both["ours"].scores["f1"] == pytest.approx(vb.weighted_f1([0, 1, 0, 1, 0, 0, 0, 1], [0, 1, 0, 1, 0, 1, 1, 0]))
    # An unreadable output is "unparsable": wrong under ours; official scores it as read, [1] padded to
    # [1, 0, 0]: labels [0,1,0 | 1,0 | 0,0,1], predictions [0,1,0 | 0,1 | 1,0,0]: TP 1, FN 2, FP 2, TN 3;
    # F1_pos 1/3, F1_neg 3/5; (5 * 1/3 + 3 * 3/5) / 8 = 13/30.
    unreadable = {**outputs, "c": "[1]"}
    assert vb.score_task("SC", samples, unreadable).failed_samples == {"unparsable": 1}
    assert vb.score_task("SC", samples, unreadable).scores["f1"] == pytest.approx(58 / 168)
    official = vb.score_task("SC", samples, unreadable, accounting="official")
    assert official.scores["f1"] == pytest.approx(13 / 30) and official.num_scored == 3
    assert official.failed_samples == {} and official.failures == 1
    with pytest.raises(ValueError, match="accounting"):
        vb.score_task("SC", samples, outputs, accounting="lenient")


def test_official_accounting_with_nothing_left_to_score():
    result = vb.score_task("IC", [sample(id="a")], {"a": None}, accounting="official")
    assert result.scores == {"f1": None, "f1_pos": None, "f1_neg": None} and result.num_scored == 0
    assert result.failed_samples == {"generation_failed": 1}
    assert vb.score_task("FF", [sample("FF", id="a", task_gt=True)], {}, accounting="official").scores == {
        "accuracy": None}
    # An answer without a label is scored, all 0 (the release pads it): labels [0, 1], predictions [0, 0]:
    # F1_pos 0, F1_neg 2/3; (1 * 0 + 1 * 2/3) / 2.
    result = vb.score_task("IC", [sample(id="a")], {"a": "no labels here"}, accounting="official")
    assert result.scores["f1"] == pytest.approx(1 / 3) and result.num_scored == 1


def test_mj_scoring_both_orders_and_ties():
    samples = [sample("MJ", id=i, task_gt=None) for i in "abcdefg"]
    outputs = {
        "a": ("[9, 4]", "[5, 8]"),  # good: 9 + 8 > 4 + 5: correct
        "b": ("[9, 4]", "[9, 4]"),  # prefers response 1 whatever it is: 13 = 13, a tie: wrong
        "c": ("[3, 7]", "[6, 2]"),  # prefers the bad one: wrong
        "d": ('["8", "6"] Response 1 is better.', "[6, 8]"),  # robust 16 > 12; official (6,1)+(6,8): 14 > 7
        "e": ("[8, 6]", None),  # second order failed: a failed sample
        "g": ("[7, 3]", "no idea"),  # second order unreadable
    }  # "f" missing entirely
    result = vb.score_task("MJ", samples, outputs)
    assert result.scores == {"accuracy": pytest.approx(2 / 7)}  # a, d of 7; e, f, g count wrong
    assert (result.num_outputs, result.failures) == (14, 4)
    assert result.failed_samples == {"generation_failed": 2, "unparsable": 1}
    # official: e and f (an order without an output) left out; g's unread "no idea" is (0, 0): 7 + 0 > 3 + 0.
    official = vb.score_task("multi_solution", samples, outputs, accounting="official")
    assert official.scores == {"accuracy": pytest.approx(3 / 5)} and official.num_scored == 5
    assert official.failed_samples == {"generation_failed": 2}
    release = vb.score_task("multi_solution", samples, outputs, parser="official", accounting="official")
    assert release.scores == {"accuracy": pytest.approx(3 / 5)} and release.failures == 4
    quirk = {"a": ('["8", "6"] Response 1 is better.', '["6", "8"] Response 2 is better.')}
    assert vb.score_task("MJ", samples[:1], quirk).scores["accuracy"] == 1.0
    assert vb.score_task("MJ", samples[:1], quirk, parser="official").scores["accuracy"] == 0.0  # (6,1),(8,2)


def test_ff_scoring():
    samples = [sample("FF", id=str(i), task_gt=label) for i, label in enumerate([True, False, True, False, True])]
    outputs = {"0": "Yes.", "1": "I think yes, but no.", "2": "True", "3": "Hmm, hard to say."}
    robust = vb.score_task("FF", samples, outputs)
    assert robust.scores["accuracy"] == pytest.approx(2 / 5) and robust.failures == 2
    official = vb.score_task("FF", samples, outputs, parser="official")
    assert official.scores["accuracy"] == pytest.approx(3 / 5) and official.failures == 2
    # The release's accounting: "4" (no output) left out, "3" (no yes/no) scored wrong.
    release = vb.score_task("FF", samples, outputs, parser="official", accounting="official")
    assert release.scores["accuracy"] == pytest.approx(3 / 4) and release.num_scored == 4
    assert release.failed_samples == {"generation_failed": 1}
    assert vb.score_task("FF", samples, outputs, accounting="official").scores["accuracy"] == pytest.approx(2 / 4)


def test_criticism_win_tie_lose():
    samples = [sample("ERA", id=i, task_gt="reference") for i in "abcd"]
    judged = {
        "a": ("[6, 8]", "[9, 5]"),  # reference 6 + 5, candidate 8 + 9: win
        "b": ("[8, 6]", "[6, 8]"),  # reference 16, candidate 12: lose
        "c": ("[8, 8]", "[7, 7]"),  # tie
    }  # "d" not judged: a failed judge call
    result = vb.score_task("ERA", samples, judged)
    assert result.scores == pytest.approx({"win": 0.25, "tie": 0.25, "lose": 0.5})  # d counts as a loss
    assert result.failures == 2 and result.num_outputs == 8 and result.failed_samples == {"judge_failed": 1}
    official = vb.score_task("ERA", samples, judged, accounting="official")
    assert official.scores == pytest.approx({"win": 1 / 3, "tie": 1 / 3, "lose": 1 / 3})


def release_weighted_f1(labels, predictions):
    """The release's utils.get_F1Score: scikit-learn's F1 of each class, each weighted by the other's share."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    f1_pos = f1_score(labels, predictions, pos_label=1, zero_division=0)
    f1_neg = f1_score(labels, predictions, pos_label=0, zero_division=0)
    return (np.sum(labels == 0) * f1_pos + np.sum(labels == 1) * f1_neg) / labels.size


def test_official_accounting_is_the_release_scorers():
    """Short, long, unreadable, empty and missing answers, each task, scored by the release's rules by hand."""
    # Step tasks (get_sc_mc_rd_eval_res.py): every answer padded with 0 or cut to the steps; no line left out.
    steps = [sample("IC", id="short", task_gt=(0, 1, 0)), sample("IC", id="long", task_gt=(1, 0)),
             sample("IC", id="unread", task_gt=(0, 0, 1)), sample("IC", id="missing", task_gt=(1, 1)),
             sample("IC", id="empty", task_gt=(0, 1))]
    answers = {"short": "[0, 1]", "long": "[1, 0, 1, 1]", "unread": "I cannot tell.", "empty": ""}
    # Kept: [0,1,0 | 1,0 | 0,0,1 | 0,1] against [0,1,0 | 1,0 | 0,0,0 | 0,0]: TP 2, FN 2, FP 0, TN 6;
    # F1_pos 4/6, F1_neg 12/14; (6 * 2/3 + 4 * 6/7) / 10 = 26/35.
    labels = [0, 1, 0, 1, 0, 0, 0, 1, 0, 1]
    padded = [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert release_weighted_f1(labels, padded) == pytest.approx(26 / 35)
    for parser in vb.PARSERS:  # both parsers pad these answers alike
        result = vb.score_task("IC", steps, answers, parser=parser, accounting="official")
        assert result.scores["f1"] == pytest.approx(26 / 35), parser
        assert (result.scores["f1_pos"], result.scores["f1_neg"]) == pytest.approx((2 / 3, 6 / 7))
        assert result.num_scored == 4 and result.failed_samples == {"generation_failed": 1}
        # Not fully read: short, unread, missing, empty; robust also "long" (4 labels for 2 steps).
        assert result.failures == {"official": 4, "robust": 5}[parser]
    # Ours counts those four wrong (flipped): labels [0,1,0 | 1,0 | 0,0,1 | 1,1 | 0,1] against
    # [1,0,1 | 1,0 | 1,1,0 | 0,0 | 1,0]: TP 1, FN 5, FP 5, TN 1: F1 1/6 for both classes, weighted 1/6.
    ours = vb.score_task("IC", steps, answers, parser="official")
    assert ours.scores["f1"] == pytest.approx(1 / 6) and ours.failed_samples == {"generation_failed": 1,
                                                                                  "unparsable": 3}

    # MJ (get_ms_eval_res.py): the last two integers, padded; an empty answer is [0, 0]; a line needs both orders.
    mj = [sample("MJ", id=i, task_gt=None) for i in ("both", "short", "long", "empty", "missing")]
    pairs = {"both": ("[9, 4]", "[5, 8]"),  # 9 + 8 > 4 + 5: correct
             "short": ("8", "[2, 7]"),  # (8, 0): 8 + 7 > 0 + 2: correct
             "long": ("Response 1: 3, Response 2: 9, in 2 steps", "[6, 6]"),  # last two (9, 2): 15 > 8
             "empty": ("", ""),  # (0, 0) twice: a tie, wrong
             "missing": ("[7, 2]", None)}  # no line: left out
    release = vb.score_task("MJ", mj, pairs, parser="official", accounting="official")
    assert release.scores["accuracy"] == pytest.approx(3 / 4) and release.num_scored == 4
    # robust reads "long" as (3, 9): 3 + 6 < 9 + 6, wrong; "short" as (0, 0): 0 + 7 > 0 + 2, correct.
    assert vb.score_task("MJ", mj, pairs, accounting="official").scores["accuracy"] == pytest.approx(2 / 4)
    assert vb.score_task("MJ", mj, pairs, parser="official").scores["accuracy"] == pytest.approx(2 / 5)

    # ERA/EC (get_ec_era_eval_res.py): the judge's last two integers, padded; no judge output: left out.
    era = [sample("ERA", id=i, task_gt="reference") for i in ("win", "short", "unread", "missing")]
    judged = {"win": ("[6, 8]", "[9, 5]"),  # reference 6 + 5, candidate 8 + 9: win
              "short": ("7", "[8, 3]"),  # (7, 0): reference 7 + 3 = 10, candidate 0 + 8: lose
              "unread": ("no scores", "[5, 5]"),  # (0, 0): 0 + 5 each: tie
              "missing": (None, None)}
    release = vb.score_task("ERA", era, judged, parser="official", accounting="official")
    assert release.scores == pytest.approx({"win": 1 / 3, "tie": 1 / 3, "lose": 1 / 3})
    assert release.num_scored == 3 and release.failed_samples == {"judge_failed": 1}
    ours = vb.score_task("ERA", era, judged, parser="official")
    assert ours.scores == pytest.approx({"win": 1 / 4, "tie": 0, "lose": 3 / 4})


def test_vlmevalkit_accounting_scores_a_failed_generation_as_its_failure_message():
    """VLMEvalKit (vlmeval/dataset/vlrmbench.py) writes a failed or empty generation as its failure message
    and scores it: no sample is left out. The release's rules otherwise (its parsers are the release's)."""
    assert not re.search(r"\d|\b(yes|no|true|false)\b", vb.VLMEVALKIT_FAIL_MSG, re.IGNORECASE)
    # Step tasks: "missing" is scored as all 0. [0,1,0 | 1,0 | 0,0,1 | 1,1 | 0,1] against
    # [0,1,0 | 1,0 | 0,0,0 | 0,0 | 0,0]: TP 2, FN 4, FP 0, TN 6; F1_pos 4/8, F1_neg 12/16; (6/2 + 6 * 3/4) / 12.
    steps = [sample("IC", id="short", task_gt=(0, 1, 0)), sample("IC", id="long", task_gt=(1, 0)),
             sample("IC", id="unread", task_gt=(0, 0, 1)), sample("IC", id="missing", task_gt=(1, 1)),
             sample("IC", id="empty", task_gt=(0, 1))]
    answers = {"short": "[0, 1]", "long": "[1, 0, 1, 1]", "unread": "I cannot tell.", "empty": ""}
    labels = [0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1]
    read = [0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert release_weighted_f1(labels, read) == pytest.approx(5 / 8)
    result = vb.score_task("IC", steps, answers, parser="official", accounting="vlmevalkit")
    assert result.scores == pytest.approx({"f1": 5 / 8, "f1_pos": 1 / 2, "f1_neg": 3 / 4})
    assert (result.num_scored, result.failures, result.failed_samples) == (5, 4, {"generation_failed": 1})
    assert result.step_counts == {"tp": 2, "fp": 0, "fn": 4, "tn": 6}
    assert vb.score_task("IC", steps, answers, parser="official", accounting="official").scores["f1"] == \
        pytest.approx(26 / 35)  # the release leaves "missing" out
    # MJ: each order read alone, a failed one as (0, 0). "one_failed": 7 + 0 > 2 + 0, correct; "both_failed":
    # (0, 0) twice, a tie, wrong; "empty" likewise. Correct: both, short, long, one_failed = 4 of 6.
    mj = [sample("MJ", id=i, task_gt=None) for i in ("both", "short", "long", "empty", "one_failed", "both_failed")]
    pairs = {"both": ("[9, 4]", "[5, 8]"), "short": ("8", "[2, 7]"),
             "long": ("Response 1: 3, Response 2: 9, in 2 steps", "[6, 6]"), "empty": ("", ""),
             "one_failed": ("[7, 2]", None)}  # "both_failed" has no output
    result = vb.score_task("MJ", mj, pairs, parser="official", accounting="vlmevalkit")
    assert result.scores == {"accuracy": pytest.approx(4 / 6)} and result.num_scored == 6
    assert result.failed_samples == {"generation_failed": 2}
    official = vb.score_task("MJ", mj, pairs, parser="official", accounting="official")
    assert official.scores == {"accuracy": pytest.approx(3 / 4)} and official.num_scored == 4
    # FF: VLMEvalKit's check is `task_gt is True` (lines 260, 263), never true for the numpy booleans read
    # back from its prediction file: it prints 0. Compared by value: 0, 1, 2 right; 3 (no yes/no) and
    # 4 (no output: the failure message) wrong: 3/5, where the release leaves 4 out (3/4).
    ff = [sample("FF", id=str(i), task_gt=label) for i, label in enumerate([True, False, True, False, True])]
    said = {"0": "Yes.", "1": "I think yes, but no.", "2": "True", "3": "Hmm, hard to say."}
    result = vb.score_task("FF", ff, said, parser="official", accounting="vlmevalkit")
    assert result.scores == {"accuracy": 0.0, "accuracy_by_value": pytest.approx(3 / 5)}
    assert result.num_scored == 5 and result.failed_samples == {"generation_failed": 1}
    assert not any(np.bool_(label) is True for label in (True, False))  # why VLMEvalKit's check never holds
    # ERA/EC: not in VLMEvalKit.
    era = vb.score_task("ERA", [sample("ERA", id="a", task_gt="reference")], {"a": ("[6, 8]", "[9, 5]")},
                        accounting="vlmevalkit")
    assert era.scores == {"win": None, "tie": None, "lose": None} and era.num_scored == 0 and era.failures == 0
    unread = vb.score_task("ERA", [sample("ERA", id="a", task_gt="reference")], {"a": ("[6, 8]", None)},
                           accounting="vlmevalkit")
    assert unread.failures == vb.score_task("ERA", [sample("ERA", id="a", task_gt="reference")],
                                            {"a": ("[6, 8]", None)}).failures == 1
    both = vb.score_accountings("IC", steps, answers, parser="official")
    assert set(both) == set(vb.ACCOUNTINGS) == {"ours", "official", "vlmevalkit"}


def test_pooled_step_f1_against_the_papers_w_avg():
    """VLMEvalKit's step summary pools the steps of all step tasks; the paper's W-Avg averages the task F1s by
    sample count. SC: labels (0, 1) read right, F1 1. IC: labels (0, 0, 0, 1) read all 0: F1_pos 0, F1_neg
    6/7, weighted 1/4 * 6/7 = 3/14. W-Avg (1 sample each): (1 + 3/14) / 2 = 17/28. Pooled: [0,1,0,0,0,1]
    against [0,1,0,0,0,0]: TP 1, FN 1, FP 0, TN 4; F1_pos 2/3, F1_neg 8/9; (4 * 2/3 + 2 * 8/9) / 6 = 20/27."""
    results = {"SC": vb.score_task("SC", [sample(id="a", task_gt=(0, 1))], {"a": "[0, 1]"}),
               "IC": vb.score_task("IC", [sample("IC", id="b", task_gt=(0, 0, 0, 1))], {"b": "[0, 0, 0, 0]"})}
    assert results["IC"].scores["f1"] == pytest.approx(3 / 14)
    assert vb.weighted_average({t: r.scores["f1"] for t, r in results.items()}, {"SC": 1, "IC": 1}) == \
        pytest.approx(17 / 28)
    assert vb.pooled_step_f1(results) == pytest.approx(20 / 27)
    assert vb.pooled_step_f1(results) == pytest.approx(vb.weighted_f1([0, 1, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0]))
    assert vb.pooled_step_f1({"MJ": vb.score_task("MJ", [sample("MJ", id="c", task_gt=None)], {})}) is None


def test_official_accounting_scores_unread_answers_of_the_shipped_records():
    """Every one of the 58 real IC records answered without a label: the release scores them all 0, so F1 is
    the all-0 baseline (806 steps, 165 erroneous: F1_pos 0, F1_neg 2*641 / (2*641 + 165), weight 165/806)."""
    data = vb.load_task(IC_FILE, "IC")
    unread = {s.id: "The image does not show enough to say." for s in data}
    result = vb.score_task("IC", data.samples, unread, parser="official", accounting="official")
    assert result.scores["f1"] == pytest.approx(165 / 806 * 1282 / 1447) and result.num_scored == 58
    assert result.failures == 58 and result.failed_samples == {}
    assert vb.score_task("IC", data.samples, unread, parser="official").scores["f1"] == 0.0  # ours: all flipped


# ---------------------------------------------------------------- table

def full_results(step_f1=0.5, mj=0.6, ff=0.7):
    results = {}
    paper = vb.load_paper_results()
    for t in TASKS:
        scores = ({"f1": step_f1, "f1_pos": 0.0, "f1_neg": 0.0} if t.theme == "step"
                  else {"win": 0.1, "tie": 0.2, "lose": 0.7} if t.theme == "criticism"
                  else {"accuracy": mj if t.short == "MJ" else ff})
        n = paper["samples"][t.short]
        results[t.short] = vb.TaskResult(task=t.file, num_samples=n, num_outputs=n, failures=3,
                                         scores=scores, parser="robust")
    return results


def test_theme_average_needs_every_task():
    results = full_results(mj=0.5, ff=1.0)
    assert vb.theme_average(results, "step") == pytest.approx(0.5)
    assert vb.theme_average(results, "outcome") == pytest.approx((0.5 * 2986 + 2416) / (2986 + 2416))
    del results["FF"]
    assert vb.theme_average(results, "outcome") is None


def test_results_table_has_paper_rows_ours_and_the_judge():
    partial = {"IC": full_results()["IC"]}
    table = vb.results_table({"fire-teacher": full_results(), "fire-student (IC only)": partial},
                             judge="fire-teacher (LLaVA-NeXT-8B)", render="plain")
    lines = table.splitlines()
    header = lines[lines.index(next(l for l in lines if l.startswith("| Model | SC")))]
    assert header.split(" | ")[1:4] == ["SC", "RD", "CM"] and "Step W-Avg" in header and "EC L |" in header
    assert "ERA/EC judge: fire-teacher (LLaVA-NeXT-8B) (paper rows: Qwen2.5-VL-72B)" in table
    assert "parser=robust, render=plain" in table
    gpt = next(l for l in lines if l.startswith("| GPT-4o (paper)"))
    assert gpt.startswith("| GPT-4o (paper) | 73.7 | 50.6 |") and "| 62.4 |" in gpt and "| 66.3 |" in gpt
    assert sum(l.endswith("(paper) |") or "(paper) |" in l for l in lines) == len(vb.PAPER_MODELS)
    ours = next(l for l in lines if l.startswith("| fire-teacher |"))
    outcome = f"{100 * (0.6 * 2986 + 0.7 * 2416) / 5402:.1f}"
    assert ours == ("| fire-teacher | " + " | ".join(["50.0"] * 9) + f" | 60.0 | 70.0 | {outcome} | "
                    + " | ".join(["10.0", "20.0", "70.0"] * 2) + " |")
    student = next(l for l in lines if l.startswith("| fire-student (IC only) |"))
    assert student.split(" | ")[8:10] == ["50.0", "-"]  # IC scored, no step W-Avg from one task
    assert "| fire-teacher | 3/998 | 3/997 |" in table
    assert "| fire-student (IC only) | - | - | - | - | - | - | - | 3/58 | - |" in table


# ---------------------------------------------------------------- label-leak audit

def test_audit_on_a_planted_surface_rule(tmp_path):
    from fire_jax.vlrmbench.audit import audit_file

    # Erroneous steps, and only they, end with a space before the next marker: trailing_whitespace reads the
    # labels exactly. 3 records, 10 steps, 3 erroneous.
    records = [("a", [0, 1, 0]), ("b", [1, 0, 0, 0]), ("c", [0, 0, 1])]
    lines = []
    for rid, labels in records:
        steps = [f"STEP{k}: step {k} of {rid}." + (" " if label else "") for k, label in enumerate(labels, 1)]
        lines.append(json.dumps(dict(id=rid, image=["x.png"], question="Q?", category="c", task_gt=labels,
                                     step_list=[f"STEP{k}: step {k} of {rid}." for k in range(1, len(labels) + 1)],
                                     reasoning_error="\n".join(steps))))
    path = tmp_path / "step_correctness.jsonl"
    path.write_text("\n".join(lines) + "\n")
    audit, data = audit_file(path)
    # all_0: F1_neg = 2*7/(2*7+3) = 14/17, weighted by N_pos/N = 3/10. all_1: F1_pos = 6/13, weighted by 7/10.
    assert audit["all_0"] == pytest.approx(0.3 * 14 / 17) and audit["all_1"] == pytest.approx(0.7 * 6 / 13)
    assert audit["rules"]["trailing_whitespace"] == 1.0 and audit["rules"]["no_trailing_whitespace"] == 0.0
    # step_list has the same text without the space: stripped, nothing differs; the first step rule
    # hits b's step 1 only: TP 1, FP 2, FN 2 -> F1_pos 1/3; TN 5, FN_neg 2, FP_neg 2 -> F1_neg 5/7.
    assert audit["rules"]["differs_from_step_list"] == pytest.approx(0.3 * 14 / 17)
    assert audit["rules"]["first_step"] == pytest.approx(0.7 / 3 + 0.3 * 5 / 7)
    assert (audit["steps"], audit["erroneous_steps"]) == (10, 3)

    out = tmp_path / "audit.json"
    import subprocess
    import sys
    tool = Path(__file__).parent.parent / "tools" / "audit_vlrmbench.py"
    printed = subprocess.run([sys.executable, str(tool), str(path), str(IC_FILE), "--json", str(out)],
                             capture_output=True, text=True, check=True).stdout
    written = json.loads(out.read_text())
    assert list(written) == ["step_correctness.jsonl", "image_ref_error.jsonl"]
    assert set(written["step_correctness.jsonl"]) == {"all_0", "all_1", "rules"}
    assert written["step_correctness.jsonl"]["rules"]["trailing_whitespace"] == 1.0
    assert "| trailing_whitespace | 100.0 |" in printed
    # The 58 real IC records: 806 steps, 165 erroneous; the rewritten steps give themselves away.
    ic = written["image_ref_error.jsonl"]
    assert ic["all_0"] == pytest.approx(165 / 806 * 1282 / 1447)
    assert ic["all_1"] == pytest.approx(641 / 806 * 330 / 971)
    assert ic["rules"]["not_prefix_of_step_list"] == 1.0


def test_audit_best_threshold():
    from fire_jax.vlrmbench.audit import best_threshold, split_steps

    assert best_threshold([1, 5, 2, 7], [0, 1, 0, 1]) == (1.0, 2.0)
    assert best_threshold([1, 5, 2, 7], [1, 0, 1, 0], above=False) == (1.0, 5.0)
    assert split_steps("STEP1: a \nSTEP2: b\n\nSTEP3: c", 4) == [" a ", " b\n", " c", ""]


# ---------------------------------------------------------------- the paper's analyses (no model)

def test_majority_voting_over_crafted_samples():
    from fire_jax.vlrmbench import analyses as va

    assert va.majority_labels([[0, 1, 1], [1, 1, 0], [0, 1, 0]]) == [0, 1, 0]
    assert va.majority_labels([[0, 1], [1, 1]]) == [0, 1]  # a tie is 0
    s = sample(task_gt=(0, 1, 0))
    assert va.vote("SC", s, [["[0, 1, 0]"], ["STEP 1: 1.\nSTEP 2: 1.\nSTEP 3: 0."], ["[1, 0, 1]"]]) == "[1, 1, 0]"
    assert va.vote("SC", s, [["no"], ["[0, 0, 1]"], [None]]) == "[0, 0, 1]"  # unread votes do not count
    assert va.vote("SC", s, [["no"], [None]]) is None
    ff = sample("FF", task_gt=True)
    assert va.vote("FF", ff, [["Yes"], ["No."], ["yes"]]) == "Yes"
    assert va.vote("FF", ff, [["Yes"], ["No."], ["hmm"]]) == "No"  # 1 : 1 is not a majority for yes
    mj = sample("MJ", task_gt=None)
    votes = [("[9, 4]", "[5, 8]"), ("[9, 4]", "[9, 4]"), ("[3, 7]", "[6, 2]"), ("[8, 2]", "[1, 9]")]
    assert va.vote("MJ", mj, votes) == ("[1, 0]", "[0, 1]")  # verdicts +1, 0, -1, +1: good wins
    assert va.vote("MJ", mj, votes[1:3]) == ("[0, 0]", "[0, 0]")  # 0 and -1 tie: no winner
    assert vb.score_task("MJ", [mj], {"s": va.vote("MJ", mj, votes)}).scores["accuracy"] == 1.0
    assert va.sample_seed(0, "SC", "a") == va.sample_seed(0, "step_correctness", "a") != va.sample_seed(1, "SC", "a")


def test_length_buckets_on_crafted_records():
    from fire_jax.vlrmbench import analyses as va

    lengths = [3, 10, 11, 15, 16, 30]
    samples = [sample(id=str(n), task_gt=(1,) + (0,) * (n - 1)) for n in lengths]
    groups = va.length_buckets(samples)
    assert {k: [s.id for s in v] for k, v in groups.items()} == {
        "<=10 steps": ["3", "10"], "10-15": ["11", "15"], "> 15": ["16", "30"]}
    # <=10: exact; 10-15: "11" all zeros, "15" missing (ours: every label flipped); > 15: nothing read.
    outputs = {"3": "[1, 0, 0]", "10": str([1] + [0] * 9), "11": str([0] * 11)}
    results = va.by_length(samples, outputs)
    assert results["<=10 steps"] == {"samples": 2, "ours": 1.0, "official": 1.0, "failed_samples": {}}
    # 10-15 ours: labels 26 (2 pos), "11" predicts all 0, "15" predicts [0, 1 x 14]: TP 0, FP 14, FN 2,
    # F1_pos 0; TN 10, FN_neg 14 (wrongly predicted 1)... F1_neg = 2*10 / (2*10 + 14 + 2) = 20/36.
    assert results["10-15"]["ours"] == pytest.approx(2 / 26 * 20 / 36)
    assert results["10-15"]["official"] == pytest.approx(1 / 11 * 20 / 21)  # "11" alone: F1_neg 20/21
    assert results["> 15"]["official"] is None and results["> 15"]["ours"] == 0.0
    table = va.length_table(results, "ours-model", vb.load_paper_results())
    assert "| GPT-4o (paper) | 77.8 | 75.2 | 68.6 |" in table and "| samples (paper) | 263 | 468 | 267 |" in table
    assert "| ours-model (ours) | 100.0 | 4.3 | 0.0 |" in table and "| ours-model (official) | 100.0 | 8.7 | - |" in table


def test_positional_bias_from_mj_outputs():
    from fire_jax.vlrmbench import analyses as va

    samples = [sample("MJ", id=i, task_gt=None) for i in "abcd"]
    outputs = {"a": ("[9, 2]", "[2, 9]"), "b": ("[9, 4]", "[9, 4]"), "c": ("[8, 3]", "unsure")}  # "d": none
    results = va.positional(samples, outputs)
    # better_first: a, b, c right; d counts wrong (ours) or is left out (official). Means over a, b, c.
    assert results["better_first"] == {"mean_response_1": pytest.approx(26 / 3), "mean_response_2": 3.0,
                                       "accuracy": {"ours": 0.75, "official": 1.0}, "samples": 4, "failed": 1}
    # better_second: a right, b wrong; c's "unsure" counts wrong (ours) or is read as (0, 0), wrong (official).
    assert results["better_second"]["accuracy"] == {"ours": 0.25, "official": pytest.approx(1 / 3)}
    assert results["better_second"]["failed"] == 2 and results["better_second"]["mean_response_1"] == 5.5
    table = va.positional_table(results, "m", vb.load_paper_results())
    assert "| better_first | GPT-4o (paper) | 9.8 | 7.8 | 52.2 |  |  |" in table
    assert "| better_second | m | 5.5 | 6.5 | 25.0 | 33.3 | 2/4 |" in table


def test_shot_prompt_and_answer_matching():
    from fire_jax.vlrmbench import analyses as va

    pool = [sample(id=i, task_gt=(0, 1)) for i in "abc"]
    assert [e.id for e in va.shot_examples(pool[0], pool, 2)] == ["b", "c"]
    prompt = va.shot_prompt(pool[0], va.shot_examples(pool[0], pool, 1))
    assert prompt.count("## Example") == 1 and "### Output\n[0, 1]\n\n## Question\nQ?" in prompt
    assert prompt.endswith(vb.build_prompt(pool[0], "SC").split("## Question\n", 1)[1])
    assert va.answer_correct("Thought: count.\nAnswer: The number of green squares is 2.",
                             "The number of green squares is 2.")
    assert not va.answer_correct("Answer: The number of green squares is 3.", "The number of green squares is 2.")
    assert va.answer_correct("Answer: 12.0", "12") and not va.answer_correct("Answer: 12 or 13", "12")
    assert va.answer_correct("So the answer is B.", "b") and not va.answer_correct("Answer: bb", "b")
    records = [{"scores": [10.0]}, {"scores": [0.0, 10.0]}, {"scores": [0.0, 0.0]}, {"scores": [0.0, 10.0]}]
    assert va.correction_rate(records) == {"items": 4, "first_wrong": 3, "corrected": 2, "rate": 2 / 3}
    with pytest.raises(ValueError, match="unknown analyses"):
        va.select("positional,ranking")
    assert va.select("length,positional") == ["positional", "length"] and va.select("all") == list(va.ANALYSES)
