"""The decoder: continuous batching over fixed decode slots of one static-shape KV cache.

Every generation in fire_jax runs here: a server's requests as they arrive,
an agent's batch of dialogue turns, and :func:`fire_jax.infer.decode.generate`'s
fixed batch (a short driver over an :class:`Engine`). ``slots`` rows share one
cache ``[slots, cache_len]`` per layer. Between decode chunks the host admits
waiting requests into free slots (a batched prefill of prompts of one length
bucket, written into the slots' cache rows), and a request that stops frees
its slot at the next chunk boundary.

**A write column per slot.** A prompt left-padded to its bucket B fills columns
``[0, B)`` of its row and its decode steps write columns B, B + 1, ...; a decode
step is the model's batched one-token forward, the cache write a scatter of one
column per row (:func:`fire_jax.models.llama.write_columns`). Masked columns
weigh exactly zero in attention, so a request's greedy tokens do not depend on
what runs beside it (tested alone and among 31 others, and against
transformers' ``generate``).

**The one bucket rule and the one window rule.** :func:`prompt_bucket` pads every
prefill; a decode chunk attends over the first ``bucket_min * 2^j`` columns
that hold its rows' columns for the chunk, or all of them (:meth:`Engine._window`),
so compiled shapes are few and known up front.

**Prefix caching** (``prefix_cache=True``; vLLM's automatic prefix caching,
SGLang's RadixAttention): a row outlives its request.
:class:`fire_jax.infer.prefix_cache.PrefixCache` records the tokens whose keys and
values each row holds, and a request whose prompt begins with a held prefix
(the same dialogue's previous turn, a prompt shared with another request, image
tokens only for the same images) prefills only the rest (:func:`_extend`). Free
rows are evicted least recently used first. Reused keys and values were computed
by another prefill and by decode steps, so a log-prob may differ in the last
bits from a whole-prompt prefill; greedy tokens are the same on the tests'
workloads. ``stats`` counts prompt tokens admitted, reused and prefilled.

**Per request:** ``max_tokens``, stop ids and stop strings, and greedy or
temperature / top-k / top-p sampling (:mod:`fire_jax.infer.sampling`) with its
own seed: the key of token t is ``fold_in(key(seed), t)``, so a sampled request
draws the same tokens whatever runs beside it.

**On a mesh** the slots are split over the ``data`` axis and the cache's KV
heads over ``tensor`` (when it divides them); the weights are replicated
unless the caller placed them. docs/decoding.md has the design and its measurements.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from fire_jax.data.images import pad_tiles
from fire_jax.geometry import place_images
from fire_jax.infer.prefix_cache import PrefixCache, image_key
from fire_jax.infer.sampling import RowSettings, pick
from fire_jax.models.llama import KVCache, columns

#: Times each jitted function was traced (= compiled): one per new shape or static config.
TRACE_COUNTS: collections.Counter = collections.Counter()

#: Stop ids per request, padded with -1 on the device.
MAX_STOP_IDS = 8


@dataclasses.dataclass
class Request:
    """One generation request. ``prompt``: token ids, image placeholders expanded (as ``generate``)."""

    prompt: Sequence[int]
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    stop_ids: Sequence[int] | None = None  # None: the engine's (the tokenizer's eot / eos)
    stop: Sequence[str] = ()  # stop strings; the text is cut before the first one
    pixel_values: np.ndarray | None = None  # float32 [tiles, 3, H, W], this request's images' tiles concatenated
    image_sizes: Sequence[Sequence[int]] = ()  # (h, w) per image


@dataclasses.dataclass
class Result:
    tokens: list[int]  # generated ids, a stop id kept (as generate)
    logprobs: list[float]  # log p(token) under the raw logits (empty from an engine with logprobs=False)
    text: str | None  # without stop ids, cut before a stop string; None without a tokenizer
    finish_reason: str  # "stop" (stop id or string) or "length"
    prompt_tokens: int


class Ticket:
    """A submitted request: wait for its :class:`Result`, or follow it with ``on_update(ticket, delta, done)``."""

    def __init__(self, request: Request, on_update: Callable | None, images: bytes | None = None):
        self.request, self.on_update = request, on_update
        self.ids = np.asarray(request.prompt, np.int32)
        self.images = images  # a digest of the request's images (fire_jax.infer.prefix_cache.image_key)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.sent = 0  # characters of text already passed to on_update
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.cancelled = False  # set by Engine.cancel; the engine thread frees the slot
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError("request not finished")
        if self.error is not None:
            raise self.error
        return self.result


class _Graph:
    """A graphdef with its hash computed once: ``jax.jit`` hashes a static argument on every call, and a
    LlavaNext graphdef's hash takes ~0.3 ms (dispatch went from ~1.1 to ~0.6 ms a call, 50-60 calls a run
    of the serve benchmark)."""

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return other is self or (isinstance(other, _Graph) and other.graphdef == self.graphdef)


def _write_rows(cache: KVCache, new: KVCache, slots) -> KVCache:
    """``new``'s rows (their first ``width`` columns) written into cache rows ``slots``, columns ``[0, width)``;
    the rest of those rows masked out (the old occupant's columns)."""
    rows, width = new.mask.shape
    written = cache.map_columns(lambda c, f, axis: c.at[columns(axis, slots, slice(0, width))].set(f.astype(c.dtype)),
                                new)
    row_mask = jnp.zeros((rows, cache.mask.shape[1]), bool).at[:, :width].set(new.mask)
    return KVCache(written.k, written.v, cache.mask.at[slots].set(row_mask), cache.index)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("cache", "hidden"))
