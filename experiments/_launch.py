"""Shared flags of the experiment launchers: ``--size tiny|8b``, ``--workdir``, ``--steps`` (tiny smoke runs)."""

import argparse
import os

from fire_jax.data.config import load_config

PIPELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "pipeline.py")


def parse(description: str, default_workdir: str, **extra) -> tuple[argparse.Namespace, object]:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "8b"), default="tiny", help="tiny: CPU smoke run; 8b: the paper")
    parser.add_argument("--workdir", default=default_workdir)
    parser.add_argument("--steps", type=int, default=0, help="training steps per model (0: the config's)")
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name}", **kwargs)
    args = parser.parse_args()
    config = load_config(f"{PIPELINE}:{args.size}")
    if args.steps:
        for stage in ("base_train", "teacher_train", "student_train"):
            if config.get(stage):
                config[stage].train.total_steps = args.steps
    return args, config
