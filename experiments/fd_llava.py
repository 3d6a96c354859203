"""FD-LLaVA (Table 3): train the teacher on FIRE-100K (+ LLaVA-665K at 8B), evaluate its feedback and scores.

    python experiments/fd_llava.py                                     # tiny smoke run on CPU
    python experiments/fd_llava.py --size 8b --workdir /runs/fd_llava
"""

import os

from _launch import parse

from fire_jax.stages.main_job import base_and_teacher, eval_stage

if __name__ == "__main__":
    args, config = parse(__doc__, "runs/fd_llava")
    baseline, fd = base_and_teacher(config, args.workdir)  # fd: the trained teacher's agent spec
    config.eval_fixed.fixed.roles = ("teacher",)
    out = os.path.join(args.workdir, "eval")
    eval_stage(config.eval_fixed, os.path.join(out, "baseline_fixed"), student=baseline,
               teacher=dict(baseline, name=f"{baseline['name']} teacher"))
    eval_stage(config.eval_fixed, os.path.join(out, "fd_fixed"), student=baseline, teacher=fd)
