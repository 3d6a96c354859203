"""Sequence lengths of the shipped real FIRE records at 8B: Llama 3's tokenizer, LLaVA-NeXT-8B's image tokens.

    python tools/fire_lengths.py                         # builds the tokenizer if needed (tools/llama3_tokenizer.py)
    python tools/fire_lengths.py --max_len 2048,3072,4096 --json lengths.json

For the 189 records of tests/fixtures/fire (the public FIRE demo subset, 94 of FIRE-100K and 95 of FIRE-1M), the
student and the teacher training sequence of each (FIRE Eqs. 5-6: chat template, labels on r_i, i >= 2 / on every f_i),
with the image at its original size (tests/fixtures/fire/original_sizes.json) as ``anyres`` tiles or as one
``pad`` tile. Prints percentiles and, per max_len, how many sequences are cut and how many lose every label
(dropped as ``no_labelled_token``, or ``image_cut``), and the labelled tokens cut away.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "fire")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Length:
    record: str
    role: str
    image_mode: str
    tokens: int  # whole sequence, image tokens included
    image_end: int  # position after the image block
    labelled: np.ndarray  # positions of labelled tokens


def sequence_lengths(tokenizer_path: str) -> tuple[list[Length], dict[str, int]]:
    """Every record x role x image mode; and the records skipped, by reason."""
    from fire_jax.data.chat import ChatTokenizer, training_messages
    from fire_jax.core.config import load_config
    from fire_jax.data.sources import geometry_from_model_config
    from fire_jax.data.bad_records import BadRecords
    from fire_jax.data.records import load_records

    with open(os.path.join(FIXTURES, "original_sizes.json")) as f:
        sizes = json.load(f)
    model = load_config(os.path.join(ROOT, "configs", "llava_next_8b.py")).model
    out, bad = [], BadRecords()
    files = [os.path.join(FIXTURES, name) for name in ("fire_100k_demo.json", "fire_1m_demo.json")]
    for mode in ("anyres", "pad"):
        model.image_mode = mode
        chat = ChatTokenizer.from_file(tokenizer_path, geometry_from_model_config(model))
        for role in ("student", "teacher"):
            records, skipped = load_records(files, os.path.join(FIXTURES, "images"), require_scores=role == "teacher")
            if mode == "anyres" and role == "student":
                bad.merge(skipped)
            for record in records:
                size = sizes[os.path.basename(record.image)]
                encoded = chat.encode(training_messages(record, role), size)
                out.append(Length(record.id, role, mode, len(encoded), encoded.image_start + encoded.image_tokens,
                                  np.flatnonzero(encoded.loss_mask)))
    return out, dict(bad)


def summary(lengths: list[Length], max_lens: list[int]) -> list[dict]:
    """Per (role, image mode): percentiles, and per max_len the sequences cut / left with no label."""
    rows = []
    for role in ("student", "teacher"):
        for mode in ("anyres", "pad"):
            group = [x for x in lengths if x.role == role and x.image_mode == mode]
            tokens = np.array([x.tokens for x in group])
            row = dict(role=role, image_mode=mode, n=len(group), min=int(tokens.min()),
                       median=int(np.median(tokens)), p90=int(np.percentile(tokens, 90)),
                       p99=int(np.percentile(tokens, 99)), max=int(tokens.max()), cut={}, lose_labels={},
                       labels_cut={})
            total_labels = sum(len(x.labelled) for x in group)
            for m in max_lens:
                row["cut"][m] = int((tokens > m).sum())
                row["lose_labels"][m] = sum(x.image_end > m or not (x.labelled < m).any() for x in group)
                row["labels_cut"][m] = round(sum(int((x.labelled >= m).sum()) for x in group) / total_labels, 4)
            rows.append(row)
    return rows


def markdown(rows: list[dict], max_lens: list[int]) -> str:
    head = ("| role | image | n | median | p90 | p99 | max | " +
            " | ".join(f"cut / no label at {m}" for m in max_lens) + " |")
    lines = [head, "|" + "---|" * (7 + len(max_lens))]
    for r in rows:
        lines.append(f"| {r['role']} | {r['image_mode']} | {r['n']} | {r['median']} | {r['p90']} | {r['p99']} | "
                     f"{r['max']} | " + " | ".join(f"{r['cut'][m]} / {r['lose_labels'][m]}" for m in max_lens) + " |")
    return "\n".join(lines)


def main():
    import llama3_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a Llama-3 tokenizer.json (default: build it, tools/llama3_tokenizer.py)")
    parser.add_argument("--max_len", default="2048,3072,4096", help="comma-separated max_len values to report")
    parser.add_argument("--json", help="write the summary rows here")
    args = parser.parse_args()
    try:
        max_lens = [int(m) for m in args.max_len.split(",")]
    except ValueError:
        parser.error(f"argument --max_len: expected comma-separated integers, got {args.max_len!r}")
    if not max_lens or min(max_lens) < 1:
        parser.error(f"argument --max_len: expected positive integers, got {args.max_len!r}")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        parser.error(f"argument --tokenizer: {args.tokenizer!r} is not a file")
    lengths, bad = sequence_lengths(args.tokenizer or llama3_tokenizer.build())
    rows = summary(lengths, max_lens)
    print(f"records: {len({x.record for x in lengths})} ({', '.join(f'{k} {v}' for k, v in bad.items())} skipped)")
    print(markdown(rows, max_lens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line("fire_lengths")(main)()
