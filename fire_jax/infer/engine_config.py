"""The shape of an engine: its decode slots, cache columns, prompt buckets and chunk length, and the one rule
that sizes an engine for a set of prompts.

Per-request settings (token budget, sampling, stops) are not here: they are each request's
:class:`fire_jax.infer.sampling.SamplingParams`. An engine's shape fixes its compiled programs, so it is set
once per engine; the settings change from request to request on the same programs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fire_jax.infer.buckets import Buckets

#: The shortest cache row :meth:`EngineConfig.sized_for` gives (columns); rows grow by doubling from it, so a
#: growing workload rebuilds its engine a few times, not at every new length.
MIN_CACHE_LEN = 256


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an engine is laid out (:class:`fire_jax.infer.engine.Engine`).

    slots: decode slots (rows of the KV cache); cache_len: columns per row (a prompt's bucket + its
    max_tokens must fit); chunk: decode steps per dispatch at most; bucket_min, bucket_step: the prompt
    buckets (``bucket_step`` None: the server's finer rule; an int: powers of two up to it, then its
    multiples, fewer shapes for batch jobs); prefill_batch, prefill_tokens: a prefill's rows and padded
    tokens at most; max_images: images per request; min_width: a decode chunk covers at least this many
    slots; prefix_cache: reuse cached prompt prefixes; logprobs: each token's log-prob in the results;
    admit_wait: a started engine's wait for new requests after a chunk that finished some (seconds);
    pad_id: the id of prompts' left padding (masked; any id but the image token); stop_ids: a request's
    stop ids when its settings name none (the chat template's end of turn and EOS).
    """

    slots: int = 32
    cache_len: int = 1024
    chunk: int = 16
    bucket_min: int = 64
    bucket_step: int | None = 1024
    prefill_batch: int = 8
    prefill_tokens: int = 1024
    max_images: int = 4
    min_width: int = 1
    prefix_cache: bool = True
    logprobs: bool = True
    admit_wait: float = 0.002
    pad_id: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        for name in ("slots", "cache_len", "chunk", "bucket_min", "prefill_batch", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def buckets(self) -> Buckets:
        """The prompt buckets and cache windows of an engine of this shape."""
        return Buckets(self.bucket_min, self.bucket_step, self.cache_len)

    def sized_for(self, prompt_lengths: Sequence[int], max_tokens: int, *, slots: int = 0, images: int = 0,
                  doubling: bool = False) -> "EngineConfig":
        """This shape with room for prompts of ``prompt_lengths`` tokens and ``max_tokens`` new tokens each: the
        one sizing rule of an engine. Slots: one per prompt, at least ``slots``; cache rows: the longest
        prompt's bucket + ``max_tokens`` (``doubling``: the power of two from :data:`MIN_CACHE_LEN` that
        holds it, for a backend that rebuilds its engine as its calls grow); images per request: at least
        ``images``."""
        need = max(self.buckets.prompt(n) for n in prompt_lengths) + max_tokens
        cache_len = need
        if doubling:
            cache_len = MIN_CACHE_LEN
            while cache_len < need:
                cache_len *= 2
        return self.replace(slots=max(slots, len(prompt_lengths)), cache_len=cache_len,
                            max_images=max(self.max_images, images))

    @classmethod
    def from_config(cls, section, **overrides) -> "EngineConfig":
        """The engine fields of a config section (``config.decode``, ``config.generate``, a CLI's flags: any
        mapping or namespace; fields it does not name keep their defaults), then ``overrides``."""
        values = section if isinstance(section, dict) else (
            section.to_dict() if hasattr(section, "to_dict") else vars(section))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in values.items() if k in names and v is not None}, **overrides})
