"""A generation request and its progress: what is asked (:class:`Request`), how far it has got (:class:`Ticket`:
its tokens, its text and where a stop cuts it, what a follower has been sent) and what it came to
(:class:`Result`). The engine (:class:`fire_jax.infer.engine.Engine`) feeds a ticket the tokens its slot
generates; the ticket decides when the request is done.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

import numpy as np

from fire_jax.infer.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    """One generation request: ``prompt`` token ids, image placeholders expanded (as ``generate``), decoded by
    ``sampling``, with this request's images' tiles concatenated (float32 ``[tiles, 3, H, W]``) and each
    image's (h, w)."""

    prompt: Sequence[int]
    sampling: SamplingParams = SamplingParams()
    pixel_values: np.ndarray | None = None
    image_sizes: Sequence[Sequence[int]] = ()


@dataclasses.dataclass
class Result:
    tokens: list[int]  # generated ids, a stop id kept (as generate)
    logprobs: list[float]  # log p(token) under the raw logits (empty from an engine with logprobs=False)
    text: str | None  # without stop ids, cut before a stop string; None without a tokenizer
    finish_reason: str  # "stop" (stop id or string), "length" or "cancelled"
    prompt_tokens: int


class Ticket:
    """A submitted request: wait for its :class:`Result`, or follow it with ``on_update(ticket, delta, done)``
    (``delta``: the text added since the last call; ``done``: None while it runs, then the finish reason, or
    "error")."""

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

    def append(self, tokens: Sequence[int], logprobs: Sequence[float] | None, stop_ids: Sequence[int],
               tokenizer=None) -> str | None:
        """Take newly generated tokens (their log-probs kept unless None): up to a stop id or the request's
        ``max_tokens``; with a tokenizer, the text decoded again and cut before a stop string. Returns the finish
        reason ("stop", "length"), or None while the request runs, after passing the text that is sure to stay
        to ``on_update``."""
        sampling = self.request.sampling
        reason = None
        for k, token in enumerate(tokens):
            self.tokens.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[k])
            if token in stop_ids:
                reason = "stop"
                break
            if len(self.tokens) >= sampling.max_tokens:
                reason = "length"
                break
        hold = 0
        if tokenizer is not None:
            self.text = tokenizer.decode([t for t in self.tokens if t not in stop_ids], skip_special_tokens=True)
            cuts = [i for i in (self.text.find(s) for s in sampling.stop) if i >= 0]
            if cuts:
                self.text, reason = self.text[:min(cuts)], "stop"
            elif reason is None:  # not yet sure these characters stay: a stop string may be starting
                hold = max([len(s) - 1 for s in sampling.stop] + [0])
                hold += len(self.text) - len(self.text.rstrip("\ufffd"))  # an incomplete UTF-8 character
        if reason is None and self.on_update is not None:
            end = max(self.sent, len(self.text) - hold)
            delta, self.sent = self.text[self.sent:end], end
            self.on_update(self, delta, None)
        return reason

    def finish(self, reason: str, *, with_text: bool) -> None:
        """End the request with its :class:`Result` (``with_text``: the engine decodes text); the rest of its text
        goes to ``on_update`` with the reason. The result is set first: a listener on another thread (the server's
        event loop) may read it as soon as it hears the reason."""
        self.result = Result(list(self.tokens), list(self.logprobs), self.text if with_text else None, reason,
                             len(self.request.prompt))
        if self.on_update is not None:
            delta, self.sent = self.text[self.sent:], len(self.text)
            self.on_update(self, delta, reason)
        self._done.set()

    def fail(self, error: BaseException) -> None:
        """End the request with ``error`` (raised by :meth:`wait`; ``on_update`` hears "error")."""
        self.error = error
        if self.on_update is not None:
            self.on_update(self, "", "error")
        self._done.set()
