"""FIRE data layer: records, chat rendering with loss masks, anyres images, TFDS, input pipeline.

Plain Python + numpy (+ PIL, tokenizers, grain, tfds); never imports jax.
"""
