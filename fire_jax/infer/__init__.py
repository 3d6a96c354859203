"""Inference: the engine (the one decode loop), its samplers and prefix cache, ``generate`` over it, and the
student / teacher agents."""

from fire_jax.infer.agents import Feedback, Student, Teacher
from fire_jax.infer.decode import DecodeConfig, Generation, generate
from fire_jax.infer.forward import forward_logits

__all__ = ["DecodeConfig", "Generation", "generate", "forward_logits", "Student", "Teacher",
           "Feedback"]
