"""Build one split of the FIRE tensorflow-datasets dataset (array_record, no TensorFlow).

    python tools/build_dataset.py --json FIRE-train-100K.json --image_root /data/fire/images \
        --split fire_100k --out /data/tfds

writes <out>/fire/<split>/1.0.0/ and prints the examples per source and the
bad records skipped, by reason (or stops at the first one with
--on_bad_record error). Splits: fire_100k, fire_1m, fire_bench, instruct (LLaVA-665K-style
records), or any other name. A split already built is not rebuilt; its saved counts are printed.
"""

import argparse

from fire_jax.core.cli import existing_dir, input_errors_end_in_one_line
from fire_jax.data import tfds_fire
from fire_jax.data.bad_records import BadRecords


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="append", required=True, help="JSON or JSONL file (repeatable)")
    parser.add_argument("--image_root", required=True, type=existing_dir, help="directory the records' image paths are relative to")
    parser.add_argument("--split", required=True, help=f"split name, e.g. {', '.join(tfds_fire.SPLITS)}")
    parser.add_argument("--out", required=True, help="TFDS data directory")
    parser.add_argument("--on_bad_record", choices=("skip", "error"), default="skip")
    args = parser.parse_args()
    builder = tfds_fire.build(args.json, args.image_root, args.split, args.out, on_bad_record=args.on_bad_record)
    saved = tfds_fire.metadata(args.out, args.split)
    sources = saved.get("source_counts", {})
    print(f"\nsplit {args.split}: {sum(sources.values())} examples -> {tfds_fire.dataset_dir(args.out, args.split)}")
    for source, count in sorted(sources.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {source:<18} {count:>8}")
    # A fresh build knows the first offender of each reason; a split built earlier only its counts.
    bad = builder.bad if builder.source_counts else BadRecords(saved.get("bad_records", {}))
    print(bad.report(f"split {args.split}: bad records skipped"))


if __name__ == "__main__":
    input_errors_end_in_one_line("build_dataset")(main)()
