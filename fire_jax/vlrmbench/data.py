"""VLRMBench data: one task's JSONL read into samples, bad records counted by reason."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any, Iterator

from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import outside_root
from fire_jax.data.jsonl import jsonl_lines
from fire_jax.vlrmbench.tasks import STEP_MARK, Sample, TaskInfo, check_choice, task_info


def count_steps(reasoning: str) -> int:
    """Number of "STEPk:" markers that open a line of `reasoning`."""
    return len(STEP_MARK.findall(reasoning))


class BadRecord(BadRecordError):
    """A VLRMBench record that cannot be used: a :class:`BadRecordError` (counted by the one
    :class:`BadRecords`) whose message names file, line and field as ``path:line: field 'x': reason: detail``."""

    def __init__(self, path: Path, line: int, field: str | None, reason: str, detail: str):
        super().__init__(reason, f"{path}:{line}", field or "<record>", detail)
        self.path, self.line = path, line
        self.args = (f"{path}:{line}" + (f": field {field!r}" if field else "") + f": {reason}: {detail}",)


@dataclasses.dataclass
class TaskData:
    """The usable samples of one task file, the bad records skipped and the odd ones kept, by reason."""

    task: str
    path: Path
    samples: list[Sample]
    skipped: BadRecords  # reason -> number of records (and the first offender of each)
    # reason -> records kept although odd: "step_count_mismatch" (task_gt's length differs from the
    # STEP markers of reasoning_error; kept, as the release keeps them, with len(task_gt) steps) and
    # "missing_image" (an image file does not exist; kept under missing_images="send_without").
    kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    def describe(self) -> str:
        """One line for logs: samples kept and records skipped by reason."""
        line = f"{self.task}: {len(self.samples)} samples from {self.path}"
        if self.skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
            line += f"; skipped {sum(self.skipped.values())} bad records ({reasons})"
        if self.kept:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.kept.items()))
            line += f"; kept {sum(self.kept.values())} odd records ({reasons})"
        return line


def _text_fields(info: TaskInfo) -> tuple[str, ...]:
    """The solution fields a task's prompts read (FF needs one of the two)."""
    if info.file == "multi_solution":
        return ("step_list", "reasoning_error")
    if info.file == "foresight":
        return ()
    return ("reasoning_error",)


MISSING_IMAGES = ("skip", "send_without")


