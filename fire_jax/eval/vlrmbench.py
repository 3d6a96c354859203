"""VLRMBench: a model judged as a vision-language reward model (SPEC section 7).

The model-independent half: load the benchmark's JSONL, render the official
prompts, parse what a model answered, score it, and print a table shaped like
Table 3 of the VLRMBench paper beside the paper's own rows. Plain Python and
numpy; a runner that generates with a fire_jax model calls these functions.

Two switches keep the release's behaviour available for comparable numbers:

- ``render="official"`` fills ``{ai_respond_1}`` (MJ) and FF's reasoning
  process with ``str(step_list)``, a Python list with quotes, brackets and
  literal "\\n", as the release does. The default ``"plain"`` writes the steps
  as "STEP1: ...\\nSTEP2: ..." text, the shape of ``reasoning_error``, so the
  good solution does not give itself away by its format.
- ``parser="official"`` reads outputs as the release's scripts do (every
  integer is a label; the last two integers are the scores; yes/no anywhere).
  The default ``"robust"`` reads the list the prompt asked for. Every scorer
  counts the outputs its parser failed on.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from fire_jax.eval.vlrmbench_prompts import JUDGE_PROMPTS, TASK_PROMPTS, TASKS, TaskInfo, task_info

PARSERS = ("robust", "official")
RENDERS = ("plain", "official")
# What a failed sample (its generation or judge call failed, or its output could not be read) counts as:
# "ours" counts it wrong (every step label flipped, MJ/FF wrong, ERA/EC a loss); "official" leaves it
# out of the score, as the release's scripts do.
ACCOUNTINGS = ("ours", "official")
FAILURE_REASONS = ("generation_failed", "judge_failed", "unparsable")
PAPER_RESULTS = Path(__file__).parent / "paper_results" / "vlrmbench.json"
# Rows of the paper's Table 3 printed beside ours by default: the open models
# nearest to LLaVA-NeXT-8B in size and lineage, plus the large references.
PAPER_MODELS = ("Llava-OneVision-7B", "Llama3.2-11B", "Qwen2.5VL-7B", "Qwen2.5VL-72B", "GPT-4o")
PAPER_JUDGE = "Qwen2.5-VL-72B"  # the release's judge for ERA/EC; references by GPT-4o


def _check_choice(value: str, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# ----------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------

# A step marker at the start of reasoning_error or of one of its lines.
_STEP_MARK = re.compile(r"(?:^|\n)[ \t]*STEP\s*\d+\s*:")
# The "STEPk:" prefix of one step_list item.
_STEP_PREFIX = re.compile(r"^\s*STEP\s*\d+\s*:")


def count_steps(reasoning: str) -> int:
    """Number of "STEPk:" markers that open a line of `reasoning`."""
    return len(_STEP_MARK.findall(reasoning))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One benchmark record.

    `task_gt` by theme: step tasks, a tuple of 0/1 per step of
    `reasoning_error` (1 = the step is erroneous; its length is the number
    of steps, even where the STEP markers of reasoning_error count otherwise); FF, a bool (the partial
    process leads to a correct answer); ERA/EC, the reference answer (str, or
    a tuple of steps); MJ, whatever the record holds (unused).
    """

    task: str  # file name of the task, e.g. "image_ref_error"
    id: str
    images: tuple[str, ...]  # joined to image_root when the loader had one
    question: str
    step_list: tuple[str, ...] | None  # the correct solution, one item per step
    reasoning_error: str | None  # the solution with errors, "STEP1: ...\nSTEP2: ..."
    task_gt: Any
    category: str
    line: int  # 1-based line of the record in its JSONL file


class BadRecord(ValueError):
    """A record that cannot be used; the message names file, line and field."""

    def __init__(self, path: Path, line: int, field: str | None, reason: str, detail: str):
        where = f"{path}:{line}" + (f": field {field!r}" if field else "")
        super().__init__(f"{where}: {reason}: {detail}")
        self.path, self.line, self.field, self.reason = path, line, field, reason


