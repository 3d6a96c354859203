"""Evaluate a fire_jax model on VLRMBench (Ruan et al., 2025; docs/vlrmbench.md).

    python -m fire_jax.evaluate_vlrm --config configs/eval_vlrm.py --data_dir DIR [--image_root DIR] \\
        [--tasks SC,IC,...] [--workdir OUT] [--retry_failed] [--config.generate.batch_size=8 ...] \\
        [--analyses=positional,voting,shots,length,correction]

Runs the chosen tasks (default: all 12, or config.vlrm.tasks), appending each
sample's raw outputs to OUT/outputs/<task>.jsonl (a rerun resumes), then
writes OUT/results.json and OUT/results.md (Table 3 of the VLRMBench paper,
the paper's rows beside ours) and prints the table. --analyses then runs
the paper's analyses (Tables 4-7, Fig. 4), each writing OUT/analyses/<name>.md
and .json and resuming like the tasks (fire_jax/vlrmbench/analyses.py). See
fire_jax/vlrmbench/runner.py for how prompts, images and the judge work.
"""

import os

from absl import flags

from fire_jax.core.cli import define_config_flag, run_absl
from fire_jax.core.config import CONFIGS_DIR

_CONFIG = define_config_flag(__name__, "fire_jax.evaluate_vlrm", os.path.join(CONFIGS_DIR, "eval_vlrm.py"),
                             "config file (get_config(arg)); path:arg", kind="vlrm")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "folder with the task files <task>.jsonl", required=True)
_IMAGE_ROOT = flags.DEFINE_string("image_root", None, "the records' image paths are relative to it (default: --data_dir)")
_TASKS = flags.DEFINE_string("tasks", None, "comma-separated tasks, short or file names (default: config.vlrm.tasks)")
_WORKDIR = flags.DEFINE_string("workdir", "vlrm_eval", "outputs, results.json and results.md go here")
_ANALYSES = flags.DEFINE_string("analyses", None, "comma-separated paper analyses to run after the tasks: "
                                "positional, voting, shots, length, correction (or all)")
_RETRY_FAILED = flags.DEFINE_bool("retry_failed", False, "generate again the samples whose earlier generation failed")


def main(argv):
    del argv
    from absl import logging

    from fire_jax.vlrmbench.suite import evaluate

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # no INFO lines between the progress bars

    evaluate(_CONFIG.value, _DATA_DIR.value, _WORKDIR.value, image_root=_IMAGE_ROOT.value, tasks=_TASKS.value,
             retry_failed=_RETRY_FAILED.value, analyses=_ANALYSES.value)


if __name__ == "__main__":
    run_absl(main, "fire_jax.evaluate_vlrm")
