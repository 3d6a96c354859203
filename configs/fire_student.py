# FIRE-LLaVA: the student on FIRE-100K + FIRE-1M (8B). Options as in configs/fire.py, e.g. released=True:
#   python -m fire_jax.train --config configs/fire_student.py --workdir DIR
#   python -m fire_jax.train --config configs/fire_student.py:released=True --workdir DIR
#   python -m fire_jax.train --config configs/fire_student.py:base=llava_15_vicuna_7b --workdir DIR   (Table A6)
#   python -m fire_jax.train --config configs/fire_student.py:base=llava_next_vicuna_7b --workdir DIR   (Table A5)
"""FIRE-LLaVA: the student on FIRE-100K + FIRE-1M."""

import os

from fire_jax.core.config import load_config


def get_config(arg: str = ""):
    here = os.path.dirname(os.path.abspath(__file__))
    return load_config(os.path.join(here, "fire.py") + ":" + ",".join(p for p in ("fire_student", arg) if p))