@dataclasses.dataclass
class TaskData:
    """The usable samples of one task file, the bad records skipped and the odd ones kept, by reason."""

    task: str
    path: Path
    samples: list[Sample]
    skipped: collections.Counter  # reason -> number of records
    # reason -> records kept although odd: "step_count_mismatch" (task_gt's length differs from the
    # STEP markers of reasoning_error; kept, as the release keeps them, with len(task_gt) steps).
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


def _parse_record(text: str, info: TaskInfo, path: Path, line: int, image_root: Path | None,
                  kept: collections.Counter) -> Sample:
    def bad(reason: str, field: str | None, detail: str) -> BadRecord:
        return BadRecord(path, line, field, reason, detail)

    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad("malformed_json", None, str(e)) from None
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

    images = tuple(record["image"])
    if image_root is not None:
        images = tuple(str(image_root / p) for p in images)
        for image in images:
            if not Path(image).is_file():
                raise bad("missing_image", "image", f"no file {image}")

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
    )


def load_task(path_or_dir: str | Path, task: str, image_root: str | Path | None = None,
              on_bad_record: str = "skip") -> TaskData:
    """Reads one task's JSONL (`path_or_dir` is the file or the folder holding `<task>.jsonl`).

    Bad records are malformed JSON lines, missing or mistyped fields, a
    duplicate id, and (when `image_root` is given) an image file that does
    not exist. A step record whose labels count differently from the STEP
    markers of reasoning_error is kept (the release keeps it; the labels give
    the number of steps) and counted in `TaskData.kept`.
    `on_bad_record="skip"` drops them and counts them in `TaskData.skipped` by
    reason; `"error"` raises BadRecord naming file, line and field.
    """
    _check_choice(on_bad_record, ("skip", "error"), "on_bad_record")
    info = task_info(task)
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / f"{info.file}.jsonl"
    root = None if image_root is None else Path(image_root)
    samples: list[Sample] = []
    skipped: collections.Counter = collections.Counter()
    kept: collections.Counter = collections.Counter()
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                odd = collections.Counter()
                sample = _parse_record(text, info, path, line, root, odd)
                if sample.id in seen:
                    raise BadRecord(path, line, "id", "duplicate_id", f"id {sample.id!r} seen before")
            except BadRecord as e:
                if on_bad_record == "error":
                    raise
                skipped[e.reason] += 1
                continue
            seen.add(sample.id)
            samples.append(sample)
            kept.update(odd)
    return TaskData(task=info.file, path=path, samples=samples, skipped=skipped, kept=kept)


# ----------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------


def render_steps(steps: Sequence[str], render: str = "plain") -> str:
    """A list of steps as prompt text.

    official: ``str(list)``, as the release's ``str.format`` writes a list.
    plain: "STEP1: <step 1>\\nSTEP2: <step 2>..." -- each item's own "STEPk:"
    prefix (if any) replaced by its position and surrounding whitespace
    stripped. reasoning_error strings differ by file in their spacing (e.g.
    IC's have two spaces after "STEPk:" and keep each step only up to its
    first inner colon, SR's keep the steps' trailing blank lines); plain
    keeps the text whole and the layout uniform.
    """
    _check_choice(render, RENDERS, "render")
    if render == "official":
        return str(list(steps))
    return "\n".join(f"STEP{k}: {_STEP_PREFIX.sub('', step, count=1).strip()}"
                     for k, step in enumerate(steps, start=1))


def reasoning_process(sample: Sample, task: str, render: str = "plain") -> str:
    """What fills `{reasoning_process}` in the task prompt.

    Step tasks, ERA and EC: the record's reasoning_error, verbatim. FF: the
    foresight prompt has this one placeholder for "part of the reasoning
    process", and the FF records already hold that partial process; like the
    release, we use the record's reasoning_error when it has one, else its
    step_list (rendered by `render`), and never cut it further.
    """
    info = task_info(task)
    if info.file == "multi_solution":
        raise ValueError("MJ has two responses, not one reasoning process; use build_prompt")
    if info.file == "foresight" and sample.reasoning_error is None:
        return render_steps(sample.step_list, render)
    return sample.reasoning_error


