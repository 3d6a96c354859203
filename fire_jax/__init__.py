"""fire_jax: FIRE (feedback-refinement) for vision-language models in JAX/Flax NNX."""

__version__ = "0.1.0"
