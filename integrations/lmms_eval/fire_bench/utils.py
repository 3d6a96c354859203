"""FIRE-Bench fixed dialogues (FIRE Tables 2-3) as lmms-eval tasks: fire_bench_student and fire_bench_teacher.

Loaded with ``lmms-eval --include_path integrations/lmms_eval`` from a fire_jax checkout, in an environment
where fire_jax is importable: every piece of the protocol is fire_jax's own, so the numbers are those of
``python -m fire_jax.evaluate --config configs/eval_fixed.py`` on the same predictions, to the last digit.

- Records: FIRE-test.json-style records (the release's schema), read by lmms-eval's ``json`` loader from the
  ``data_files`` of ``_default_template_yaml``; each is parsed and its image checked by
  :func:`fire_jax.data.records.parse_record` / ``check_image`` under the image root
  ``$FIRE_BENCH_IMAGE_ROOT`` (default: the images of the shipped synthetic test set). A bad record is skipped
  and counted by reason, as fire_jax.evaluate skips it.
- Docs: one per labelled turn, in :func:`fire_jax.eval.fixed.labelled_turns`'s order: the student's r_k for
  k >= 2 (the turns Eq. 5 labels), the teacher's f_k for every k (Eq. 6).
- Prompts: the student's prompt for r_k and the teacher's for f_k given the reference history
  (:func:`fire_jax.dialogue.agents.student_prompt` / ``teacher_prompt``, the teacher seeing every earlier turn,
  as trained), with fire_jax's system prompt and the image as a file lmms-eval sends as a PNG data URL.
- Metrics: :func:`fire_jax.eval.fixed.fixed_results` on the turn records
  (:func:`fire_jax.eval.fixed.turn_record`): BLEU-1..4 and CIDEr for both roles, the teacher's BLEU/CIDEr on
  the text after "Feedback:" and its score MAE (a reply without a score costs 10), with fire_jax's default
  readers (``fixed.teacher_text="feedback"``, ``fixed.score_parser="robust"``).
"""

from __future__ import annotations

import json
import os
import sys

from fire_jax.core.config import resolve_path
from fire_jax.data.chat import SYSTEM
from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import check_image
from fire_jax.data.records import Conversation, parse_record
from fire_jax.data.scores import parse_score
from fire_jax.eval import fixed
from fire_jax.dialogue.agents import student_prompt, teacher_prompt

#: The image root of the records: $FIRE_BENCH_IMAGE_ROOT, else the shipped synthetic test set's images (those of
#: the default data_files).
DEFAULT_IMAGE_ROOT = "assets:synthetic_fire/images"
TEACHER_HISTORY = "full"  # the teacher sees every earlier turn in fixed dialogues, as trained (Eq. 6)


def image_root() -> str:
    return resolve_path(os.environ.get("FIRE_BENCH_IMAGE_ROOT") or DEFAULT_IMAGE_ROOT)


def _conversation(doc: dict) -> Conversation:
    return parse_record(json.loads(doc["record"]), default_id=doc["default_id"])


def _turn(doc: dict) -> fixed.FixedTurn:
    return fixed.FixedTurn(_conversation(doc), doc["image"], doc["role"], doc["turn"])


def turn_docs(rows: list[dict], role: str) -> list[dict]:
    """The docs of ``role``'s labelled turns of every good record of ``rows`` (FIRE records as the json
    loader gives them), in :func:`fire_jax.eval.fixed.labelled_turns`'s order (``seq``)."""
    bad, pairs, raws = BadRecords(), [], {}
    for index, raw in enumerate(rows):
        raw = {k: v for k, v in raw.items() if v is not None}  # a field the json loader filled for other rows
        where = f"record {index}"
        try:
            record = parse_record(raw, default_id=str(index), where=where)
            if not isinstance(record, Conversation):
                raise BadRecordError("not_fire", where, "question", "an instruction record in a FIRE test set")
            pairs.append((record, check_image(record, image_root(), where)))
        except BadRecordError as e:
            bad.handle(e, "skip")
            continue
        if record.id in raws:  # fire_jax.evaluate keys its outputs by record id
            raise ValueError(f"fire_bench_{role}: two records have the id {record.id!r} (records {raws[record.id][1]} "
                             f"and {index})")
        raws[record.id] = (json.dumps(raw), str(index))
    if bad:
        print(f"fire_bench_{role}: skipped bad records {dict(bad)}", file=sys.stderr)
    return [{"seq": seq, "record": raws[t.record.id][0], "default_id": raws[t.record.id][1], "image": t.image,
             "role": t.role, "turn": t.turn, "key": t.key}
            for seq, t in enumerate(fixed.labelled_turns(pairs, (role,)))]


def student_docs(dataset):
    import datasets

    return datasets.Dataset.from_list(turn_docs(dataset.to_list(), "student"))


def teacher_docs(dataset):
    import datasets

    return datasets.Dataset.from_list(turn_docs(dataset.to_list(), "teacher"))


def doc_to_messages(doc: dict) -> list[dict]:
    """The chat messages of a turn's prompt, as fire_jax's endpoint agents send them (fire_jax.infer.api)."""
    turn = _turn(doc)
    record, history = turn.record, turn.record.turns[:turn.turn - 1]
    if turn.role == "student":
        prompt = student_prompt(record.question, history)
    else:
        prompt = teacher_prompt(record.question, record.groundtruth, record.turns[turn.turn - 1].response, history,
                                TEACHER_HISTORY)
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    for message in prompt:
        content = [{"type": "image", "url": turn.image}] * message.images + [{"type": "text", "text": message.text}]
        messages.append({"role": message.role, "content": content})
    return messages


def doc_to_visual(doc: dict) -> list[str]:
    return [doc["image"]]


def doc_to_text(doc: dict) -> str:
    """The last user message's text (what a single-turn model would see; the chat models get every turn)."""
    return doc_to_messages(doc)[-1]["content"][-1]["text"]


def doc_to_target(doc: dict) -> str:
    """The reference turn: r_k for the student, f_k for the teacher."""
    turn = _turn(doc)
    truth = turn.record.turns[turn.turn - 1]
    return truth.response if turn.role == "student" else truth.feedback


def process_results(doc: dict, results: list[str]) -> dict:
    """The turn record of fire_jax's fixed-dialogue outputs, under every metric of the task."""
    prediction = results[0]
    record = fixed.turn_record(_turn(doc), prediction, parse_score(prediction) if doc["role"] == "teacher" else None)
    record["seq"] = doc["seq"]
    return {metric: record for metric in METRICS[doc["role"]]}


METRICS = {"student": ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr"),
           "teacher": ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr", "MAE", "no_score")}


def _overall(records: list[dict]) -> dict:
    records = sorted(records, key=lambda r: r["seq"])  # fire_jax's order: the sums run in the same order
    results = fixed.fixed_results(records)
    return results[records[0]["role"]]["overall"]


def bleu_1(records):
    return _overall(records)["BLEU-1"]


def bleu_2(records):
    return _overall(records)["BLEU-2"]


def bleu_3(records):
    return _overall(records)["BLEU-3"]


def bleu_4(records):
    return _overall(records)["BLEU-4"]


def cider(records):
    return _overall(records)["CIDEr"]


def mae(records):
    return _overall(records)["MAE"]


def no_score(records):
    return _overall(records)["no_score"]