def num_orders(task: str) -> int:
    """Prompts per sample: 2 for MJ (good solution first, then swapped), else 1."""
    return 2 if task_info(task).file == "multi_solution" else 1


def build_prompt(sample: Sample, task: str, render: str = "plain", order: int = 0) -> str:
    """The release's prompt for `task` filled with `sample` (order < num_orders(task)).

    MJ: order 0 puts step_list (the good solution) as response 1 and
    reasoning_error as response 2; order 1 swaps them.
    """
    info = task_info(task)
    _check_choice(render, RENDERS, "render")
    if order not in range(num_orders(task)):
        raise ValueError(f"{info.short} has {num_orders(task)} prompt order(s), got order={order}")
    template = TASK_PROMPTS[info.file]
    if info.file == "multi_solution":
        good, bad = render_steps(sample.step_list, render), sample.reasoning_error
        first, second = (good, bad) if order == 0 else (bad, good)
        return template.format(question=sample.question, ai_respond_1=first, ai_respond_2=second)
    return template.format(question=sample.question, reasoning_process=reasoning_process(sample, task, render))


def build_judge_prompt(sample: Sample, task: str, candidate: str, render: str = "plain", order: int = 0) -> str:
    """The release's judge prompt for ERA/EC, reference vs `candidate` (the model's answer).

    order 0: the reference (task_gt) is response 1, the candidate response 2;
    order 1 swaps them. Every criticism sample is judged in both orders. A
    reference given as a list of steps is rendered like step_list.
    """
    info = task_info(task)
    if info.theme != "criticism":
        raise ValueError(f"{info.short} has no judge prompt; only ERA and EC are judged")
    _check_choice(render, RENDERS, "render")
    if order not in (0, 1):
        raise ValueError(f"judge prompts have orders 0 and 1, got order={order}")
    reference = sample.task_gt if isinstance(sample.task_gt, str) else render_steps(sample.task_gt, render)
    first, second = (reference, candidate) if order == 0 else (candidate, reference)
    # EC's judge prompt has no {reasoning_error}; str.format ignores the extra key.
    return JUDGE_PROMPTS[info.file].format(question=sample.question, reasoning_error=sample.reasoning_error,
                                           ai_respond_1=first, ai_respond_2=second)


# ----------------------------------------------------------------------------
# Parsers. Each returns what it read and whether it read it; a missing output
# (None: the generation failed) is a failure, read as the parser's padding.
# ----------------------------------------------------------------------------

_INTEGER = re.compile(r"\d+")
_BRACKETED = re.compile(r"\[([^\[\]]*)\]")
_PARENTHESISED = re.compile(r"\(([^()]*)\)")
_LABEL_ITEM = re.compile(r"[01]")
_SCORE_ITEM = re.compile(r"(\d+(?:\.\d+)?)(?:\s*/\s*10)?")
# A step's label: 0/1 (not "0.5" or "10"; a full stop after it is fine), a verdict word or a mark.
# "incorrect" before "correct"; "no error" before "error". 1 = the step is erroneous.
_LABEL = (r"(?P<label>[01](?!\d|\.\d)|incorrect\b|not\s+correct\b|wrong\b|erroneous\b|no\s+errors?\b|"
          r"errors?\b|correct\b|right\b|[✓✔✅✗✘❌])")
_ERRONEOUS = re.compile(r"incorrect|not\s+correct|wrong|erroneous|errors?|1|[✗✘❌]", re.IGNORECASE)
_BOLD = r"(?:\*\*|__|\*)?"
# "STEP 3: 1", "**Step 3**: 1.", "step_3 = 0", '{"STEP3": 1}', "| Step 3 | 1 |", "Step 3 - incorrect",
# "Indicator for STEP 3: 0", "STEP 3 -> 1"; (?!\d) keeps "STEP 10" from reading as step 1.
_STEP_PAIR = re.compile(rf"STEP[\s_]*(?P<step>\d+)(?!\d){_BOLD}[\"']?\s*(?:[:=\-–—|]|->|→)\s*{_BOLD}\s*[\"'(]?"
                        + _LABEL, re.IGNORECASE)
