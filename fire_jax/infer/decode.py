"""Decode settings, and :func:`generate`: one fixed batch of prompts through the engine (docs/decoding.md).

:func:`generate` is a short driver over :class:`fire_jax.infer.engine.Engine`,
the one decode loop: the batch's prompts become requests of an engine with a
slot per row, and the results come back as arrays. Prompts are left-padded to
their length bucket (:func:`fire_jax.infer.engine.prompt_bucket`) with positions
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

from fire_jax.infer.engine import MAX_STOP_IDS, Engine, Request, prompt_bucket
from fire_jax.infer.forward import normalise_sizes
from fire_jax.infer.sampling import seeds_from_key


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How to decode: the settings of every request of a call, and the engine's buckets and chunk length."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter; 0: only the most likely token
    stop_ids: tuple[int, ...] = ()  # the tokenizer's and template's (ChatTokenizer.stop_ids); () decodes to the end
    pad_id: int = 0  # fills the left padding of prompts (masked, so any id but the image token)
    bucket_min: int = 64  # prompt buckets (fire_jax.infer.engine.prompt_bucket): powers of two from bucket_min
    bucket_step: int = 1024  # up to bucket_step, then multiples of it
    chunk: int = 16  # decode steps per dispatch; the attended cache window grows between chunks
    prefix_cache: bool = True  # agents reuse cached prompt prefixes across calls; generate's one batch does not

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.stop_ids) > MAX_STOP_IDS or not all(0 <= i < 2 ** 31 for i in self.stop_ids):
            raise ValueError(f"stop_ids: at most {MAX_STOP_IDS} token ids, got {list(self.stop_ids)}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.temperature < 0 or not 0 <= self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling settings: temperature={self.temperature}, top_k={self.top_k}, "
                             f"top_p={self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, section, **overrides) -> "DecodeConfig":
        """The one way a config section (``config.decode``, ``config.generate``, a CLI's parsed flags: any
        mapping or namespace) becomes a DecodeConfig: its fields that name a DecodeConfig field (others,
        such as ``batch_size``, are the caller's), then ``overrides``."""
        values = section if isinstance(section, dict) else (
            section.to_dict() if hasattr(section, "to_dict") else vars(section))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in values.items() if k in names and v is not None}, **overrides})


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


def requests_for(prompts: Sequence[Sequence[int]], pixel_values, image_sizes, config: DecodeConfig,
                 rng: jax.Array | None = None) -> list[Request]:
    """Engine requests for a batch: row b's tiles ``pixel_values[b]`` when it has images, the config's
    sampling settings, and row b's seed drawn from ``rng`` (the same key draws the same tokens)."""
    if not config.greedy and rng is None:
        raise ValueError(f"sampling (temperature={config.temperature}) needs an explicit rng key")
    sizes = normalise_sizes(image_sizes, len(prompts))
    if any(sizes) and pixel_values is None:
        raise ValueError("image sizes given for some examples but no pixel_values")
    seeds = seeds_from_key(None if config.greedy else rng, len(prompts))
    return [Request(list(map(int, prompt)), max_tokens=config.max_new_tokens, temperature=config.temperature,
                    top_p=config.top_p, top_k=config.top_k, seed=int(seeds[b]), stop_ids=config.stop_ids,
                    pixel_values=np.asarray(pixel_values[b], np.float32) if sizes[b] else None,
                    image_sizes=sizes[b])
            for b, prompt in enumerate(prompts)]


def generate(model, prompts: Sequence[Sequence[int]], *, pixel_values: np.ndarray | None = None,
             image_sizes: Sequence | None = None, config: DecodeConfig = DecodeConfig(),
             rng: jax.Array | None = None, tokenizer=None, mesh: Mesh | None = None,
             pad_rows: int = 0) -> Generation:
    """Generate up to ``config.max_new_tokens`` for each prompt.

    Args:
      model: a :class:`fire_jax.models.LlavaNext`.
      prompts: unpadded token ids per example, images as ``geometry.num_tokens(size)``
        placeholder ids (HF "expanded" convention).
      pixel_values: float32 ``[batch, tiles, 3, H, W]`` (an example's images' tiles
        concatenated, zeros beyond).
      image_sizes: per example None, one (h, w), or a list of (h, w).
      rng: PRNG key, required when sampling (temperature > 0).
      tokenizer: anything with ``decode(ids, skip_special_tokens=True)`` (HF ``tokenizers.Tokenizer``).
      mesh: split the batch over its 'data' axis and the cache's KV heads over 'tensor'.
      pad_rows: at least this many slots (idle ones beyond the batch), so a short last batch decodes
        at the full batch's width; prefills compile per (bucket, power-of-two rows), the decode per cache length.
    """
    requests = requests_for(prompts, pixel_values, image_sizes, config, rng)
    rows = max(len(prompts), pad_rows)
    bucket = max(prompt_bucket(len(p), config.bucket_min, config.bucket_step) for p in prompts)
    engine = Engine(model, slots=rows, cache_len=bucket + config.max_new_tokens,
                    prefill_batch=rows, prefill_tokens=rows * bucket, chunk=config.chunk, stop_ids=config.stop_ids,
                    pad_id=config.pad_id, bucket_min=config.bucket_min, bucket_step=config.bucket_step,
                    max_images=max(1, *(len(r.image_sizes) for r in requests)), min_width=rows,
                    prefix_cache=False, mesh=mesh)
    results = engine.generate(requests)
    tokens = np.full((len(prompts), config.max_new_tokens), -1, np.int32)
    logprobs = np.zeros((len(prompts), config.max_new_tokens), np.float32)
    for b, result in enumerate(results):
        tokens[b, :len(result.tokens)] = result.tokens
        logprobs[b, :len(result.logprobs)] = result.logprobs
    texts = None
    if tokenizer is not None:  # once at the end (an engine with a tokenizer decodes every chunk's text)
        texts = [tokenizer.decode([t for t in r.tokens if t not in config.stop_ids], skip_special_tokens=True)
                 for r in results]
    return Generation(tokens, logprobs, texts)
