"""Data-size ablation (Fig. 6): students on FIRE-100K plus 200K..1000K of FIRE-1M (source ``fire_1m`` of
configs/fire.py, LLaVA-665K mixed in unchanged), each in free dialogues.

    python experiments/data_size_ablation.py                           # tiny: 240 and 720 synthetic dialogues
    python experiments/data_size_ablation.py --size 8b --workdir /runs/ablation
Writes WORKDIR/fig6.json (AT, ADR, ATR, RR per size) and fig6.png (the four panels).
"""

from _launch import parse

from fire_jax.pipeline.main_job import data_size_ablation

SIZES = {"tiny": [240, 720], "8b": [200_000, 400_000, 600_000, 800_000, 1_000_000]}

if __name__ == "__main__":
    args, config = parse(__doc__, "runs/ablation", sizes=dict(default="", help="comma-separated sizes"))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES[args.size]
    data_size_ablation(config, args.workdir, sizes)