# A numbered list or table row of labels: "1. 0", "2) incorrect", "| 3 | 1 |", "**1.** Correct".
_NUMBERED = re.compile(rf"^[ \t>*-]*\|?\s*{_BOLD}(?P<step>\d+)(?!\d)[.):]?{_BOLD}\s*(?:\||:|-|–)?\s*{_BOLD}[\"']?"
                       + _LABEL + r"[\"']?\s*(?:\*\*)?\s*(?:$|[|.,;:!(]|\s[-–(:])", re.IGNORECASE | re.MULTILINE)
# A line that is nothing but labels: "0, 1, 0", "0 1 0", "Answer: 0,1,0".
_BARE_LINE = re.compile(r"^[^\n\d]{0,20}?((?:[01](?:\s*[,;]\s*|\s+))+[01])\s*\.?\s*$", re.MULTILINE)
# "Response 1: 8", "Score for Response 2 = 7/10", "**Response 1**: 8".
_RESPONSE_SCORE = re.compile(r"Response\s*([12])(?!\d)\**\s*[:=]\s*\**\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)


def _bracketed_lists(text: str, item: re.Pattern, pattern: re.Pattern = _BRACKETED) -> list[list[str]]:
    """Every [a, b, ...] in `text` whose items (unquoted, unbolded) all fully match `item`."""
    lists = []
    for body in pattern.findall(text):
        items = [i.strip().strip("\"'*").strip() for i in body.split(",")]
        if all(item.fullmatch(i) for i in items):
            lists.append(items)
    return lists


def _pad(values: list, n: int) -> list:
    return (values + [0] * n)[:n]


def _label_value(word: str) -> int:
    return int(bool(_ERRONEOUS.fullmatch(word.strip())))


def _numbered_labels(pattern: re.Pattern, text: str) -> dict[int, int]:
    """{step: label} from "STEP k: x" pairs or numbered rows; the first label of each step wins."""
    pairs: dict[int, int] = {}
    for match in pattern.finditer(text):
        pairs.setdefault(int(match.group("step")), _label_value(match.group("label")))
    return pairs


def _step_readings(text: str) -> Iterator[list[int] | dict[int, int]]:
    """The ways a text can hold step labels, in order of trust (see parse_step_labels_ex)."""
    for pattern in (_BRACKETED, _PARENTHESISED):
        lists = _bracketed_lists(text, _LABEL_ITEM, pattern)
        yield from ([int(i) for i in items] for items in reversed(lists))  # the last list first
    yield _numbered_labels(_STEP_PAIR, text)
    yield _numbered_labels(_NUMBERED, text)
    for line in reversed(_BARE_LINE.findall(text)):
        yield [int(i) for i in re.findall(r"[01]", line)]


def parse_step_labels_ex(text: str | None, num_steps: int, parser: str = "robust") -> tuple[list[int], bool]:
    """Per-step labels (1 = erroneous) read from a step-task output, and whether reading succeeded.

    official (the release): every integer in the text is a label, values > 1
    become 1, the first `num_steps` are kept, missing ones are 0; it "fails"
    when the text has fewer integers than steps. It reads "STEP 1: 0, STEP 2:
    1" as [1, 0, 1, 1] and counts a restated "[Indicator for STEP 1, ...]".
    robust (default): the readings of :func:`_step_readings`, in order --
    bracketed 0/1 lists (last first), then parenthesised ones, "STEP k: x"
    pairs, numbered rows ("1. 0", "| 1 | 1 |"), lines of bare labels -- where
    a label is 0/1 (a full stop after it is fine), a verdict word
    ("incorrect", "wrong", "error" = 1; "correct", "right", "no error" = 0)
    or a check mark. The first reading with exactly `num_steps` labels (a
    list) or a label for every step 1..num_steps and no other (pairs, rows)
    wins; else the first non-empty reading, padded with 0 or cut, and the
    parse counts as a failure. Every form it reads is in tests/test_vlrmbench.py.
    """
    _check_choice(parser, PARSERS, "parser")
    if text is None:
        return [0] * num_steps, False
    if parser == "official":
        labels = [min(int(i), 1) for i in _INTEGER.findall(text)]
        return _pad(labels, num_steps), len(labels) >= num_steps
    fallback = None
    for reading in _step_readings(text):
        if isinstance(reading, dict):
            complete = set(reading) == set(range(1, num_steps + 1))
            labels = [reading.get(k, 0) for k in range(1, num_steps + 1)]
        else:
            complete, labels = len(reading) == num_steps, _pad(reading, num_steps)
        if complete:
            return labels, True
        if reading and fallback is None:
            fallback = labels
    return (fallback or [0] * num_steps), False


def parse_step_labels(text: str | None, num_steps: int, parser: str = "robust") -> list[int]:
    """Per-step labels read from a step-task output; see parse_step_labels_ex."""
    return parse_step_labels_ex(text, num_steps, parser)[0]


def parse_scores_ex(text: str | None, parser: str = "robust") -> tuple[tuple[float, float], bool]:
    """The two scores (response 1, response 2) of an MJ or judge output, and whether reading succeeded.

    official (the release): the last two integers, padded with 0 when fewer
    (it "fails" then); '["8", "6"] Response 1 is better.' reads as (6, 1).
    robust (default): the last bracketed list of exactly two numbers (quotes
    and "/10" allowed), else "Response 1: x ... Response 2: y"; (0, 0) when
    neither is there.
    """
    _check_choice(parser, PARSERS, "parser")
    if text is None:
        return (0.0, 0.0), False
    if parser == "official":
        numbers = [float(i) for i in _INTEGER.findall(text)]
        ok = len(numbers) >= 2
        first, second = numbers[-2:] if ok else _pad(numbers, 2)
        return (first, second), ok
    lists = [items for items in _bracketed_lists(text, _SCORE_ITEM) if len(items) == 2]
    if lists:
        first, second = (float(_SCORE_ITEM.fullmatch(i).group(1)) for i in lists[-1])
        return (first, second), True
    scores: dict[str, float] = {}
    for response, score in _RESPONSE_SCORE.findall(text):
        scores.setdefault(response, float(score))
    if set(scores) == {"1", "2"}:
        return (scores["1"], scores["2"]), True
    return (0.0, 0.0), False


def parse_scores(text: str | None, parser: str = "robust") -> tuple[float, float]:
    """The two scores of an MJ or judge output; see parse_scores_ex."""
    return parse_scores_ex(text, parser)[0]


def parse_foresight(text: str | None, parser: str = "robust") -> frozenset[bool]:
    """The answers an FF output is read as giving (True = "yes"); empty = failed to read.

    official (the release): True if yes/true appears anywhere as a word,
    False if no/false does, so "I think yes, but no" gives {True, False} and
    is scored correct whatever the label. robust (default): only the first
    yes/no/true/false word.
    """
    _check_choice(parser, PARSERS, "parser")
    words = [] if text is None else [w.lower() for w in _YES_NO.findall(text)]
    if parser == "robust":
        words = words[:1]
    return frozenset(w in ("yes", "true") for w in words)


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------


def _binary(values: Sequence[int], name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or not np.isin(array, (0, 1)).all():
        raise ValueError(f"{name} must be a flat sequence of 0/1")
    return array.astype(bool)


def f1_per_class(labels: Sequence[int], predictions: Sequence[int]) -> tuple[float, float]:
    """(F1 of the positive class, F1 of the negative class); positives = erroneous steps (1).

    A class with no true and no predicted members has F1 0, as scikit-learn's
    f1_score (zero_division=0) that the release called.
    """
    y, p = _binary(labels, "labels"), _binary(predictions, "predictions")
    if y.shape != p.shape or not y.size:
        raise ValueError(f"need equally many labels and predictions, at least one; got {y.size} and {p.size}")

    def f1(y_c: np.ndarray, p_c: np.ndarray) -> float:
        true_pos = int(np.sum(y_c & p_c))
        denominator = 2 * true_pos + int(np.sum(~y_c & p_c)) + int(np.sum(y_c & ~p_c))
        return 2 * true_pos / denominator if denominator else 0.0

    return f1(y, p), f1(~y, ~p)


def weighted_f1(labels: Sequence[int], predictions: Sequence[int]) -> float:
    """VLRMBench's weighted F1 = (N_neg/N) F1_pos + (N_pos/N) F1_neg.

    Each class is weighted by the *other* class's share (the inverse of
    scikit-learn's "weighted"), so the rare erroneous steps count most.
    Degenerate case, explicit: when every label is 0 (or every label is 1)
    the whole weight lands on the absent class, whose F1 is 0, so the score
    is 0.0 whatever the predictions -- as the release computes it.
    """
    y = _binary(labels, "labels")
    f1_pos, f1_neg = f1_per_class(labels, predictions)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.0
    return (n_neg * f1_pos + n_pos * f1_neg) / y.size


def weighted_average(values: Mapping[str, float], counts: Mapping[str, int]) -> float:
    """Mean of `values` (keyed by task) weighted by `counts` (samples per task), as the paper's W-Avg."""
    total = sum(counts[task] for task in values)
    return sum(values[task] * counts[task] for task in values) / total


# ----------------------------------------------------------------------------
# Scoring: outputs are keyed by sample id; a missing id is a failed generation.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One task's scores (fractions in [0, 1]) and how many outputs could not be read.

    scores: step tasks "f1" (weighted), "f1_pos", "f1_neg"; MJ and FF
    "accuracy"; ERA and EC "win", "tie", "lose" (the candidate vs the
    reference). None when `accounting="official"` left no sample to score.
    """

    task: str  # file name
    num_samples: int
    num_outputs: int  # 2 per sample for MJ, ERA, EC; else 1
    failures: int  # outputs missing or not read by the parser
    scores: dict[str, float | None]
    parser: str
    accounting: str = "ours"
    num_scored: int = -1  # samples in the score: all under "ours", the others left out under "official"
    # Failed samples by reason (FAILURE_REASONS): counted wrong ("ours") or left out ("official").
    failed_samples: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _pair(outputs: Mapping[str, Sequence[str | None]], sample_id: str) -> tuple[str | None, str | None]:
    first, second = outputs.get(sample_id, (None, None))
    return first, second


def _failure(texts: Sequence[str | None], read: Sequence[bool], missing: str) -> str | None:
    """Why a sample failed: `missing` when an output is None, "unparsable" when one was not read."""
    if any(text is None for text in texts):
        return missing
    return None if all(read) else "unparsable"


def score_task(task: str, samples: Sequence[Sample], outputs: Mapping[str, Any], parser: str = "robust",
               accounting: str = "ours") -> TaskResult:
    """Scores one task from the outputs keyed by sample id.

    outputs[id]: step tasks and FF, the model's text; MJ, (order 0 text,
    order 1 text) as in build_prompt; ERA/EC, the *judge's* (order 0 text,
    order 1 text) as in build_judge_prompt. A missing id or None text is a
    failed generation ("generation_failed"; ERA/EC "judge_failed": the judge
    call failed or had no candidate to judge); an output the parser cannot
    fully read is "unparsable" (an MJ/ERA/EC sample fails when either of its
    two outputs does). `accounting` says what a failed sample counts as:
    "ours" counts it wrong -- every step label the opposite of the truth, MJ
    and FF wrong, ERA/EC a loss; "official" leaves it out, as the release.
    The other samples are scored alike under both.

    Step tasks: weighted F1 over all steps of the task pooled. MJ: correct
    when the good solution's two scores (response 1 of order 0 + response 2
    of order 1) sum higher than the bad one's; ties are wrong. FF: correct
    when the label is among the answers read. ERA/EC: win when the
    candidate's summed score is higher than the reference's, tie when equal.
    """
    info = task_info(task)
    _check_choice(parser, PARSERS, "parser")
    _check_choice(accounting, ACCOUNTINGS, "accounting")
    if not samples:
        raise ValueError(f"no samples to score for {info.short}")
    failures = 0
    failed: collections.Counter = collections.Counter()
    scored = 0
    if info.theme == "step":
        labels, predictions = [], []
        for sample in samples:
            text = outputs.get(sample.id)
            predicted, ok = parse_step_labels_ex(text, len(sample.task_gt), parser)
            failures += not ok
            reason = _failure([text], [ok], "generation_failed")
            if reason:
                failed[reason] += 1
                if accounting == "official":
                    continue
                predicted = [1 - label for label in sample.task_gt]
            scored += 1
            labels.extend(sample.task_gt)
            predictions.extend(predicted)
        if labels:
            f1_pos, f1_neg = f1_per_class(labels, predictions)
            scores = {"f1": weighted_f1(labels, predictions), "f1_pos": f1_pos, "f1_neg": f1_neg}
        else:
            scores = {"f1": None, "f1_pos": None, "f1_neg": None}
        num_outputs = len(samples)
    elif info.file == "foresight":
        correct = 0
        for sample in samples:
            text = outputs.get(sample.id)
            answers = parse_foresight(text, parser)
            failures += not answers
            reason = _failure([text], [bool(answers)], "generation_failed")
            if reason:
                failed[reason] += 1
                if accounting == "official":
                    continue
            scored += 1
            correct += sample.task_gt in answers
        scores = {"accuracy": correct / scored if scored else None}
        num_outputs = len(samples)
    else:  # two orders: MJ (good solution first) and the ERA/EC judge (reference first)
        counts = collections.Counter()
        for sample in samples:
            texts = _pair(outputs, sample.id)
            (first, first_ok), (second, second_ok) = (parse_scores_ex(text, parser) for text in texts)
            failures += (not first_ok) + (not second_ok)
            reason = _failure(texts, [first_ok, second_ok],
                              "generation_failed" if info.file == "multi_solution" else "judge_failed")
            if reason:
                failed[reason] += 1
                if accounting == "official":
                    continue
            scored += 1
            first_response = first[0] + second[1]  # good solution (MJ) / reference (ERA, EC)
            second_response = first[1] + second[0]  # bad solution (MJ) / candidate (ERA, EC)
            counts["failed" if reason else "second" if second_response > first_response else
                   "first" if first_response > second_response else "tie"] += 1

        def share(count: int) -> float | None:
            return count / scored if scored else None

        if info.file == "multi_solution":  # a failed sample is not correct
            scores = {"accuracy": share(counts["first"])}
        else:  # a failed sample is a loss
            scores = {"win": share(counts["second"]), "tie": share(counts["tie"]),
                      "lose": share(counts["first"] + counts["failed"])}
        num_outputs = 2 * len(samples)
    return TaskResult(task=info.file, num_samples=len(samples), num_outputs=num_outputs, failures=failures,
                      scores=scores, parser=parser, accounting=accounting, num_scored=scored,
                      failed_samples=dict(sorted(failed.items())))


def score_both(task: str, samples: Sequence[Sample], outputs: Mapping[str, Any],
               parser: str = "robust") -> dict[str, TaskResult]:
    """score_task under every accounting: {"ours": ..., "official": ...}."""
    return {accounting: score_task(task, samples, outputs, parser, accounting) for accounting in ACCOUNTINGS}


def theme_average(results: Mapping[str, TaskResult], theme: str) -> float | None:
    """W-Avg of the step tasks' F1 or the outcome tasks' accuracy, weighted by our sample counts.

    None unless every task of the theme was scored: an average over some of
    the tasks is not the paper's column. Under the official accounting a task
    weighs by the samples left in its score.
    """
    if theme not in ("step", "outcome"):
        raise ValueError(f"W-Avg is defined for the step and outcome themes, got {theme!r}")
    tasks = [t for t in TASKS if t.theme == theme]
    by_file = {task_info(name).file: result for name, result in results.items()}
    if any(t.file not in by_file for t in tasks):
        return None
    key = "f1" if theme == "step" else "accuracy"
    values = {t.file: by_file[t.file].scores[key] for t in tasks}
    weights = {t.file: by_file[t.file].num_samples if by_file[t.file].num_scored < 0 else by_file[t.file].num_scored
               for t in tasks}
    if any(v is None for v in values.values()) or not sum(weights.values()):
        return None
    return weighted_average(values, weights)


# ----------------------------------------------------------------------------
# Table 3
# ----------------------------------------------------------------------------


def load_paper_results(path: str | Path = PAPER_RESULTS) -> dict:
    """The VLRMBench paper's published numbers (the repo's copy)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _row_cells(results: Mapping[str, TaskResult]) -> dict[str, float | None]:
    """Our results as Table 3's columns, in percent; None where a task was not scored."""
    by_short = {task_info(name).short: result for name, result in results.items()}
    cells: dict[str, float | None] = {}
    for t in TASKS:
        result = by_short.get(t.short)
        if t.theme == "criticism":
            for key, column in (("win", "W"), ("tie", "T"), ("lose", "L")):
                cells[f"{t.short} {column}"] = _percent(None if result is None else result.scores[key])
        else:
            key = "f1" if t.theme == "step" else "accuracy"
            cells[t.short] = _percent(None if result is None else result.scores[key])
    for theme, column in (("step", "Step W-Avg"), ("outcome", "Outcome W-Avg")):
        average = theme_average(results, theme)
        cells[column] = None if average is None else 100 * average
    return cells


