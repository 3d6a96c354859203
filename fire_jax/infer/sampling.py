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
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


#: Bounds of the settings, as the per-row arrays of a decode chunk hold them (float32, int32, uint32) and as
#: OpenAI's chat completions API accepts them (temperature in [0, 2]).
MAX_TEMPERATURE = 2.0
INT32_MAX = 2 ** 31 - 1
MAX_STOP_IDS = 8  # stop ids per request, padded with -1 on the device


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: its token budget, greedy or temperature -> top-k -> top-p sampling with its
    own seed, and where it stops. The one place these settings are checked: a value out of range raises
    ValueError naming the field, when the settings are made (a config section, a server request, a CLI flag).

    ``stop_ids`` None: the engine's (the chat template's end of turn and EOS, ``ChatTokenizer.stop_ids``);
    ``stop``: strings the text is cut before.
    """

    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # 1: no nucleus filter; 0: only the most likely token
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0  # the key of token t is fold_in(key(seed), t)
    stop_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.stop_ids is not None:
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        problems = []
        if not _integer(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            problems.append(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float, np.floating))
                or not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE):
            problems.append(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float, np.floating))
                or not 0 <= self.top_p <= 1):  # NaN fails the comparison too
            problems.append(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            problems.append(f"top_k must be an integer in [0, {INT32_MAX}] (0: off), got {self.top_k!r}")
        if not _integer(self.seed) or not 0 <= self.seed < 2 ** 32:
            problems.append(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.stop_ids is not None and (len(self.stop_ids) > MAX_STOP_IDS or not all(
                _integer(i) and 0 <= i <= INT32_MAX for i in self.stop_ids)):
            problems.append(f"stop_ids: at most {MAX_STOP_IDS} token ids, got {list(self.stop_ids)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop: non-empty strings, got {list(self.stop)!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes) -> "SamplingParams":
        """These settings with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, section, *, source: str = "decode settings", **overrides) -> "SamplingParams":
        """The sampling fields of a config section (``config.decode``, ``config.generate``, a CLI's parsed flags:
        any mapping or namespace): ``max_new_tokens`` (the name Hugging Face's ``generate`` and the configs use)
        as ``max_tokens``, ``temperature``, ``top_k``, ``top_p``; fields it leaves out or sets to None keep
        their defaults; then ``overrides`` (SamplingParams' own names). A value out of range is bad input: an
        :class:`fire_jax.core.config.InputError` naming ``source`` (the section, or the command line), which a
        command ends on in one line."""
        from fire_jax.core.config import InputError

        values = section if isinstance(section, dict) else (
            section.to_dict() if hasattr(section, "to_dict") else vars(section))
        names = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}
        settings = {names[k]: v for k, v in values.items() if k in names and v is not None}
        try:
            return cls(**{**settings, **overrides})
        except ValueError as e:
            problem = str(e)
            if "max_tokens" in settings and "max_tokens" not in overrides:  # the name the section gave it
                problem = problem.replace("max_tokens", "max_new_tokens")
            raise InputError(f"{source}: {problem}") from None


def greedy_token(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, -1)`` (the first maximum) as two plain reductions, a max and a min over the
    indices that reach it: XLA:CPU runs argmax's two-operand reduce as a scalar loop (docs/decoding.md,
    measurements)."""
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
        """The tempered logits with filtered tokens at -inf. Each filter sorts the vocabulary of every row, which
        on a CPU costs many times a small model's decode step (a 49,152-token vocabulary: SmolLM2's), so each runs
        only when some row asks for it (``lax.cond``): rows that filter nothing (top_k 0, top_p 1) are drawn from
        their tempered logits as they are."""
        scores = logits / jnp.where(self.temperature > 0, self.temperature, 1.0)[:, None]
        scores = jax.lax.cond(jnp.any(self.top_k > 0), self._top_k, lambda s: s, scores)
        return jax.lax.cond(jnp.any(self.top_p < 1), self._top_p, lambda s: s, scores)

    def _top_k(self, scores: jax.Array) -> jax.Array:
        """Each row's ``top_k`` highest scores kept (all where its top_k is 0)."""
        vocab = scores.shape[-1]
        ranked = jnp.sort(scores, axis=-1)[:, ::-1]  # descending
        kth = jnp.take_along_axis(ranked, jnp.clip(self.top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        return jnp.where((self.top_k[:, None] > 0) & (scores < kth), -jnp.inf, scores)

    def _top_p(self, scores: jax.Array) -> jax.Array:
        """Each row's smallest set of most likely tokens whose probability reaches ``top_p`` kept (all where its
        top_p is 1)."""
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
    def of(cls, params: "Sequence[SamplingParams]", rows: int) -> "RowSettings":
        """Host arrays of requests' settings, padded to ``rows`` greedy rows."""
        pad = rows - len(params)
        return cls(temperature=np.asarray([p.temperature for p in params] + [0.0] * pad, np.float32),
                   top_k=np.asarray([p.top_k for p in params] + [0] * pad, np.int32),
                   top_p=np.asarray([p.top_p for p in params] + [1.0] * pad, np.float32),
                   seeds=np.asarray([p.seed for p in params] + [0] * pad, np.uint32))


def pick(logits: jax.Array, settings: RowSettings, counts: jax.Array, logprobs: bool = True):
    """Each row's next token (greedy where its temperature is 0, else drawn with the key of its ``counts``-th
    token) and log p(token) under the raw logits (zeros without ``logprobs``: an engine whose callers read no
    log-probs skips the log-softmax over the vocabulary). The sampling filters run only when a row samples."""
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
