# FIRE100K-LLaVA: the student on FIRE-100K (8B). Options as in configs/fire.py, e.g. released=True:
#   python -m fire_jax.train --config configs/fire100k_student.py --workdir DIR
#   python -m fire_jax.train --config configs/fire100k_student.py:released=True --workdir DIR
"""FIRE100K-LLaVA: the student on FIRE-100K."""

import os

from fire_jax.core.config import load_config


def get_config(arg: str = ""):
    here = os.path.dirname(os.path.abspath(__file__))
    return load_config(os.path.join(here, "fire.py") + ":" + ",".join(p for p in ("fire100k_student", arg) if p))
