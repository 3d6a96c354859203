"""Free dialogues: the student and the teacher talk until the answer is solved (FIRE Tables 4-6, Fig. 7).

The dialogue loop and its stop rule are the dialogue engine's
(:func:`fire_jax.dialogue.loop.run_dialogues`, :data:`fire_jax.dialogue.stop.FREE_DIALOGUE`), shared with
FIRE-1M-style data generation.

:func:`run_free` appends every finished dialogue (all its texts and scores) to
a JSONL file and skips on rerun the items already there;
:func:`free_results` turns the dialogues into AT, ADR, ATR, RR and the
accuracy curve, overall and per source dataset.
"""

from __future__ import annotations

import collections
import math
from typing import Mapping, Sequence

from fire_jax.data.items import Item
from fire_jax.eval.metrics import accuracy_by_turn, free_dialogue_metrics
from fire_jax.dialogue.loop import Dialogue, dialogue_record, run_dialogues
from fire_jax.dialogue.stop import FREE_DIALOGUE, StopRule
from fire_jax.core.results import ResultStore, read_json_object


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

    T_baseline of AT (docs/spec.md, "FIRE-Bench metrics"): the baseline model's mean of t_k on its own run
    (``mean_turns`` of its free-dialogue results); None where it has none.
    """
    results = read_json_object(path)
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
    """Free-dialogue metrics overall and per source dataset (FIRE Tables 4-6).

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
        "score_parser": rule.score_parser,  # how the scores were read (StopRule)
    }
