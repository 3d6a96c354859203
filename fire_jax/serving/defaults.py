"""What the server and the demo run when no model is named: the main job's trained student and teacher when a
run of it is in the working directory, else a random tiny model."""

from __future__ import annotations

import os

#: What ``python -m fire_jax.serve`` serves without --model: the main job's run (``runs/smollm2``, its default, then
#: ``runs/tiny``), the first one trained.
MAIN_JOB_RUNS = ("runs/smollm2", "runs/tiny")


def default_models(root: str = ".") -> tuple[dict[str, str | None], str | None, str]:
    """({name: checkpoint or None (random)}, base init or None, why) for a run without --model."""
    for run in MAIN_JOB_RUNS:
        paths = {role: os.path.join(root, run, role) for role in ("student", "teacher")}
        found = {role: path for role, path in paths.items() if os.path.isdir(path)}
        if found:
            base = os.path.join(root, run, "base", "export", "hf_merged")
            return found, base if os.path.isdir(base) else None, \
                f"the main job's trained models under {os.path.join(root, run)}"
    return {"tiny-random": None}, None, (f"a random tiny model (no main job run under "
                                         f"{' or '.join(os.path.join(root, r) for r in MAIN_JOB_RUNS)})")