def results_table(rows: Mapping[str, Mapping[str, TaskResult]], *, judge: str, render: str,
                  paper_models: Sequence[str] = PAPER_MODELS, paper: dict | None = None) -> str:
    """Markdown table shaped like the paper's Table 3: the paper's rows, then ours.

    rows: our model name -> {task (short or file name) -> TaskResult}. The
    judge of ERA/EC is named; a second table gives each task's parse failures.
    """
    paper = load_paper_results() if paper is None else paper
    columns = paper["columns"]
    parsers = sorted({r.parser for results in rows.values() for r in results.values()})
    accountings = [a for a in ACCOUNTINGS if any(r.accounting == a for results in rows.values()
                                                 for r in results.values())]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    out = [
        "VLRMBench (paper Table 3 layout): step tasks weighted F1, outcome tasks accuracy, "
        "criticism win/tie/lose against the GPT-4o reference answers; all in %.",
        f"ERA/EC judge: {judge} (paper rows: {PAPER_JUDGE}). "
        f"Our rows: parser={'/'.join(parsers) or '-'}, render={render}, "
        f"accounting={'/'.join(accountings) or '-'} (ours: failed samples count wrong; "
        "official: they are left out).",
        "",
        line(["Model"] + columns),
        line(["---"] + ["---:"] * len(columns)),
    ]
    for model in paper_models:
        out.append(line([f"{model} (paper)"] + [number(v) for v in paper["rows"][model]]))
    for model, results in rows.items():
        cells = _row_cells(results)
        out.append(line([model] + [number(cells[c]) for c in columns]))
    out += ["", "Outputs the parser could not read (failures / outputs; ERA/EC: the judge's outputs):", ""]
    out.append(line(["Model"] + [t.short for t in TASKS]))
    out.append(line(["---"] + ["---:"] * len(TASKS)))
    for model, results in rows.items():
        by_short = {task_info(name).short: r for name, r in results.items()}
        out.append(line([model] + [f"{by_short[t.short].failures}/{by_short[t.short].num_outputs}"
                                   if t.short in by_short else "-" for t in TASKS]))
    return "\n".join(out) + "\n"
