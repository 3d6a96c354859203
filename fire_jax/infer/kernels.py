"""The engine's jitted programs: prefill into cache rows, the first tokens, decode chunks, row moves.

These are the only places fire_jax loops over tokens or builds a KV cache
(``tests/test_architecture.py`` checks it). Each is a pure function of the
model's state and the engine's arrays; :class:`fire_jax.infer.engine.Engine`
decides which rows run and with which shapes (:mod:`fire_jax.infer.scheduler`,
:class:`fire_jax.infer.buckets.Buckets`).

**A write column per slot.** A prompt left-padded to its bucket B fills columns
``[0, B)`` of its row and its decode steps write columns B, B + 1, ...; a decode
step is the model's batched one-token forward, the cache write a scatter of one
column per row (:func:`fire_jax.models.llama.write_columns`). Masked columns
weigh exactly zero in attention, so a request's greedy tokens do not depend on
what runs beside it.

**On a mesh** the cache is laid out by logical axis names, like the models'
parameters (:data:`CACHE_AXES`, mapped to mesh axes by ``fire_jax.core.config.DEFAULT_RULES``): slots over
``data``, the KV heads over ``tensor`` where that divides them.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from fire_jax.core import axes as ax
from fire_jax.infer.sampling import RowSettings, pick
from fire_jax.models.llama import KVCache, columns
from fire_jax.models.partitioning import logical_to_spec

#: Times each jitted function was traced (= compiled): one per new shape or static config.
TRACE_COUNTS: collections.Counter = collections.Counter()

#: Logical axes of the engine's arrays: a layer's keys ``[slots, kv_heads, head_dim, columns]`` and values
#: ``[slots, kv_heads, columns, head_dim]``, the mask ``[slots, columns]``, the last hidden states
#: ``[slots, dim]``.
CACHE_AXES = dict(k=(ax.SLOTS, ax.KV_HEADS, None, None), v=(ax.SLOTS, ax.KV_HEADS, None, None),
                  mask=(ax.SLOTS, None), hidden=(ax.SLOTS, None))


class Graph:
    """A graphdef with its hash computed once: ``jax.jit`` hashes a static argument on every call, and hashing a
    LlavaNext graphdef costs a noticeable part of a call's dispatch."""

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return other is self or (isinstance(other, Graph) and other.graphdef == self.graphdef)


class DecodeRows(NamedTuple):
    """The ``[width]`` rows of a decode chunk (the first ``width`` slots). Slot s feeds ``token[s]`` at
    position ``position[s]`` into cache column ``column[s]``; ``count[s]`` tokens are generated so far, of at
    most ``budget[s]``; ``live[s]``: a request holds the slot; ``stop_ids[s]``: its stop ids, -1 padded."""

    token: jax.Array
    column: jax.Array
    position: jax.Array
    count: jax.Array
    budget: jax.Array
    live: jax.Array
    stop_ids: jax.Array
    settings: RowSettings


class DecodeState(NamedTuple):
    """What a decode chunk's loop carries from step to step: the step, each row's last token, the cache
    window, the tokens and log-probs ``[width, steps]`` so far (-1 / 0 where none), which rows are done and
    how many finished in this chunk."""

    step: jax.Array
    token: jax.Array
    cache: KVCache
    tokens: jax.Array
    logprobs: jax.Array
    done: jax.Array
    finished: jax.Array


def new_cache(model, slots: int, cache_len: int, mesh: Mesh | None, rules) -> tuple[KVCache, jax.Array]:
    """An empty cache of ``slots`` rows of ``cache_len`` columns and the rows' last hidden states, every array
    its own buffer (they are donated), laid out on ``mesh`` by :data:`CACHE_AXES` and ``rules``."""
    cache = KVCache.init(model.cfg.llm, slots, cache_len, model.dtype)
    hidden = jnp.zeros((slots, model.cfg.llm.dim), model.dtype)
    if mesh is None:
        return cache, hidden
    put = lambda x, axes: jax.device_put(x, NamedSharding(mesh, logical_to_spec(axes, x.shape, rules, mesh)))
    cache = KVCache(tuple(put(x, CACHE_AXES["k"]) for x in cache.k), tuple(put(x, CACHE_AXES["v"]) for x in cache.v),
                    put(cache.mask, CACHE_AXES["mask"]), jax.device_put(cache.index, NamedSharding(mesh, P())))
    return cache, put(hidden, CACHE_AXES["hidden"])


