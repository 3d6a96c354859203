"""The main job: the FIRE pipeline end to end on the built-in default, a small LLaVA-NeXT on the pretrained
SmolLM2-135M-Instruct (or, by config, the from-scratch tiny model or LLaVA-NeXT-8B).

    python -m fire_jax.run                                              # SmolLM2 LLaVA, synthetic data, CPU
    python -m fire_jax.run --config configs/main_job.py:tiny --workdir runs/tiny
    python -m fire_jax.run --config configs/main_job.py:8b --workdir DIR
    python -m fire_jax.run --config.student_train.train.total_steps=50  # any field overridable

Trains the teacher (FD) and the student (FIRE), evaluates the untrained baseline and the trained student in
fixed and free dialogues, and prints the tables and the paths of the plots (see fire_jax/stages/main_job.py).
"""

import os

from absl import flags

from fire_jax.core.cli import define_config_flag, run_absl
from fire_jax.core.config import CONFIGS_DIR

_CONFIG = define_config_flag(__name__, "fire_jax.run", os.path.join(CONFIGS_DIR, "main_job.py"),
                             "the main job's config (configs/main_job.py)", kind="base_train")
_WORKDIR = flags.DEFINE_string("workdir", "runs/smollm2", "where models, evaluations and the summary go")


def main(argv):
    del argv
    from absl import logging

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
    from fire_jax.stages.main_job import run

    run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    run_absl(main, "fire_jax.run")
