"""Free dialogues: the student and the teacher talk until the answer is solved (SPEC 6, Tables 4-6, Fig. 7).

Per item: the student answers (r_k), the teacher scores it (f_k, a_k), and
:func:`stop_reason` decides whether the dialogue goes on:

- a_k is None (the teacher's reply has no score): stop, ``"no_score"`` (counts as 0);
- a_k >= threshold (8): stop, ``"solved"``;
- k > 1 and a_k <= a_{k-1}: stop, ``"no_increase"`` (free dialogues only);
- k = max_turns (5): stop, ``"max_turns"``.

:func:`run_dialogues` keeps up to ``batch_size`` dialogues in flight: each
step is one batched student call and one batched teacher call over the live
dialogues, each at its own turn; a finished dialogue leaves the batch and the
next item takes its place. The same loop, with :data:`FIRE_1M_GENERATION`'s
rule (stop at 8 or after 3 turns, no "no_increase" stop), writes FIRE-1M-style
data (:mod:`fire_jax.eval.data_generation`).

:func:`run_free` appends every finished dialogue (all its texts and scores) to
a JSONL file and skips on rerun the items already there;
:func:`free_results` turns the dialogues into AT, ADR, ATR, RR and the
accuracy curve, overall and per source dataset.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
from typing import Callable, Iterable, Mapping, Sequence

from fire_jax.data.records import Turn
from fire_jax.eval.bench_io import Item, ResultStore
from fire_jax.eval.metrics import accuracy_by_turn, free_dialogue_metrics


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a dialogue ends (SPEC 6)."""

    max_turns: int = 5  # n_max
    threshold: float = 8  # a score >= threshold solves the item
    stop_on_no_increase: bool = True  # stop when a_k <= a_{k-1}

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


FREE_DIALOGUE = StopRule()  # free dialogues (Tables 4-6)
FIRE_1M_GENERATION = StopRule(max_turns=3, stop_on_no_increase=False)  # FIRE-1M-style data (Fig. 3b)
STOP_REASONS = ("no_score", "solved", "no_increase", "max_turns")


def stop_reason(scores: Sequence[float | None], rule: StopRule = FREE_DIALOGUE) -> str | None:
    """Why the dialogue with teacher scores a_1..a_k stops after turn k, or None if it goes on."""
    score = scores[-1]
    if score is None:
        return "no_score"
    if score >= rule.threshold:
        return "solved"
    if rule.stop_on_no_increase and len(scores) > 1 and score <= scores[-2]:
        return "no_increase"
    if len(scores) >= rule.max_turns:
        return "max_turns"
    return None


@dataclasses.dataclass
class Dialogue:
    """One item's dialogue so far."""

    item: Item
    turns: list[Turn] = dataclasses.field(default_factory=list)
    stop: str | None = None  # one of STOP_REASONS once finished

    @property
    def scores(self) -> list[float | None]:
        return [turn.score for turn in self.turns]


def _fill(values: list, size: int) -> list:
    """``values`` padded to ``size`` with copies of its first entry (one compiled batch shape per run)."""
    return values + [values[0]] * (size - len(values))


