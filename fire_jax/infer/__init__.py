"""Decoding: jitted prefill + KV-cache decode loop (:mod:`fire_jax.infer.decode`)."""

from fire_jax.infer.decode import LLAMA3_STOP_IDS, DecodeConfig, Generation, generate

__all__ = ["LLAMA3_STOP_IDS", "DecodeConfig", "Generation", "generate"]
