"""The engine's shape buckets: the padded length of every prefill and the cache window of every step.

An engine compiles one program per shape it meets, so every length it runs is rounded up to a few known
values: a prompt to its bucket (:meth:`Buckets.prompt`), the rest of a prompt after a cached prefix to its own
bucket (:meth:`Buckets.rest`), and the cache columns a prefill of that rest or a decode chunk attends over to
a window of ``bucket_min * 2^j`` columns (:meth:`Buckets.window`, :meth:`Buckets.decode_window`). Admission,
prefix-cache extension and decoding all read this one object.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucket rules of an engine with ``cache_len`` columns per row.

    ``bucket_step`` None (a server's engine): a prompt pads to a multiple of ``bucket_min`` up to
    ``8 * bucket_min`` tokens, then of ``2 * bucket_min`` up to twice that, and so on: a prompt pads less than a
    quarter of its length, and a context of C columns has 8 buckets up to ``8 * bucket_min`` and 4 per doubling
    after that (docs/serving.md compares it with powers of two). ``bucket_step`` an int (batch jobs: the agents
    and :func:`fire_jax.infer.decode.generate`): the next power of two from ``bucket_min`` up to
    ``bucket_step``, then multiples of ``bucket_step``: fewer shapes to compile.
    """

    bucket_min: int = 64
    bucket_step: int | None = None
    cache_len: int | None = None  # None: no cache to fit (sizing an engine)

    def prompt(self, n: int, room: int | None = None) -> int:
        """The padded length of an ``n``-token prompt. A bucket past ``room`` (the columns a cache row leaves
        the prompt) falls back to ``n`` rounded up to a multiple of ``bucket_min``."""
        if self.bucket_step is None:
            step = self.bucket_min
            while n > 8 * step:
                step *= 2
            length = -(-n // step) * step
        else:
            length = self.bucket_min
            while length < min(n, self.bucket_step):
                length *= 2
            length = length if n <= length else -(-n // self.bucket_step) * self.bucket_step
        if room is not None and length > room:
            return -(-n // self.bucket_min) * self.bucket_min
        return length

    def rest(self, n: int) -> int:
        """The padded length of the ``n`` tokens of a prompt past its cached prefix (prefilled after it)."""
        return self.prompt(n)

    def window(self, columns: int) -> int:
        """The cache columns a step over the first ``columns`` attends over: ``bucket_min * 2^j`` >=
        ``columns``, at most the whole row."""
        window = self.bucket_min
        while window < columns:
            window *= 2
        return window if self.cache_len is None else min(window, self.cache_len)

    def decode_window(self, columns: int, steps: int | None = None) -> int:
        """The window of a decode chunk of ``steps`` steps over the first ``columns``: :meth:`window`, or the
        whole row when cutting the window out and writing it back costs more than it saves. The cut and the
        write-back each read and write the window once; each step saves reading the ``cache_len - window``
        columns past it: so a window only when ``steps * (cache_len - window) > 4 * window``. ``steps`` None:
        every window a chunk may take."""
        window = self.window(columns)
        if window >= self.cache_len or (steps is not None and steps * (self.cache_len - window) <= 4 * window):
            return self.cache_len
        return window

    def decode_windows(self) -> list[int]:
        """Every window a decode chunk may take."""
        return sorted({self.decode_window(self.bucket_min << j) for j in range(self.cache_len.bit_length())})