def state_on_mesh(state, mesh: Mesh | None):
    """The weights replicated onto the mesh, unless the caller already placed them there.

    Without a mesh, weights that all live on one device are committed to it (no copy): a model built in process
    and one restored from a checkpoint (committed, as orbax places arrays) then meet the same compiled
    programs, where an uncommitted and a committed argument would key two compiles of each.
    """
    if mesh is None:
        devices = {d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set}
        return jax.device_put(state, SingleDeviceSharding(devices.pop())) if len(devices) == 1 else state
    devices = set(mesh.devices.flat)
    if all(leaf.sharding.device_set == devices for leaf in jax.tree.leaves(state)):
        return state
    return jax.device_put(state, NamedSharding(mesh, P()))


def _write_rows(cache: KVCache, new: KVCache, slots) -> KVCache:
    """``new``'s rows (their first ``width`` columns) written into cache rows ``slots``, columns ``[0, width)``;
    the rest of those rows masked out (the old occupant's columns)."""
    rows, width = new.mask.shape
    written = cache.map_columns(lambda c, f, axis: c.at[columns(axis, slots, slice(0, width))].set(f.astype(c.dtype)),
                                new)
    row_mask = jnp.zeros((rows, cache.mask.shape[1]), bool).at[:, :width].set(new.mask)
    return KVCache(written.k, written.v, cache.mask.at[slots].set(row_mask), cache.index)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("cache", "hidden"))
def admit(graph: Graph, state, cache: KVCache, hidden, input_ids, attention_mask, positions, pixel_values,
          image_index, slots):
    """Prefill ``[rows, bucket]`` prompts into cache rows ``slots``, columns ``[0, bucket)``, and each
    prompt's last hidden state into ``hidden[slots]`` (:func:`first_tokens` turns it into the first token).
    Returns the cache and ``hidden``."""
    TRACE_COUNTS["engine_admit"] += 1
    model = nnx.merge(graph.graphdef, state)
    rows, bucket = input_ids.shape
    fresh = KVCache.init(model.cfg.llm, rows, bucket, model.dtype)
    last = jnp.full((rows,), bucket - 1, jnp.int32)  # left-padded: every prompt ends in the last column
    out, fresh = model.hidden_states(input_ids, pixel_values, image_index, attention_mask, positions, fresh, last=last)
    return _write_rows(cache, fresh, slots), hidden.at[slots].set(out[:, 0].astype(hidden.dtype))


@functools.partial(jax.jit, static_argnames=("graph", "window"), donate_argnames=("cache", "hidden"))
def extend(graph: Graph, state, cache: KVCache, hidden, input_ids, attention_mask, positions, source, shift, start,
           last, slots, *, window: int):
    """Prefill the rest of prompts whose first ``start[i]`` tokens' keys and values are cached (prefix caching):
    row ``source[i]`` holds them from column ``shift[i]``. Each row's cached prefix is cut out to columns
    ``[0, start[i])`` of a ``window``-column cache (the left padding of its first prefill dropped), the
    ``[rows, length]`` rest (text, right-padded) is prefilled after it at positions ``start[i]``, ... , and the
    window goes into cache rows ``slots`` (the rest of those rows masked out), the hidden state of each prompt's
    last token (``last[i]`` in ``input_ids``) into ``hidden[slots]``. Returns the cache and ``hidden``."""
    TRACE_COUNTS["engine_extend"] += 1
    model = nnx.merge(graph.graphdef, state)
    cols = shift[:, None] + jnp.arange(window)  # [rows, window]: source columns, past the end -> fill

    def cut(x, axis):  # indexed: [rows, window, the other axes]; back to the column axis
        return jnp.moveaxis(x.at[columns(axis, source[:, None], cols)].get(mode="fill", fill_value=0), 1, axis)

    prefix = cache.map_columns(cut)
    prefix = KVCache(prefix.k, prefix.v, prefix.mask & (jnp.arange(window) < start[:, None]), start)
    out, prefix = model.hidden_states(input_ids, None, None, attention_mask, positions, prefix, last=last)
    return _write_rows(cache, prefix, slots), hidden.at[slots].set(out[:, 0].astype(hidden.dtype))


