""":func:`generate`: one fixed batch of prompts through the engine (docs/decoding.md).

:func:`generate` is a short driver over :class:`fire_jax.infer.engine.Engine`,
the one decode loop: the batch's prompts become requests (each with the call's
:class:`fire_jax.infer.sampling.SamplingParams`) of an engine with a slot per
row (:meth:`fire_jax.infer.engine_config.EngineConfig.sized_for`), and the
results come back as arrays. Prompts are left-padded to their length bucket
(:meth:`fire_jax.infer.buckets.Buckets.prompt`) with positions
``cumsum(mask) - 1``, as Hugging Face ``generate``; greedy tokens equal
transformers' (tested).

Output convention: generated ids ``[batch, max_new_tokens]``; a sequence's
stop token is kept (as in HF ``generate``, which then pads with
``pad_token_id``) and every slot after it is -1. Log-probs are those of the
chosen tokens under the model's raw (untempered, unfiltered) distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from fire_jax.infer.engine import Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.forward import normalise_sizes
from fire_jax.infer.requests import Request
from fire_jax.infer.sampling import SamplingParams, seeds_from_key


@dataclasses.dataclass
class Generation:
    """What :func:`generate` returns, one row per prompt."""

    tokens: np.ndarray  # int32 [batch, max_new_tokens]; stop token kept, then -1
    logprobs: np.ndarray  # float32 [batch, max_new_tokens]: log p(token) under the model's raw logits; 0 after stop
    texts: list[str] | None  # decoded tokens before the stop token, when a tokenizer is given

    @property
    def lengths(self) -> np.ndarray:
        """Generated tokens per row, the stop token included."""
        return (self.tokens >= 0).sum(axis=1)


def unpad(input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> list[list[int]]:
    """Token lists from a padded ``[batch, seq]`` array (either padding side)."""
    input_ids = np.asarray(input_ids)
    if attention_mask is None:
        return [list(map(int, row)) for row in input_ids]
    return [list(map(int, row[m.astype(bool)])) for row, m in zip(input_ids, np.asarray(attention_mask))]


def requests_for(prompts: Sequence[Sequence[int]], pixel_values, image_sizes, sampling: SamplingParams,
                 rng: jax.Array | None = None) -> list[Request]:
    """Engine requests for a batch: row b's tiles ``pixel_values[b]`` when it has images, the call's
    ``sampling`` settings with row b's seed drawn from ``rng`` (the same key draws the same tokens)."""
    sizes = normalise_sizes(image_sizes, len(prompts))
    if any(sizes) and pixel_values is None:
        raise ValueError("image sizes given for some examples but no pixel_values")
    return seeded([Request(list(map(int, prompt)), sampling,
                           pixel_values=np.asarray(pixel_values[b], np.float32) if sizes[b] else None,
                           image_sizes=sizes[b]) for b, prompt in enumerate(prompts)], sampling, rng)


def seeded(requests: Sequence[Request], sampling: SamplingParams, rng: jax.Array | None) -> list[Request]:
    """The requests of one call with its ``sampling`` settings, row b's seed drawn from ``rng`` (the same key
    draws the same tokens; greedy calls need none)."""
    if not sampling.greedy and rng is None:
        raise ValueError(f"sampling (temperature={sampling.temperature}) needs an explicit rng key")
    seeds = seeds_from_key(None if sampling.greedy else rng, len(requests))
    return [dataclasses.replace(r, sampling=sampling.replace(seed=int(seed))) for r, seed in zip(requests, seeds)]


def generate(model, prompts: Sequence[Sequence[int]], *, pixel_values: np.ndarray | None = None,
             image_sizes: Sequence | None = None, sampling: SamplingParams = SamplingParams(),
             engine: EngineConfig = EngineConfig(), rng: jax.Array | None = None, tokenizer=None,
             mesh: Mesh | None = None, pad_rows: int = 0) -> Generation:
    """Generate up to ``sampling.max_tokens`` for each prompt.

    Args:
      model: a :class:`fire_jax.models.LlavaNext`.
      prompts: unpadded token ids per example, images as ``geometry.num_tokens(size)``
        placeholder ids (HF "expanded" convention).
      pixel_values: float32 ``[batch, tiles, 3, H, W]`` (an example's images' tiles
        concatenated, zeros beyond).
      image_sizes: per example None, one (h, w), or a list of (h, w).
      sampling: every request's settings (``stop_ids`` None: ``engine.stop_ids``).
      engine: the buckets, chunk, pad and stop ids of the engine; its slots and cache rows are sized for the
        batch (:meth:`fire_jax.infer.engine_config.EngineConfig.sized_for`), without a prefix cache.
      rng: PRNG key, required when sampling (temperature > 0).
      tokenizer: anything with ``decode(ids, skip_special_tokens=True)`` (HF ``tokenizers.Tokenizer``).
      mesh: split the batch over its 'data' axis and the cache's KV heads over 'tensor'.
      pad_rows: at least this many slots (idle ones beyond the batch), so a short last batch decodes
        at the full batch's width; prefills compile per (bucket, power-of-two rows), the decode per cache length.
    """
    requests = requests_for(prompts, pixel_values, image_sizes, sampling, rng)
    new = sampling.max_tokens
    config = engine.sized_for([len(p) for p in prompts], new, slots=pad_rows,
                              images=max(len(r.image_sizes) for r in requests))
    config = config.replace(prefill_batch=config.slots, prefill_tokens=config.slots * (config.cache_len - new),
                            min_width=config.slots, prefix_cache=False)
    results = Engine(model, config, mesh=mesh).generate(requests)
    tokens = np.full((len(prompts), new), -1, np.int32)
    logprobs = np.zeros((len(prompts), new), np.float32)
    for b, result in enumerate(results):
        tokens[b, :len(result.tokens)] = result.tokens
        logprobs[b, :len(result.logprobs)] = result.logprobs
    texts = None
    if tokenizer is not None:  # once at the end (an engine with a tokenizer decodes every chunk's text)
        stop_ids = engine.stop_ids if sampling.stop_ids is None else sampling.stop_ids
        texts = [tokenizer.decode([t for t in r.tokens if t not in stop_ids], skip_special_tokens=True)
                 for r in results]
    return Generation(tokens, logprobs, texts)
