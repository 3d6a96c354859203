"""Decoding: jitted prefill + KV-cache decode loop, and the student / teacher agents built on it."""

from fire_jax.infer.agents import Feedback, Student, Teacher
from fire_jax.infer.decode import DecodeConfig, Generation, generate
from fire_jax.infer.forward import forward_logits

__all__ = ["DecodeConfig", "Generation", "generate", "forward_logits", "Student", "Teacher",
           "Feedback"]
