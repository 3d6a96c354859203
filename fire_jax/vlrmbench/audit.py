"""Label-leak audit of VLRMBench's step tasks: what reading no meaning at all scores.

Real VLRMBench step files carry surface features that predict the labels
without reading the question: the erroneous steps are the ones rewritten,
so they differ from the correct solution (``step_list``) at the same index
and often in their spacing and length. A model's F1 means little unless it
is printed beside these figures, so the VLRMBench report and
``tools/audit_vlrmbench.py`` print them.

Every figure is the paper's inverse-weighted F1 (:func:`weighted_f1`),
pooled over all steps of a file. A rule predicts 1 (erroneous) per step:

- ``all_0`` / ``all_1``: the trivial baselines;
- ``trailing_whitespace`` / ``no_trailing_whitespace``: the step's raw text in
  reasoning_error (up to the next STEP marker) ends with a space or newline;
- ``ends_with_period`` / ``no_final_period``: the stripped step ends with ".";
- ``first_step``, ``last_step``, ``index_at_least_best`` (steps from the best
  index k on), ``index_equal_best`` (only step k);
- ``length_above_best`` / ``length_below_best``: stripped length in characters
  against the best threshold;
- ``differs_from_step_list``: the step's text differs from the correct
  solution's step at the same index (both stripped, STEP prefixes dropped);
- ``not_prefix_of_step_list``: that step does not start with it (some files cut
  steps at their first inner colon, so a cut step still counts as copied).

The "best" rules choose their threshold on the very labels they are scored on:
an upper bound of what that one feature can do, as an audit should be.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from fire_jax.core.results import markdown_table
from fire_jax.vlrmbench.data import TaskData, load_task


from fire_jax.vlrmbench.score import weighted_f1
from fire_jax.vlrmbench.tasks import STEP_MARK, STEP_PREFIX, Sample, task_info

FIXED_RULES = ("trailing_whitespace", "no_trailing_whitespace", "ends_with_period", "no_final_period",
               "first_step", "last_step", "differs_from_step_list", "not_prefix_of_step_list")
BEST_RULES = ("index_at_least_best", "index_equal_best", "length_above_best", "length_below_best")
RULES = FIXED_RULES + BEST_RULES


def split_steps(reasoning: str, num_steps: int) -> list[str]:
    """The raw text of each step of `reasoning` (after its "STEPk:", up to the next marker), as many as labels.

    A record whose markers count otherwise is cut or padded with "" (a missing step).
    """
    marks = list(STEP_MARK.finditer(reasoning))
    texts = [reasoning[m.end():(marks[i + 1].start() if i + 1 < len(marks) else len(reasoning))]
             for i, m in enumerate(marks)]
    return (texts + [""] * num_steps)[:num_steps]


def _step_features(sample: Sample) -> dict[str, list]:
    """Per step of one sample: each fixed rule's prediction and the values the best rules threshold."""
    n = len(sample.task_gt)
    steps = split_steps(sample.reasoning_error, n)
    correct = [STEP_PREFIX.sub("", s, count=1).strip() for s in (sample.step_list or ())]
    correct = (correct + [None] * n)[:n]
    stripped = [s.strip() for s in steps]
    return {
        "trailing_whitespace": [int(s != s.rstrip()) for s in steps],
        "no_trailing_whitespace": [int(s == s.rstrip()) for s in steps],
        "ends_with_period": [int(s.endswith(".")) for s in stripped],
        "no_final_period": [int(not s.endswith(".")) for s in stripped],
        "first_step": [int(k == 0) for k in range(n)],
        "last_step": [int(k == n - 1) for k in range(n)],
        "differs_from_step_list": [int(c is None or s != c) for s, c in zip(stripped, correct)],
        "not_prefix_of_step_list": [int(c is None or not c.startswith(s)) for s, c in zip(stripped, correct)],
        "index": list(range(1, n + 1)),
        "length": [len(s) for s in stripped],
    }


def best_threshold(values: Sequence[float], labels: Sequence[int], above: bool = True) -> tuple[float, float]:
    """(best weighted F1, threshold t) of predicting 1 where value > t (above) or value < t (below).

    Thresholds lie between distinct values (and below/above all of them); ties
    keep the smallest t for "above", the largest for "below".
    """
    v = np.asarray(values, float) * (1 if above else -1)
    y = np.asarray(labels, int)
    cuts = np.concatenate([[v.min() - 1], np.unique(v)])  # predict 1 where v > cut
    best = (-1.0, 0.0)
    for cut in cuts:
        f1 = weighted_f1(y, (v > cut).astype(int))
        if f1 > best[0]:
            best = (f1, float(cut if above else -cut))
    return best


def best_equal(values: Sequence[int], labels: Sequence[int]) -> tuple[float, int]:
    """(best weighted F1, k) of predicting 1 only where value == k."""
    v, y = np.asarray(values), np.asarray(labels, int)
    scores = [(weighted_f1(y, (v == k).astype(int)), int(k)) for k in np.unique(v)]
    return max(scores, key=lambda s: (s[0], -s[1]))


