"""Markdown tables shaped like the FIRE paper's, our row beside the published ones (Tables 2-6, A5-A6, Fig. 7).

The published numbers are the repo's copy of the paper's tables,
``fire_jax/eval/paper_results/fire.json``. Source datasets are matched to the
paper's columns by name (lower case, without spaces, "-" and "_":
``synthdog-en`` is Synthdog, ``mm-vet`` is MM-Vet); sources the paper does
not report get our rows only.

Free dialogues on the other bases: Table A5 (LLaVA-NeXT-Vicuna-7B and FIRE-LLaVA-Vicuna) and Table A6
(LLaVA-1.5-Vicuna-7B and FIRE-LLaVA-1.5), overall only, as the paper's appendix reports them. A run whose base is
known (``results["base"]`` or its model config ``results["model"]``, see :func:`run_base`) gets its base's table;
a run of unknown base gets Table 4 and both.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Mapping

from fire_jax.core.results import markdown_table

PAPER_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_results", "fire.json")
FIXED_COLUMNS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr")
FREE_COLUMNS = ("AT", "ADR", "ATR", "RR")

# Normalised source name -> the paper's column in Table 5 (seen sources) or Table 6 (new sources).
_PAPER_SOURCES = {
    "vqav2": "VQAv2", "gqa": "GQA", "textvqa": "TextVQA", "chartqa": "ChartQA", "docvqa": "DocVQA", "dvqa": "DVQA",
    "geoqa+": "GeoQA+", "geoqa": "GeoQA+", "synthdog": "Synthdog", "synthdogen": "Synthdog",
    "mathvista": "MathVista", "mathverse": "MathVerse", "mmmu": "MMMU", "mme": "MME", "mmvet": "MM-Vet",
    "seedbench": "SEED-Bench", "seed": "SEED-Bench", "scienceqa": "ScienceQA", "sqa": "ScienceQA",
    "llavawild": "LLaVA-wild", "llavabench": "LLaVA-wild", "llavabenchinthewild": "LLaVA-wild",
    "llavainthewild": "LLaVA-wild",
}


#: The paper's base models, each with its free-dialogue overall table (key in fire.json, title).
BASE_TABLES = {
    "llava_next_8b": ("table4_free_dialogues_overall", "Table 4: free dialogues, overall (LLaVA-NeXT-8B)"),
    "llava_next_vicuna_7b": ("tableA5_vicuna_7b", "Table A5: free dialogues, overall (LLaVA-NeXT-Vicuna-7B)"),
    "llava_15_vicuna_7b": ("tableA6_llava15_vicuna_7b", "Table A6: free dialogues, overall (LLaVA-1.5-Vicuna-7B)"),
}


def run_base(results: Mapping) -> str | None:
    """The paper's base model a run is compared with (a key of :data:`BASE_TABLES`), or None when unknown.

    ``results["base"]`` when given, else read from ``results["model"]`` (a ``config.model`` dict):
    architecture "llava" is LLaVA-1.5-Vicuna-7B; a 32,064-row LLaVA-NeXT is LLaVA-NeXT-Vicuna-7B; a 128,320-row
    one LLaVA-NeXT-8B (configs/llava_*.py). Other models (the tiny and SmolLM2 ones) are of no paper base.
    """
    if results.get("base"):
        if results["base"] not in BASE_TABLES:
            raise ValueError(f"results base {results['base']!r}: choose from {sorted(BASE_TABLES)}")
        return results["base"]
    model = results.get("model")
    if not model:
        return None
    vocab = (model.get("llm") or {}).get("vocab_size")
    if model.get("architecture") == "llava":
        return "llava_15_vicuna_7b" if vocab == 32064 else None
    return {32064: "llava_next_vicuna_7b", 128320: "llava_next_8b"}.get(vocab)


def paper_results(path: str = PAPER_RESULTS) -> dict:
    with open(path) as f:
        return json.load(f)


def paper_source(source: str) -> str | None:
    """The paper's name of a source dataset of ours, or None if the paper has no column for it."""
    return _PAPER_SOURCES.get(re.sub(r"[\s_\-]", "", source.lower()))


def _format(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}"


def _ours(name: str) -> str:
    return f"**{name} (fire_jax)**"


