"""FIRE-100K-style data: one API-model call writes a whole student-teacher conversation (FIRE Fig. 3a, Sec. 3.2).

    python -m fire_jax.make_fire100k --model api:https://api.openai.com/v1#gpt-4o \\
        --input triplets.jsonl --image_root DIR --out fire100k_new.jsonl [--concurrency 16] \\
        [--process_index I --process_count N] [--max_items N] [--max_turns 6]

Inputs: (image, instruction, groundtruth, source) triplets, as plain
``{"id"?, "image", "question", "groundtruth", "source"?}`` objects or FIRE
records (their conversations ignored), JSON array or JSONL
(:func:`fire_jax.data.items.load_triplets`; bad ones counted by reason).

For each triplet the model gets :data:`SYSTEM_PROMPT` and a user message
with the image and :data:`USER_PROMPT` (ours: the paper shows its prompts
only as pictures, Figs. A11-A12) and answers with the whole conversation as
JSON, ``{"turns": [{"thought", "answer", "score", "feedback"}, ...]}``.
:func:`parse_conversation` reads it strictly into FIRE turns: the student's
response ``"Thought: ...\\nAnswer: ..."``, the teacher's feedback
``"Score: N.\\nFeedback: ..."``; the record is then checked with
:func:`fire_jax.data.records.parse_record`. Kept: conversations that parse,
have at most --max_turns (6) turns and whose last score is higher than the
first (the paper's two filters: :func:`fire_jax.data.filters.drop_reason`, the keep/drop rule of FIRE-1M-style
generation too). Every drop is counted by reason (:data:`DROP_REASONS`).

Outputs (``--process_count N`` > 1 writes ``OUT-<i>-of-<N>.jsonl`` per process,
each taking the triplets ``i, i + N, ...``):

- ``OUT``: kept records, in the released raw schema (FIRE-train-100K.json) (``tools/build_dataset.py --json OUT``);
- ``OUT.dropped.jsonl``: {id, source, reason, detail, output} per dropped conversation;
- ``OUT.stats.json`` and ``OUT.stats.png``: per-source yield, drops, Fig. 5 statistics.

Requests go out concurrently (``--concurrency``) with the retries of
:class:`fire_jax.infer.api.ApiBackend`; each result is appended as it comes,
so a killed run loses only the requests in flight and a rerun skips every id
already kept or dropped (a request that still failed, ``api_error``, is
retried by the next run).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import re

from fire_jax.core.cli import run_command
from fire_jax.core.config import resolve_path
from fire_jax.data.chat import Message
from fire_jax.data.items import Item, load_triplets
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.filters import FILTER_REASONS, drop_reason
from fire_jax.data.records import Turn, load_records
from fire_jax.infer.agents import generator
from fire_jax.infer.api import ApiBackend, ApiError
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.dialogue import fire_record
from fire_jax.infer.dialogue import Dialogue
from fire_jax.core.results import ResultStore, write_json

MAX_TURNS = 6  # the paper drops conversations with more turns
#: Why a conversation is not kept: malformed output (not_json, bad_structure, bad_score, empty_text), the
#: generated-conversation filter (:data:`fire_jax.data.filters.FILTER_REASONS`, then a parse_record reason), or a
#: request that failed.
DROP_REASONS = ("not_json", "bad_structure", "bad_score", "empty_text", *FILTER_REASONS, "api_error")

SYSTEM_PROMPT = """You write training conversations for FIRE, a dataset that teaches a vision-language model to \
refine its answers from feedback. You are given an image, a question about it and its groundtruth answer. Write a \
whole conversation between a student (a vision-language model) and a teacher:

1. The student answers the question. Its first answer is plausible but imperfect, the way a real model errs: a \
wrong detail, a miscount, an incomplete or too vague answer. Each student response has a "thought" (its short \
reasoning about the image) and an "answer".
2. The teacher compares the student's answer with the groundtruth in terms of accuracy, relevance, helpfulness \
and level of detail, gives an overall integer "score" from 0 to 10 (higher is better), and writes "feedback": \
polite and specific, saying which parts of the answer are wrong, what is missing and how to improve it. The \
feedback must NOT state the groundtruth answer.
3. The student refines its answer using the feedback, and the teacher scores and comments again. Scores rise as \
the answer improves. Stop when the answer is correct (score 8 or more), after at most {max_turns} student turns.

