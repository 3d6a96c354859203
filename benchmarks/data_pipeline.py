"""Host input pipeline throughput at LLaVA-NeXT-8B shapes, against what training needs.

    python benchmarks/data_pipeline.py [--batch_size 64] [--batches 3] [--role student]

The full host path (JPEG decode, anyres tiles at 336 px, chat rendering,
tokenisation, batching to [B, 5, 3, 336, 336] + buckets up to 3072 tokens) on
the real FIRE demo conversations (tests/fixtures/fire) with their images
upscaled to photo size (long side 640 px, JPEG q90), with 1 and 2 grain
worker threads / processes. The tokenizer is the tiny BPE (a Llama-3
tokenizer.json is not shipped); it cuts text into more tokens than Llama-3's,
so text costs are, if anything, overstated.

Needed rate: 64 examples per optimizer step (the global batch, FIRE Sec. 5.1). The step time is an
assumption, printed with the table: the brief's ~10 s per step on 8 H100s,
and a FLOP estimate (~64 x 2.8k tokens x 6 x 8e9 params, LoRA + full remat,
40% of 8 x 989 TFLOP/s bf16) of ~2.5 s.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fire_jax.core.config import load_config
from fire_jax.data.images import load_image, tiles  # noqa: E402
from fire_jax.data.pipeline import InputPipeline, Preprocessor, collate  # noqa: E402
from fire_jax.data.records import load_records  # noqa: E402
from fire_jax.data.sources import geometry_from_model_config

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "fire")
STEP_TIMES = {"brief: ~10 s/step on 8 H100": 10.0, "FLOP estimate: ~2.5 s/step": 2.5}
EXAMPLES_PER_STEP = 64


def photo_sized_dataset(out_dir: str) -> str:
    """The fixture records, their images upscaled to a long side of 640 px; returns the JSON path."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    records = []
    for name in ("fire_100k_demo.json", "fire_1m_demo.json"):
        with open(os.path.join(FIXTURES, name)) as f:
            records += json.load(f)
    kept = []
    for record in records:
        src = os.path.join(FIXTURES, "images", record["image"])
        if not os.path.exists(src):
            continue
        image = load_image(src)
        scale = 640 / max(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        record = dict(record, image=os.path.splitext(record["image"])[0] + ".jpg")
        image.save(os.path.join(out_dir, "images", record["image"]), quality=90)
        kept.append(record)
    path = os.path.join(out_dir, "fire_photo_size.json")
    with open(path, "w") as f:
        json.dump(kept, f)
    return path


def stage_times(data, geometry, records_path, image_root, n=40):
    """Per-example milliseconds of each stage, in the calling thread."""
    records, _ = load_records(records_path, image_root)
    records = records[:n]
    pre = Preprocessor(tokenizer_path=data["tokenizer"], geometry=geometry, role=data["role"],
                       max_len=data["max_len"])
    times = {"decode (JPEG -> RGB)": 0.0, "anyres tiles (resize, pad, cut)": 0.0, "render + tokenize": 0.0}
    examples = []
    for record in records:
        t0 = time.perf_counter()
        image = load_image(os.path.join(image_root, record.image))
        image.load()
        t1 = time.perf_counter()
        image_tiles, size = tiles(image, geometry)
        t2 = time.perf_counter()
        encoded = pre.chat.encode(pre.messages(record), size)
        t3 = time.perf_counter()
        times["decode (JPEG -> RGB)"] += t1 - t0
        times["anyres tiles (resize, pad, cut)"] += t2 - t1
        times["render + tokenize"] += t3 - t2
        examples.append({"input_ids": encoded.input_ids[:data["max_len"]],
                         "loss_mask": encoded.loss_mask[:data["max_len"]],
                         "turn_ids": encoded.turn_ids[:data["max_len"]], "tiles": image_tiles,
                         "image_size": np.asarray(size, np.int32), "example_id": record.id})
    examples = [e for e in examples if len(e["input_ids"]) <= data["max_len"]]
    t0 = time.perf_counter()
    collate(examples, batch_size=len(examples), buckets=data["buckets"], pad_id=pre.chat.pad_id,
            image_token_id=pre.chat.image_token_id, geometry=geometry)
    times["batch (normalise, pad, place_images)"] = time.perf_counter() - t0
    return {k: 1e3 * v / len(records) for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=3, help="timed batches per setting (after one warm-up)")
    parser.add_argument("--role", default="student", choices=("student", "teacher"))
    args = parser.parse_args()

    config = load_config(os.path.join(ROOT, "configs", "llava_next_8b.py"))
    geometry = geometry_from_model_config(config.model)
    with tempfile.TemporaryDirectory() as tmp:
        records_path = photo_sized_dataset(tmp)
        image_root = os.path.join(tmp, "images")
        data = dict(tokenizer="assets:tiny_tokenizer.json", image_token="<image>", pad_token="<pad>",
                    role=args.role, teacher_history="full",
                    sources=dict(fire=dict(json=records_path, image_root=image_root)), on_bad_record="skip",
                    max_len=3072, buckets=(1024, 2048, 3072), batch_size=args.batch_size, shuffle=True, seed=0,
                    num_epochs=0, num_threads=0, num_workers=0)
        print(f"LLaVA-NeXT-8B shapes: {geometry.tile_size} px tiles, max_tiles {geometry.max_tiles}, "
              f"max_len {data['max_len']}, batch {args.batch_size}, role {args.role}; "
              f"{os.cpu_count()} CPU cores on this machine")
        print("\nper example, one thread (ms):")
        for stage, ms in stage_times(data, geometry, records_path, image_root).items():
            print(f"  {stage:<38} {ms:7.1f}")

        rows = []
        for label, threads, workers in (("in-thread (no prefetch)", 0, 0), ("1 thread", 1, 0), ("2 threads", 2, 0),
                                        ("1 process", 1, 1), ("2 processes", 1, 2)):
            pipeline = InputPipeline(data, geometry, num_threads=threads, num_workers=workers)
            try:
                next(pipeline)  # warm-up: worker start, first batch
                t0 = time.perf_counter()
                for _ in range(args.batches):
                    batch = next(pipeline)
                elapsed = time.perf_counter() - t0
            finally:
                pipeline.close()
            examples = args.batches * args.batch_size
            rows.append((label, examples / elapsed, args.batches / elapsed))
        shape = "x".join(map(str, batch["pixel_values"].shape))
        print(f"\nfull host pipeline (last batch: input_ids {batch['input_ids'].shape}, pixel_values {shape}):")
        print(f"  {'setting':<26} {'examples/s':>11} {'batches/s':>10}")
        for label, ex_s, b_s in rows:
            print(f"  {label:<26} {ex_s:11.1f} {b_s:10.3f}")
        print(f"\nneeded for training ({EXAMPLES_PER_STEP} examples per step):")
        best = max(r[1] for r in rows)
        for label, step_s in STEP_TIMES.items():
            need = EXAMPLES_PER_STEP / step_s
            print(f"  {label:<34} {need:6.1f} examples/s   best setting here gives {best / need:5.1f}x that")
        if pipeline.dropped:
            print("\n" + pipeline.report())


if __name__ == "__main__":
    main()
