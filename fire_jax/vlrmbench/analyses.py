"""The VLRMBench paper's analyses with a fire_jax model (``--analyses=positional,voting,shots,length,correction``).

Each writes ``workdir/analyses/<name>.md`` (a table shaped like the paper's,
the paper's published rows from the repo's copy beside ours) and
``<name>.json``, and resumes like the main runner: what it generates is
appended per sample to ``workdir/analyses/<name>/*.jsonl`` and skipped on a
rerun; the settings it depends on are kept in
``workdir/analyses/<name>/settings.json`` and a rerun with others stops.

- ``positional`` (Table 4): MJ with the better solution first (order 0) and
  second (order 1): mean score of each response and accuracy of that order
  alone, read from the main run's MJ outputs (no new generation).
- ``length`` (Table 5): SC weighted F1 by reasoning length (<= 10, 11-15,
  > 15 steps), read from the main run's SC outputs.
- ``shots`` (Table 6): SC with 0, 1 and 2 in-context examples. 0-shot is the
  main run; a k-shot prompt puts k other SC records (question, reasoning,
  their label list; text only, the file's first records that are not the
  sample) before the question.
- ``voting`` (Fig. 4): K samples per prompt at ``temperature`` (0.9, the
  paper's), majority vote over the first k for each k of ``vote_k``. Every
  sample draws with its own seed, ``crc32("<seed>/<task>/<id>")`` (kept in its
  record), so a sample's votes do not depend on its batch or on resuming.
- ``correction`` (Table 7): on (image, question, groundtruth) items, a student
  answers, the evaluated model (the reward model) writes an error analysis
  of a wrong answer with the ERA prompt, and the student answers again; run
  on :func:`fire_jax.dialogue.loop.run_dialogues` with a two-turn stop rule.
  Correction rate = first answers wrong then right / first answers wrong,
  judged against the groundtruth by :func:`answer_correct`.

Failed or unreadable outputs follow the failure accounting of
:func:`fire_jax.vlrmbench.score_task`; every table shows both the ours and the
release's ("official") figures (VLMEvalKit has none of these analyses).
"""

from __future__ import annotations

import collections
import json
import re
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from fire_jax.dialogue.stop import StopRule
from fire_jax.core.results import ResultStore, check_settings, markdown_table
from fire_jax.core.files import write_text
from fire_jax.vlrmbench.data import TaskData
from fire_jax.vlrmbench.parse import parse_foresight, try_parse_scores, try_parse_step_labels
from fire_jax.vlrmbench.score import load_paper_results, score_accountings
from fire_jax.vlrmbench.tasks import TASK_PROMPTS, Sample, task_info

ANALYSES = ("positional", "voting", "shots", "length", "correction")
ACCOUNTINGS = ("ours", "official")  # the accountings the analyses report: ours and the release's
LENGTH_BUCKETS = (("<=10 steps", 0, 10), ("10-15", 11, 15), ("> 15", 16, 10 ** 9))  # Table 5's columns


def select(analyses: str | Sequence[str] | None) -> list[str]:
    """Analysis names from "positional,voting" or a list ("all": every one), in ANALYSES order."""
    if analyses is None:
        return []
    names = [a.strip() for a in analyses.split(",")] if isinstance(analyses, str) else list(analyses)
    names = [a for a in names if a]
    if names == ["all"]:
        return list(ANALYSES)
    unknown = sorted(set(names) - set(ANALYSES))
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    return [a for a in ANALYSES if a in names]


def tasks_needed(names: Sequence[str], config) -> list[str]:
    """The benchmark tasks the analyses read (added to the main run)."""
    needed = {"positional": ["multi_solution"], "length": ["step_correctness"], "shots": ["step_correctness"],
              "voting": [task_info(t).file for t in _split(config.analyses.voting.tasks)], "correction": []}
    return [t for name in names for t in needed[name]]


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# ----------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------