@functools.partial(jax.jit, static_argnames=("graph", "logprobs"))
def first_tokens(graph: Graph, state, hidden, slots, settings: RowSettings, *, logprobs: bool):
    """The first token (and its log-prob) of the requests prefilled into ``slots`` (``[rows]``): one LM-head
    product for every prompt admitted at a chunk boundary, not one per prefill (a one-row product reads the
    whole LM head as a many-row one does)."""
    TRACE_COUNTS["engine_first"] += 1
    model = nnx.merge(graph.graphdef, state)
    return pick(model.logits(hidden[slots]), settings, jnp.zeros(slots.shape, jnp.int32), logprobs)


@functools.partial(jax.jit, static_argnames=("graph", "steps", "window", "logprobs"), donate_argnames=("cache",))
def decode_chunk(graph: Graph, state, cache: KVCache, rows: DecodeRows, wanted, *, steps: int, window: int,
                 logprobs: bool):
    """Up to ``steps`` one-token steps of the first ``width`` slots (``rows``; the cache has ``slots >= width``
    rows, the rest idle), in one ``while_loop``, attending over the first ``window`` columns: the host picks a
    window past every live row's last column in this chunk, so a step reads the filled part of the cache, not
    every column. The window is cut out once before the loop and written back once after it (cutting it inside
    the loop would copy it per layer per step on XLA:CPU).

    Step i feeds row s's token at ``position[s] + i`` into its cache column ``column[s] + i``. Stops when every
    row is done, or as soon as ``wanted`` rows (> 0) have finished in it, to take waiting requests. Returns the
    cache, and tokens and log-probs ``[width, steps]`` (-1 / 0 where none).
    """
    TRACE_COUNTS["engine_decode"] += 1
    model = nnx.merge(graph.graphdef, state)
    width = rows.token.shape[0]
    whole = cache
    cache = cache.map_columns(lambda x, axis: x[columns(axis, slice(0, width), slice(0, window))])

    def keep_going(s: DecodeState):
        return (s.step < steps) & ~jnp.all(s.done) & ~((wanted > 0) & (s.finished >= wanted))

    def one_token(s: DecodeState) -> DecodeState:
        logits, cache = model(jnp.maximum(s.token, 0)[:, None], attention_mask=jnp.ones((width, 1), bool),
                              positions=(rows.position + s.step)[:, None], cache=s.cache)
        new, logprob = pick(logits[:, 0], rows.settings, rows.count + s.step, logprobs)
        new, logprob = jnp.where(s.done, -1, new), jnp.where(s.done, 0.0, logprob)
        stopped = ~s.done & ((new[:, None] == rows.stop_ids).any(axis=1) | (rows.count + s.step + 1 >= rows.budget))
        return DecodeState(s.step + 1, new, cache,
                           jax.lax.dynamic_update_slice(s.tokens, new[:, None], (0, s.step)),
                           jax.lax.dynamic_update_slice(s.logprobs, logprob[:, None], (0, s.step)),
                           s.done | stopped, s.finished + stopped.sum())

    start = DecodeState(jnp.zeros((), jnp.int32), rows.token, KVCache(cache.k, cache.v, cache.mask, rows.column),
                        jnp.full((width, steps), -1, jnp.int32), jnp.zeros((width, steps), jnp.float32), ~rows.live,
                        jnp.zeros((), jnp.int32))
    end = jax.lax.while_loop(keep_going, one_token, start)
    put = lambda w, x: jax.lax.dynamic_update_slice(w, x, (0,) * w.ndim)
    cache = KVCache(*jax.tree.map(put, (whole.k, whole.v, whole.mask), (end.cache.k, end.cache.v, end.cache.mask)),
                    whole.index)
    return cache, end.tokens, end.logprobs


@functools.partial(jax.jit, donate_argnames=("cache",))
def swap_rows(cache: KVCache, source, target, count) -> KVCache:
    """Cache rows ``source[i]`` and ``target[i]`` swapped for i < ``count``, one pair at a time in place (a
    scatter of every row of ``source`` at once copies far more than the few rows a compaction moves). A swap,
    not a copy: the free row a live one moves into may hold a cached prefix."""
    TRACE_COUNTS["engine_move"] += 1

    def one(i, cache):
        def swap(x):
            a, b = (jax.lax.dynamic_index_in_dim(x, r[i], 0) for r in (source, target))
            return jax.lax.dynamic_update_index_in_dim(jax.lax.dynamic_update_index_in_dim(x, a, target[i], 0),
                                                       b, source[i], 0)
        return KVCache(tuple(map(swap, cache.k)), tuple(map(swap, cache.v)), swap(cache.mask), cache.index)

    return jax.lax.fori_loop(0, count, one, cache)
