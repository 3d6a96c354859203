"""The main job's SmolLM2 training stages on the CPU: layers scanned or unrolled, batches shuffled or grouped by length.

    python benchmarks/main_job_steps.py                      # base, teacher and student (about 6 minutes on 2 cores)
    python benchmarks/main_job_steps.py --stages teacher --steps 5

For each stage of ``configs/main_job.py`` (its model, LoRA, trainable parts, batch and buckets; the fetched
SmolLM2-135M-Instruct GGUF under a random vision tower: the weights do not change the time), the stage's first
batch from its own input pipeline, stepped with the 30 LLM layers stored stacked and run as one ``lax.scan``
(``model.scan_layers=True``) and as a list (``False``), both in this run: the first step's seconds (compiling
included) and the best of 2 means over ``--steps`` steps. Then, for every stage, the padded columns of all its
batches with the shuffled order and with ``data.group_by_length`` (the pipeline alone, no model): the fraction of
them that holds real tokens, which a step's time follows. The machine's float32 matmul rate is printed first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from fire_jax.core.config import load_config  # noqa: E402
from fire_jax.core.machine import matmul_rate  # noqa: E402
from fire_jax.data.pipeline import InputPipeline  # noqa: E402
from fire_jax.models.config import LlavaNextConfig  # noqa: E402

STAGES = {"base": "base_train", "teacher": "teacher_train", "student": "student_train"}


def stage_config(stage: str):
    config = load_config(os.path.join(ROOT, "configs", "main_job.py"))[STAGES[stage]]
    config.init.vision_tower = ""  # the CLIP stage's tower in the job; a random one here (same shapes)
    return config


def pipeline(config, **overrides) -> InputPipeline:
    geometry = LlavaNextConfig.from_dict(config.model).geometry
    return InputPipeline(config.data, geometry, image_token_id=config.model.image_token_id,
                         student_first_turn=config.loss.get("student_first_turn", False), **overrides)


def step_times(stage: str, scan_layers: bool, steps: int) -> dict:
    from fire_jax.weights.build import build_model
    from fire_jax.weights.sharding import make_mesh, put_batch
    from fire_jax.train.step import Trainer

    config = stage_config(stage)
    config.model.scan_layers = scan_layers
    mesh = make_mesh(tuple(config.mesh.shape))
    rules = tuple((name, tuple(axes)) for name, axes in config.mesh.rules)
    model = build_model(config)
    data = pipeline(config)
    batch = put_batch(next(data), mesh, rules)
    data.close()
    trainer = Trainer(model, config.train, config.loss, config.train.total_steps, mesh, rules)
    del model
    state, rng = trainer.initial_state, jax.random.key(0)

    def step():
        nonlocal state
        state, metrics = trainer.step(state, batch, rng)
        jax.block_until_ready(metrics)

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return {"shape": tuple(batch["input_ids"].shape), "first": first, "step": best}


def fill(stage: str, group_by_length: int) -> tuple[int, int, int]:
    """Real tokens, padded columns and distinct shapes over the stage's batches."""
    config = stage_config(stage)
    data = pipeline(config, group_by_length=group_by_length)
    real = padded = 0
    shapes = set()
    for _ in range(config.train.total_steps):
        batch = next(data)
        real += int(batch["attention_mask"].sum())
        padded += batch["attention_mask"].size
        shapes.add(batch["input_ids"].shape)
    data.close()
    return real, padded, len(shapes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="base,teacher,student", help="comma-separated: base, teacher, student")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat (2 repeats, the best kept)")
    args = parser.parse_args()
    stages = args.stages.split(",")
    print(f"float32 matmul: {matmul_rate() / 1e9:.0f} GFLOP/s; load average {os.getloadavg()[0]:.2f}")
    print("| stage | batch | layers | first step s (compile incl.) | s / step | unrolled / scanned |")
    print("|---|---|---|---:|---:|---:|")
    for stage in stages:
        scanned = step_times(stage, True, args.steps)
        unrolled = step_times(stage, False, args.steps)
        for name, row in (("scanned", scanned), ("unrolled", unrolled)):
            ratio = f"{unrolled['step'] / scanned['step']:.2f}" if name == "unrolled" else ""
            print(f"| {stage} | {row['shape'][0]} x {row['shape'][1]} | {name} | {row['first']:.1f} | "
                  f"{row['step']:.2f} | {ratio} |", flush=True)
    print("\n| stage | data.group_by_length | real tokens | padded columns | filled | shapes |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage in stages:
        configured = int(stage_config(stage).data.get("group_by_length", 0))
        for window in sorted({0, configured or 8}):
            real, padded, shapes = fill(stage, window)
            mark = " (configured)" if window == configured else ""
            print(f"| {stage} | {window}{mark} | {real:,} | {padded:,} | {real / padded:.2f} | {shapes} |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