def fixed_report(results: Mapping, paper: Mapping | None = None) -> str:
    """Tables 2 (student) and 3 (teacher) with the paper's rows, then ours per source dataset."""
    paper = paper_results() if paper is None else paper
    sections = []
    for role, table, extra in (("student", "table2_student_fixed_dialogues", ()),
                               ("teacher", "table3_teacher_fixed_dialogues", ("MAE",))):
        if role not in results["metrics"]:
            continue
        metrics = results["metrics"][role]
        columns = (*FIXED_COLUMNS, *extra)
        name = results[role]["name"]
        header = ("model", *columns, "turns")
        rows = [(f"{model} (paper)", *values, "") for model, values in paper[table].items() if model != "columns"]
        rows.append((_ours(name), *(metrics["overall"][c] for c in columns), metrics["overall"]["n"]))
        title = f"Table {2 if role == 'student' else 3}: fixed dialogues, {role} ({name})"
        sections.append(f"### {title}\n\n" + markdown_table(header, rows, cell=_format))
        per_source = [(source, *(m[c] for c in columns), m["n"]) for source, m in metrics["per_source"].items()]
        sections.append(f"#### {role} per source dataset (fire_jax)\n\n" +
                        markdown_table(("source", *columns, "turns"), per_source, cell=_format))
        if role == "teacher":
            overall = metrics["overall"]
            compared = {"whole": "the whole reply, score line included",
                        "feedback": "the text after \"Feedback:\" on both sides (\"\" for a reply the release "
                                    "cannot read), as the release's analyze_feedback.py"}
            read = {"robust": "the robust score reader",
                    "official": "the release's get_score, a reply without \"Feedback:\" unscored, as its "
                                "eval_feedback.py"}
            sections.append(f"Teacher BLEU/CIDEr compare {compared[overall['teacher_text']]} "
                            f"(fixed.teacher_text={overall['teacher_text']}); the MAE reads scores with "
                            f"{read[overall['score_parser']]} (fixed.score_parser={overall['score_parser']}). "
                            f"Teacher replies without a score: {overall['no_score']} of {overall['n']} "
                            f"(each costs 10 in the MAE).")
    return "\n\n".join(sections) + "\n"


def _free_row(label: str, m: Mapping) -> tuple:
    return (label, *(m[c] for c in FREE_COLUMNS), m["K"], m["items"])


def free_report(results: Mapping, paper: Mapping | None = None, *, threshold: float) -> str:
    """Table 4 (overall; A5 / A6 on the Vicuna bases), Tables 5-6 (the paper's seen and new sources, 8B), other
    sources, Fig. 7's accuracy (8B). ``threshold``: the stop rule's the run used, named in Fig. 7's title."""
    paper = paper_results() if paper is None else paper
    metrics = results["metrics"]
    name = results["student"]["name"]
    header = ("model", *FREE_COLUMNS, "K", "items")
    baseline = metrics.get("baseline")
    parser = metrics.get("score_parser", "robust")
    sections = [
        f"Student {name}, teacher {results['teacher']['name']}. K: dialogues with more than one turn "
        f"(the metrics' items); AT normalised by " +
        (f"the baseline run {baseline!r}." if baseline else "this run itself (no baseline_results: AT = 1).") +
        f" Scores read by free.score_parser={parser}" +
        (" (the release's get_score; a score of 0 stops a dialogue, as its model_fire_chat_loader.py)."
         if parser == "official" else " (a reply without a score stops the dialogue and counts 0)."),
    ]
    base = run_base(results)
    for table, title in [BASE_TABLES[base]] if base else BASE_TABLES.values():
        rows = [(f"{model} (paper)", *values, "", "") for model, values in paper[table].items() if model != "columns"]
        rows.append(_free_row(_ours(name), metrics["overall"]))
        sections.append(f"### {title}\n\n" + markdown_table(header, rows, cell=_format))
    if base is None:
        sections.append("The run's base model is unknown: our row stands beside each base's published rows.")

    placed = set()
    per_source = () if base not in (None, "llava_next_8b") else (  # the paper reports sources at 8B only
        ("table5_free_dialogues_seen_sources", "Table 5: free dialogues, seen sources"),
        ("table6_free_dialogues_new_sources", "Table 6: free dialogues, new sources"))
    for key, title in per_source:
        rows = []
        for source, m in metrics["per_source"].items():
            column = paper_source(source)
            if column not in paper[key]:
                continue
            placed.add(source)
            rows += [(f"{column}: {model} (paper)", *values, "", "") for model, values in paper[key][column].items()]
            rows.append(_free_row(f"{column}: {_ours(name)} [{source}]", m))
        if rows:
            sections.append(f"### {title}\n\n" + markdown_table(header, rows, cell=_format))
    others = [_free_row(source, m) for source, m in metrics["per_source"].items() if source not in placed]
    if others:
        sections.append("### Sources the paper does not report (fire_jax)\n\n" +
                        markdown_table(("source", *FREE_COLUMNS, "K", "items"), others, cell=_format))

    turns = len(metrics["overall"]["accuracy_by_turn"])
    figure7 = paper["figure7_accuracy_by_turn"] if base in (None, "llava_next_8b") else {}  # Fig. 7: 8B only
    rows = [(f"{model} (paper)", *(values.get(f"turn{t}") for t in range(1, turns + 1)))
            for model, values in figure7.items() if model != "note"]
    rows.append((_ours(name), *(100 * a for a in metrics["overall"]["accuracy_by_turn"])))
    sections.append(f"### Fig. 7: accuracy by turn (% of items with score >= {threshold:g})\n\n" +
                    markdown_table(("model", *(f"turn {t}" for t in range(1, turns + 1))), rows, cell=_format))
    stops = metrics["overall"]["stops"]
    sections.append("Stops: " + ", ".join(f"{reason} {count}" for reason, count in stops.items()) + ".")
    return "\n\n".join(sections) + "\n"


