"""FIRE-LLaVA (Tables 2-6): train FD-LLaVA and FIRE-LLaVA (FIRE-100K + FIRE-1M, each with LLaVA-665K at 8B as the
paper did; ``--options llava_n=N`` or ``llava_ratio=R`` sets how much), evaluate against the baseline.

    python experiments/fire_llava.py                                   # tiny smoke run on CPU (~5 min)
    python experiments/fire_llava.py --size 8b --workdir /runs/fire_llava
"""

from _launch import parse

from fire_jax.stages.main_job import run

if __name__ == "__main__":
    args, config = parse(__doc__, "runs/fire_llava")
    run(config, args.workdir)
