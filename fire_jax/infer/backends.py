"""Backends: what turns chat prompts with images into texts, the one interface under every agent.

A backend is any object with the :class:`Backend` methods: :meth:`~Backend.generate` (a batch of prompts, each
with its image, to texts) and :meth:`~Backend.stream` (one prompt, its text passed on as it grows), both with
per-call :class:`fire_jax.infer.sampling.SamplingParams` (None: the backend's own, set when it was built). Two
implement it:

- :class:`InProcess`: a model and its chat tokenizer, generating on engines it owns
  (:class:`fire_jax.infer.engine.Engine`): one sized for each call's batch, and a started one that streams;
- :class:`fire_jax.infer.api.ApiBackend`: an OpenAI-compatible endpoint (``api:<base_url>#<model>``).

Backends are built by :func:`fire_jax.infer.factory.generator` (a model spec to a backend); the prompt builders
over them (the student, the teacher, VLRMBench's responder, FIRE-100K generation, the demo's streaming chat)
never look inside one.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol, Sequence

import numpy as np

from fire_jax.data.chat import ChatTokenizer, Message
from fire_jax.data.images import TileCache, load_image, preprocess
from fire_jax.infer.decode import requests_for
from fire_jax.infer.engine import Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.requests import Request
from fire_jax.infer.sampling import SamplingParams


class Backend(Protocol):
    """Texts for chat prompts with images (:class:`fire_jax.data.chat.Message` lists; a message's ``images``
    say where its images go)."""

    #: Where the backend's model came from, in words (a checkpoint, an endpoint).
    description: str
    #: Tokens one streamed request may hold, prompt and reply (0: the backend does not say, an endpoint).
    context: int
    #: The tokenizer a prompt's text is counted in (None: an endpoint's own).
    tokenizer: object
    #: How its images are tiled (:class:`fire_jax.core.geometry.ImageGeometry`; None: an endpoint's own).
    geometry: object

    def generate(self, images: Sequence, prompts: Sequence[Sequence[Message]],
                 sampling: SamplingParams | None = None, rng=None, *, system: str | None = None,
                 errors: bool = False) -> list:
        """Each prompt's text, stripped. ``images[i]``: prompt i's image (a path, bytes or PIL image), or a
        sequence of them (one per image its messages hold, in order). ``rng``: the key sampled calls draw
        with (each row its own seed). ``system``: the system prompt's text (None: fire_jax's,
        :data:`fire_jax.data.chat.SYSTEM`). A failure raises; with ``errors`` a failed row holds its exception
        in place of its text instead (an in-process failure is every row's)."""

    def stream(self, image, messages: Sequence[Message], on_delta: Callable[[str, int], None],
               sampling: SamplingParams | None = None) -> str:
        """One prompt's text, stripped; ``on_delta(piece, tokens)`` with each piece of it as it is generated and
        the tokens generated so far. An exception raised by ``on_delta`` stops the generation and is raised.
        Raises :class:`Refused` before anything is generated for a request the backend cannot run."""


class Refused(ValueError):
    """A streamed request refused before generation: over the backend's context, or the backend is stopping
    (``stopping``)."""

    def __init__(self, message: str, stopping: bool = False):
        super().__init__(message)
        self.stopping = stopping


def images_of(image) -> list:
    """A prompt's images as a list: ``image`` one image, or a tuple / list of them."""
    return list(image) if isinstance(image, (list, tuple)) else [image]


#: Every in-process backend's decoded and tiled images: a dialogue's image is tiled once, not at every turn by
#: the student and again by the teacher.
TILES = TileCache()


def chat_request(chat: ChatTokenizer, messages: Sequence[Message], images: Sequence, sampling: SamplingParams, *,
                 system: str | None = None, tiles: TileCache | None = None) -> Request:
    """The one way from a chat to an engine request (the agents', the server's and the demo's alike): each image
    (a path, encoded bytes or a PIL image) decoded and tiled as the model reads it (``chat.geometry``, its
    conventions; through ``tiles``, a cache, when given), the messages rendered by the chat template with the
    assistant header and each image's placeholder expanded for its size, the tiles concatenated in order.
    ``system`` replaces the system prompt. A chat the template or the images cannot take raises ValueError."""
    tiled = [tiles.get(image, chat.geometry) if tiles is not None else
             preprocess(load_image(image, alpha="keep"), chat.geometry) for image in images]
    sizes = [size for _, size in tiled]
    prompt = chat.encode(messages, image_sizes=sizes, add_generation_prompt=True, system=system).input_ids.tolist()
    pixel_values = None if not tiled else tiled[0][0] if len(tiled) == 1 else np.concatenate([t for t, _ in tiled])
    return Request(prompt, sampling, pixel_values=pixel_values, image_sizes=sizes)

#: The streaming engine: decode steps between two updates of a streamed text, and requests streamed at once.
STREAM_CHUNK = 2
STREAM_SLOTS = 4


class StreamingEngines:
    """The started engines streamed requests run on, one per model and context: backends of one model (the demo's
    student and teacher when they are one checkpoint) stream on one engine. Thread-safe."""

    def __init__(self):
        self._engines: dict = {}
        self._lock = threading.Lock()

    def engine(self, model, chat: ChatTokenizer, context: int) -> Engine:
        with self._lock:
            key = (id(model), context)
            if key not in self._engines:
                config = EngineConfig(slots=STREAM_SLOTS, cache_len=context, prefill_batch=1, chunk=STREAM_CHUNK,
                                      bucket_step=None, stop_ids=chat.stop_ids, pad_id=chat.pad_id, logprobs=False)
                self._engines[key] = Engine(model, config, tokenizer=chat.tokenizer).start()
            return self._engines[key]


class InProcess:
    """The in-process backend: a model, its chat tokenizer, the settings of a call that names none
    (``sampling``) and the shape of its engine (``engine``), generating on the model's
    :class:`fire_jax.infer.engine.Engine`. Every in-process generation goes through :meth:`generate_ids` (the
    student's, the teacher's and VLRMBench's prompts alike); :meth:`stream` runs on a second, started engine of
    :data:`STREAM_SLOTS` slots and ``context`` columns (``streaming``'s, shared by the backends of one model),
    which passes the text on every :data:`STREAM_CHUNK` tokens (the demo: several people at once, each seeing
    the text grow).

    Each prompt is prefilled in its own length bucket, short prompts several to a prefill, and a step attends
    over the columns its rows have filled. ``batch_size`` > 0 gives the engine at least that many slots (one set
    of compiled shapes for a whole run); a sampled call draws with seeds from its ``rng`` key, so the same key
    draws the same texts (bit for bit with ``prefix_cache=False``; a reused prefix's keys and values may differ
    in the last bits).

    The engine keeps each call's keys and values for the next (``engine.prefix_cache``, on by default): a
    dialogue's prompt at turn k begins with its prompt at turn k - 1 (the student's: then r_{k-1} and f_{k-1};
    the teacher's: the question, groundtruth and instruction again), so only what follows is prefilled.
    An engine rebuilt larger takes over the old one's cached prefixes.
    """

    def __init__(self, model, chat: ChatTokenizer, sampling: SamplingParams = SamplingParams(), *,
                 engine: EngineConfig = EngineConfig(), mesh=None, batch_size: int = 0, description: str = "",
                 context: int = 2048, streaming: StreamingEngines | None = None):
        if chat.image_token_id != model.cfg.image_token_id:
            raise ValueError(f"tokenizer image id {chat.image_token_id} != model image_token_id "
                             f"{model.cfg.image_token_id}")
        self.model, self.chat, self.mesh, self.batch_size = model, chat, mesh, batch_size
        self.description = description  # where the model came from (fire_jax.infer.loading.Loaded.description)
        # agents read texts: no log-probs
        self.engine_config = engine.replace(stop_ids=chat.stop_ids, pad_id=chat.pad_id, logprobs=False)
        self.sampling = sampling
        self.context, self.tokenizer, self.geometry = context, chat.tokenizer, model.cfg.geometry
        self._engine: Engine | None = None
        self.streaming = StreamingEngines() if streaming is None else streaming

    def generate(self, images, prompts: Sequence[Sequence[Message]], sampling: SamplingParams | None = None,
                 rng=None, *, system: str | None = None, errors: bool = False) -> list:
        """:meth:`Backend.generate`: each prompt rendered by the chat template with the assistant header. Each
        request carries its own images' tiles (decoded and tiled once for all agents, :data:`TILES`), and the
        engine pads them once, where it forms a prefill's batch."""
        try:
            return self._generate(images, prompts, sampling, rng, system)
        except Exception as e:
            if not errors:
                raise
            return [e] * len(prompts)

    def _generate(self, images, prompts, sampling, rng, system) -> list[str]:
        rows = [chat_request(self.chat, messages, images_of(row), sampling or self.sampling, system=system,
                             tiles=TILES) for messages, row in zip(prompts, images)]
        texts = self.generate_ids([r.prompt for r in rows], [r.pixel_values for r in rows],
                                  [r.image_sizes for r in rows], sampling, rng)
        return [text.strip() for text in texts]

    def generate_ids(self, prompts: Sequence[Sequence[int]], pixel_values, image_sizes,
                     sampling: SamplingParams | None = None, rng=None) -> list[str]:
        """The texts generated for token-id prompts (images expanded), each row's tiles (a list of
        ``[tiles, 3, T, T]`` arrays, None for a row without images, or one padded ``[batch, tiles, 3, T, T]``
        array) and each row's image size(s)."""
        sampling = sampling or self.sampling
        requests = requests_for(prompts, pixel_values, image_sizes, sampling, rng)
        try:
            engine = self.engine(prompts, max(len(r.image_sizes) for r in requests), sampling.max_tokens)
            return [result.text for result in engine.generate(requests)]
        except BaseException:  # an interrupted or failed call leaves requests in the engine: start afresh
            self._engine = None
            raise

    def engine(self, prompts: Sequence[Sequence[int]], images: int = 0, max_tokens: int | None = None) -> Engine:
        """The backend's engine, sized by :meth:`fire_jax.infer.engine_config.EngineConfig.sized_for`:
        ``max(batch_size, rows)`` slots, cache rows long enough for every prompt's bucket + ``max_tokens``
        (default: the backend's; a power of two), at least ``images`` images per request; built anew, larger,
        when a call needs more."""
        max_tokens = self.sampling.max_tokens if max_tokens is None else max_tokens
        c = self.engine_config.sized_for([len(p) for p in prompts], max_tokens, slots=self.batch_size,
                                         images=images, doubling=True)
        old = self._engine
        if old is None or old.cache_len < c.cache_len or old.slots < c.slots or old.max_images < c.max_images:
            if old is not None:
                c = c.replace(slots=max(c.slots, old.slots), cache_len=max(c.cache_len, old.cache_len),
                              max_images=max(c.max_images, old.max_images))
            self._engine = Engine(self.model, c.replace(min_width=c.slots), tokenizer=self.chat.tokenizer,
                                  mesh=self.mesh)
            if old is not None:
                self._engine.stats.update(old.stats)  # counts over the backend's calls
                if c.prefix_cache:
                    self._engine.adopt(old)
        return self._engine

    def streaming_engine(self) -> Engine:
        """The started engine :meth:`stream` runs on (built at its first use, shared with the backends built
        with the same ``streaming``)."""
        return self.streaming.engine(self.model, self.chat, self.context)

    def stream(self, image, messages: Sequence[Message], on_delta: Callable[[str, int], None],
               sampling: SamplingParams | None = None) -> str:
        """:meth:`Backend.stream` on the started engine (its greedy tokens are those of :meth:`generate`)."""
        s = sampling or self.sampling
        request = chat_request(self.chat, messages, [] if image is None else images_of(image), s)
        updates: queue.SimpleQueue = queue.SimpleQueue()
        engine = self.streaming_engine()
        try:
            ticket = engine.submit(request, lambda ticket, delta, reason: updates.put(
                (delta, reason, len(ticket.tokens))))  # the engine's thread: counted as the piece arrives
        except ValueError as e:  # e.g. a prompt over the engine's context
            raise Refused(str(e)) from None
        except RuntimeError as e:  # the engine is stopping
            raise Refused(str(e), stopping=True) from None
        try:
            while True:
                delta, reason, tokens = updates.get()
                if reason == "error":
                    raise ticket.error
                on_delta(delta, tokens)
                if reason in ("stop", "length"):
                    return ticket.text.strip()
        except BaseException:
            engine.cancel(ticket)
            raise