def _pct(value) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _beside(m: Mapping, key: str, blind: str) -> str:
    """A teacher's share with the blind teacher's in brackets ("–" when there is none; results written before
    the blind teacher existed have no bracket)."""
    if m.get(key) is None:
        return "–"
    return _pct(m[key]) + (f" ({_pct(m[blind])})" if m.get(blind) is not None else "")


def judged_report(results: Mapping) -> str:
    """The exact judge's tables (synthetic test sets): accuracy by turn, refinement, the teacher's agreement."""
    judged = results["metrics"]["judged"]
    threshold = judged["threshold"]  # the stop rule's (fire_bench.judged_metrics)
    overall = judged["overall"]
    sections = [f"### Exact judge (answer after \"Answer:\" = groundtruth, case, spacing and final punctuation "
                f"ignored); the teacher says \"right\" when its score is >= {threshold:g}"]
    if results["setting"] == "free":
        turns = len(overall["accuracy_by_turn"])
        header = ("source", *(f"acc t{t}" for t in range(1, turns + 1)), "acc final", "refined / wrong first",
                  "agreement", "direction (blind)", "distance score (blind)", "solved but wrong", "stopped but right",
                  "items")
        rows = []
        for source, m in [("overall", overall), *judged["per_source"].items()]:
            rows.append((source, *(_pct(a) or "–" for a in m["accuracy_by_turn"]), _pct(m["accuracy_final"]) or "–",
                         f"{m['refined']} / {m['wrong_first']} ({_pct(m['refinement_rate']) or '–'})",
                         _pct(m["agreement"]) or "–", _beside(m, "teacher_direction", "blind_direction"),
                         _beside(m, "teacher_distance_score", "blind_distance_score"),
                         f"{m['solved_but_wrong']} / {m['solved']}",
                         m["stopped_but_right"], m["items"]))
        sections.append(markdown_table(header, rows, cell=_format))
        sections.append("Accuracy at turn t: the answer at turn t, or the last one of a dialogue that ended earlier. "
                        "Refined: wrong at turn 1, right at the end. Direction, distance score: of the teacher's "
                        "replies to wrong answers on the task's scale (synthetic set), the share whose feedback "
                        "points the way the set's rule does, and the share whose score is the rule's for that "
                        "distance; in brackets the same for a blind teacher (the hint and score given most often to "
                        "that answer in the FD teacher's training turns, without the groundtruth or the image). "
                        f"Solved but wrong: stopped with score >= {threshold:g} on a wrong answer (of all "
                        "solved). Stopped but right: ended unsolved on a right answer.")
        by_turn = overall["agreement_by_turn"]
        sections.append(markdown_table(("teacher agreement", *(f"turn {t}" for t in range(1, len(by_turn) + 1)),
                                        "all turns"),
                                       [("share of turns", *(_pct(a) or "–" for a in by_turn),
                                         _pct(overall["agreement"]) or "–")], cell=_format))
        confusion = overall["confusion"]
    else:
        confusion = None
        if "student" in overall:
            s = overall["student"]
            sections.append(markdown_table(
                ("student (generated r_k)", *(f"turn {k}" for k in s["accuracy_by_turn"]), "all", "turns"),
                [("accuracy", *(_pct(a) or "–" for a in s["accuracy_by_turn"].values()), _pct(s["accuracy"]) or "–",
                  s["n"])], cell=_format))
        if "teacher" in overall:
            t = overall["teacher"]
            sections.append(markdown_table(
                ("teacher (on the true r_k)", *(f"turn {k}" for k in t["agreement_by_turn"]), "all", "turns"),
                [("agreement", *(_pct(a) or "–" for a in t["agreement_by_turn"].values()),
                  _pct(t["agreement"]) or "–", t["n"])], cell=_format))
            confusion = t["confusion"]
    if confusion is not None:
        sections.append("Teacher vs judge, all turns:\n\n" + markdown_table(
            ("judge \\ teacher", f"score >= {threshold:g}", f"score < {threshold:g} or none"),
            [("right", confusion["right_solved"], confusion["right_unsolved"]),
             ("wrong", confusion["wrong_solved"], confusion["wrong_unsolved"])], cell=_format))
    return "\n\n".join(sections) + "\n"