def _admit(graph: _Graph, state, cache: KVCache, hidden, input_ids, attention_mask, positions, pixel_values,
           image_index, slots):
    """Prefill ``[rows, bucket]`` prompts into cache rows ``slots``, columns ``[0, bucket)``, and each
    prompt's last hidden state into ``hidden[slots]`` (:func:`_first_tokens` turns it into the first token).
    Returns the cache and ``hidden``."""
    TRACE_COUNTS["engine_admit"] += 1
    model = nnx.merge(graph.graphdef, state)
    rows, bucket = input_ids.shape
    fresh = KVCache.init(model.cfg.llm, rows, bucket, model.dtype)
    last = jnp.full((rows,), bucket - 1, jnp.int32)  # left-padded: every prompt ends in the last column
    out, fresh = model.hidden_states(input_ids, pixel_values, image_index, attention_mask, positions, fresh, last=last)
    return _write_rows(cache, fresh, slots), hidden.at[slots].set(out[:, 0].astype(hidden.dtype))


@functools.partial(jax.jit, static_argnames=("graph", "window"), donate_argnames=("cache", "hidden"))
def _extend(graph: _Graph, state, cache: KVCache, hidden, input_ids, attention_mask, positions, source, shift, start,
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
def _first_tokens(graph: _Graph, state, hidden, slots, settings: RowSettings, *, logprobs: bool):
    """The first token (and its log-prob) of the requests prefilled into ``slots`` (``[rows]``): one LM-head
    product for every prompt admitted at a chunk boundary, not one per prefill (on CPU a one-row product
    reads the whole LM head, ~1 ms at vocab 32000)."""
    TRACE_COUNTS["engine_first"] += 1
    model = nnx.merge(graph.graphdef, state)
    return pick(model.logits(hidden[slots]), settings, jnp.zeros(slots.shape, jnp.int32), logprobs)


@functools.partial(jax.jit, static_argnames=("graph", "steps", "window", "logprobs"), donate_argnames=("cache",))
def _decode_chunk(graph: _Graph, state, cache: KVCache, column, token, position, count, budget, live, stop_ids,
                  settings: RowSettings, wanted, *, steps: int, window: int, logprobs: bool):
    """Up to ``steps`` one-token steps of the first ``width`` slots (the ``[width]`` arguments; the cache has
    ``slots >= width`` rows, the rest idle), in one ``while_loop``, attending over the first ``window``
    columns: the host picks a window past every live row's last column in this chunk, so a step reads the
    filled part of the cache, not all ``cache_len`` columns. The window is cut out once before the loop and
    written back once after it (cutting it inside the loop would copy it per layer per step on XLA:CPU).

    Step i feeds slot s's ``token[s]`` at ``position[s] + i`` into its cache column ``column[s] + i``;
    ``count[s]`` tokens are generated so far, of at most ``budget[s]``. Stops when every row is done, or
    as soon as ``wanted`` rows (> 0) have finished in it, to take waiting requests. Returns the cache, and
    tokens and log-probs ``[width, steps]`` (-1 / 0 where none).
    """
    TRACE_COUNTS["engine_decode"] += 1
    model = nnx.merge(graph.graphdef, state)
    slots = token.shape[0]
    whole = cache
    cache = cache.map_columns(lambda x, axis: x[columns(axis, slice(0, slots), slice(0, window))])

    def keep_going(carry):
        step, _, _, _, done, finished = carry
        return (step < steps) & ~jnp.all(done) & ~((wanted > 0) & (finished >= wanted))

    def one_token(carry):
        step, token, cache, (tokens_out, logprobs_out), done, finished = carry
        logits, cache = model(jnp.maximum(token, 0)[:, None], attention_mask=jnp.ones((slots, 1), bool),
                              positions=(position + step)[:, None], cache=cache)
        new, logprob = pick(logits[:, 0], settings, count + step, logprobs)
        new, logprob = jnp.where(done, -1, new), jnp.where(done, 0.0, logprob)
        tokens_out = jax.lax.dynamic_update_slice(tokens_out, new[:, None], (0, step))
        logprobs_out = jax.lax.dynamic_update_slice(logprobs_out, logprob[:, None], (0, step))
        stopped = ~done & ((new[:, None] == stop_ids).any(axis=1) | (count + step + 1 >= budget))
        return step + 1, new, cache, (tokens_out, logprobs_out), done | stopped, finished + stopped.sum()

    out = (jnp.full((slots, steps), -1, jnp.int32), jnp.zeros((slots, steps), jnp.float32))
    cache = KVCache(cache.k, cache.v, cache.mask, column)
    carry = (jnp.zeros((), jnp.int32), token, cache, out, ~live, jnp.zeros((), jnp.int32))
    _, _, cache, (tokens, logprobs), _, _ = jax.lax.while_loop(keep_going, one_token, carry)
    put = lambda w, x: jax.lax.dynamic_update_slice(w, x, (0,) * w.ndim)
    cache = KVCache(*jax.tree.map(put, (whole.k, whole.v, whole.mask), (cache.k, cache.v, cache.mask)), whole.index)
    return cache, tokens, logprobs


def prompt_bucket(n: int, bucket_min: int = 64, bucket_step: int | None = None, room: int | None = None) -> int:
    """A prompt's padded length: the one bucket rule of every prefill.

    ``bucket_step`` None (a server's engine): a multiple of ``bucket_min`` up to ``8 * bucket_min`` tokens,
    then of ``2 * bucket_min`` up to twice that, and so on: a prompt pads less than a quarter of its length,
    and a context of C columns has 8 buckets up to ``8 * bucket_min`` and 4 per doubling after that (on CPU a
    prefill costs its padded tokens: on the serve benchmark's prompts, 16..400 tokens, 15,744 padded columns
    where powers of two pad 20,096). ``bucket_step`` given (the agents' and ``generate``'s
    :class:`fire_jax.infer.decode.DecodeConfig`): the next power of two from ``bucket_min`` up to
    ``bucket_step``, then multiples of ``bucket_step``: fewer shapes for the batch jobs to compile.
    A bucket past ``room`` (the columns a cache row leaves the prompt) falls back to the length rounded up to
    a multiple of ``bucket_min``.
    """
    if bucket_step is None:
        step = bucket_min
        while n > 8 * step:
            step *= 2
        length = -(-n // step) * step
    else:
        length = bucket_min
        while length < min(n, bucket_step):
            length *= 2
        length = length if n <= length else -(-n // bucket_step) * bucket_step
    if room is not None and length > room:
        return -(-n // bucket_min) * bucket_min
    return length


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """Left-pad token lists to ``length``. Returns int32 ids, bool mask, positions ``[batch, length]``.

    positions = cumsum(mask) - 1 on real tokens and 0 on padding (HF ``generate``).
    """
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for b, prompt in enumerate(prompts):
        if not 0 < len(prompt) <= length:
            raise ValueError(f"prompt {b} has {len(prompt)} tokens; expected 1..{length}")
        ids[b, length - len(prompt):] = prompt
        mask[b, length - len(prompt):] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, mask, positions


@functools.partial(jax.jit, donate_argnames=("cache",))
def _swap_rows(cache: KVCache, source, target, count) -> KVCache:
    """Cache rows ``source[i]`` and ``target[i]`` swapped for i < ``count``, one pair at a time in place (a
    scatter of all ``len(source)`` rows at once took 12-15 ms on the serve benchmark's cache; three rows
    this way 0.9 ms). A swap, not a copy: the free row a live one moves into may hold a cached prefix."""
    TRACE_COUNTS["engine_move"] += 1

    def one(i, cache):
        def swap(x):
            a, b = (jax.lax.dynamic_index_in_dim(x, r[i], 0) for r in (source, target))
            return jax.lax.dynamic_update_index_in_dim(jax.lax.dynamic_update_index_in_dim(x, a, target[i], 0),
                                                       b, source[i], 0)
        return KVCache(tuple(map(swap, cache.k)), tuple(map(swap, cache.v)), swap(cache.mask), cache.index)

    return jax.lax.fori_loop(0, count, one, cache)


def _state_on_mesh(state, mesh: Mesh | None):
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


def _int_in(value, low: int, high: int) -> bool:
    """An integer (numpy's too, not a bool) within [low, high]."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and low <= value <= high


class Engine:
    """Continuous batching over ``slots`` decode slots of ``cache_len`` cache columns each.

    Drive it with :meth:`generate` (a list of requests, run to the end), or
    :meth:`start` a background thread and :meth:`submit` from any thread.

    Args:
      model: a :class:`fire_jax.models.LlavaNext`.
      tokenizer: anything with ``decode(ids, skip_special_tokens=True)``; needed for stop strings and text.
      stop_ids: the default stop ids of a request (the stop token is kept in ``tokens``).
      pad_id: fills prompts' left padding (masked; any id but the image token).
      prefill_batch, prefill_tokens: a prefill's rows (waiting requests of one bucket, a power of two) and
        padded tokens at most (one row whatever its bucket).
      chunk: decode steps per dispatch at most (fewer when rows finish while requests wait).
      logprobs: each token's log-prob in the results (False: none, and 5-10% less work per decode step).
      admit_wait: on a started engine (a server), seconds to wait after a chunk that finished requests for
        as many new ones to arrive before the next chunk: closed-loop clients send their next request as soon
        as they are answered, and a request that misses the chunk waits a whole chunk for a slot.
      bucket_min, bucket_step: the prompt buckets (:func:`prompt_bucket`); ``bucket_min`` is also the
        shortest decode window (columns).
      max_images: images per request (bounds the tile buckets).
      min_width: a decode chunk covers at least this many slots (fewer compiled shapes: a batch job that
        fills every slot gains little from narrower chunks in its tail, and compiles each width it meets).
      prefix_cache: reuse the cached keys and values of a prompt's longest cached prefix and prefill only the
        rest (:mod:`fire_jax.infer.prefix_cache`); False: prefill every prompt whole.
      mesh: split the slots over its ``data`` axis (``slots`` is rounded up to a multiple of its size, and
        every chunk decodes all of them) and the cache's KV heads over ``tensor`` when that divides them.
    """

    def __init__(self, model, *, tokenizer=None, slots: int = 32, cache_len: int = 1024, prefill_batch: int = 8,
                 prefill_tokens: int = 1024, chunk: int = 16, stop_ids: Sequence[int] = (),
                 pad_id: int = 0, bucket_min: int = 64, bucket_step: int | None = None, max_images: int = 4,
                 min_width: int = 1, admit_wait: float = 0.002, logprobs: bool = True, prefix_cache: bool = True,
                 mesh: Mesh | None = None):
        if pad_id == model.cfg.image_token_id:
            raise ValueError(f"pad_id {pad_id} is the image token id")
        if mesh is not None:
            slots = -(-slots // mesh.shape["data"]) * mesh.shape["data"]
            min_width = slots  # a narrower chunk would gather rows across the data axis
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.cache_len, self.chunk = slots, cache_len, chunk
        self.prefill_batch, self.prefill_tokens = max(1, min(prefill_batch, slots)), prefill_tokens
        self.admit_wait, self.logprobs = admit_wait, logprobs
        self.stop_ids, self.pad_id = tuple(int(i) for i in stop_ids), pad_id
        self.bucket_min, self.bucket_step, self.max_images = bucket_min, bucket_step, max_images
        self.min_width = min(max(min_width, 1), slots)
        self.mesh = mesh
        graphdef, state = nnx.split(model)
        self.graph, self.state = _Graph(graphdef), _state_on_mesh(state, mesh)
        self.cache = KVCache.init(model.cfg.llm, slots, cache_len, model.dtype)  # every array its own buffer: donated
        self.hidden = jnp.zeros((slots, model.cfg.llm.dim), model.dtype)  # a prompt's last hidden state per slot
        if mesh is not None:
            heads = "tensor" if "tensor" in mesh.axis_names and model.cfg.llm.kv_heads % mesh.shape["tensor"] == 0 \
                else None
            put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P("data", *spec)))
            self.cache = KVCache(tuple(put(x, heads, None, None) for x in self.cache.k),
                                 tuple(put(x, heads, None, None) for x in self.cache.v), put(self.cache.mask, None),
                                 jax.device_put(self.cache.index, NamedSharding(mesh, P())))
            self.hidden = put(self.hidden, None)
        self._fresh: list[int] = []  # slots prefilled since the last first-token product
        self.occupant: list[Ticket | None] = [None] * slots
        self.token = np.zeros(slots, np.int32)  # the last generated token, fed next
        self.column = np.zeros(slots, np.int32)  # the cache column the slot's next token is written at
        self.padding = np.zeros(slots, np.int32)  # left padding of its prompt: its position is column - padding
        self.prefix = PrefixCache(slots, cache_len, model.cfg.image_token_id, enabled=prefix_cache)
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.lock = threading.Condition()
        self.accepting = True
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._freed = 0  # requests the last decode chunk finished
        # prefills, first products, decode chunks / steps, tokens, requests...; prompt tokens admitted, of which
        # reused (a cached prefix) and prefilled
        self.stats = collections.Counter()

    # -- requests ---------------------------------------------------------------------------------

    def bucket(self, request: Request) -> int:
        """A request's prompt bucket, leaving room for its ``max_tokens`` in the cache row."""
        return prompt_bucket(len(request.prompt), self.bucket_min, self.bucket_step,
                             room=self.cache_len - request.max_tokens)

    def check(self, request: Request) -> None:
        """Raise ValueError when a request cannot run (too long, bad settings)."""
        n = len(request.prompt)
        if n < 1:
            raise ValueError("empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        # Every setting must fit the per-row arrays of a decode chunk (float32, int32, uint32): one that does
        # not is refused here, alone, not when the chunk that holds it and other requests is built.
        if (not math.isfinite(request.temperature) or request.temperature < 0 or not 0 <= request.top_p <= 1
                or not _int_in(request.top_k, 0, 2 ** 31 - 1)):
            raise ValueError(f"bad sampling settings: temperature={request.temperature}, top_k={request.top_k}, "
                             f"top_p={request.top_p}")
        if not _int_in(request.seed, 0, 2 ** 32 - 1):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {request.seed!r}")
        if request.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        stop_ids = self.stop_ids if request.stop_ids is None else request.stop_ids
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
        if not all(_int_in(i, 0, 2 ** 31 - 1) for i in stop_ids):
            raise ValueError(f"stop ids must be token ids, got {list(stop_ids)}")
        if len(request.image_sizes) > self.max_images:
            raise ValueError(f"at most {self.max_images} images per request, got {len(request.image_sizes)}")
        bucket = self.bucket(request)
        if bucket + request.max_tokens > self.cache_len:
            raise ValueError(f"prompt of {n} tokens (bucket {bucket}) + max_tokens {request.max_tokens} exceeds the "
                             f"context of {self.cache_len} tokens")

    def submit(self, request: Request, on_update: Callable | None = None) -> Ticket:
        """Queue a request (checked first: ValueError); thread-safe."""
        self.check(request)
        ticket = Ticket(request, on_update,
                        image_key(request.pixel_values, request.image_sizes) if self.prefix.enabled else None)
        with self.lock:
            if not self.accepting:
                raise RuntimeError("the engine is shutting down")
            self.waiting.append(ticket)
            self.lock.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Stop a request whose client went away; thread-safe. A waiting request leaves the queue at once, a
        running one frees its slot at the next chunk boundary. Its result keeps the tokens so far, with
        finish_reason "cancelled". False when it had already finished."""
        with self.lock:
            if ticket.done:
                return False
            ticket.cancelled = True
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                self._finish(ticket, "cancelled")
            self.lock.notify_all()
        return True

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        """Run requests to the end on the calling thread (the engine must not be started)."""
        tickets = [self.submit(r) for r in requests]
        while self.busy():
            self.step()
        return [t.wait(0) for t in tickets]

    def _width(self, last_slot: int) -> int:
        """Slots a decode chunk covers: a power of two past the highest live slot, at least ``min_width``."""
        return min(max(1 << last_slot.bit_length(), self.min_width), self.slots)

    def _window(self, columns: int, steps: int | None = None) -> int:
        """Cache columns a decode chunk attends over: ``bucket_min * 2^j`` >= ``columns``, or all of them.

        Cutting a window out before the chunk and writing it back after copies it twice (a read and a write
        each time), where each of the chunk's ``steps`` saves reading the ``cache_len - window`` columns past
        it: so a window only when ``steps * (cache_len - window) > 4 * window``. (On the serve benchmark a
        window of 512 out of 576 columns, cut for chunks of 1-4 steps, cost 25-40 ms a chunk and made its
        decode 1.5x slower.) ``steps`` None: every window that may be taken."""
        window = self.bucket_min
        while window < columns:
            window *= 2
        if window >= self.cache_len or (steps is not None and steps * (self.cache_len - window) <= 4 * window):
            return self.cache_len
        return window

    def widths_and_windows(self) -> list[tuple[int, int]]:
        """Every (width, window) a decode chunk may take: which ones a run meets depends on when requests
        arrive and finish."""
        widths = sorted({self._width(slot) for slot in range(self.slots)})
        windows = sorted({self._window(self.bucket_min << j) for j in range(self.cache_len.bit_length())})
        return [(w, c) for w in widths for c in windows]

    def warm_up(self) -> int:
        """Compile every decode chunk shape (each runs zero steps: no live rows), the row move (moving
        nothing) and the first-token products now, so no request waits for a compile mid-run; prefills still
        compile on their first (bucket, rows, tiles). Returns the decode shapes."""
        zeros = np.zeros(max(1, self.slots // 2), np.int32)
        self.cache = _swap_rows(self.cache, zeros, zeros, np.int32(0))
        for rows in sorted({self._first_rows(n) for n in range(1, self.slots + 1)}):
            _first_tokens(self.graph, self.state, self.hidden, np.zeros(rows, np.int32), self._settings([], rows)[0],
                          logprobs=self.logprobs)
        shapes = self.widths_and_windows()
        for width, window in shapes:
            settings, budget, stop_ids = self._settings([], width)
            zeros = np.zeros(width, np.int32)
            self.cache, *_ = _decode_chunk(
                self.graph, self.state, self.cache, zeros, zeros, zeros, zeros, budget, np.zeros(width, bool),
                stop_ids, settings, np.int32(0), steps=self.chunk, window=window,
                logprobs=self.logprobs)
        return len(shapes)

    def adopt(self, old: "Engine") -> None:
        """Take over the cached prefixes of an idle engine of the same model with at most as many slots and
        columns (an agent whose call needs a larger engine keeps its dialogues' prefixes): its rows become
        this engine's first rows."""
        if old.busy() or old.slots > self.slots or old.cache_len > self.cache_len:
            raise ValueError("adopt takes an idle engine with at most as many slots and columns")
        rows, length = old.slots, old.cache_len
        self.cache = self.cache.map_columns(
            lambda new, x, axis: new.at[columns(axis, slice(0, rows), slice(0, length))].set(x), old.cache)
        self.column[:rows], self.padding[:rows] = old.column, old.padding
        self.prefix.adopt(old.prefix)

    def busy(self) -> bool:
        return bool(self.waiting) or any(t is not None for t in self.occupant)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + sum(t is not None for t in self.occupant)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Free the slots of cancelled requests, admit waiting requests into free slots, then one decode chunk."""
        for slot, ticket in enumerate(self.occupant):
            if ticket is not None and ticket.cancelled:
                self._release(slot)
                self._finish(ticket, "cancelled")
        while True:  # fill every free slot before decoding: the chunk runs them all
            while self._admit_waiting():
                pass
            if not self._fresh:
                break
            self._first()  # first tokens may finish requests (a stop id, max_tokens 1) and free their slots
        if any(t is not None for t in self.occupant):
            self._compact()
            self._decode()

    def _left(self, slot: int) -> int:
        """Tokens the slot's request may still generate."""
        ticket = self.occupant[slot]
        return ticket.request.max_tokens - len(ticket.tokens)

    def _compact(self) -> None:
        """Move the live rows above the narrowest width that holds them all into free slots below it, when
        that at least halves the decode width for 4 or more steps. Free slots are taken lowest first, but
        the rows left running when the queue runs dry sit wherever their requests came in: at 32 clients
        on the serve benchmark the last 45 of ~100 steps decoded 2-16 live rows as 32. Moving a row swaps
        it with the free one (at most ``slots / 2`` pairs, one compiled shape; the free row's cached prefix
        goes up), about two steps' reading."""
        live = [s for s, t in enumerate(self.occupant) if t is not None]
        width, narrow = self._width(live[-1]), self._width(len(live) - 1)
        if narrow > width // 2 or max(map(self._left, live)) < 4:
            return
        moves = list(zip([s for s in live if s >= narrow], [s for s in range(narrow) if self.occupant[s] is None]))
        source, target = np.zeros((2, max(1, self.slots // 2)), np.int32)
        source[:len(moves)], target[:len(moves)] = zip(*moves)
        self.cache = _swap_rows(self.cache, source, target, np.int32(len(moves)))
        for a, b in moves:
            self.occupant[b], self.occupant[a] = self.occupant[a], None
            self.prefix.swap(a, b)
            for array in (self.token, self.column, self.padding):
                array[[a, b]] = array[[b, a]]
        self.stats["moved_rows"] += len(moves)

    def _tiles(self, request: Request) -> int:
        """Tile bucket: a multiple of ``geometry.max_tiles`` (0 without images)."""
        if not request.image_sizes:
            return 0
        per = self.model.cfg.geometry.max_tiles
        return -(-len(request.pixel_values) // per) * per

    def _plan(self, ticket: Ticket) -> tuple[tuple, int, int]:
        """(group key, source row, cached prefix length) of a waiting request: ("extend", rest bucket) when a
        cached prefix leaves a shorter bucket to prefill than the whole prompt's, else ("fresh", bucket,
        tiles), -1, 0."""
        request = ticket.request
        bucket = self.bucket(request)
        row, m = self.prefix.match(ticket.ids, ticket.images)
        if m and (rest := prompt_bucket(len(ticket.ids) - m, self.bucket_min, self.bucket_step)) < bucket:
            return ("extend", rest), row, m
        return ("fresh", bucket, self._tiles(request)), -1, 0

    def _admit_waiting(self) -> bool:
        """Prefill one group of waiting requests (one kind and bucket) into free slots; False when none could
        go in. A request that reuses a free row's prefix goes into that row; the others take free rows least
        recently used first, those holding prefixes that waiting requests will reuse last."""
        with self.lock:
            free = [s for s, t in enumerate(self.occupant) if t is None]
            if not free or not self.waiting:
                return False
            plans = [(t, *self._plan(t)) for t in self.waiting]
            key = plans[0][1]
            group = [p for p in plans if p[1] == key]
            fit = min(len(group), len(free), self.prefill_batch, max(1, self.prefill_tokens // key[1]))
            group = group[:1 << (fit.bit_length() - 1)]
            in_place = {}
            for t, _, source, m in group:
                if m and source in free and source not in in_place.values():
                    in_place[t] = source
            victims = iter(self.prefix.victims([s for s in free if s not in in_place.values()],
                                               keep={source for _, _, source, m in plans if m}))
            slots = [in_place[t] if t in in_place else next(victims) for t, *_ in group]
            for t, *_ in group:
                self.waiting.remove(t)
        try:
            if key[0] == "fresh":
                self._prefill([t for t, *_ in group], slots, *key[1:])
            else:
                self._extend(group, slots, key[1])
        except Exception as e:  # a request the model cannot run fails alone; the engine keeps serving
            for (t, *_), slot in zip(group, slots):
                self.prefix.drop(slot)
                self._finish_error(t, e)
        return True

    def _prefill(self, group: list[Ticket], slots: list[int], bucket: int, tiles: int) -> None:
        requests = [t.request for t in group]
        input_ids, attention_mask, positions = left_pad([list(r.prompt) for r in requests], bucket, self.pad_id)
        pixel_values, image_index = None, None
        if tiles:  # the one place a request's tiles are padded: into its prefill's batch
            cfg = self.model.cfg
            pixel_values = pad_tiles([r.pixel_values for r in requests], tiles=tiles, batch=len(group),
                                     tile_size=cfg.geometry.tile_size)
            sizes = [[tuple(s) for s in r.image_sizes] for r in requests]
            image_index = place_images(input_ids, cfg.image_token_id, sizes, cfg.geometry, tiles)
        self.cache, self.hidden = _admit(self.graph, self.state, self.cache, self.hidden, input_ids, attention_mask,
                                         positions, pixel_values, image_index, np.asarray(slots, np.int32))
        self.stats["prefills"] += 1
        for ticket, slot in zip(group, slots):
            self._occupy(slot, ticket, bucket, bucket - len(ticket.ids), 0)

    def _extend(self, group: list[tuple], slots: list[int], length: int) -> None:
        """Prefill the rest of each request after its cached prefix (``group``: (ticket, key, source row,
        prefix length)), the rests right-padded to ``length``, over a window of the first columns past the
        longest prefix + ``length``."""
        rows = len(group)
        input_ids = np.full((rows, length), self.pad_id, np.int32)
        attention_mask = np.zeros((rows, length), bool)
        starts = np.asarray([m for *_, m in group], np.int32)
        for b, (ticket, *_, m) in enumerate(group):
            input_ids[b, :len(ticket.ids) - m] = ticket.ids[m:]
            attention_mask[b, :len(ticket.ids) - m] = True
        positions = starts[:, None] + np.arange(length, dtype=np.int32)
        sources = np.asarray([source for _, _, source, _ in group], np.int32)
        window = self.bucket_min
        while window < int(starts.max()) + length:
            window *= 2
        self.cache, self.hidden = _extend(
            self.graph, self.state, self.cache, self.hidden, input_ids, attention_mask, positions, sources,
            self.prefix.start[sources].astype(np.int32), starts, attention_mask.sum(axis=1).astype(np.int32) - 1,
            np.asarray(slots, np.int32), window=min(window, self.cache_len))
        self.stats["prefills"] += 1
        self.stats["prefix_hits"] += rows
        for (ticket, _, source, m), slot in zip(group, slots):
            self.prefix.touch(source)
            self._occupy(slot, ticket, len(ticket.ids), 0, m)

    def _occupy(self, slot: int, ticket: Ticket, column: int, padding: int, reused: int) -> None:
        """A prefilled request takes its slot: its next token goes to ``column``, its prompt's KV sits from
        column ``padding``, the first ``reused`` of them from a cached prefix."""
        self.occupant[slot] = ticket
        self.column[slot], self.padding[slot] = column, padding
        self.prefix.hold(slot, ticket.ids, ticket.images, padding)
        self._fresh.append(slot)
        n = len(ticket.ids)
        self.stats["prompt_tokens"] += n
        self.stats["reused_tokens"] += reused
        self.stats["prefilled_tokens"] += n - reused

    def _release(self, slot: int) -> None:
        """Free a slot whose request ended; its row keeps the KV of the prompt and the tokens fed after it
        (every generated one but the last), to be reused."""
        ticket, self.occupant[slot] = self.occupant[slot], None
        held = int(self.column[slot] - self.padding[slot])
        tokens = np.concatenate((ticket.ids, np.asarray(ticket.tokens, np.int32)))[:held]
        self.prefix.hold(slot, tokens, ticket.images, int(self.padding[slot]))

    def _first_rows(self, n: int) -> int:
        """Rows of the first-token product for ``n`` fresh slots: a power of two, at most ``slots``."""
        return min(1 << (n - 1).bit_length(), self.slots)

    def _first(self) -> None:
        """The first tokens of the requests prefilled since the last call, in one product (padded with the
        first slot)."""
        slots, self._fresh = self._fresh, []
        rows = self._first_rows(len(slots))
        settings, _, _ = self._settings([self.occupant[s].request for s in slots], rows)
        token, logprob = _first_tokens(self.graph, self.state, self.hidden,
                                       np.asarray(slots + slots[:1] * (rows - len(slots)), np.int32), settings,
                                       logprobs=self.logprobs)
        token, logprob = np.asarray(token), np.asarray(logprob)
        self.stats["first_products"] += 1
        for b, slot in enumerate(slots):
            self.token[slot] = token[b]
            self._emit(slot, [int(token[b])], [float(logprob[b])])

    def _settings(self, requests: Sequence[Request], rows: int) -> tuple[RowSettings, np.ndarray, np.ndarray]:
        """Per-row sampling settings, token budgets and stop ids (-1 padded), padded to ``rows`` (greedy, a
        budget of one, no stop ids)."""
        stop_ids = np.full((rows, MAX_STOP_IDS), -1, np.int32)
        for b, r in enumerate(requests):
            ids = self.stop_ids if r.stop_ids is None else tuple(r.stop_ids)
            stop_ids[b, :len(ids)] = ids
        budget = np.asarray([r.max_tokens for r in requests] + [1] * (rows - len(requests)), np.int32)
        return RowSettings.of(requests, rows), budget, stop_ids

    def _decode(self) -> None:
        # Decode only the first `width` slots (free slots are taken lowest first): one request alone costs a
        # 1-row step, not a `slots`-row one; over a window past every live row's last column in this chunk.
        live_slots = [s for s, t in enumerate(self.occupant) if t is not None]
        width = self._width(live_slots[-1])
        occupant = self.occupant[:width]
        left = {s: self._left(s) for s in live_slots}
        with self.lock:
            wanted = 1 if self.waiting else 0  # end the chunk as soon as a waiting request can go in
        # The chunk's steps, as far as the host can tell: to the first finishing row when it ends there.
        steps = min(self.chunk, sorted(left.values())[wanted - 1] if wanted else max(left.values()))
        window = self._window(max(int(self.column[s]) + min(self.chunk, left[s]) for s in live_slots), steps)
        requests = [t.request if t is not None else Request([0], max_tokens=1) for t in occupant]
        settings, budget, stop_ids = self._settings(requests, width)
        live = np.asarray([t is not None for t in occupant])
        count = np.asarray([len(t.tokens) if t is not None else 0 for t in occupant], np.int32)
        self.cache, tokens, logprobs = _decode_chunk(
            self.graph, self.state, self.cache, self.column[:width], self.token[:width],
            self.column[:width] - self.padding[:width], count, budget, live, stop_ids, settings, np.int32(wanted),
            steps=self.chunk, window=window,
            logprobs=self.logprobs)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        self.stats["decode_chunks"] += 1
        self.stats["decode_steps"] += int((tokens >= 0).any(axis=0).sum())
        for slot, ticket in enumerate(occupant):
            if ticket is None:
                continue
            n = int((tokens[slot] >= 0).sum())
            self.token[slot] = tokens[slot, n - 1]
            self.column[slot] += n
            self._emit(slot, tokens[slot, :n].tolist(), logprobs[slot, :n].tolist())
        self._freed = sum(t is not None and self.occupant[s] is None for s, t in enumerate(occupant))

    def _emit(self, slot: int, tokens: list[int], logprobs: list[float]) -> None:
        """Append a slot's new tokens; finish its request (freeing the slot) on a stop or its budget."""
        ticket = self.occupant[slot]
        request = ticket.request
        stop_ids = self.stop_ids if request.stop_ids is None else tuple(request.stop_ids)
        reason = None
        for token, logprob in zip(tokens, logprobs):
            ticket.tokens.append(token)
            if self.logprobs:
                ticket.logprobs.append(logprob)
            if token in stop_ids:
                reason = "stop"
                break
            if len(ticket.tokens) >= request.max_tokens:
                reason = "length"
                break
        self.stats["tokens"] += len(tokens)
        hold = 0
        if self.tokenizer is not None:
            ids = [t for t in ticket.tokens if t not in stop_ids]
            ticket.text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cuts = [i for i in (ticket.text.find(s) for s in request.stop if s) if i >= 0]
            if cuts:
                ticket.text, reason = ticket.text[:min(cuts)], "stop"
            elif reason is None:  # not yet sure these characters stay: a stop string may be starting
                hold = max([len(s) - 1 for s in request.stop] + [0])
                hold += len(ticket.text) - len(ticket.text.rstrip("\ufffd"))  # an incomplete UTF-8 character
        if reason is not None:
            self._release(slot)
            self._finish(ticket, reason)
        elif ticket.on_update is not None:
            end = max(ticket.sent, len(ticket.text) - hold)
            delta, ticket.sent = ticket.text[ticket.sent:end], end
            ticket.on_update(ticket, delta, None)

    def _finish(self, ticket: Ticket, reason: str) -> None:
        """Hand a finished request (a stop, its budget, or cancelled) its :class:`Result`; the rest of its text
        goes to ``on_update`` with the reason."""
        if ticket.on_update is not None:
            delta, ticket.sent = ticket.text[ticket.sent:], len(ticket.text)
            ticket.on_update(ticket, delta, reason)
        self.stats["cancelled" if reason == "cancelled" else "requests"] += 1
        ticket.result = Result(list(ticket.tokens), list(ticket.logprobs),
                               ticket.text if self.tokenizer is not None else None, reason,
                               len(ticket.request.prompt))
        ticket._done.set()

    def _finish_error(self, ticket: Ticket, error: BaseException) -> None:
        ticket.error = error
        if ticket.on_update is not None:
            ticket.on_update(ticket, "", "error")
        ticket._done.set()

    # -- a background thread ----------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._serve, name="fire_jax-engine", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            with self.lock:
                while not self.busy() and not self._stopping:
                    self.lock.wait()
                if self._stopping and not self.busy():
                    return
                # The clients of requests that just finished may be sending their next ones: wait a moment
                # (at most admit_wait seconds) for as many as finished, rather than leave their slots idle
                # for a whole chunk.
                deadline = time.perf_counter() + self.admit_wait
                while (self._freed and len(self.waiting) < self._freed and not self._stopping
                       and (left := deadline - time.perf_counter()) > 0):
                    self.lock.wait(left)
                self._freed = 0
            try:
                self.step()
            except Exception as e:  # a failed decode fails the requests in the slots, never the thread
                for slot, ticket in enumerate(self.occupant):
                    if ticket is not None:
                        self.occupant[slot] = None
                        self.prefix.drop(slot)
                        self._finish_error(ticket, e)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish those in flight (``drain``) or fail them; join the thread."""
        with self.lock:
            self.accepting = False
            if not drain:
                for t in list(self.waiting):
                    self._finish_error(t, RuntimeError("the engine stopped"))
                self.waiting.clear()
            self._stopping = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
