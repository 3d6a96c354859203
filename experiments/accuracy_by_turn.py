"""Fig. 7 for several students on one plot, from their free-dialogue results.

    python experiments/accuracy_by_turn.py --out fig7.png \
        baseline=runs/fire_llava/eval/baseline_free/results.json FIRE=runs/fire_llava/eval/fire_free/results.json
"""

import argparse

from fire_jax.pipeline.main_job import accuracy_curves

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=PATH/results.json of a free-dialogue evaluation")
    parser.add_argument("--out", default="fig7.png")
    args = parser.parse_args()
    accuracy_curves(dict(run.split("=", 1) for run in args.runs), args.out)