def run_dialogues(items: Iterable[Item], student, teacher, rule: StopRule, *, batch_size: int,
                  on_finish: Callable[[Dialogue], None], rng=None) -> int:
    """Talk about every item until :func:`stop_reason` stops it; returns the number of steps.

    ``student.respond(images, questions, histories)`` gives r_k and
    ``teacher.feedback(images, questions, groundtruths, answers, histories)``
    gives f_k with its score (:class:`fire_jax.infer.Student` / ``Teacher``).
    Calls always carry ``batch_size`` rows (a short batch is padded with
    copies, whose outputs are dropped). ``on_finish`` gets each dialogue as it ends.
    ``rng``: a JAX key for sampling, folded with the step (None: greedy decoding needs none).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pending, active, step = iter(items), [], 0
    while True:
        active += [Dialogue(item) for item in _take(pending, batch_size - len(active))]
        if not active:
            return step
        images = _fill([d.item.image for d in active], batch_size)
        questions = _fill([d.item.question for d in active], batch_size)
        histories = _fill([list(d.turns) for d in active], batch_size)
        keys = (None, None) if rng is None else _step_keys(rng, step)
        responses = student.respond(images, questions, histories, rng=keys[0])
        feedbacks = teacher.feedback(images, questions, _fill([d.item.groundtruth for d in active], batch_size),
                                     responses, histories, rng=keys[1])
        for dialogue, response, feedback in zip(active, responses, feedbacks):
            dialogue.turns.append(Turn(response, feedback.text, feedback.score))
            dialogue.stop = stop_reason(dialogue.scores, rule)
            if dialogue.stop:
                on_finish(dialogue)
        active = [d for d in active if not d.stop]
        step += 1


def _take(iterator, n: int) -> list:
    """The next ``n`` (or fewer, at the end) entries of an iterator."""
    return list(itertools.islice(iterator, max(n, 0)))


def _step_keys(rng, step: int):
    import jax

    key = jax.random.fold_in(rng, step)
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def dialogue_record(dialogue: Dialogue) -> dict:
    """A finished dialogue as one JSON object of the free-dialogue results file."""
    item = dialogue.item
    return {"key": item.id, "id": item.id, "source": item.source, "image": item.image_path,
            "question": item.question, "groundtruth": item.groundtruth, "scores": dialogue.scores,
            "stop": dialogue.stop,
            "turns": [{"response": t.response, "feedback": t.feedback, "score": t.score} for t in dialogue.turns]}


def run_free(items: Sequence[Item], student, teacher, path: str, *, rule: StopRule = FREE_DIALOGUE,
             batch_size: int = 8, rng=None) -> list[dict]:
    """Free dialogues on every item, resumable; returns their records in item order.

    Each finished dialogue is appended to the JSONL file ``path`` at once;
    items whose id is already there are not run again.
    """
    from tqdm.auto import tqdm

    with ResultStore(path) as store:
        todo = [item for item in items if item.id not in store]
        print(f"free dialogues: {len(items)} items, {len(items) - len(todo)} already in {path}, {len(todo)} to run")
        with tqdm(total=len(items), initial=len(items) - len(todo), desc="free dialogues", unit="dialogue",
                  dynamic_ncols=True) as progress:
            def finish(dialogue: Dialogue) -> None:
                store.add(dialogue_record(dialogue))
                progress.update(1)

            run_dialogues(todo, student, teacher, rule, batch_size=batch_size, on_finish=finish, rng=rng)
        return [store[item.id] for item in items]


# ---------------------------------------------------------------------------- metrics


def load_baseline(path: str) -> dict:
    """Mean turns of a baseline run ({"overall": t, "per_source": {source: t}}), from its results.json.

    T_baseline of SPEC 6: the baseline model's mean of t_k on its own run
    (``mean_turns`` of its free-dialogue results); None where it has none.
    """
    with open(path) as f:
        results = json.load(f)
    if results.get("setting") != "free":
        raise ValueError(f"{path}: baseline_results must be the results.json of a free-dialogue run, "
                         f"got setting {results.get('setting')!r}")
    metrics = results["metrics"]
    return {"name": results.get("student", {}).get("name", path),
            "overall": metrics["overall"].get("mean_turns"),
            "per_source": {source: m.get("mean_turns") for source, m in metrics["per_source"].items()}}


def _block(records: Sequence[Mapping], rule: StopRule, penalty_turns: float, baseline_turns) -> dict:
    """AT, ADR, ATR, RR, K, mean_turns, the accuracy curve and counts over some dialogues."""
    scores = [record["scores"] for record in records]
    normalise = baseline_turns if baseline_turns not in ("self", None) else None
    metrics = free_dialogue_metrics(scores, baseline_turns=normalise, threshold=rule.threshold,
                                    max_turns=rule.max_turns, penalty_turns=penalty_turns)
    if baseline_turns is None:  # a baseline run without this source: AT cannot be normalised
        metrics["AT"] = math.nan
    metrics["baseline_turns"] = baseline_turns
    metrics["accuracy_by_turn"] = accuracy_by_turn(scores, max_turns=rule.max_turns, threshold=rule.threshold)
    metrics["items"] = len(records)
    metrics["stops"] = dict(sorted(collections.Counter(record["stop"] for record in records).items()))
    metrics["turns"] = dict(sorted(collections.Counter(len(s) for s in scores).items()))
    return metrics


def free_results(records: Sequence[Mapping], *, rule: StopRule = FREE_DIALOGUE, penalty_turns: float = 10,
                 baseline: Mapping | None = None) -> dict:
    """Free-dialogue metrics overall and per source dataset (SPEC 6).

    ``baseline``: :func:`load_baseline` of the baseline run, normalising AT
    per source by the baseline's mean turns on that source (as Tables 5-6:
    the baseline's AT is 1.0 on every source); without one, AT is normalised
    by this run itself (AT = 1.0, ``baseline_turns`` "self").
    """
    def turns(source=None):
        if baseline is None:
            return "self"
        value = baseline["overall"] if source is None else baseline["per_source"].get(source)
        return value if value is not None and math.isfinite(value) else None

    by_source = collections.defaultdict(list)
    for record in records:
        by_source[record["source"]].append(record)
    return {
        "overall": _block(records, rule, penalty_turns, turns()),
        "per_source": {source: _block(group, rule, penalty_turns, turns(source))
                       for source, group in sorted(by_source.items())},
        "baseline": None if baseline is None else baseline["name"],
    }
