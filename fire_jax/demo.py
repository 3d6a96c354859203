"""python -m fire_jax.demo: the feedback chat in a browser: the student answers, you or the teacher give feedback,
the student refines (:mod:`fire_jax.serving.demo`)."""

from fire_jax.core.cli import run_command
from fire_jax.serving.demo import main

if __name__ == "__main__":
    run_command(main, "fire_jax.demo")
