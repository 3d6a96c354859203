"""FIRE100K-LLaVA (Tables 2, 4-6): the student on FIRE-100K (+ LLaVA-665K at 8B), evaluated with FD-LLaVA.

    python experiments/fire100k_llava.py                                # tiny smoke run on CPU
    python experiments/fire100k_llava.py --size 8b --workdir /runs/fire100k_llava
    python experiments/fire100k_llava.py --size 8b --options llava_n=0 --workdir /runs/fire100k_only  # FIRE alone
"""

import os

from _launch import parse

from fire_jax.core.config import load_config
from fire_jax.stages.main_job import run

if __name__ == "__main__":
    args, config = parse(__doc__, "runs/fire100k_llava")
    if args.size == "8b":
        configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
        config.student_train = load_config(os.path.join(configs, "fire100k_student.py") + f":{args.options}")
    run(config, args.workdir)
