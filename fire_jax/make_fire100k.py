"""FIRE-100K-style data: one API-model call writes a whole student-teacher conversation (FIRE Fig. 3a, Sec. 3.2).

    python -m fire_jax.make_fire100k --model api:https://api.openai.com/v1#gpt-4o \\
        --input triplets.jsonl --image_root DIR --out fire100k_new.jsonl [--concurrency 16] \\
        [--process_index I --process_count N] [--max_items N] [--max_turns 6]

Inputs: (image, instruction, groundtruth, source) triplets, as plain
``{"id"?, "image", "question", "groundtruth", "source"?}`` objects or FIRE
records (their conversations ignored), JSON array or JSONL
(:func:`fire_jax.data.items.load_triplets`; bad ones counted by reason).

For each triplet (:mod:`fire_jax.dialogue.fire100k`: its prompts, parser and
writer) the model gets :data:`SYSTEM_PROMPT` and a user message
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
import os

from fire_jax.core.cli import run_command
from fire_jax.core.config import resolve_path
from fire_jax.core.results import ResultStore, write_json
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.items import load_triplets
from fire_jax.data.records import load_records
from fire_jax.dialogue.fire100k import MAX_TURNS, make_records
from fire_jax.infer.factory import generator
from fire_jax.infer.sampling import SamplingParams


def shard_path(out: str, index: int, count: int) -> str:
    if count == 1:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}-{index:05d}-of-{count:05d}{ext or '.jsonl'}"


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