def _parse_record(record: Any, info: TaskInfo, path: Path, line: int, image_root: Path | None,
                  kept: collections.Counter, missing_images: str = "skip") -> Sample:
    def bad(reason: str, field: str | None, detail: str) -> BadRecord:
        return BadRecord(path, line, field, reason, detail)

    if not isinstance(record, dict):
        raise bad("malformed_json", None, f"expected a JSON object, got {type(record).__name__}")

    # task_gt is read by every theme but MJ; FF needs step_list or reasoning_error.
    required = ("id", "image", "question", "category") + (("task_gt",) if info.file != "multi_solution" else ())
    for field in required + _text_fields(info):
        if field not in record:
            raise bad("missing_field", field, "missing")
    if info.file == "foresight" and "step_list" not in record and "reasoning_error" not in record:
        raise bad("missing_field", "step_list", "FF needs step_list or reasoning_error")

    def is_str_list(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    if not isinstance(record["id"], (str, int)) or isinstance(record["id"], bool):
        raise bad("bad_field", "id", f"expected a string, got {record['id']!r}")
    if not is_str_list(record["image"]) or not record["image"]:
        raise bad("bad_field", "image", f"expected a non-empty list of paths, got {record['image']!r}")
    for field in ("question", "category"):
        if not isinstance(record[field], str):
            raise bad("bad_field", field, f"expected a string, got {type(record[field]).__name__}")
    if "step_list" in record and not is_str_list(record["step_list"]):
        raise bad("bad_field", "step_list", "expected a list of strings")
    if "reasoning_error" in record and not isinstance(record["reasoning_error"], str):
        raise bad("bad_field", "reasoning_error", "expected a string")

    task_gt = record.get("task_gt")
    if info.theme == "step":
        if not isinstance(task_gt, list) or not all(type(v) is int and v in (0, 1) for v in task_gt):
            raise bad("bad_field", "task_gt", f"expected a list of 0/1, got {task_gt!r}")
        if not task_gt:
            raise bad("bad_field", "task_gt", "expected at least one label")
        if len(task_gt) != count_steps(record["reasoning_error"]):
            kept["step_count_mismatch"] += 1
        task_gt = tuple(task_gt)
    elif info.file == "foresight":
        if not isinstance(task_gt, bool):
            raise bad("bad_field", "task_gt", f"expected true/false, got {task_gt!r}")
    elif info.theme == "criticism":
        if not (isinstance(task_gt, str) or is_str_list(task_gt)) or not task_gt:
            raise bad("bad_field", "task_gt", "expected the reference answer (a string or a list of steps)")
        task_gt = task_gt if isinstance(task_gt, str) else tuple(task_gt)

    images, missing = tuple(record["image"]), ()
    if image_root is not None:
        for image in images:
            why = outside_root(str(image_root), image)
            if why:
                raise bad("image_outside_root", "image", why)
        images = tuple(str(image_root / p) for p in images)
        missing = tuple(image for image in images if not Path(image).is_file())
        if missing and missing_images == "skip":
            raise bad("missing_image", "image", f"no file {missing[0]}")
        if missing:
            kept["missing_image"] += 1
            images = tuple(image for image in images if image not in missing)

    step_list = record.get("step_list")
    return Sample(
        task=info.file,
        id=str(record["id"]),
        images=images,
        question=record["question"],
        step_list=None if step_list is None else tuple(step_list),
        reasoning_error=record.get("reasoning_error"),
        task_gt=task_gt,
        category=record["category"],
        line=line,
        missing_images=missing,
    )


def load_task(path_or_dir: str | Path, task: str, image_root: str | Path | None = None,
              on_bad_record: str = "skip", missing_images: str = "skip") -> TaskData:
    """Reads one task's JSONL (`path_or_dir` is the file or the folder holding `<task>.jsonl`).

    Bad records are malformed JSON lines, missing or mistyped fields, a
    duplicate id, and (when `image_root` is given) an image file that does
    not exist -- unless `missing_images="send_without"`, which keeps such a
    record without those images (the release's clients send its request
    without them) and counts it in `TaskData.kept` ("missing_image"). A step
    record whose labels count differently from the STEP markers of
    reasoning_error is kept (the release keeps it; the labels give the number
    of steps) and counted in `TaskData.kept`.
    `on_bad_record="skip"` drops them and counts them in `TaskData.skipped` by
    reason; `"error"` raises BadRecord naming file, line and field.
    """
    check_choice(on_bad_record, ("skip", "error"), "on_bad_record")
    check_choice(missing_images, MISSING_IMAGES, "missing_images")
    info = task_info(task)
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / f"{info.file}.jsonl"
    root = None if image_root is None else Path(image_root)
    samples: list[Sample] = []
    skipped = BadRecords()
    kept: collections.Counter = collections.Counter()
    seen: set[str] = set()
    for record in jsonl_lines(str(path)):
        try:
            if record.error is not None:
                raise BadRecord(path, record.line, None, "malformed_json", record.error)
            odd = collections.Counter()
            sample = _parse_record(record.value, info, path, record.line, root, odd, missing_images)
            if sample.id in seen:
                raise BadRecord(path, record.line, "id", "duplicate_id", f"id {sample.id!r} seen before")
        except BadRecord as e:
            skipped.handle(e, on_bad_record)
            continue
        seen.add(sample.id)
        samples.append(sample)
        kept.update(odd)
    return TaskData(task=info.file, path=path, samples=samples, skipped=skipped, kept=kept)


