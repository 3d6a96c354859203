"""python -m fire_jax.serve: an OpenAI-compatible chat server over the continuous-batching engine
(:mod:`fire_jax.serving.server`)."""

from fire_jax.core.cli import run_command
from fire_jax.serving.server import main

if __name__ == "__main__":
    run_command(main, "fire_jax.serve")
