"""Which tokens each row of the engine's KV cache holds, to reuse a cached prompt prefix (prefix caching).

A multi-turn dialogue sends prompts that begin with the previous turn's: the
student's prompt for r_k is its prompt for r_{k-1}, then r_{k-1} and f_{k-1};
the teacher's repeats the system prompt, the question with its groundtruth and
the instruction every turn. vLLM's automatic prefix caching
(https://docs.vllm.ai/en/latest/design/prefix_caching.html) and SGLang's
RadixAttention (Zheng et al. 2024, "SGLang: Efficient Execution of Structured
Language Model Programs") keep the KV of finished requests and prefill only
what follows the longest cached prefix. Here the cache is the engine's own
``[slots, cache_len]`` rows (a fixed size, static shapes): a freed slot keeps
its row, and this table records what it holds, so the row is reused in place
or copied into another slot, until a request with nothing to reuse takes the
least recently used free row (LRU eviction).

Images: a prompt's image placeholder ids are the same for any image of that
size, but their keys and values depend on the pixels. So a row also records a
digest of its request's images (:func:`image_key`), and a prefix that covers
an image placeholder matches only a prompt with the same images. A reused
prefix covers every image of the prompt (what remains to prefill is text: no
vision tower runs for it).
"""

from __future__ import annotations

import hashlib

import numpy as np


def image_key(pixel_values, image_sizes) -> bytes | None:
    """A digest of a request's images (tiles and sizes), None without images."""
    if not len(image_sizes):
        return None
    digest = hashlib.blake2b(np.ascontiguousarray(pixel_values, np.float32).tobytes(), digest_size=16)
    digest.update(np.asarray(image_sizes, np.int64).tobytes())
    return digest.digest()


class PrefixCache:
    """The tokens whose keys and values each cache row holds, and which free row to overwrite next.

    Row ``r`` holds the KV of ``tokens[r, :length[r]]`` in columns ``start[r]``, ``start[r] + 1``, ... (the
    engine lays a fresh prompt out left-padded; a prompt that reused a prefix starts at column 0). Unused
    entries are -1, which no token id equals, so one vectorised comparison finds every row's common prefix
    with a prompt. ``enabled=False``: :meth:`match` finds nothing and free rows go lowest first (the
    engine without prefix caching).
    """

    def __init__(self, rows: int, cache_len: int, image_token_id: int, enabled: bool = True):
        self.enabled, self.image_token_id = enabled, image_token_id
        self.tokens = np.full((rows, cache_len), -1, np.int32)
        self.length = np.zeros(rows, np.int64)
        self.start = np.zeros(rows, np.int64)
        self.images: list[bytes | None] = [None] * rows
        self.used = np.zeros(rows, np.int64)  # when each row was last written or reused (LRU)
        self._clock = 0

    def hold(self, row: int, tokens, images: bytes | None, start: int) -> None:
        """Row ``row`` now holds ``tokens``' KV from column ``start``."""
        n = min(len(tokens), self.tokens.shape[1] - start)
        self.tokens[row] = -1
        self.tokens[row, :n] = np.asarray(tokens[:n], np.int32)
        self.length[row], self.start[row], self.images[row] = n, start, images
        self._clock += 1
        self.used[row] = self._clock

    def drop(self, row: int) -> None:
        """Row ``row`` holds nothing reusable (its request failed, or it was overwritten)."""
        self.tokens[row] = -1
        self.length[row], self.images[row] = 0, None

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` swapped their contents (the engine moved a live row into a free one)."""
        for array in (self.tokens, self.length, self.start, self.used):
            array[[a, b]] = array[[b, a]]
        self.images[a], self.images[b] = self.images[b], self.images[a]

    def match(self, prompt: np.ndarray, images: bytes | None) -> tuple[int, int]:
        """(row, m): the row holding the longest reusable prefix of ``prompt`` and its length ``m``, or
        (-1, 0). The prefix leaves at least one token to prefill (its hidden state gives the first new
        token), covers an image only where the row's images are the prompt's, and covers them all."""
        n = len(prompt)
        if not self.enabled or n < 2 or not self.length.any():
            return -1, 0
        k = min(n - 1, self.tokens.shape[1])
        same = self.tokens[:, :k] == prompt[None, :k]
        common = np.where(same.all(axis=1), k, same.argmin(axis=1))
        placeholders = np.flatnonzero(prompt == self.image_token_id)
        if placeholders.size:
            alike = np.asarray([held == images for held in self.images])
            common = np.where(alike, common, np.minimum(common, placeholders[0]))
            common = np.where(common > placeholders[-1], common, 0)
        row = int(np.argmax(common))
        return (row, int(common[row])) if common[row] > 0 else (-1, 0)

    def victims(self, free, keep=()) -> list[int]:
        """The free rows in the order to overwrite them: least recently used first, rows in ``keep``
        (cached prefixes that waiting requests will reuse) last; lowest first when disabled."""
        if not self.enabled:
            return sorted(free)
        return sorted(free, key=lambda r: (r in keep, self.used[r] if self.length[r] else 0, r))

    def adopt(self, old: "PrefixCache") -> None:
        """Take over a smaller table (its rows become the first rows here)."""
        rows, length = old.tokens.shape
        self.tokens[:rows, :length], self.length[:rows], self.start[:rows] = old.tokens, old.length, old.start
        self.images[:rows], self.used[:rows], self._clock = old.images, old.used, max(self._clock, old._clock)

    def touch(self, row: int) -> None:
        self._clock += 1
        self.used[row] = self._clock
