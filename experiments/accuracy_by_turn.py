"""Fig. 7 for several students on one plot, from their free-dialogue results.

    python experiments/accuracy_by_turn.py --out fig7.png \
        baseline=runs/fire_llava/eval/baseline_free/results.json FIRE=runs/fire_llava/eval/fire_free/results.json
"""

import argparse

from fire_jax.core.results import read_json_object
from fire_jax.eval.plots import plot_accuracy_by_turn
from fire_jax.eval.report import paper_results


def accuracy_curves(results_files: dict[str, str], out_path: str) -> dict[str, list]:
    """Fig. 7 for several students: each free-dialogue ``results.json`` is one curve on the same plot."""
    curves = {name: read_json_object(path)["metrics"]["overall"]["accuracy_by_turn"]
              for name, path in results_files.items()}
    plot_accuracy_by_turn(curves, out_path, paper=paper_results()["figure7_accuracy_by_turn"])
    print(f"wrote {out_path}")
    return curves


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=PATH/results.json of a free-dialogue evaluation")
    parser.add_argument("--out", default="fig7.png")
    args = parser.parse_args()
    accuracy_curves(dict(run.split("=", 1) for run in args.runs), args.out)
