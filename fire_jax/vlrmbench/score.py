"""Scoring VLRMBench outputs, and the table shaped like Table 3 of the VLRMBench paper beside its rows.

Outputs are keyed by sample id: a text, or None (also a missing id) where no output came back. Three
accountings: ``"ours"`` counts a failed sample (no output, or one the parser cannot fully read) wrong;
``"official"`` scores exactly as the release's scorers do (see :func:`score_task`): a short or unreadable
answer is padded and scored, and only a sample without an output is left out; ``"vlmevalkit"`` scores as
VLMEvalKit's VLRMBench dataset (open-compass/VLMEvalKit ``vlmeval/dataset/vlrmbench.py``): a sample without
an output is scored as VLMEvalKit's failure message. Plain Python and numpy.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fire_jax.core.results import markdown_table

from fire_jax.vlrmbench.parse import PARSERS, parse_foresight, try_parse_scores, try_parse_step_labels
from fire_jax.vlrmbench.tasks import TASKS, Sample, check_choice, task_info


# How failed samples are scored: "ours" counts a sample whose output is missing or not fully read wrong
# (every step label flipped, MJ/FF wrong, ERA/EC a loss); "official" is the release's scorers, "vlmevalkit"
# VLMEvalKit's (score_task).
ACCOUNTINGS = ("ours", "official", "vlmevalkit")
# What VLMEvalKit writes as the prediction of a request that failed or came back empty (``vlmeval/api/base.py``
# ``BaseAPI.generate`` returns its ``fail_msg``; ``vlmeval/inference.py`` ``FAIL_MSG``): no digit, no yes/no.
VLMEVALKIT_FAIL_MSG = "Failed to obtain answer via API."
FAILURE_REASONS = ("generation_failed", "judge_failed", "unparsable")
PAPER_RESULTS = Path(__file__).parent / "paper_results.json"
# Rows of the paper's Table 3 printed beside ours by default: the open models
# nearest to LLaVA-NeXT-8B in size and lineage, plus the large references.
PAPER_MODELS = ("Llava-OneVision-7B", "Llama3.2-11B", "Qwen2.5VL-7B", "Qwen2.5VL-72B", "GPT-4o")
PAPER_JUDGE = "Qwen2.5-VL-72B"  # the release's judge for ERA/EC; references by GPT-4o


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------


def _binary(values: Sequence[int], name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or not np.isin(array, (0, 1)).all():
        raise ValueError(f"{name} must be a flat sequence of 0/1")
    return array.astype(bool)


def step_counts(labels: Sequence[int], predictions: Sequence[int]) -> dict[str, int]:
    """{"tp", "fp", "fn", "tn"} of step labels against predictions; positives = erroneous steps (1)."""
    y, p = _binary(labels, "labels"), _binary(predictions, "predictions")
    if y.shape != p.shape or not y.size:
        raise ValueError(f"need equally many labels and predictions, at least one; got {y.size} and {p.size}")
    return {"tp": int(np.sum(y & p)), "fp": int(np.sum(~y & p)), "fn": int(np.sum(y & ~p)),
            "tn": int(np.sum(~y & ~p))}


def _f1(true_pos: int, false_pos: int, false_neg: int) -> float:
    denominator = 2 * true_pos + false_pos + false_neg
    return 2 * true_pos / denominator if denominator else 0.0


def f1_per_class(labels: Sequence[int], predictions: Sequence[int]) -> tuple[float, float]:
    """(F1 of the positive class, F1 of the negative class); positives = erroneous steps (1).

    A class with no true and no predicted members has F1 0, as scikit-learn's
    f1_score (zero_division=0) that the release called.
    """
    c = step_counts(labels, predictions)
    return _f1(c["tp"], c["fp"], c["fn"]), _f1(c["tn"], c["fn"], c["fp"])


def weighted_f1_of_counts(counts: Mapping[str, int]) -> float:
    """VLRMBench's weighted F1 = (N_neg/N) F1_pos + (N_pos/N) F1_neg from the confusion counts.

    Each class is weighted by the *other* class's share (the inverse of
    scikit-learn's "weighted"), so the rare erroneous steps count most.
    Degenerate case, explicit: when every label is 0 (or every label is 1)
    the whole weight lands on the absent class, whose F1 is 0, so the score
    is 0.0 whatever the predictions -- as the release computes it.
    """
    n_pos, n_neg = counts["tp"] + counts["fn"], counts["tn"] + counts["fp"]
    if n_pos == 0 or n_neg == 0:
        return 0.0
    f1_pos, f1_neg = _f1(counts["tp"], counts["fp"], counts["fn"]), _f1(counts["tn"], counts["fn"], counts["fp"])
    # In the release's order of operations (utils.get_F1Score; VLMEvalKit's get_F1Score), to the last digit.
    weight_pos, weight_neg = n_neg / (n_pos + n_neg), n_pos / (n_pos + n_neg)
    return weight_neg * f1_neg + weight_pos * f1_pos


def weighted_f1(labels: Sequence[int], predictions: Sequence[int]) -> float:
    """VLRMBench's weighted F1 of the pooled steps (:func:`weighted_f1_of_counts`)."""
    return weighted_f1_of_counts(step_counts(labels, predictions))


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
    "accuracy" (FF under "vlmevalkit" also "accuracy_by_value": see
    score_task); ERA and EC "win", "tie", "lose" (the candidate vs the
    reference). None when `accounting="official"` left no sample to score, and
    for ERA/EC under "vlmevalkit" (VLMEvalKit has no criticism tasks).
    """

    task: str  # file name
    num_samples: int
    num_outputs: int  # 2 per sample for MJ, ERA, EC; else 1
    failures: int  # outputs missing or not fully read by the parser (under either accounting)
    scores: dict[str, float | None]
    parser: str
    accounting: str = "ours"
    num_scored: int = -1  # samples in the score: all under "ours"/"vlmevalkit"; "official": those with an output
    # Failed samples by reason (FAILURE_REASONS): under "ours" the samples counted wrong; under "official"
    # the samples left out (no output), while an unread output is scored as the release reads it; under
    # "vlmevalkit" the samples without an output, scored as VLMEvalKit's failure message.
    failed_samples: dict[str, int] = dataclasses.field(default_factory=dict)
    # Step tasks: the confusion counts of the steps scored ({"tp", "fp", "fn", "tn"}; step_counts), so that
    # the steps of several tasks can be pooled (pooled_step_f1).
    step_counts: dict[str, int] | None = None

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


@dataclasses.dataclass
class _Accounting:
    """How failed samples count under each accounting, and what the parser reads.

    ``accounting="ours"`` counts every failed sample wrong: its step labels
    the opposite of the truth, MJ and FF wrong, ERA/EC a loss.

    ``accounting="official"`` is the release's scorers (JCruan519/VLRMBench,
    ``model_eval/``), task by task. The release's clients (``vllm_localapi_eval.py``,
    ``online_api_eval.py``) write an output line only for a request that
    returned (an empty answer too); the scorers then read every line:

    - step tasks (``get_sc_mc_rd_eval_res.py``, ``process_jsonl`` with
      ``utils.format_model_answer_tolist``): every answer is read by
      ``parser``, cut or padded with 0 to the sample's steps, and its steps
      pooled; only a sample without an answer is left out (no line, or a
      null answer, on which the release's ``re.findall`` raises). F1 over the
      pooled steps of the samples kept.
    - FF (``get_fores_eval_res.py``): correct when a true label meets "yes" /
      "true" (a false one "no" / "false") in the answer; an answer without
      one counts wrong; only a sample without an answer is left out
      (``re.search`` raises on a null). Accuracy over the samples kept.
    - MJ (``get_ms_eval_res.py``; the client writes the line once both orders
      returned): left out when either order has no answer; an empty answer
      reads as "[0,0]"; the scores are ``parser``'s (official: the last two
      integers, padded with 0: ``format_ms_ec_era_model_answer_tolist``).
      Accuracy over the samples kept.
    - ERA/EC (``get_ec_era_eval_res.py``): every candidate that has a line is
      judged in both orders (an empty one too); a sample is left out when
      either judge output is missing (the judge call failed after its
      retries, or there was no candidate line to judge); the judge's two
      scores are ``parser``'s, padded with 0 (official: the last two integers).
      Win, tie, lose over the samples judged.

    ``accounting="vlmevalkit"`` is VLMEvalKit's VLRMBench dataset
    (open-compass/VLMEvalKit ``vlmeval/dataset/vlrmbench.py``), which has the
    step tasks, MJ and FF and no ERA/EC (their scores are None). Its parsers
    are the release's (``parser="official"`` reads as they do); it leaves no
    sample out: a request that failed or came back empty is written as its
    failure message (:data:`VLMEVALKIT_FAIL_MSG`) and scored, so a step
    sample reads as all 0 labels, an MJ order as (0, 0) (a tie when both
    orders failed: not correct) and an FF answer as wrong. Its FF check is
    ``task_gt is True`` / ``is False`` (vlrmbench.py lines 260, 263), which
    never holds for the numpy booleans read back from its prediction file, so
    the FF accuracy it prints is 0 for every model: "accuracy" reproduces
    that 0; "accuracy_by_value" is the keyword check compared by value (as
    the release's ``task_gt == True``) under this accounting.
    """

    name: str
    parser: str
    failures: int = 0  # outputs missing or not fully read
    scored: int = 0  # samples scored (not left out)
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def official(self) -> bool:
        return self.name == "official"

    @property
    def vlmevalkit(self) -> bool:
        return self.name == "vlmevalkit"

    def counted(self, texts: Sequence[str | None], reason: str | None) -> tuple[bool, bool]:
        """(left out, counted wrong) of a sample, its failure counted by reason where it is either (or, under
        vlmevalkit, where it has no output and is scored as the failure message)."""
        missing = any(text is None for text in texts)
        left_out = self.official and missing
        wrong = self.name == "ours" and reason is not None
        if left_out or wrong or (self.vlmevalkit and missing):
            self.failed[reason] += 1
        return left_out, wrong

    def read(self, text: str | None) -> str | None:
        """What the parser reads: under vlmevalkit a missing output is VLMEvalKit's failure message."""
        return VLMEVALKIT_FAIL_MSG if self.vlmevalkit and text is None else text


def score_task(task: str, samples: Sequence[Sample], outputs: Mapping[str, Any], parser: str = "robust",
               accounting: str = "ours") -> TaskResult:
    """Scores one task from the outputs keyed by sample id.

    outputs[id]: step tasks and FF, the model's text; MJ, (order 0 text,
    order 1 text) as in build_prompt; ERA/EC, the *judge's* (order 0 text,
    order 1 text) as in build_judge_prompt. None (or a missing id) is a
    sample without that output ("generation_failed"; ERA/EC "judge_failed":
    the judge call failed or had no candidate to judge); an output the parser
    cannot fully read is "unparsable" (an MJ/ERA/EC sample fails when either
    of its two outputs does). The metrics:

    - step tasks: weighted F1 over all steps of the task pooled;
    - MJ: correct when the good solution's two scores (response 1 of order 0
      + response 2 of order 1) sum higher than the bad one's; ties are wrong;
    - FF: correct when the label is among the answers read;
    - ERA/EC: win when the candidate's summed score (response 2 of order 0 +
      response 1 of order 1) is higher than the reference's, tie when equal.

    ``accounting``: how a failed sample counts (:class:`_Accounting`: "ours", "official" as the release's
    scorers, "vlmevalkit" as VLMEvalKit's dataset). ``failures`` counts the outputs missing or not fully read;
    ``failed_samples`` the samples counted wrong ("ours"), left out ("official") or scored as the failure
    message ("vlmevalkit").
    """
    info = task_info(task)
    check_choice(parser, PARSERS, "parser")
    check_choice(accounting, ACCOUNTINGS, "accounting")
    if not samples:
        raise ValueError(f"no samples to score for {info.short}")
    tally = _Accounting(accounting, parser)
    if tally.vlmevalkit and info.theme == "criticism":  # not scored; its unread outputs counted as under the others
        unread = sum(not try_parse_scores(text, parser)[1] for sample in samples for text in _pair(outputs, sample.id))
        return TaskResult(task=info.file, num_samples=len(samples), num_outputs=2 * len(samples), failures=unread,
                          scores={"win": None, "tie": None, "lose": None}, parser=parser, accounting=accounting,
                          num_scored=0)
    confusion = None  # step tasks: the confusion counts of the steps scored
    if info.theme == "step":
        scores, confusion = _score_steps(samples, outputs, tally)
    elif info.file == "foresight":
        scores = _score_foresight(samples, outputs, tally)
    else:  # two orders: MJ (good solution first) and the ERA/EC judge (reference first)
        scores = _score_two_orders(info, samples, outputs, tally)
    num_outputs = len(samples) if info.theme == "step" or info.file == "foresight" else 2 * len(samples)
    return TaskResult(task=info.file, num_samples=len(samples), num_outputs=num_outputs, failures=tally.failures,
                      scores=scores, parser=parser, accounting=accounting, num_scored=tally.scored,
                      failed_samples=dict(sorted(tally.failed.items())), step_counts=confusion)


def _score_steps(samples, outputs, tally: _Accounting) -> tuple[dict, dict | None]:
    """Weighted F1 over every scored sample's steps pooled; a failed sample (``ours``) predicts the opposite."""
    labels, predictions = [], []
    for sample in samples:
        text = outputs.get(sample.id)
        predicted, ok = try_parse_step_labels(tally.read(text), len(sample.task_gt), tally.parser)
        tally.failures += not ok
        left_out, wrong = tally.counted([text], _failure([text], [ok], "generation_failed"))
        if left_out:
            continue
        if wrong:
            predicted = [1 - label for label in sample.task_gt]
        tally.scored += 1
        labels.extend(sample.task_gt)
        predictions.extend(predicted)
    confusion = step_counts(labels, predictions) if labels else None
    if not confusion:
        return {"f1": None, "f1_pos": None, "f1_neg": None}, None
    return {"f1": weighted_f1_of_counts(confusion), "f1_pos": _f1(confusion["tp"], confusion["fp"], confusion["fn"]),
            "f1_neg": _f1(confusion["tn"], confusion["fn"], confusion["fp"])}, confusion


def _score_foresight(samples, outputs, tally: _Accounting) -> dict:
    """FF accuracy: correct when the label is among the answers read."""
    correct = 0
    for sample in samples:
        text = outputs.get(sample.id)
        answers = parse_foresight(tally.read(text), tally.parser)  # empty when nothing was read: never correct
        tally.failures += not answers
        left_out, _ = tally.counted([text], _failure([text], [bool(answers)], "generation_failed"))
        if left_out:
            continue
        tally.scored += 1
        correct += sample.task_gt in answers
    scores = {"accuracy": correct / tally.scored if tally.scored else None}
    if tally.vlmevalkit:  # VLMEvalKit prints 0 (`task_gt is True` on a numpy boolean); see _Accounting
        scores = {"accuracy": 0.0, "accuracy_by_value": scores["accuracy"]}
    return scores


def _score_two_orders(info, samples, outputs, tally: _Accounting) -> dict:
    """MJ accuracy (the good solution's summed scores above the bad one's), or ERA/EC win / tie / lose (the
    candidate's summed judge scores against the reference's); a failed sample is wrong / a loss."""
    counts = collections.Counter()
    for sample in samples:
        texts = _pair(outputs, sample.id)
        (first, first_ok), (second, second_ok) = (try_parse_scores(tally.read(text), tally.parser) for text in texts)
        tally.failures += (not first_ok) + (not second_ok)
        reason = _failure(texts, [first_ok, second_ok],
                          "generation_failed" if info.file == "multi_solution" else "judge_failed")
        left_out, wrong = tally.counted(texts, reason)
        if left_out:
            continue
        tally.scored += 1
        first_response = first[0] + second[1]  # good solution (MJ) / reference (ERA, EC)
        second_response = first[1] + second[0]  # bad solution (MJ) / candidate (ERA, EC)
        counts["failed" if wrong else "second" if second_response > first_response else
               "first" if first_response > second_response else "tie"] += 1
    share = (lambda count: count / tally.scored) if tally.scored else (lambda count: None)
    if info.file == "multi_solution":  # a failed sample is not correct
        return {"accuracy": share(counts["first"])}
    return {"win": share(counts["second"]), "tie": share(counts["tie"]),  # a failed sample is a loss
            "lose": share(counts["first"] + counts["failed"])}


def score_accountings(task: str, samples: Sequence[Sample], outputs: Mapping[str, Any], parser: str = "robust",
                      official_outputs: Mapping[str, Any] | None = None,
                      accountings: Sequence[str] = ACCOUNTINGS) -> dict[str, TaskResult]:
    """score_task under each of ``accountings`` (default all): {"ours": ..., "official": ..., "vlmevalkit": ...}.

    ``official_outputs``: what the official accounting reads, where it differs from ``outputs`` (the
    runner's records hold an empty answer, which ours counts as no output, VLMEvalKit writes as its failure
    message and the release scores as written; see :func:`fire_jax.vlrmbench.runner.task_outputs`);
    default ``outputs``.
    """
    for accounting in accountings:
        check_choice(accounting, ACCOUNTINGS, "accounting")
    return {accounting: score_task(task, samples, official_outputs if accounting == "official" and
                                   official_outputs is not None else outputs, parser, accounting)
            for accounting in accountings}


def theme_average(results: Mapping[str, TaskResult], theme: str) -> float | None:
    """W-Avg of the step tasks' F1 or the outcome tasks' accuracy, weighted by our sample counts.

    None unless every task of the theme was scored: an average over some of
    the tasks is not the paper's column. Under the official accounting a task
    weighs by the samples in its score.
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


def pooled_step_f1(results: Mapping[str, TaskResult]) -> float | None:
    """Weighted F1 of all steps of the step tasks scored, pooled: VLMEvalKit's step summary
    (``Overall_F1_weighted``, ``vlmeval/dataset/vlrmbench.py`` lines 366-383). The paper's Step W-Avg
    (:func:`theme_average`) instead averages the task F1s weighted by their sample counts, so a task with
    long solutions weighs more here. None when no step task has a scored step."""
    counts = [r.step_counts for r in results.values() if r.step_counts]
    if not counts:
        return None
    return weighted_f1_of_counts({k: sum(c[k] for c in counts) for k in ("tp", "fp", "fn", "tn")})


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

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    out = [
        "VLRMBench (paper Table 3 layout): step tasks weighted F1, outcome tasks accuracy, "
        "criticism win/tie/lose against the GPT-4o reference answers; all in %.",
        f"ERA/EC judge: {judge} (paper rows: {PAPER_JUDGE}). "
        f"Our rows: parser={'/'.join(parsers) or '-'}, render={render}, "
        f"accounting={'/'.join(accountings) or '-'} (ours: a sample without an output or not fully read "
        "counts wrong; official: the release's scorers, a short or unread answer padded and scored, a sample "
        "without an output left out; vlmevalkit: VLMEvalKit's scorer, a sample without an output scored as its "
        "failure message, no ERA/EC, and FF 0 as VLMEvalKit prints it, its `task_gt is True` never holding).",
        "",
        markdown_table(["Model"] + columns,
                       [[f"{model} (paper)"] + [number(v) for v in paper["rows"][model]] for model in paper_models]
                       + [[model] + [number(_row_cells(results)[c]) for c in columns]
                          for model, results in rows.items()], align="l" + "r" * len(columns)),
    ]
    out += ["", "The step summary two ways: Step W-Avg is the paper's (the task F1s averaged, weighted by sample "
            "count); the pooled F1 is VLMEvalKit's Overall_F1_weighted (the weighted F1 of all steps of the step "
            "tasks scored together).", ""]
    pooled = {model: pooled_step_f1(results) for model, results in rows.items()}
    out.append(markdown_table(["Model", "Step W-Avg: paper's definition", "Step F1 pooled: VLMEvalKit's"],
                              [[model, number(_row_cells(results)["Step W-Avg"]),
                                number(None if pooled[model] is None else 100 * pooled[model])]
                               for model, results in rows.items()], align="lrr"))
    out += ["", "Outputs the parser could not read (failures / outputs; ERA/EC: the judge's outputs):", ""]
    failures = []
    for model, results in rows.items():
        by_short = {task_info(name).short: r for name, r in results.items()}
        failures.append([model] + [f"{by_short[t.short].failures}/{by_short[t.short].num_outputs}"
                                   if t.short in by_short else "-" for t in TASKS])
    out.append(markdown_table(["Model"] + [t.short for t in TASKS], failures, align="l" + "r" * len(TASKS)))
    return "\n".join(out) + "\n"

