"""Inference: the engine (the one decode loop), its samplers and prefix cache, ``generate`` over it, the backends
(in process and endpoints) and the one factory of a backend from a model spec."""

from fire_jax.infer.decode import Generation, generate
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.forward import forward_logits
from fire_jax.infer.sampling import SamplingParams

__all__ = ["EngineConfig", "Generation", "SamplingParams", "generate", "forward_logits"]
