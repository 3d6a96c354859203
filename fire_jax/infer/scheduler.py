"""Which requests run where: the engine's decode slots, its waiting queue, prefill plans and row moves.

Host-side bookkeeping only (numpy and Python, no JAX): :class:`fire_jax.infer.engine.Engine` asks the
:class:`Scheduler` what to prefill next (a :class:`Prefill`: one group of waiting requests of one kind and
bucket, and the slots they go into) and which rows to move down before a decode chunk, and runs the
kernels (:mod:`fire_jax.infer.kernels`) on the answer.

**Prefix caching** (vLLM's automatic prefix caching, SGLang's RadixAttention): a row outlives its request.
:class:`fire_jax.infer.prefix_cache.PrefixCache` records the tokens whose keys and values each row holds,
and a request whose prompt begins with a held prefix (the same dialogue's previous turn, a prompt shared
with another request, image tokens only for the same images) prefills only the rest (an :class:`Extend`).
Free rows are evicted least recently used first.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from fire_jax.infer.buckets import Buckets
from fire_jax.infer.prefix_cache import PrefixCache


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A whole prompt prefilled, left-padded to ``bucket``, with ``tiles`` image tiles (a multiple of the
    model's tiles per image; 0 without images)."""

    bucket: int
    tiles: int

    @property
    def length(self) -> int:
        return self.bucket


@dataclasses.dataclass(frozen=True)
class Extend:
    """The rest of a prompt after its cached prefix prefilled, right-padded to ``length``."""

    length: int


@dataclasses.dataclass(frozen=True)
class Admission:
    """How one waiting request goes in: as a :class:`Fresh` or an :class:`Extend` prefill; ``source``: the row
    that holds its cached prefix of ``reused`` tokens (-1 and 0 for a fresh one)."""

    ticket: object  # fire_jax.infer.requests.Ticket
    kind: Fresh | Extend
    source: int = -1
    reused: int = 0


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One prefill: requests of one kind and bucket (``admissions``) into cache rows ``slots``."""

    kind: Fresh | Extend
    admissions: list[Admission]
    slots: list[int]

    @property
    def tickets(self) -> list:
        return [a.ticket for a in self.admissions]


@dataclasses.dataclass
class Slots:
    """Every decode slot's state: its request (None: free), the last generated token (fed next), the cache
    column its next token is written at, and its prompt's left padding (its position is column - padding)."""

    occupant: list
    token: np.ndarray
    column: np.ndarray
    padding: np.ndarray

    @classmethod
    def empty(cls, n: int) -> "Slots":
        return cls([None] * n, np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32))

    def live(self) -> list[int]:
        return [s for s, t in enumerate(self.occupant) if t is not None]

    def free(self) -> list[int]:
        return [s for s, t in enumerate(self.occupant) if t is None]

    def swap(self, a: int, b: int) -> None:
        self.occupant[a], self.occupant[b] = self.occupant[b], self.occupant[a]
        for array in (self.token, self.column, self.padding):
            array[[a, b]] = array[[b, a]]


