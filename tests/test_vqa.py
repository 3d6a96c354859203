"""Table 1's forgetting check: the VQA runner (resumable, bad lines counted, the paper's rows) and its CLI."""

import json
import os
import subprocess
import sys

import pytest

from fire_jax.eval.vqa import final_answer, run_vqa

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
IMAGES = os.path.join(ROOT, "tests", "fixtures", "fire", "images")


class ScriptedStudent:
    """Answers from a table keyed by question; counts the questions it was asked."""

    def __init__(self, replies):
        self.replies, self.asked = replies, []

    def respond(self, images, questions):
        assert all(os.path.isfile(image) for image in images)
        self.asked += [q.split("\n")[0] for q in questions]
        return [self.replies[q.split("\n")[0]] for q in questions]


def _write(tmp_path):
    image = sorted(os.listdir(IMAGES))[0]
    lines = [
        dict(id="count", image=image, question="How many?", answers=["2"] * 3 + ["3"] * 7),
        dict(id="colour", image=image, question="What colour?", answers="red"),
        dict(id="mc", image=image, question="Which one?", answers=["B"], choices=["cat", "dog"]),
        dict(id="no_image", image="nowhere.jpg", question="?", answers=["x"]),
        dict(id="no_answers", image=image, question="?"),
    ]
    path = tmp_path / "vqa.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    return str(path)


def test_runner_scores_resumes_and_prints_the_paper_rows(tmp_path, capsys):
    path = _write(tmp_path)
    student = ScriptedStudent({"How many?": "Thought: I count them.\nAnswer: two", "What colour?": "Red.",
                               "Which one?": "B"})
    results = run_vqa(path, str(tmp_path / "out"), student, name="tiny", image_root=IMAGES, benchmark="VQAv2",
                      batch_size=2)
    assert results["items"] == 3 and results["accuracy"] == pytest.approx((0.9 + 1.0 + 1.0) / 3)
    assert results["bad_records"] == {"missing_image": 1, "missing_field": 1, "invalid_json": 1}
    assert results["paper"] == {"LLaVA-NeXT-8B": 79.0, "FIRE-LLaVA": 82.9}
    out = capsys.readouterr().out
    assert "| LLaVA-NeXT-8B (paper) | 79.0 |" in out and "| FIRE-LLaVA (paper) | 82.9 |" in out
    assert "| tiny (ours) | 96.7 |" in out
    # A rerun asks nothing again and gives the same figures.
    again = ScriptedStudent({})
    assert run_vqa(path, str(tmp_path / "out"), again, name="tiny", image_root=IMAGES)["accuracy"] == \
        results["accuracy"] and again.asked == []
    assert final_answer("Thought: x\nAnswer: y\nAnswer: z ") == "z" and final_answer(" y ") == "y"


def test_cli_with_a_tiny_model(tmp_path):
    path = _write(tmp_path)
    out = subprocess.run([sys.executable, "-m", "fire_jax.evaluate", "--vqa", path, "--image_root", IMAGES,
                          "--benchmark", "GQA", "--config", os.path.join(ROOT, "configs", "eval_fixed.py"),
                          "--config.decode.max_new_tokens=4", "--workdir", str(tmp_path / "cli")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "cli" / "vqa_results.json").read_text())
    assert results["items"] == 3 and 0.0 <= results["accuracy"] <= 1.0 and results["paper"]["FIRE-LLaVA"] == 65.8
    lines = (tmp_path / "cli" / "vqa_outputs.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == ["colour", "count", "mc"]
