"""Evaluate a student and a teacher on FIRE-Bench (FIRE Tables 2-6, Fig. 7), or plot a FIRE split's statistics.

    python -m fire_jax.evaluate --config configs/eval_fixed.py [--workdir OUT] [--config.student.adapter=DIR ...]
    python -m fire_jax.evaluate --config configs/eval_free.py [--workdir OUT] [--config.free.baseline_results=...]
    python -m fire_jax.evaluate --data_stats FIRE-train-100K.json [--image_root DIR] [--workdir OUT]
    python -m fire_jax.evaluate --vqa gqa.jsonl --image_root DIR --benchmark GQA --config configs/eval_fixed.py:8b

The first two run fixed dialogues (Tables 2-3) or free dialogues (Tables
4-6, Fig. 7) as ``config.setting`` says, appending every finished turn or
dialogue to OUT/<setting>_outputs.jsonl (a rerun resumes), then write
OUT/results.json, OUT/results.md (the paper's rows beside ours) and PNG plots.
``--data_stats`` plots Fig. 5 (first-turn scores, score gain per turn, turns
per dialogue) of any FIRE records file to OUT/data_statistics.png; with
``--image_root`` records whose image is missing are counted and left out.
``--vqa`` scores ``config.student``'s single-turn answers on a JSONL of {image, question, answers} (Table 1's
forgetting check, resumable, the paper's row for ``--benchmark`` beside ours; fire_jax/eval/vqa.py).
See fire_jax/eval/fire_bench.py.
"""

from __future__ import annotations

import os

from absl import flags

from fire_jax.core.cli import define_config_flag, run_absl
from fire_jax.core.config import CONFIGS_DIR

_CONFIG = define_config_flag(__name__, "fire_jax.evaluate", os.path.join(CONFIGS_DIR, "eval_fixed.py"),
                             "config file (get_config(arg)); path:arg", kind="setting")
_WORKDIR = flags.DEFINE_string("workdir", "fire_eval", "outputs, results.json, results.md and plots go here")
_DATA_STATS = flags.DEFINE_string("data_stats", None, "plot the statistics of this FIRE records file (JSON/JSONL) "
                                  "instead of evaluating")
_IMAGE_ROOT = flags.DEFINE_string("image_root", None, "with --data_stats: check the records' images under it; "
                                  "with --vqa: the images' root")
_VQA = flags.DEFINE_string("vqa", None, "score single-turn answers of config.student on this JSONL of "
                           "{image, question, answers[, choices]} (Table 1)")
_BENCHMARK = flags.DEFINE_string("benchmark", "", "with --vqa: the Table 1 column to print the paper's rows of "
                                 "(GQA, VQAv2, VizWiz, TextVQA, SQA-IMG, MMBench)")


def main(argv):
    del argv
    from absl import logging

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # jax and matplotlib log at INFO
    from fire_jax.eval.fire_bench import evaluate, split_statistics

    if _VQA.value:
        from fire_jax.eval.vqa import evaluate_vqa

        evaluate_vqa(_CONFIG.value, _VQA.value, _WORKDIR.value, image_root=_IMAGE_ROOT.value or "",
                     benchmark=_BENCHMARK.value)
    elif _DATA_STATS.value:
        split_statistics(_DATA_STATS.value, _WORKDIR.value, _IMAGE_ROOT.value)
    else:
        evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    run_absl(main, "fire_jax.evaluate")
