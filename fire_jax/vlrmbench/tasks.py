"""VLRMBench (Ruan et al., 2025): the task table, the official prompts, and the prompts built from a sample.

The twelve task prompts and the two judge prompts are the official release's
(JCruan519/VLRMBench, model_eval/eval_prompt_files.py), verbatim, shipped as
package data (``fire_jax/vlrmbench/prompts.json``; keys: task file names, and
``judge/<task>`` for the two judges); tests/test_vlrmbench.py compares every
character with the release's file.

Placeholders (filled with str.format): {question}; {reasoning_process} (step
tasks, FF, ERA, EC); {ai_respond_1} / {ai_respond_2} (MJ and both judges);
{reasoning_error} (ERA judge).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, NamedTuple, Sequence


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
    # Image files of the record that do not exist, left out of `images` (missing_images="send_without").
    missing_images: tuple[str, ...] = ()


class TaskInfo(NamedTuple):
    short: str  # column name in the paper's Table 3
    file: str  # benchmark file name without .jsonl; the key of TASK_PROMPTS
    theme: str  # "step" | "outcome" | "criticism"
    metric: str  # "weighted_f1" | "accuracy" | "win_tie_lose"


TASKS = (
    TaskInfo("SC", "step_correctness", "step", "weighted_f1"),
    TaskInfo("RD", "redundant_det", "step", "weighted_f1"),
    TaskInfo("CM", "most_confidence", "step", "weighted_f1"),
    TaskInfo("EH", "existence_hallucination", "step", "weighted_f1"),
    TaskInfo("AH", "attribute_hallucination", "step", "weighted_f1"),
    TaskInfo("DE", "detail_error", "step", "weighted_f1"),
    TaskInfo("SR", "location_error", "step", "weighted_f1"),
    TaskInfo("IC", "image_ref_error", "step", "weighted_f1"),
    TaskInfo("MJ", "multi_solution", "outcome", "accuracy"),
    TaskInfo("FF", "foresight", "outcome", "accuracy"),
    TaskInfo("ERA", "error_reason_analysis", "criticism", "win_tie_lose"),
    TaskInfo("EC", "error_correction", "criticism", "win_tie_lose"),
)

_BY_NAME = {name: t for t in TASKS for name in (t.short, t.file)}


def task_info(name: str) -> TaskInfo:
    """The task called `name`, by short name ("IC") or file name ("image_ref_error")."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown VLRMBench task {name!r}; expected one of "
                         f"{[t.short for t in TASKS]} or {[t.file for t in TASKS]}") from None


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.json"), encoding="utf-8") as _f:
    _RELEASE = json.load(_f)
#: The task prompts by task file name, and the ERA / EC judge prompts.
TASK_PROMPTS = {t.file: _RELEASE[t.file] for t in TASKS}
JUDGE_PROMPTS = {k.split("/", 1)[1]: v for k, v in _RELEASE.items() if k.startswith("judge/")}

RENDERS = ("plain", "official")
# A step marker at the start of reasoning_error or of one of its lines.
STEP_MARK = re.compile(r"(?:^|\n)[ \t]*STEP\s*\d+\s*:")
# The "STEPk:" prefix of one step_list item.
STEP_PREFIX = re.compile(r"^\s*STEP\s*\d+\s*:")


def check_choice(value: str, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


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
    check_choice(render, RENDERS, "render")
    if render == "official":
        return str(list(steps))
    return "\n".join(f"STEP{k}: {STEP_PREFIX.sub('', step, count=1).strip()}"
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
    check_choice(render, RENDERS, "render")
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
    check_choice(render, RENDERS, "render")
    if order not in (0, 1):
        raise ValueError(f"judge prompts have orders 0 and 1, got order={order}")
    reference = sample.task_gt if isinstance(sample.task_gt, str) else render_steps(sample.task_gt, render)
    first, second = (reference, candidate) if order == 0 else (candidate, reference)
    # EC's judge prompt has no {reasoning_error}; str.format ignores the extra key.
    return JUDGE_PROMPTS[info.file].format(question=sample.question, reasoning_error=sample.reasoning_error,
                                           ai_respond_1=first, ai_respond_2=second)


