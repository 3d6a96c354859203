"""Shared flags of the experiment launchers: ``--size tiny|8b``, ``--workdir``, ``--steps`` (tiny smoke runs),
``--options`` (8b: configs/fire.py options for every trained model, e.g. ``llava_n=100000`` or ``released=True``;
by default LLaVA-665K is mixed in whole, as the paper did)."""

import argparse
import os

from fire_jax.core.config import load_config

PIPELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "main_job.py")


def parse(description: str, default_workdir: str, **extra) -> tuple[argparse.Namespace, object]:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "8b"), default="tiny", help="tiny: CPU smoke run; 8b: the paper")
    parser.add_argument("--workdir", default=default_workdir)
    parser.add_argument("--steps", type=int, default=0, help="training steps per model (0: the config's)")
    parser.add_argument("--options", default="", help="8b: configs/fire.py options, e.g. llava_n=100000,released=True "
                        "(default: all of LLaVA-665K mixed in, the paper's recipe)")
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name}", **kwargs)
    args = parser.parse_args()
    if args.options and args.size != "8b":
        parser.error("--options applies to --size 8b (the tiny run trains on the synthetic set)")
    config = load_config(f"{PIPELINE}:{args.size}" + (f",{args.options}" if args.options else ""))
    if args.steps:
        for stage in ("base_train", "teacher_train", "student_train"):
            if config.get(stage):
                config[stage].train.total_steps = args.steps
    return args, config
