"""FIRE-Bench as lmms-eval tasks (integrations/lmms_eval/fire_bench): the same turns, prompts and metrics as
python -m fire_jax.evaluate; and, where lmms-eval is installed, its own CLI against python -m fire_jax.serve."""

import importlib.util
import json
import os

import pytest

from fire_jax.core.config import resolve_path
from fire_jax.data.chat import SYSTEM, TEACHER_INSTRUCTION
from fire_jax.data.items import load_conversations
from fire_jax.data.scores import parse_score
from fire_jax.eval import fixed
from fire_jax.eval.fire_bench import evaluate
from fire_jax.dialogue.agents import Feedback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TASKS = os.path.join(ROOT, "integrations", "lmms_eval")
TEST_JSON = resolve_path("assets:synthetic_fire/test.json")
IMAGES = resolve_path("assets:synthetic_fire/images")


def task_utils():
    """integrations/lmms_eval/fire_bench/utils.py, imported as lmms-eval imports it (by file)."""
    spec = importlib.util.spec_from_file_location("fire_bench_utils", os.path.join(TASKS, "fire_bench", "utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AGGREGATIONS = {"BLEU-1": "bleu_1", "BLEU-2": "bleu_2", "BLEU-3": "bleu_3", "BLEU-4": "bleu_4", "CIDEr": "cider",
                "MAE": "mae", "no_score": "no_score"}


class Student:
    """Answers near the synthetic set's own wording, so that BLEU and CIDEr are not 0."""

    def respond(self, images, questions, histories, rng=None):
        return [f"Thought: I count them in the image again.\nAnswer: There are {len(h) + 1}." for h in histories]


class Teacher:
    """Scores 4 + k; a question about circles gets a reply without a score (MAE 10, counted in no_score)."""

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None):
        out = []
        for question, history in zip(questions, histories):
            k = len(history) + 1
            text = ("Feedback: no score." if "circle" in question else
                    f"Score: {4 + k}.\nFeedback: Your count is too high. Count them again ({k}).")
            out.append(Feedback(text, parse_score(text)))
        return out


def test_tasks_score_fire_jax_evaluates_predictions_to_the_last_digit(tmp_path, monkeypatch):
    """fire_jax.evaluate's fixed dialogues with scripted agents; its predictions, scored by the lmms-eval tasks'
    process_results and aggregations (handed over in another order), give every metric bit for bit. A
    record whose image is missing is skipped by both."""
    from test_fire_bench import eval_config

    with open(TEST_JSON) as f:
        records = json.load(f)[:6]
    records[4] = {**records[4], "image": "no_such_image.png"}
    path = tmp_path / "test.json"
    path.write_text(json.dumps(records))
    config = eval_config("fixed")
    config.test.update(json=str(path), image_root=IMAGES)
    results = evaluate(config, str(tmp_path / "run"), agents=(Student(), Teacher()))
    with open(results["outputs"]) as f:
        predictions = {line["key"]: line["prediction"] for line in map(json.loads, f)}

    monkeypatch.setenv("FIRE_BENCH_IMAGE_ROOT", IMAGES)
    utils = task_utils()
    pairs = load_conversations(config.test)
    assert len(pairs) == 5
    for role in fixed.ROLES:
        docs = utils.turn_docs(records, role)
        assert [d["key"] for d in docs] == [t.key for t in fixed.labelled_turns(pairs, (role,))]
        scored = [utils.process_results(doc, [predictions[doc["key"]]]) for doc in docs]
        overall = results["metrics"][role]["overall"]
        assert set(scored[0]) == set(utils.METRICS[role])
        for metric in utils.METRICS[role]:
            value = getattr(utils, AGGREGATIONS[metric])([s[metric] for s in reversed(scored)])
            assert value == overall[metric], (role, metric)
        assert overall["BLEU-1"] > 0.3 and overall["CIDEr"] > 0.1  # the comparison is not of zeros
    assert results["metrics"]["teacher"]["overall"]["no_score"] >= 1


