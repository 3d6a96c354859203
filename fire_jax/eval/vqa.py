"""Table 1's forgetting check: single-turn answers on any VQA-style JSONL, scored, the paper's rows beside ours.

    python -m fire_jax.evaluate --vqa gqa_testdev.jsonl --image_root /data/gqa/images --benchmark GQA \
        --config configs/eval_fixed.py:8b --config.student.adapter=FIRE_LLAVA --workdir OUT

One JSON object per line: ``{"id"?, "image", "question", "answers"}`` with ``answers`` a list of human answers
(VQAv2: 10; scored by :func:`fire_jax.eval.metrics.vqa_accuracy`) or one string, plus ``choices`` (a list of
option texts, lettered A, B, ...) for multiple choice (scored by exact match,
:func:`fire_jax.eval.metrics.multiple_choice_accuracy`). The student of ``config.student`` answers each
question once (prompts as LLaVA's evaluation: "Answer the question using a single word or phrase." / "Answer
with the option's letter from the given choices directly."); the text after its last "Answer:" is the answer.
Every answer is appended to OUT/vqa_outputs.jsonl (a rerun resumes); OUT/vqa_results.json and
OUT/vqa_results.md hold the accuracy and the paper's Table 1 rows. Bad lines are skipped and counted by reason.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import image_path
from fire_jax.data.jsonl import read_objects
from fire_jax.eval import metrics
from fire_jax.core.results import ResultStore, markdown_table, write_json
from fire_jax.core.files import write_text

SHORT_ANSWER = "Answer the question using a single word or phrase."
LETTER_ANSWER = "Answer with the option's letter from the given choices directly."
PAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_results", "fire.json")


def read_items(path: str, image_root: str = "") -> tuple[list[dict], BadRecords]:
    """The usable items of a JSONL / JSON-array file; bad ones counted by reason (missing_field,
    image_outside_root, missing_image, bad_answer)."""
    def parse(raw: dict, where: str, default_id: str) -> dict:
        for field in ("image", "question", "answers"):
            if not raw.get(field):
                raise BadRecordError("missing_field", where, field)
        answers = [raw["answers"]] if isinstance(raw["answers"], str) else [str(a) for a in raw["answers"]]
        if not isinstance(raw["image"], str):
            raise BadRecordError("missing_field", where, "image", f"expected a path, got {raw['image']!r}")
        image = image_path(image_root, raw["image"], where)  # refuses a path out of the root
        if not os.path.isfile(image):
            raise BadRecordError("missing_image", where, "image", image)
        item = dict(id=str(raw.get("id", default_id)), image=image, question=str(raw["question"]),
                    answers=answers, choices=[str(c) for c in raw.get("choices") or []])
        if item["choices"]:
            try:
                metrics.multiple_choice_accuracy("", answers[0], item["choices"])  # raises if not an option
            except ValueError as e:
                raise BadRecordError("bad_answer", where, "answers", str(e))
        return item

    bad = BadRecords()
    return list(read_objects(path, parse, bad=bad)), bad


def prompt(item: dict) -> str:
    if item["choices"]:
        options = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(item["choices"]))
        return f"{item['question']}\n{options}\n{LETTER_ANSWER}"
    return f"{item['question']}\n{SHORT_ANSWER}"


def final_answer(response: str) -> str:
    """The answer in a response: the text after its last "Answer:" (FIRE's "Thought: ...\\nAnswer: ..."), else all."""
    head, marker, tail = response.rpartition("Answer:")
    return (tail if marker else response).strip()


def score(item: dict, answer: str) -> float:
    if item["choices"]:
        return metrics.multiple_choice_accuracy(answer, item["answers"][0], item["choices"])
    return metrics.vqa_accuracy(answer, item["answers"])


def paper_rows(benchmark: str) -> dict[str, float]:
    """The paper's Table 1 values of ``benchmark`` (a column name, e.g. "VQAv2"), per model."""
    with open(PAPER) as f:
        table = json.load(f)["table1_instruction_following"]
    if benchmark not in table["columns"]:
        return {}
    column = table["columns"].index(benchmark)
    return {name: values[column] for name, values in table.items() if name != "columns"}


def table(benchmark: str, ours: dict[str, float]) -> str:
    """Markdown: the paper's rows (Table 1) and ours, accuracy in %."""
    rows = [(f"{name} (paper)", f"{value:.1f}") for name, value in paper_rows(benchmark).items()]
    rows += [(f"{name} (ours)", f"{100 * value:.1f}") for name, value in ours.items()]
    return markdown_table(("model", f"{benchmark or 'accuracy'} (%)"), rows)


def run_vqa(path: str, workdir: str, student, *, name: str = "student", image_root: str = "",
            benchmark: str = "", batch_size: int = 16) -> dict[str, Any]:
    """Answer every item once with ``student`` (anything with ``respond(images, questions)``), resumably; score."""
    from tqdm.auto import tqdm

    items, bad = read_items(path, image_root)
    os.makedirs(workdir, exist_ok=True)
    with ResultStore(os.path.join(workdir, "vqa_outputs.jsonl"), key_field="id") as store:
        todo = [item for item in items if item["id"] not in store]
        with tqdm(total=len(items), initial=len(items) - len(todo), desc="vqa") as progress:
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                responses = student.respond([item["image"] for item in batch], [prompt(item) for item in batch])
                for item, response in zip(batch, responses):
                    answer = final_answer(response)
                    store.add(dict(id=item["id"], question=item["question"], response=response, answer=answer,
                                   answers=item["answers"], choices=item["choices"], accuracy=score(item, answer)))
                progress.update(len(batch))
        done = [store[item["id"]] for item in items]
    accuracy = sum(r["accuracy"] for r in done) / max(len(done), 1)
    results = dict(benchmark=benchmark, model=name, items=len(done), accuracy=accuracy,
                   bad_records=dict(bad), paper=paper_rows(benchmark))
    results = write_json(os.path.join(workdir, "vqa_results.json"), results, indent=1)
    markdown = table(benchmark, {name: accuracy})
    write_text(os.path.join(workdir, "vqa_results.md"), markdown + "\n")
    print(bad.report(f"{path}: bad records skipped"))
    print(markdown)
    return results


def evaluate_vqa(config, path: str, workdir: str, *, image_root: str = "", benchmark: str = "") -> dict[str, Any]:
    """:func:`run_vqa` with ``config.student`` loaded as an eval config does (configs/eval_fixed.py)."""
    from fire_jax.eval.fire_bench import agent_from_section, agent_name

    rows = config.decode.get("batch_size", 16)
    student = agent_from_section(config, "student")
    return run_vqa(path, workdir, student, name=agent_name(config.student), image_root=image_root,
                   benchmark=benchmark, batch_size=rows)

