"""How the next token is picked from the logits: greedy, or temperature -> top-k -> top-p sampling.

The engine decodes rows of different requests in one step, so every setting is
per row (``[rows]`` arrays): a greedy row and a sampled row share a step.
:class:`Greedy` takes the most likely token; :class:`Nucleus` scales by the
temperature, keeps the ``top_k`` most likely tokens and then the smallest set
whose mass reaches ``top_p`` (HF's TemperatureLogitsWarper -> TopKLogitsWarper
-> TopPLogitsWarper order), and draws one with the row's own key. Row r's key
for its t-th generated token is ``fold_in(key(seed[r]), t)``: a sampled
request draws the same tokens whatever runs beside it.

:class:`RowSettings` carries the per-row settings into the jitted decode;
:func:`pick` applies them and returns each row's token and its log-probability
under the raw (untempered, unfiltered) distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def greedy_token(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, -1)`` (the first maximum) as two plain reductions, a max and a min over the
    indices that reach it: XLA:CPU runs argmax's two-operand reduce as a scalar loop, 3-4x slower at
    batch 32 x 32000."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a row of NaNs matches nothing: the last id, never out of range


def token_logprob(logits: jax.Array, token: jax.Array) -> jax.Array:
    """log softmax(logits)[token] per row (float32 ``[rows, vocab]``, ``[rows]``), without the full
    ``[rows, vocab]`` log-softmax: one max, one sum of exponentials."""
    top = jnp.max(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return (chosen - top) - jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))


class Greedy:
    """The most likely token of each row."""

    def __call__(self, logits: jax.Array) -> jax.Array:
        return greedy_token(logits)


@dataclasses.dataclass(frozen=True)
class Nucleus:
    """Temperature -> top-k -> top-p per row (``[rows]`` arrays; top_k 0 and top_p 1 filter nothing; top_p 0
    keeps only the most likely token). Temperatures must be > 0 where the row is drawn."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    def scores(self, logits: jax.Array) -> jax.Array:
        """The tempered logits with filtered tokens at -inf."""
        vocab = logits.shape[-1]
        scores = logits / jnp.where(self.temperature > 0, self.temperature, 1.0)[:, None]
        ranked = jnp.sort(scores, axis=-1)[:, ::-1]  # descending
        kth = jnp.take_along_axis(ranked, jnp.clip(self.top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        scores = jnp.where((self.top_k[:, None] > 0) & (scores < kth), -jnp.inf, scores)
        ranked = jnp.sort(scores, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        keep = ((jnp.cumsum(probs, axis=-1) - probs) < self.top_p[:, None]).at[:, 0].set(True)
        threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((self.top_p[:, None] < 1) & (scores < threshold), -jnp.inf, scores)

    def __call__(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
        """One draw per row, row r with ``keys[r]``."""
        draw = jax.vmap(lambda key, row: jax.random.categorical(key, row))
        return draw(keys, self.scores(logits)).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings ``[rows]``: temperature (0: greedy), top_k, top_p and the seed of the row's
    keys."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array

    @classmethod
    def of(cls, requests, rows: int) -> "RowSettings":
        """Host arrays for requests (anything with temperature, top_k, top_p, seed), padded to ``rows``
        greedy rows."""
        pad = rows - len(requests)
        return cls(temperature=np.asarray([r.temperature for r in requests] + [0.0] * pad, np.float32),
                   top_k=np.asarray([r.top_k for r in requests] + [0] * pad, np.int32),
                   top_p=np.asarray([r.top_p for r in requests] + [1.0] * pad, np.float32),
                   seeds=np.asarray([r.seed for r in requests] + [0] * pad, np.uint32))


def pick(logits: jax.Array, settings: RowSettings, counts: jax.Array, logprobs: bool = True):
    """Each row's next token (greedy where its temperature is 0, else drawn with the key of its ``counts``-th
    token) and log p(token) under the raw logits (zeros without ``logprobs``: a log-softmax over the
    vocabulary is 5-10% of a decode step on CPU). The sampling filters run only when a row samples."""
    logits = logits.astype(jnp.float32)
    greedy = Greedy()(logits)

    def sampled():
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(settings.seeds, counts)
        drawn = Nucleus(settings.temperature, settings.top_k, settings.top_p)(logits, keys)
        return jnp.where(settings.temperature > 0, drawn, greedy)

    token = jax.lax.cond(jnp.any(settings.temperature > 0), sampled, lambda: greedy)
    return token, token_logprob(logits, token) if logprobs else jnp.zeros(token.shape, jnp.float32)


def seeds_from_key(key: jax.Array | None, rows: int) -> np.ndarray:
    """uint32 seeds ``[rows]`` drawn from a JAX key (zeros without one): a call keyed by ``key`` samples the
    same tokens every time."""
    if key is None:
        return np.zeros(rows, np.uint32)
    return np.asarray(jax.random.bits(key, (rows,), jnp.uint32))