Reply with JSON only, no other text, in exactly this form (one object per student turn, in order):
{{"turns": [{{"thought": "...", "answer": "...", "score": 4, "feedback": "..."}}, ...]}}"""

USER_PROMPT = "Question: {question}\nGroundtruth: {groundtruth}\n\nWrite the conversation as JSON."

_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.DOTALL)
_TURN_KEYS = {"thought", "answer", "score", "feedback"}


class Malformed(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def parse_conversation(text: str) -> list[Turn]:
    """The FIRE turns of a model's JSON conversation; raises :class:`Malformed` naming the reason.

    Strict: one JSON object (optionally in a single ```json fence) with a non-empty
    ``turns`` list of objects with exactly the keys thought, answer, score (a number
    in 0..10) and feedback (non-empty strings).
    """
    text = text.strip()
    fenced = _FENCE.match(text)
    try:
        data = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as e:
        raise Malformed("not_json", f"{e}; output starts {text[:60]!r}") from None
    turns = data.get("turns") if isinstance(data, dict) else None
    if not isinstance(turns, list) or not turns:
        raise Malformed("bad_structure", "expected an object with a non-empty 'turns' list")
    out = []
    for k, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or set(turn) != _TURN_KEYS:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise Malformed("bad_structure", f"turn {k}: expected keys {sorted(_TURN_KEYS)}, got {keys}")
        score = turn["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 10 \
                or not math.isfinite(score):
            raise Malformed("bad_score", f"turn {k}: score {score!r} is not a number in 0..10")
        texts = [turn[key] for key in ("thought", "answer", "feedback")]
        if not all(isinstance(t, str) for t in texts):
            raise Malformed("bad_structure", f"turn {k}: thought, answer and feedback must be strings")
        if not all(t.strip() for t in texts):
            raise Malformed("empty_text", f"turn {k}: an empty thought, answer or feedback")
        thought, answer, feedback = (" ".join(t.split()) for t in texts)  # one line each: "Score:" stays first
        score = int(score) if float(score).is_integer() else float(score)
        out.append(Turn(f"Thought: {thought}\nAnswer: {answer}", f"Score: {score}.\nFeedback: {feedback}", score))
    return out


def prompt(item: Item) -> list[Message]:
    """The prompt for one triplet, after :data:`SYSTEM_PROMPT`: the image, then the question and groundtruth."""
    return [Message("user", USER_PROMPT.format(question=item.question, groundtruth=item.groundtruth), images=1)]


def to_record(item: Item, output: str, *, image_root: str, split: str, max_turns: int) -> tuple[dict | None, dict | None]:
    """(kept record, None) or (None, drop entry) for one model output."""
    drop = lambda reason, detail: (None, {"id": item.id, "source": item.source, "reason": reason, "detail": detail,
                                          "output": output[:4000]})
    try:
        turns = parse_conversation(output)
    except Malformed as e:
        return drop(e.reason, e.detail)
    record = fire_record(Dialogue(item, turns), split=split, image_root=image_root)
    reason = drop_reason(record, max_turns=max_turns)
    return drop(reason.reason, str(reason)) if reason else (record, None)


def shard_path(out: str, index: int, count: int) -> str:
    if count == 1:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}-{index:05d}-of-{count:05d}{ext or '.jsonl'}"


def make_records(items, backend: ApiBackend, out: str, *, image_root: str, split: str = "fire_100k",
                 max_turns: int = MAX_TURNS, concurrency: int = 16) -> collections.Counter:
    """Ask ``backend`` for a conversation per triplet not yet done, ``concurrency`` at a time, each written as it
    comes; returns this run's api_error count (as a Counter)."""
    from tqdm.auto import tqdm

    failed = collections.Counter()
    with ResultStore(out, key_field="id") as kept, ResultStore(out + ".dropped.jsonl", key_field="id") as dropped:
        todo = [item for item in items if item.id not in kept and item.id not in dropped]
        print(f"FIRE-100K-style generation with {backend.spec}: {len(items)} triplets, {len(items) - len(todo)} "
              f"already done ({len(kept)} kept), {len(todo)} to run", flush=True)
        system = SYSTEM_PROMPT.format(max_turns=max_turns)
        ask = lambda item: backend.generate([item.image], [prompt(item)], system=system)[0]  # retried, counted
        with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool, \
                tqdm(total=len(items), initial=len(items) - len(todo), desc="generate", unit="conversation",
                     dynamic_ncols=True) as progress:
            futures = {pool.submit(ask, item): item for item in todo}
            for future in concurrent.futures.as_completed(futures):
                item = futures[future]
                try:
                    output = future.result()
                except ApiError as e:
                    failed["api_error"] += 1
                    print(f"{item.id}: {e}", flush=True)
                    continue
                record, drop = to_record(item, output, image_root=image_root, split=split, max_turns=max_turns)
                if record:  # written and flushed at once
                    kept.add(record)
                else:
                    dropped.add(drop)
                progress.update(1)
                progress.set_postfix(kept=len(kept))
    return failed


def report(items, out: str, image_root: str, failed: collections.Counter, plot: str) -> dict:
    """Per-source yield, drops by reason and Fig. 5 statistics of ``out`` (read back through the record parser)."""
    from fire_jax.eval.plots import plot_data_statistics

    records, bad = load_records(out, image_root) if os.path.exists(out) else ([], BadRecords())
    with ResultStore(out + ".dropped.jsonl", key_field="id") as dropped:
        drops = collections.Counter(d["reason"] for d in dropped) + failed
        dropped_by_source = collections.Counter(d["source"] for d in dropped)
    kept_by_source = collections.Counter(r.source for r in records)
    per_source = {}
    for source in sorted({item.source for item in items} | set(kept_by_source)):
        done = kept_by_source[source] + dropped_by_source[source]
        per_source[source] = {"triplets": sum(item.source == source for item in items), "done": done,
                              "kept": kept_by_source[source],
                              "yield": kept_by_source[source] / done if done else None}
    statistics = plot_data_statistics(records, plot, title=f"{os.path.basename(out)}: {len(records)} conversations")
    stats = {"per_source": per_source, "dropped": dict(sorted(drops.items())), "read_back_bad_records": dict(bad),
             "statistics": statistics}
    print(f"\n{'source':<20} {'triplets':>8} {'done':>6} {'kept':>6} {'yield':>6}")
    for source, row in per_source.items():
        rate = "-" if row["yield"] is None else f"{100 * row['yield']:.0f}%"
        print(f"{source:<20} {row['triplets']:>8} {row['done']:>6} {row['kept']:>6} {rate:>6}")
    print("\ndropped: " + (", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "none"))
    print(bad.report("read back through fire_jax.data.records, bad records"))
    print(f"\nFig. 5 statistics of {len(records)} kept conversations (plot: {plot}):")
    print(f"  first-turn scores 0..10: {statistics['first_score']}")
    print("  mean score gain by turn: " + ", ".join(f"turn {k}: {v:+.2f} (n={statistics['gain_count'][k]})"
                                                    for k, v in statistics["score_gain"].items()))
    print("  dialogues by turns: " + ", ".join(f"{k}: {v}" for k, v in statistics["turns"].items()))
    write_json(out + ".stats.json", stats, indent=1)
    return stats


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="api:<base_url>#<model> (key from FIRE_JAX_API_KEY / "
                                                       "OPENAI_API_KEY)")
    parser.add_argument("--input", action="append", required=True, help="triplets or FIRE records (repeatable)")
    parser.add_argument("--image_root", required=True, help="the inputs' image paths are relative to it")
    parser.add_argument("--out", required=True, help="JSONL of kept FIRE records")
    parser.add_argument("--split", default="fire_100k", help="the records' split field")
    parser.add_argument("--max_items", type=int, default=0, help="a fixed random subset of this many (0: all)")
    parser.add_argument("--max_turns", type=int, default=MAX_TURNS, help="drop conversations with more turns")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--process_index", type=int, default=0)
    parser.add_argument("--process_count", type=int, default=1)
    parser.add_argument("--max_tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--retries", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="Fig. 5 PNG (default: OUT.stats.png)")
    args = parser.parse_args(argv)
    if not args.model.startswith("api:"):
        parser.error(f"--model {args.model!r}: expected api:<base_url>#<model>")
    if not 0 <= args.process_index < args.process_count:
        parser.error(f"--process_index {args.process_index} must be in [0, --process_count {args.process_count})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    image_root = resolve_path(args.image_root)
    bad = BadRecords()
    items = load_triplets(args.input, image_root, bad=bad, max_examples=args.max_items)
    print(f"{len(items)} triplets from {', '.join(args.input)}")
    print(bad.report("input bad records"))
    items = items[args.process_index::args.process_count]
    out = shard_path(args.out, args.process_index, args.process_count)
    if args.process_count > 1:
        print(f"process {args.process_index} of {args.process_count}: {len(items)} triplets -> {out}")
    sampling = SamplingParams.from_config(args, source="the command line", max_tokens=args.max_tokens)
    backend = generator(args.model, sampling, concurrency=1, retries=args.retries, timeout=args.timeout, seed=args.seed)
    failed = make_records(items, backend, out, image_root=image_root, split=args.split, max_turns=args.max_turns,
                          concurrency=args.concurrency)
    if backend.failures:
        print(f"request failures (retries included): {dict(backend.failures)}")
    return report(items, out, image_root, failed, args.plot or out + ".stats.png")


if __name__ == "__main__":
    run_command(main, "fire_jax.make_fire100k")
