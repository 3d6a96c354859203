"""The decoder: continuous batching over fixed decode slots of one static-shape KV cache.

Every generation in fire_jax runs here: a server's requests as they arrive,
an agent's batch of dialogue turns, and :func:`fire_jax.infer.decode.generate`'s
fixed batch (a short driver over an :class:`Engine`). ``slots`` rows share one
cache ``[slots, cache_len]`` per layer. Between decode chunks the host admits
waiting requests into free slots (a batched prefill of prompts of one length
bucket, written into the slots' cache rows), and a request that stops frees
its slot at the next chunk boundary.

The engine in parts: :class:`Engine` (here) takes requests, runs the loop and
hands out results; :class:`fire_jax.infer.scheduler.Scheduler` decides which
requests go into which slots (prefill plans, the prefix cache, row moves);
:mod:`fire_jax.infer.kernels` holds the jitted programs (prefill, first tokens,
decode chunks with their typed loop state, row swaps);
:class:`fire_jax.infer.buckets.Buckets` the one bucket rule and the one window
rule, so compiled shapes are few and known up front. Masked cache columns weigh
exactly zero in attention, so a request's greedy tokens do not depend on what
runs beside it (tested alone and among 31 others, and against transformers'
``generate``).

**Prefix caching** (``EngineConfig.prefix_cache``): a request whose prompt
begins with the keys and values a row still holds prefills only the rest.
Reused keys and values were computed by another prefill and by decode steps,
so a log-prob may differ in the last bits from a whole-prompt prefill; greedy
tokens are the same on the tests' workloads. ``stats`` counts prompt tokens
admitted, reused and prefilled.

**Per request** (:class:`fire_jax.infer.sampling.SamplingParams`, checked when
made): ``max_tokens``, stop ids and stop strings, and greedy or temperature /
top-k / top-p sampling with its own seed: the key of token t is
``fold_in(key(seed), t)``, so a sampled request draws the same tokens whatever
runs beside it. docs/decoding.md has the design and its measurements.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fire_jax.core.config import DEFAULT_RULES
from fire_jax.core.geometry import place_images
from fire_jax.data.images import pad_tiles
from fire_jax.infer import kernels
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.prefix_cache import PrefixCache, image_key
from fire_jax.infer.requests import Request, Result, Ticket
from fire_jax.infer.sampling import MAX_STOP_IDS, RowSettings, SamplingParams
from fire_jax.infer.scheduler import Fresh, Prefill, Scheduler
from fire_jax.models.llama import columns


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


class ContextExceeded(ValueError):
    """A request whose prompt bucket and ``max_tokens`` are over a cache row (:meth:`Engine.check`)."""


class Engine:
    """Continuous batching over ``config.slots`` decode slots of ``config.cache_len`` cache columns each
    (:class:`fire_jax.infer.engine_config.EngineConfig` says what each field does).

    Drive it with :meth:`generate` (a list of requests, run to the end), or
    :meth:`start` a background thread and :meth:`submit` from any thread.

    Args:
      model: a :class:`fire_jax.models.LlavaNext`.
      config: the engine's shape.
      tokenizer: anything with ``decode(ids, skip_special_tokens=True)``; needed for stop strings and text.
      mesh: split the slots over its ``data`` axis (``slots`` is rounded up to a multiple of its size, and
        every chunk decodes all of them) and the cache's KV heads over ``tensor`` when that divides them,
        through the logical axis rules of the models' parameters (``fire_jax.core.config.DEFAULT_RULES``).
    """

    def __init__(self, model, config: EngineConfig = EngineConfig(), *, tokenizer=None, mesh: Mesh | None = None):
        if config.pad_id == model.cfg.image_token_id:
            raise ValueError(f"pad_id {config.pad_id} is the image token id")
        if mesh is not None:
            slots = -(-config.slots // mesh.shape["data"]) * mesh.shape["data"]
            config = config.replace(slots=slots, min_width=slots)  # a narrower chunk would gather rows across data
        self.model, self.config, self.tokenizer, self.mesh = model, config, tokenizer, mesh
        self.buckets = config.buckets
        graphdef, state = nnx.split(model)
        self.graph, self.state = kernels.Graph(graphdef), kernels.state_on_mesh(state, mesh)
        self.cache, self.hidden = kernels.new_cache(model, config.slots, config.cache_len, mesh, DEFAULT_RULES)
        self.prefix = PrefixCache(config.slots, config.cache_len, model.cfg.image_token_id,
                                  enabled=config.prefix_cache)
        self.scheduler = Scheduler(config.slots, self.buckets, self.prefix, prefill_batch=config.prefill_batch,
                                   prefill_tokens=config.prefill_tokens, min_width=config.min_width,
                                   tiles_per_image=model.cfg.geometry.max_tiles)
        self.slots_state = self.scheduler.slots
        self.waiting = self.scheduler.waiting
        self._fresh: list[int] = []  # slots prefilled since the last first-token product
        self.lock = threading.Condition()
        self.accepting = True
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._freed = 0  # requests the last decode chunk finished
        # prefills, first products, decode chunks / steps, tokens, requests...; prompt tokens admitted, of which
        # reused (a cached prefix) and prefilled
        self.stats = collections.Counter()

    @property
    def slots(self) -> int:
        return self.config.slots

    @property
    def cache_len(self) -> int:
        return self.config.cache_len

    @property
    def max_images(self) -> int:
        return self.config.max_images

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.config.stop_ids

    # -- requests ---------------------------------------------------------------------------------

    def stop_ids_of(self, request: Request) -> tuple[int, ...]:
        """A request's stop ids: its own, or the engine's when it names none."""
        return self.config.stop_ids if request.sampling.stop_ids is None else request.sampling.stop_ids

    def check(self, request: Request) -> None:
        """Raise ValueError when a request cannot run on this engine (its settings were checked when made):
        an empty prompt, a prompt and max_tokens over a cache row (:class:`ContextExceeded`), too many images,
        stop strings without a tokenizer, too many stop ids of the engine's."""
        n = len(request.prompt)
        if n < 1:
            raise ValueError("empty prompt")
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        if len(self.stop_ids_of(request)) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(self.stop_ids_of(request))}")
        if len(request.image_sizes) > self.config.max_images:
            raise ValueError(f"at most {self.config.max_images} images per request, got {len(request.image_sizes)}")
        bucket, max_tokens = self.bucket(request), request.sampling.max_tokens
        if bucket + max_tokens > self.config.cache_len:
            raise ContextExceeded(f"prompt of {n} tokens (bucket {bucket}) + max_tokens {max_tokens} exceeds the "
                                  f"context of {self.config.cache_len} tokens")

    def bucket(self, request: Request) -> int:
        """A request's prompt bucket, leaving room for its ``max_tokens`` in the cache row."""
        return self.scheduler.bucket(request)

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

    def widths_and_windows(self) -> list[tuple[int, int]]:
        """Every (width, window) a decode chunk may take: which ones a run meets depends on when requests
        arrive and finish."""
        return [(w, c) for w in self.scheduler.widths() for c in self.buckets.decode_windows()]

    def warm_up(self) -> int:
        """Compile every decode chunk shape (each runs zero steps: no live rows), the row move (moving
        nothing) and the first-token products now, so no request waits for a compile mid-run; prefills still
        compile on their first (bucket, rows, tiles). Returns the decode shapes."""
        zeros = np.zeros(max(1, self.config.slots // 2), np.int32)
        self.cache = kernels.swap_rows(self.cache, zeros, zeros, np.int32(0))
        for rows in sorted({self.scheduler.first_rows(n) for n in range(1, self.config.slots + 1)}):
            kernels.first_tokens(self.graph, self.state, self.hidden, np.zeros(rows, np.int32),
                                 RowSettings.of([], rows), logprobs=self.config.logprobs)
        shapes = self.widths_and_windows()
        for width, window in shapes:
            zeros = np.zeros(width, np.int32)
            rows = self._rows([], zeros, zeros, zeros, zeros, np.zeros(width, bool))
            self.cache, *_ = kernels.decode_chunk(self.graph, self.state, self.cache, rows, np.int32(0),
                                                  steps=self.config.chunk, window=window,
                                                  logprobs=self.config.logprobs)
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
        state, held = self.slots_state, old.slots_state
        state.column[:rows], state.padding[:rows] = held.column, held.padding
        self.prefix.adopt(old.prefix)

    def busy(self) -> bool:
        return bool(self.waiting) or any(t is not None for t in self.slots_state.occupant)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.slots_state.live())

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Free the slots of cancelled requests, admit waiting requests into free slots, then one decode chunk."""
        for slot, ticket in enumerate(self.slots_state.occupant):
            if ticket is not None and ticket.cancelled:
                self.scheduler.release(slot)
                self._finish(ticket, "cancelled")
        while True:  # fill every free slot before decoding: the chunk runs them all
            while self._admit_waiting():
                pass
            if not self._fresh:
                break
            self._first()  # first tokens may finish requests (a stop id, max_tokens 1) and free their slots
        if self.slots_state.live():
            self._compact()
            self._decode()

    def _compact(self) -> None:
        """Move the live rows above the narrowest width that holds them all into free slots below it
        (:meth:`fire_jax.infer.scheduler.Scheduler.compaction`)."""
        moves = self.scheduler.compaction()
        if not moves:
            return
        source, target = np.zeros((2, max(1, self.config.slots // 2)), np.int32)
        source[:len(moves)], target[:len(moves)] = zip(*moves)
        self.cache = kernels.swap_rows(self.cache, source, target, np.int32(len(moves)))
        self.stats["moved_rows"] += len(moves)

    def _admit_waiting(self) -> bool:
        """Prefill the scheduler's next group of waiting requests into free slots; False when none could go
        in."""
        with self.lock:
            prefill = self.scheduler.next_prefill()
        if prefill is None:
            return False
        try:
            if isinstance(prefill.kind, Fresh):
                self._prefill(prefill)
            else:
                self._extend(prefill)
        except Exception as e:  # a request the model cannot run fails alone; the engine keeps serving
            for ticket, slot in zip(prefill.tickets, prefill.slots):
                self.prefix.drop(slot)
                ticket.fail(e)
        return True

    def _prefill(self, prefill: Prefill) -> None:
        requests = [t.request for t in prefill.tickets]
        bucket, tiles = prefill.kind.bucket, prefill.kind.tiles
        input_ids, attention_mask, positions = left_pad([list(r.prompt) for r in requests], bucket,
                                                        self.config.pad_id)
        pixel_values, image_index = None, None
        if tiles:  # the one place a request's tiles are padded: into its prefill's batch
            cfg = self.model.cfg
            pixel_values = pad_tiles([r.pixel_values for r in requests], tiles=tiles, batch=len(requests),
                                     tile_size=cfg.geometry.tile_size)
            sizes = [[tuple(s) for s in r.image_sizes] for r in requests]
            image_index = place_images(input_ids, cfg.image_token_id, sizes, cfg.geometry, tiles)
        self.cache, self.hidden = kernels.admit(self.graph, self.state, self.cache, self.hidden, input_ids,
                                                attention_mask, positions, pixel_values, image_index,
                                                np.asarray(prefill.slots, np.int32))
        self.stats["prefills"] += 1
        for ticket, slot in zip(prefill.tickets, prefill.slots):
            self._occupy(slot, ticket, bucket, bucket - len(ticket.ids), 0)

    def _extend(self, prefill: Prefill) -> None:
        """Prefill the rest of each request after its cached prefix, the rests right-padded to the plan's
        length, over a window of the first columns past the longest prefix + that length."""
        admissions, length = prefill.admissions, prefill.kind.length
        rows = len(admissions)
        input_ids = np.full((rows, length), self.config.pad_id, np.int32)
        attention_mask = np.zeros((rows, length), bool)
        starts = np.asarray([a.reused for a in admissions], np.int32)
        for b, a in enumerate(admissions):
            input_ids[b, :len(a.ticket.ids) - a.reused] = a.ticket.ids[a.reused:]
            attention_mask[b, :len(a.ticket.ids) - a.reused] = True
        positions = starts[:, None] + np.arange(length, dtype=np.int32)
        sources = np.asarray([a.source for a in admissions], np.int32)
        self.cache, self.hidden = kernels.extend(
            self.graph, self.state, self.cache, self.hidden, input_ids, attention_mask, positions, sources,
            self.prefix.start[sources].astype(np.int32), starts, attention_mask.sum(axis=1).astype(np.int32) - 1,
            np.asarray(prefill.slots, np.int32), window=self.buckets.window(int(starts.max()) + length))
        self.stats["prefills"] += 1
        self.stats["prefix_hits"] += rows
        for a, slot in zip(admissions, prefill.slots):
            self.prefix.touch(a.source)
            self._occupy(slot, a.ticket, len(a.ticket.ids), 0, a.reused)

    def _occupy(self, slot: int, ticket: Ticket, column: int, padding: int, reused: int) -> None:
        """A prefilled request takes its slot (its first ``reused`` prompt tokens from a cached prefix)."""
        self.scheduler.occupy(slot, ticket, column, padding)
        self._fresh.append(slot)
        n = len(ticket.ids)
        self.stats["prompt_tokens"] += n
        self.stats["reused_tokens"] += reused
        self.stats["prefilled_tokens"] += n - reused

    def _first(self) -> None:
        """The first tokens of the requests prefilled since the last call, in one product (padded with the
        first slot)."""
        slots, self._fresh = self._fresh, []
        rows = self.scheduler.first_rows(len(slots))
        settings = RowSettings.of([self.slots_state.occupant[s].request.sampling for s in slots], rows)
        token, logprob = kernels.first_tokens(self.graph, self.state, self.hidden,
                                              np.asarray(slots + slots[:1] * (rows - len(slots)), np.int32),
                                              settings, logprobs=self.config.logprobs)
        token, logprob = np.asarray(token), np.asarray(logprob)
        self.stats["first_products"] += 1
        for b, slot in enumerate(slots):
            self.slots_state.token[slot] = token[b]
            self._emit(slot, [int(token[b])], [float(logprob[b])])

    def _rows(self, tickets: Sequence[Ticket | None], token, column, position, count, live) -> kernels.DecodeRows:
        """A decode chunk's rows: the tickets' settings, budgets and stop ids (-1 padded); a free slot's (None)
        greedy, a budget of one, no stop ids, as are rows past the tickets."""
        width = len(token)
        params = [t.request.sampling if t is not None else SamplingParams(max_tokens=1) for t in tickets]
        stop_ids = np.full((width, MAX_STOP_IDS), -1, np.int32)
        for b, t in enumerate(tickets):
            if t is not None:
                ids = self.stop_ids_of(t.request)
                stop_ids[b, :len(ids)] = ids
        budget = np.asarray([p.max_tokens for p in params] + [1] * (width - len(params)), np.int32)
        return kernels.DecodeRows(token, column, position, count, budget, live, stop_ids,
                                  RowSettings.of(params, width))

    def _decode(self) -> None:
        # Decode only the first `width` slots (free slots are taken lowest first): one request alone costs a
        # 1-row step, not a `slots`-row one; over a window past every live row's last column in this chunk.
        state, scheduler = self.slots_state, self.scheduler
        live_slots = state.live()
        width = scheduler.width(live_slots[-1])
        occupant = state.occupant[:width]
        left = {s: scheduler.left(s) for s in live_slots}
        with self.lock:
            wanted = 1 if self.waiting else 0  # end the chunk as soon as a waiting request can go in
        # The chunk's steps, as far as the host can tell: to the first finishing row when it ends there.
        chunk = self.config.chunk
        steps = min(chunk, sorted(left.values())[wanted - 1] if wanted else max(left.values()))
        window = self.buckets.decode_window(max(int(state.column[s]) + min(chunk, left[s]) for s in live_slots),
                                            steps)
        live = np.asarray([t is not None for t in occupant])
        count = np.asarray([len(t.tokens) if t is not None else 0 for t in occupant], np.int32)
        rows = self._rows(occupant, state.token[:width], state.column[:width],
                          state.column[:width] - state.padding[:width], count, live)
        self.cache, tokens, logprobs = kernels.decode_chunk(self.graph, self.state, self.cache, rows,
                                                            np.int32(wanted), steps=chunk, window=window,
                                                            logprobs=self.config.logprobs)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        self.stats["decode_chunks"] += 1
        self.stats["decode_steps"] += int((tokens >= 0).any(axis=0).sum())
        for slot, ticket in enumerate(occupant):
            if ticket is None:
                continue
            n = int((tokens[slot] >= 0).sum())
            state.token[slot] = tokens[slot, n - 1]
            state.column[slot] += n
            self._emit(slot, tokens[slot, :n].tolist(), logprobs[slot, :n].tolist())
        self._freed = sum(t is not None and state.occupant[s] is None for s, t in enumerate(occupant))

    def _emit(self, slot: int, tokens: list[int], logprobs: list[float]) -> None:
        """Append a slot's new tokens to its request; finish it (freeing the slot) on a stop or its budget."""
        ticket = self.slots_state.occupant[slot]
        self.stats["tokens"] += len(tokens)
        reason = ticket.append(tokens, logprobs if self.config.logprobs else None,
                               self.stop_ids_of(ticket.request), self.tokenizer)
        if reason is not None:
            self.scheduler.release(slot)
            self._finish(ticket, reason)

    def _finish(self, ticket: Ticket, reason: str) -> None:
        """Hand a finished request (a stop, its budget, or cancelled) its result."""
        self.stats["cancelled" if reason == "cancelled" else "requests"] += 1
        ticket.finish(reason, with_text=self.tokenizer is not None)

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
                deadline = time.perf_counter() + self.config.admit_wait
                while (self._freed and len(self.waiting) < self._freed and not self._stopping
                       and (left := deadline - time.perf_counter()) > 0):
                    self.lock.wait(left)
                self._freed = 0
            try:
                self.step()
            except Exception as e:  # a failed decode fails the requests in the slots, never the thread
                for slot, ticket in enumerate(self.slots_state.occupant):
                    if ticket is not None:
                        self.slots_state.occupant[slot] = None
                        self.prefix.drop(slot)
                        ticket.fail(e)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish those in flight (``drain``) or fail them; join the thread."""
        with self.lock:
            self.accepting = False
            if not drain:
                for t in list(self.waiting):
                    t.fail(RuntimeError("the engine stopped"))
                self.waiting.clear()
            self._stopping = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