def test_prompts_are_the_fixed_dialogue_protocols(monkeypatch):
    """The teacher's prompt for f_2 and the student's for r_2 of the first synthetic record, message by message:
    the reference history, fire_jax's system prompt, the image before the first user text."""
    monkeypatch.setenv("FIRE_BENCH_IMAGE_ROOT", IMAGES)
    utils = task_utils()
    with open(TEST_JSON) as f:
        record = json.load(f)[0]
    r1, f1, r2, f2 = (m["value"] for m in record["conversations"])
    image = {"type": "image", "url": os.path.join(IMAGES, record["image"])}

    def text(value):
        return {"type": "text", "text": value}

    teacher = next(d for d in utils.turn_docs([record], "teacher") if d["turn"] == 2)
    assert utils.doc_to_messages(teacher) == [
        {"role": "system", "content": [text(SYSTEM)]},
        {"role": "user", "content": [image, text(f"Question: {record['question']['value']}\n"
                                                 f"Groundtruth: {record['groundtruth']['value']}")]},
        {"role": "user", "content": [text(TEACHER_INSTRUCTION)]},
        {"role": "user", "content": [text(r1.strip())]},
        {"role": "assistant", "content": [text(f1.strip())]},
        {"role": "user", "content": [text(r2.strip())]}]
    assert utils.doc_to_target(teacher) == f2.strip()
    [student] = utils.turn_docs([record], "student")  # r_1 is not a labelled student turn (Eq. 5)
    assert student["turn"] == 2 and utils.doc_to_target(student) == r2.strip()
    assert utils.doc_to_messages(student) == [
        {"role": "system", "content": [text(SYSTEM)]},
        {"role": "user", "content": [image, text(record["question"]["value"])]},
        {"role": "assistant", "content": [text(r1.strip())]},
        {"role": "user", "content": [text("Your count is too high. Count them again.")]}]


def test_lmms_eval_cli_against_fire_jax_serve_equals_fire_jax_evaluate(tmp_path):
    """lmms-eval's own CLI (--include_path, --limit 3) with its OpenAI-compatible chat model against python -m
    fire_jax.serve (a tiny LLaVA-NeXT) on the shipped synthetic test set, and python -m fire_jax.evaluate's
    fixed dialogues with the same model in process on the same records: every prediction and metric equal."""
    pytest.importorskip("lmms_eval")
    import subprocess
    import sys

    import torch
    from hf_reference import tiny_hf_model
    from loopback import child_env, server
    from test_fire_bench import eval_config

    checkpoint = str(tmp_path / "tiny")
    hf = tiny_hf_model(checkpoint)
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(8.0)  # so that greedy outputs vary
    hf.save_pretrained(checkpoint)
    max_new_tokens = 8
    with server("fire_jax.serve", ["--model", f"tiny={checkpoint}", "--slots", "4"], "/health", timeout=300) as (_, base):
        env = child_env(HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"))
        env.pop("FIRE_BENCH_IMAGE_ROOT", None)  # the default: the shipped synthetic images
        run = subprocess.run(
            [sys.executable, "-m", "lmms_eval", "--model", "openai", "--model_args",
             f"model_version=tiny,base_url={base}/v1,api_key=EMPTY,max_retries=1", "--tasks", "fire_bench",
             "--include_path", TASKS, "--limit", "3", "--gen_kwargs", f"max_new_tokens={max_new_tokens}",
             "--output_path", str(tmp_path / "lmms"), "--log_samples"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    # lmms-eval's CLI logs an evaluation's exception and still exits 0: its results file is the check
    results_files = list((tmp_path / "lmms").rglob("*_results.json"))
    assert run.returncode == 0 and len(results_files) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    [results_file] = results_files
    lmms_results = json.loads(results_file.read_text())["results"]
    lmms_turns = {}
    for role in fixed.ROLES:
        [samples] = (tmp_path / "lmms").rglob(f"*_samples_fire_bench_{role}.jsonl")
        lmms_turns[role] = [json.loads(line)["BLEU-1"] for line in samples.read_text().splitlines()]
        assert len(lmms_turns[role]) == 3 and all(t["prediction"] for t in lmms_turns[role])
        assert not any("LMMS_EVAL_REQUEST_FAILED" in t["prediction"] for t in lmms_turns[role])

    # fire_jax.evaluate in process on the records those turns come from
    ids = {t["id"] for turns in lmms_turns.values() for t in turns}
    with open(TEST_JSON) as f:
        records = [r for r in json.load(f) if r["id"] in ids]
    (tmp_path / "test.json").write_text(json.dumps(records))
    config = eval_config("fixed")
    config.test.update(json=str(tmp_path / "test.json"), image_root=IMAGES)
    config.student.init = config.teacher.init = checkpoint
    config.decode.update(max_new_tokens=max_new_tokens)
    results = evaluate(config, str(tmp_path / "fire_jax"))
    with open(results["outputs"]) as f:
        ours = {line["key"]: line for line in map(json.loads, f)}
    for role in fixed.ROLES:
        mine = [ours[t["key"]] for t in sorted(lmms_turns[role], key=lambda t: t["seq"])]
        assert [t["prediction"] for t in sorted(lmms_turns[role], key=lambda t: t["seq"])] == \
            [r["prediction"] for r in mine]
        overall = fixed.fixed_results(mine)[role]["overall"]
        for metric in AGGREGATIONS if role == "teacher" else list(AGGREGATIONS)[:5]:
            assert lmms_results[f"fire_bench_{role}"][f"{metric},none"] == overall[metric], (role, metric)