class Scheduler:
    """The slots, the waiting queue and the prefix cache of an engine of ``slots`` rows; the caller holds the
    engine's lock around :meth:`next_prefill` (the queue is shared with submitting threads)."""

    def __init__(self, slots: int, buckets: Buckets, prefix: PrefixCache, *, prefill_batch: int,
                 prefill_tokens: int, min_width: int, tiles_per_image: int):
        self.size, self.buckets, self.prefix = slots, buckets, prefix
        self.prefill_batch, self.prefill_tokens = max(1, min(prefill_batch, slots)), prefill_tokens
        self.min_width = min(max(min_width, 1), slots)
        self.tiles_per_image = tiles_per_image
        self.slots = Slots.empty(slots)
        self.waiting: collections.deque = collections.deque()

    def bucket(self, request) -> int:
        """A request's prompt bucket, leaving room for its ``max_tokens`` in the cache row."""
        return self.buckets.prompt(len(request.prompt), room=self.buckets.cache_len - request.sampling.max_tokens)

    def tiles(self, request) -> int:
        """Tile bucket: a multiple of the model's tiles per image (0 without images)."""
        if not request.image_sizes:
            return 0
        return -(-len(request.pixel_values) // self.tiles_per_image) * self.tiles_per_image

    def width(self, last_slot: int) -> int:
        """Slots a decode chunk covers: a power of two past the highest live slot, at least ``min_width``."""
        return min(max(1 << last_slot.bit_length(), self.min_width), self.size)

    def widths(self) -> list[int]:
        """Every width a decode chunk may take."""
        return sorted({self.width(slot) for slot in range(self.size)})

    def first_rows(self, n: int) -> int:
        """Rows of the first-token product for ``n`` fresh slots: a power of two, at most ``slots``."""
        return min(1 << (n - 1).bit_length(), self.size)

    def left(self, slot: int) -> int:
        """Tokens the slot's request may still generate."""
        ticket = self.slots.occupant[slot]
        return ticket.request.sampling.max_tokens - len(ticket.tokens)

    def admission(self, ticket) -> Admission:
        """How a waiting request goes in: an :class:`Extend` when a cached prefix leaves a shorter bucket to
        prefill than the whole prompt's, else a :class:`Fresh`."""
        request = ticket.request
        bucket = self.bucket(request)
        row, m = self.prefix.match(ticket.ids, ticket.images)
        if m and (rest := self.buckets.rest(len(ticket.ids) - m)) < bucket:
            return Admission(ticket, Extend(rest), row, m)
        return Admission(ticket, Fresh(bucket, self.tiles(request)))

    def next_prefill(self) -> Prefill | None:
        """The next group of waiting requests (the first one's kind and bucket, a power of two of them within
        ``prefill_batch`` rows and ``prefill_tokens`` padded tokens) and their slots, taken off the queue; None
        when no slot is free or none waits. A request that reuses a free row's prefix goes into that row; the
        others take free rows least recently used first, those holding prefixes that waiting requests will
        reuse last."""
        free = self.slots.free()
        if not free or not self.waiting:
            return None
        plans = [self.admission(t) for t in self.waiting]
        kind = plans[0].kind
        group = [p for p in plans if p.kind == kind]
        fit = min(len(group), len(free), self.prefill_batch, max(1, self.prefill_tokens // kind.length))
        group = group[:1 << (fit.bit_length() - 1)]
        in_place = {}
        for p in group:
            if p.reused and p.source in free and p.source not in in_place.values():
                in_place[p.ticket] = p.source
        victims = iter(self.prefix.victims([s for s in free if s not in in_place.values()],
                                           keep={p.source for p in plans if p.reused}))
        slots = [in_place[p.ticket] if p.ticket in in_place else next(victims) for p in group]
        for p in group:
            self.waiting.remove(p.ticket)
        return Prefill(kind, group, slots)

    def occupy(self, slot: int, ticket, column: int, padding: int) -> None:
        """A prefilled request takes its slot: its next token goes to ``column``, its prompt's KV sits from
        column ``padding``."""
        self.slots.occupant[slot] = ticket
        self.slots.column[slot], self.slots.padding[slot] = column, padding
        self.prefix.hold(slot, ticket.ids, ticket.images, padding)

    def release(self, slot: int) -> None:
        """Free a slot whose request ended; its row keeps the KV of the prompt and the tokens fed after it
        (every generated one but the last), to be reused."""
        ticket, self.slots.occupant[slot] = self.slots.occupant[slot], None
        held = int(self.slots.column[slot] - self.slots.padding[slot])
        tokens = np.concatenate((ticket.ids, np.asarray(ticket.tokens, np.int32)))[:held]
        self.prefix.hold(slot, tokens, ticket.images, int(self.slots.padding[slot]))

    def compaction(self) -> list[tuple[int, int]]:
        """Moves (live row, free slot below) of the live rows above the narrowest width that holds them all,
        when that at least halves the decode width for 4 or more steps: free slots are taken lowest first, but
        the rows left running when the queue runs dry sit wherever their requests came in. Moving a row costs
        about two steps' reading of it. Applies them to the slot state and the prefix cache (the free row's
        cached prefix goes up); the caller swaps the cache rows (at most ``slots / 2`` pairs)."""
        live = self.slots.live()
        width, narrow = self.width(live[-1]), self.width(len(live) - 1)
        if narrow > width // 2 or max(map(self.left, live)) < 4:
            return []
        moves = list(zip([s for s in live if s >= narrow],
                         [s for s in range(narrow) if self.slots.occupant[s] is None]))
        for a, b in moves:
            self.slots.swap(a, b)
            self.prefix.swap(a, b)
        return moves