def _number(value: float | None, scale: float = 100) -> str:
    return "-" if value is None else f"{scale * value:.1f}"


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An analysis table (:func:`fire_jax.core.results.markdown_table`): labels first, the other columns
    right-aligned."""
    return markdown_table(header, rows, align="l" + "r" * (len(header) - 1)) + "\n"


def _write(workdir: Path, name: str, title: str, table: str, results: dict) -> dict:
    out = workdir / "analyses"
    out.mkdir(parents=True, exist_ok=True)
    text = f"{title}\n\n{table}"
    write_text(out / f"{name}.md", text)
    write_text(out / f"{name}.json", json.dumps(results, indent=2) + "\n")
    print(text)
    return {**results, "table": text}


def _outputs(workdir: Path, data: TaskData, path: Path | None = None) -> dict[str, dict]:
    """What each accounting reads from a task's outputs JSONL (default: the main run's), by accounting."""
    from fire_jax.vlrmbench.runner import read_records, task_outputs

    records = read_records(path or workdir / "outputs" / f"{data.task}.jsonl")[0]
    return {a: task_outputs(data.samples, records, a) for a in ACCOUNTINGS}


# ----------------------------------------------------------------------------
# positional (Table 4) and length (Table 5): the main run's outputs regrouped
# ----------------------------------------------------------------------------


def positional(samples: Sequence[Sample], outputs: Mapping[str, Any], parser: str = "robust",
               official_outputs: Mapping[str, Any] | None = None) -> dict:
    """Table 4 from MJ outputs: per order, mean score of response 1 and 2 and that order's accuracy.

    better_first = order 0 (the good solution is response 1; correct when its
    score is higher), better_second = order 1. Means are over the outputs read;
    accuracy under both accountings: ours counts an output missing or not read
    wrong; official (as :func:`fire_jax.vlrmbench.score_task`) reads every
    output there is with the parser's padding and leaves out a missing one.
    ``official_outputs``: what the official accounting reads (default ``outputs``).
    """
    official_outputs = outputs if official_outputs is None else official_outputs
    results = {}
    for order, name in ((0, "better_first"), (1, "better_second")):
        read, correct, failed = [], 0, 0
        kept, official_correct = 0, 0
        for sample in samples:
            (first, second), ok = try_parse_scores(outputs.get(sample.id, (None, None))[order], parser)
            if ok:
                read.append((first, second))
                correct += _order_correct(order, first, second)
            failed += not ok
            text = official_outputs.get(sample.id, (None, None))[order]
            if text is not None:
                kept += 1
                official_correct += _order_correct(order, *try_parse_scores(text, parser)[0])
        mean = [sum(s[i] for s in read) / len(read) if read else None for i in (0, 1)]
        results[name] = {"mean_response_1": mean[0], "mean_response_2": mean[1],
                         "accuracy": {"ours": correct / len(samples),
                                      "official": official_correct / kept if kept else None},
                         "samples": len(samples), "failed": failed}
    return results


def _order_correct(order: int, first: float, second: float) -> bool:
    """Whether one MJ order's two scores rank the good solution (response 1 in order 0) higher."""
    good, bad = (first, second) if order == 0 else (second, first)
    return good > bad


def positional_table(results: Mapping, model: str, paper: Mapping) -> str:
    header = ["Order", "Model", "avg score of response 1", "avg score of response 2", "acc", "acc (official)",
              "failed"]
    rows = []
    for order in ("better_first", "better_second"):
        for name, (r1, r2, acc) in paper["table4_mj_order"][order].items():
            rows.append([order, f"{name} (paper)", f"{r1:.1f}", f"{r2:.1f}", f"{acc:.1f}", "", ""])
        ours = results[order]
        rows.append([order, model, _number(ours["mean_response_1"], 1), _number(ours["mean_response_2"], 1),
                     _number(ours["accuracy"]["ours"]), _number(ours["accuracy"]["official"]),
                     f"{ours['failed']}/{ours['samples']}"])
    return markdown(header, rows)


