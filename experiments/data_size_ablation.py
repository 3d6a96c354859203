"""Data-size ablation (Fig. 6): students on FIRE-100K plus 200K..1000K of FIRE-1M (source ``fire_1m`` of
configs/fire.py, LLaVA-665K mixed in unchanged), each in free dialogues.

    python experiments/data_size_ablation.py                           # tiny: 240 and 720 synthetic dialogues
    python experiments/data_size_ablation.py --size 8b --workdir /runs/ablation
Writes WORKDIR/fig6.json (AT, ADR, ATR, RR per size) and fig6.png (the four panels).
"""

import json
import os

import ml_collections
from _launch import parse

from fire_jax.core.results import write_json
from fire_jax.stages.main_job import base_and_teacher, eval_stage, train_and_report

SIZES = {"tiny": [240, 720], "8b": [200_000, 400_000, 600_000, 800_000, 1_000_000]}


def data_size_ablation(config, workdir: str, sizes: list[int]) -> list[dict]:
    """Fig. 6: one student per training-set size (``max_examples`` of the source ``config.ablation_source``:
    FIRE-1M at 8B, the synthetic set at tiny scale), each in free dialogues with the same FD teacher; AT
    normalised by the baseline. Writes ``fig6.json`` and ``fig6.png``; each point records the examples its
    student's data pipeline actually read (``examples``) beside the requested ``size``."""
    from fire_jax.eval.plots import plot_data_size_ablation

    source = config.ablation_source
    if source not in config.student_train.data.sources:
        raise ValueError(f"ablation_source {source!r} is not a source of the student's data "
                         f"({sorted(config.student_train.data.sources)})")
    baseline, fd = base_and_teacher(config, workdir)
    out = os.path.join(workdir, "eval")
    eval_stage(config.eval_free, os.path.join(out, "baseline_free"), student=baseline, teacher=fd)
    baseline_results = os.path.join(out, "baseline_free", "results.json")
    points = []
    for size in sizes:
        student = ml_collections.ConfigDict(config.student_train.to_dict())
        student.data.sources[source].max_examples = size
        student.data.sources[source].num_examples = size
        trained = train_and_report(student, os.path.join(workdir, f"student_{size}"), f"student on {size} dialogues")
        spec = dict(name=f"FIRE {size}", init=baseline["init"], adapter=trained["workdir"])
        result = eval_stage(config.eval_free, os.path.join(out, f"student_{size}_free"), student=spec, teacher=fd,
                            baseline_results=baseline_results)
        overall = result["metrics"]["overall"]
        points.append({"size": size, "source": source, "examples": trained["source_sizes"].get(source),
                       "steps": trained["step"],
                       **{k: overall.get(k) for k in ("AT", "ADR", "ATR", "RR", "K")}})
    write_json(os.path.join(workdir, "fig6.json"), points)
    plot_data_size_ablation(points, os.path.join(workdir, "fig6.png"), title="data-size ablation (Fig. 6)")
    print(json.dumps(points, indent=2))
    print(f"wrote {workdir}/fig6.json, fig6.png")
    return points


if __name__ == "__main__":
    args, config = parse(__doc__, "runs/ablation", sizes=dict(default="", help="comma-separated sizes"))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES[args.size]
    data_size_ablation(config, args.workdir, sizes)