def audit_samples(samples: Sequence[Sample]) -> dict:
    """The audit of one task's samples: {"all_0", "all_1", "rules": {rule: F1}, "thresholds": {rule: t},
    "steps", "erroneous_steps"}."""
    if not samples:
        raise ValueError("no samples to audit")
    labels: list[int] = []
    features: dict[str, list] = collections.defaultdict(list)
    for sample in samples:
        labels.extend(sample.task_gt)
        for name, values in _step_features(sample).items():
            features[name].extend(values)
    rules = {name: weighted_f1(labels, features[name]) for name in FIXED_RULES}
    thresholds = {}
    best: dict[str, Callable] = {
        "index_at_least_best": lambda: best_threshold(features["index"], labels, above=True),
        "index_equal_best": lambda: best_equal(features["index"], labels),
        "length_above_best": lambda: best_threshold(features["length"], labels, above=True),
        "length_below_best": lambda: best_threshold(features["length"], labels, above=False),
    }
    for name, search in best.items():
        rules[name], thresholds[name] = search()
    return {"all_0": weighted_f1(labels, [0] * len(labels)), "all_1": weighted_f1(labels, [1] * len(labels)),
            "rules": rules, "thresholds": thresholds, "steps": len(labels), "erroneous_steps": int(sum(labels))}


def audit_file(path: str | Path, task: str | None = None) -> tuple[dict, TaskData]:
    """The audit of one step-task file (task: its file or short name; default the file's stem)."""
    path = Path(path)
    info = task_info(task or path.stem)
    if info.theme != "step":
        raise ValueError(f"{path}: {info.short} has no per-step labels; the audit reads step tasks only")
    data = load_task(path, info.file)
    return audit_samples(data.samples), data


def _threshold_text(name: str, threshold: float) -> str:
    if name == "index_equal_best":
        return f"step {threshold:g}"
    if name == "index_at_least_best":
        return f"steps > {threshold:g}"
    return f"{'>' if name == 'length_above_best' else '<'} {threshold:g} chars"


def audit_report(name: str, audit: Mapping, data: TaskData | None = None) -> str:
    """One file's audit as a Markdown table (rule, F1 in %, threshold), with its counts."""
    lines = [f"{name}: {audit['steps']} steps, {audit['erroneous_steps']} erroneous"
             + ("" if data is None else f"; {data.describe()}"), "",
             "| rule | weighted F1 (%) | threshold |", "| --- | ---: | --- |",
             f"| all_0 | {100 * audit['all_0']:.1f} | |", f"| all_1 | {100 * audit['all_1']:.1f} | |"]
    for rule in RULES:
        threshold = audit["thresholds"].get(rule)
        lines.append(f"| {rule} | {100 * audit['rules'][rule]:.1f} | "
                     f"{'' if threshold is None else _threshold_text(rule, threshold)} |")
    return "\n".join(lines) + "\n"


def audit_json(audits: Mapping[str, Mapping]) -> dict:
    """The audits as ``{file name: {"all_0": F1, "all_1": F1, "rules": {rule: F1}}}``."""
    return {name: {"all_0": a["all_0"], "all_1": a["all_1"], "rules": dict(a["rules"])} for name, a in audits.items()}


def audit_table(datasets: Mapping[str, TaskData], model_f1: Mapping[str, Mapping[str, float | None]] | None = None
                ) -> str:
    """The audit of every step task in ``datasets`` beside the model's F1 (all in %), for the VLRMBench report.

    model_f1: row name -> {task file name -> weighted F1}. Empty when no step task was run.
    """
    audits = {f: audit_samples(d.samples) for f, d in datasets.items()
              if task_info(f).theme == "step" and d.samples}
    if not audits:
        return ""
    model_f1 = model_f1 or {}
    best = {f: max(a["rules"].items(), key=lambda r: r[1]) for f, a in audits.items()}
    lines = ["", "Label-leak audit (tools/audit_vlrmbench.py): weighted F1 (%) of rules that read no meaning, "
             "on the same samples, beside the model's. A model below the best surface rule has not shown "
             "that it reads the steps.", ""]

    def pct(value):
        return "-" if value is None else f"{100 * value:.1f}"

    rows = [[task_info(f).short, *[pct(row.get(f)) for row in model_f1.values()], pct(a["all_0"]), pct(a["all_1"]),
             f"{best[f][0]} {pct(best[f][1])}", *[pct(a["rules"][r]) for r in RULES]] for f, a in audits.items()]
    lines.append(markdown_table(["Task", *model_f1, "all_0", "all_1", "best surface rule", *RULES], rows,
                                align="l" + "r" * (len(model_f1) + 2) + "l" + "r" * len(RULES)))
    return "\n".join(lines) + "\n"