def length_buckets(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """SC samples by their number of steps (len(task_gt)): Table 5's <= 10, 11-15, > 15."""
    groups: dict[str, list[Sample]] = {name: [] for name, _, _ in LENGTH_BUCKETS}
    for sample in samples:
        n = len(sample.task_gt)
        groups[next(name for name, low, high in LENGTH_BUCKETS if low <= n <= high)].append(sample)
    return groups


def by_length(samples: Sequence[Sample], outputs: Mapping[str, Any], parser: str = "robust",
              official_outputs: Mapping[str, Any] | None = None) -> dict:
    """Table 5: SC weighted F1 per length bucket, under both accountings, with the bucket sizes.
    ``official_outputs``: what the official accounting reads (default ``outputs``; see score_accountings)."""
    out = {}
    for name, group in length_buckets(samples).items():
        both = (score_accountings("step_correctness", group, outputs, parser, official_outputs, ACCOUNTINGS)
                if group else {})
        out[name] = {"samples": len(group), **{a: (both[a].scores["f1"] if group else None) for a in ACCOUNTINGS},
                     "failed_samples": both["ours"].failed_samples if group else {}}
    return out


def length_table(results: Mapping, model: str, paper: Mapping) -> str:
    table5 = paper["table5_sc_by_length"]
    columns = table5["columns"]
    rows = [[f"{name} (paper)", *[f"{v:.1f}" for v in values]] for name, values in table5.items()
            if name not in ("columns", "group_sizes")]
    rows.append(["samples (paper)", *table5["group_sizes"]])
    for accounting in ACCOUNTINGS:
        rows.append([f"{model} ({accounting})", *[_number(results[c][accounting]) for c in columns]])
    rows.append(["samples (ours)", *[results[c]["samples"] for c in columns]])
    return markdown(["Model", *columns], rows)


# ----------------------------------------------------------------------------
# Generated analyses: settings and resumable outputs
# ----------------------------------------------------------------------------


def shot_prompt(sample: Sample, examples: Sequence[Sample]) -> str:
    """The SC prompt with ``examples`` (their question, reasoning and label list) before the question."""
    template = TASK_PROMPTS["step_correctness"]
    blocks = "".join(f"## Example {k}\n### Question\n{e.question}\n\n### AI assistant's reasoning process\n"
                     f"{e.reasoning_error}\n\n### Output\n{list(e.task_gt)}\n\n"
                     for k, e in enumerate(examples, start=1))
    head, tail = template.split("## Question\n", 1)
    return (head + blocks + "## Question\n" + tail).format(question=sample.question,
                                                         reasoning_process=sample.reasoning_error)


def shot_examples(sample: Sample, pool: Sequence[Sample], shots: int) -> list[Sample]:
    """The first ``shots`` records of the file that are not ``sample``."""
    return [e for e in pool if e.id != sample.id][:shots]


def shots(config, data: TaskData, generator, workdir: Path) -> dict:
    """Table 6: SC F1 with 0 (the main run), 1 and 2 in-context examples."""
    from fire_jax.vlrmbench.runner import run_task, task_settings

    folder = workdir / "analyses" / "shots"
    counts = [int(k) for k in config.analyses.shots.k.split(",")]
    check_settings(folder / "settings.json", {**task_settings(config, data.task), "shots": counts},
                   where=str(folder), outputs=folder.glob("*.jsonl"))
    outputs = {0: _outputs(workdir, data)}
    for k in counts:
        if k == 0:
            continue
        path = folder / f"step_correctness_{k}shot.jsonl"
        run_task(data, generator, None, path, render=config.vlrm.render,
                 prompt=lambda sample, order, k=k: shot_prompt(sample, shot_examples(sample, data.samples, k)))
        outputs[k] = _outputs(workdir, data, path)
    results = {}
    for k in sorted(set(counts) | {0}):
        both = score_accountings(data.task, data.samples, outputs[k]["ours"], config.vlrm.parser,
                                 outputs[k]["official"], ACCOUNTINGS)
        results[f"{k}-shot"] = {a: both[a].scores["f1"] for a in ACCOUNTINGS} | {
            "failed_samples": both["ours"].failed_samples, "samples": len(data.samples)}
    return results


def shots_table(results: Mapping, model: str, paper: Mapping) -> str:
    table6 = paper["table6_sc_icl"]
    columns = list(dict.fromkeys(table6["columns"] + list(results)))
    rows = [[f"{name} (paper)", *[f"{v:.1f}" for v in values] + ["-"] * (len(columns) - len(values))]
            for name, values in table6.items() if name != "columns"]
    for accounting in ACCOUNTINGS:
        rows.append([f"{model} ({accounting})",
                     *[_number(results[c][accounting]) if c in results else "-" for c in columns]])
    return markdown(["Model", *columns], rows)


# ----------------------------------------------------------------------------
# voting (Fig. 4)
# ----------------------------------------------------------------------------


def sample_seed(seed: int, task: str, sample_id: str) -> int:
    """The explicit per-sample seed of the voting analysis."""
    return zlib.crc32(f"{seed}/{task_info(task).file}/{sample_id}".encode())


def majority_labels(votes: Sequence[list[int]]) -> list[int]:
    """Per step, the label most of ``votes`` give; a tie gives 0 (no majority says the step is wrong)."""
    return [int(2 * sum(column) > len(column)) for column in zip(*votes)]


def vote(task: str, sample: Sample, texts: Sequence[Sequence[str | None]], parser: str = "robust"):
    """The majority answer of one sample's votes, as score_task reads outputs; None if no vote was read.

    texts: per vote, the outputs of its orders (one text; MJ's two orders).
    Step tasks: per-step majority of the label lists read ("[0, 1, ...]" out).
    FF: majority of the yes/no read (a tie: no). MJ: majority of the votes'
    verdicts (good solution's summed score higher, lower, or equal); out as a
    pair of score lists that score_task reads as that verdict.
    """
    info = task_info(task)
    if info.theme == "step":
        read = [labels for labels, ok in (try_parse_step_labels(t[0], len(sample.task_gt), parser) for t in texts)
                if ok]
        return str(majority_labels(read)) if read else None
    if info.file == "foresight":
        answers = [parse_foresight(t[0], parser) for t in texts]
        yes = [a == frozenset({True}) for a in answers if len(a) == 1]
        return None if not yes else "Yes" if 2 * sum(yes) > len(yes) else "No"
    if info.file == "multi_solution":
        verdicts = []
        for first_text, second_text in texts:
            (first, first_ok), (second, second_ok) = try_parse_scores(first_text, parser), try_parse_scores(
                second_text, parser)
            if first_ok and second_ok:
                good, bad = first[0] + second[1], first[1] + second[0]
                verdicts.append((good > bad) - (good < bad))
        if not verdicts:
            return None
        winner = collections.Counter(verdicts).most_common()
        verdict = winner[0][0] if len(winner) == 1 or winner[0][1] > winner[1][1] else 0
        return ("[1, 0]", "[0, 1]") if verdict > 0 else ("[0, 1]", "[1, 0]") if verdict < 0 else ("[0, 0]", "[0, 0]")
    raise ValueError(f"voting reads step tasks, MJ and FF, not {info.short}")


def voting(config, datasets: Mapping[str, TaskData], generator, workdir: Path) -> dict:
    """Fig. 4: each task's score by majority vote over the first k of K sampled outputs, k in vote_k."""
    from fire_jax.vlrmbench.runner import Prompt, task_settings
    from fire_jax.vlrmbench.tasks import build_prompt, num_orders
    import jax

    settings = config.analyses.voting
    ks = sorted(int(k) for k in settings.k.split(","))
    folder = workdir / "analyses" / "voting"
    tasks = [task_info(t).file for t in _split(settings.tasks)]
    check_settings(folder / "settings.json", {"tasks": tasks, "k": max(ks), "temperature": settings.temperature,
                                              **task_settings(config, tasks[0])},
                   where=str(folder), outputs=folder.glob("*.jsonl"))
    results = {}
    for task in tasks:
        data, orders = datasets[task], num_orders(task)
        sampler = generator.variant(batch_size=max(ks) * orders, temperature=settings.temperature)
        with ResultStore(folder / f"{task}.jsonl", "id", unreadable="skip") as store:
            for sample in data:
                if sample.id in store:
                    continue
                seed = sample_seed(config.seed, task, sample.id)
                requests = [Prompt(build_prompt(sample, task, config.vlrm.render, order), sample.images)
                            for _ in range(max(ks)) for order in range(orders)]
                outs = sampler(requests, rng=jax.random.key(seed))
                store.add({"id": sample.id, "seed": seed, "outputs": [t for t, _ in outs],
                           "failures": [e for _, e in outs]})
            records = store.records
        results[task_info(task).short] = {}
        for k in ks:
            voted = {}
            for sample in data:
                texts = records[sample.id]["outputs"]
                votes = [texts[j * orders:(j + 1) * orders] for j in range(k)]
                answer = vote(task, sample, votes, config.vlrm.parser)
                if answer is not None:
                    voted[sample.id] = answer
            # the voted answers are in robust form
            both = score_accountings(task, data.samples, voted, "robust", accountings=ACCOUNTINGS)
            key = "f1" if task_info(task).theme == "step" else "accuracy"
            results[task_info(task).short][str(k)] = {a: both[a].scores[key] for a in ACCOUNTINGS} | {
                "no_vote_read": sum(both["ours"].failed_samples.values())}
    return results


def voting_table(results: Mapping, model: str, temperature: float) -> str:
    ks = list(next(iter(results.values())))
    rows = [[task, f"{model} ({a})", *[_number(results[task][k][a]) for k in ks]]
            for task in results for a in ACCOUNTINGS]
    rows += [[task, "samples without a vote read", *[results[task][k]["no_vote_read"] for k in ks]]
             for task in results]
    note = (f"Majority vote over k samples at temperature {temperature} (step tasks: weighted F1; MJ/FF: "
            "accuracy; %). Fig. 4 of the paper is a plot; its values are not in the repo's published numbers, "
            "so no paper row is printed.\n\n")
    return note + markdown(["Task", "Model", *[f"k={k}" for k in ks]], rows)


# ----------------------------------------------------------------------------
# correction (Table 7)
# ----------------------------------------------------------------------------

_ANSWER = re.compile(r"answer\s*[:：]", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s.-]", " ", text.lower())).strip(" .")


def answer_correct(response: str, groundtruth: str) -> bool:
    """Whether a student's response gives the groundtruth answer.

    The answer is the text after the last "Answer:" (the student's format),
    else the whole response. A numeric groundtruth must equal the answer's
    last number; any other must equal the answer or appear in it as whole
    words (case, punctuation and spacing ignored).
    """
    match = list(_ANSWER.finditer(response))
    answer = _normalise(response[match[-1].end():] if match else response)
    truth = _normalise(groundtruth)
    if not truth:
        return False
    if _NUMBER.fullmatch(truth):
        numbers = _NUMBER.findall(answer)
        return bool(numbers) and float(numbers[-1]) == float(truth)
    return answer == truth or re.search(rf"(?<!\w){re.escape(truth)}(?!\w)", answer) is not None


class RewardModelTeacher:
    """The ``teacher`` of :func:`fire_jax.dialogue.loop.run_dialogues` for the correction rate: a prompt builder
    over the reward model (a :class:`fire_jax.vlrmbench.runner.Responder`, itself over a backend).

    ``feedback`` judges each answer against the groundtruth; for a wrong one
    before the last turn, the reward model writes an error analysis with the
    release's ERA prompt (question, the answer as the reasoning process), which
    the student reads as feedback: a :class:`fire_jax.dialogue.agents.Feedback` whose text is the analysis (""
    when none was asked for) and whose score is 10 when the answer is right, 0 when wrong.
    """

    def __init__(self, reward_model, max_turns: int = 2):
        self.reward_model, self.max_turns = reward_model, max_turns

    def feedback(self, images, questions, groundtruths, answers, histories, rng=None) -> list:
        from fire_jax.dialogue.agents import Feedback
        from fire_jax.vlrmbench.runner import Prompt

        right = [answer_correct(a, gt) for a, gt in zip(answers, groundtruths)]
        ask = [i for i, (ok, h) in enumerate(zip(right, histories)) if not ok and len(h) + 1 < self.max_turns]
        prompt = TASK_PROMPTS["error_reason_analysis"]
        texts = dict(zip(ask, self.reward_model([
            Prompt(prompt.format(question=questions[i], reasoning_process=answers[i]), (images[i],)) for i in ask])))
        return [Feedback((texts[i][0] or "") if i in texts else "", 10.0 if ok else 0.0)
                for i, ok in enumerate(right)]


#: The correction analysis's dialogues: the student answers twice at most, the second time only after a wrong
#: first answer (a right one is solved: :class:`Verdict`'s scores lie on either side of any threshold in 0..10).
CORRECTION = StopRule(max_turns=2, stop_on_no_increase=False)


def correction_rate(records: Sequence[Mapping], rule: StopRule = CORRECTION) -> dict:
    """Correction rate = first answer wrong and second right / first answer wrong, with the counts; right is
    what ``rule`` solves."""
    first_wrong = [r for r in records if not rule.solves(r["scores"][0])]
    corrected = sum(len(r["scores"]) > 1 and rule.solves(r["scores"][1]) for r in first_wrong)
    return {"items": len(records), "first_wrong": len(first_wrong), "corrected": corrected,
            "rate": corrected / len(first_wrong) if first_wrong else None}


def correction(config, generator, workdir: Path) -> dict:
    """Table 7: the student's correction rate with the evaluated model's ERA analyses, per source and overall."""
    from fire_jax.core.config import load_config
    from fire_jax.data.items import load_triplets
    from fire_jax.dialogue.agents import from_spec
    from fire_jax.dialogue.loop import run_dialogues
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams

    settings = config.analyses.correction
    if not settings.data:
        raise ValueError("the correction analysis needs (image, question, groundtruth) items: "
                         "set --config.analyses.correction.data and .image_root")
    folder = workdir / "analyses" / "correction"
    student_config = load_config(settings.student_config) if settings.student_config else config
    check_settings(folder / "settings.json",
                   {"data": settings.data, "image_root": settings.image_root,
                    "student_config": settings.student_config, "student_checkpoint": settings.student_checkpoint,
                    "max_examples": settings.max_examples, "max_new_tokens": settings.max_new_tokens,
                    "reward_model": generator.name},
                   where=str(folder), outputs=folder.glob("*.jsonl"))
    student = from_spec(settings.student_checkpoint or student_config.get("checkpoint") or None, "student",
                        SamplingParams.from_config(config.generate, source="config.generate",
                                                  max_tokens=settings.max_new_tokens),
                        engine=EngineConfig.from_config(config.generate), config=student_config,
                        batch_size=config.generate.batch_size)
    items = load_triplets(settings.data, settings.image_root, max_examples=settings.max_examples)
    teacher = RewardModelTeacher(generator.variant(max_new_tokens=settings.max_new_tokens))
    with ResultStore(str(folder / "dialogues.jsonl")) as store:
        todo = [item for item in items if item.id not in store]

        def finish(dialogue) -> None:
            store.add({"key": dialogue.item.id, "source": dialogue.item.source, "scores": dialogue.scores,
                       "turns": [{"response": t.response, "feedback": t.feedback} for t in dialogue.turns]})

        run_dialogues(todo, student, teacher, CORRECTION, batch_size=config.generate.batch_size, on_finish=finish)
        records = [store[item.id] for item in items]
    by_source = collections.defaultdict(list)
    for record in records:
        by_source[record["source"]].append(record)
    return {"student": settings.student_checkpoint or student_config.get("checkpoint") or "the evaluated model",
            "reward_model": generator.name, "overall": correction_rate(records),
            "per_source": {s: correction_rate(group) for s, group in sorted(by_source.items())}}


def correction_table(results: Mapping, paper: Mapping) -> str:
    table7 = paper["table7_correction_rate"]
    rows = [[f"{name} (paper)", *[f"{v:.1f}" for v in values]] for name, values in table7.items()
            if name != "columns"]
    paper_part = markdown(["LVLM / VLRM", *table7["columns"]], rows)
    sources = list(results["per_source"])
    ours = [[f"{results['student']} / {results['reward_model']}",
             *[_number(results["per_source"][s]["rate"]) for s in sources], _number(results["overall"]["rate"])],
            ["corrected / first wrong", *[f"{results['per_source'][s]['corrected']}/"
                                          f"{results['per_source'][s]['first_wrong']}" for s in sources],
             f"{results['overall']['corrected']}/{results['overall']['first_wrong']}"]]
    return paper_part + "\n" + markdown(["LVLM / VLRM (ours)", *sources, "Avg"], ours)


# ----------------------------------------------------------------------------
# All of them
# ----------------------------------------------------------------------------


def run(names: Sequence[str], config, datasets: Mapping[str, TaskData], generator, workdir: Path) -> dict:
    """Run the named analyses after the main run; returns {name: results (with its "table")}."""
    paper = load_paper_results()
    model, parser = generator.name, config.vlrm.parser
    out = {}
    for name in names:
        if name == "positional":
            data = datasets["multi_solution"]
            outputs = _outputs(workdir, data)
            results = positional(data.samples, outputs["ours"], parser, outputs["official"])
            out[name] = _write(workdir, name, "MJ accuracy by the better solution's position (paper Table 4); "
                               "acc counts unread outputs wrong, acc (official) scores them as the release "
                               "reads them and leaves out missing ones.",
                               positional_table(results, model, paper), results)
        elif name == "length":
            data = datasets["step_correctness"]
            outputs = _outputs(workdir, data)
            results = by_length(data.samples, outputs["ours"], parser, outputs["official"])
            out[name] = _write(workdir, name, "SC weighted F1 (%) by reasoning length (paper Table 5).",
                               length_table(results, model, paper), results)
        elif name == "shots":
            results = shots(config, datasets["step_correctness"], generator, workdir)
            out[name] = _write(workdir, name, "SC weighted F1 (%) with 0/1/2 in-context examples (paper Table 6).",
                               shots_table(results, model, paper), results)
        elif name == "voting":
            results = voting(config, datasets, generator, workdir)
            out[name] = _write(workdir, name, "Test-time scaling by majority vote (paper Fig. 4).",
                               voting_table(results, model, config.analyses.voting.temperature), results)
        elif name == "correction":
            results = correction(config, generator, workdir)
            out[name] = _write(workdir, name, "Correction rate (%) with the reward model's ERA error analysis "
                               "(paper Table 7).", correction_table(results, paper), results)
    return out
