"""Backends: what turns chat prompts with images into texts, the one interface under every agent.

A backend is any object with the :class:`Backend` methods: :meth:`~Backend.generate` (a batch of prompts, each
with its image, to texts) and :meth:`~Backend.stream` (one prompt, its text passed on as it grows), both with
per-call :class:`fire_jax.infer.sampling.SamplingParams` (None: the backend's own, set when it was built). Two
implement it:

- :class:`InProcess`: a model and its chat tokenizer, generating on engines it owns
  (:class:`fire_jax.infer.engine.Engine`): one sized for each call's batch, and a started one that streams;
- :class:`fire_jax.infer.api.ApiBackend`: an OpenAI-compatible endpoint (``api:<base_url>#<model>``).

A server needs more of a request than its text: its finish reason and token counts, a queue it can cancel from,
counts of what it served: :class:`ServedBackend`. :class:`Serving` gives that over one started engine of a fixed shape (requests made
and checked, submitted, followed by :class:`Update` s, cancelled); the OpenAI-compatible server serves its models
on them, and :meth:`InProcess.stream` runs on one.

Backends are built by :func:`fire_jax.infer.factory.generator` (a model spec to a backend; a server's by
:func:`fire_jax.infer.factory.serving`); the prompt builders over them (the student, the teacher, VLRMBench's
responder, FIRE-100K generation, the demo's streaming chat) and the server never look inside one.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from fire_jax.data.chat import ChatTokenizer, Message
from fire_jax.data.images import TileCache, load_image, preprocess
from fire_jax.infer.decode import requests_for
from fire_jax.infer.engine import ContextExceeded, Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.requests import Request, Result
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
    """A request refused before generation, for the reason ``kind`` says: "context" (its prompt and max_tokens
    over the backend's context), "stopping" (the backend takes no more requests) or "invalid" (anything else the
    model cannot run: too many images, too many stop ids)."""

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind

    @classmethod
    def of(cls, error: ValueError) -> "Refused":
        """The refusal of an engine's check: "context" for :class:`fire_jax.infer.engine.ContextExceeded`, else
        "invalid"."""
        return cls(str(error), "context" if isinstance(error, ContextExceeded) else "invalid")


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


class Update(NamedTuple):
    """How far a submitted request has got (:meth:`Serving.submit`), passed on each time its text grows and once
    when it ends."""

    delta: str  # the text added since the last update
    reason: str | None  # None while it runs; then "stop" (a stop id or string), "length", "cancelled" or "error"
    text: str  # the text so far: once finished, the reply (without stop ids, cut before a stop string)
    prompt_tokens: int  # the prompt's tokens, each image's placeholder expanded
    completion_tokens: int  # tokens generated so far (a stop id counted)
    error: BaseException | None  # why it failed ("error"), else None


class ServedBackend(Protocol):
    """What a server serves a model on: :class:`Serving` (a model on an engine), or a kind a plugin registers
    (:func:`fire_jax.infer.factory.register_serving`, e.g. the tests' scripted endpoints). A request is made from
    a chat and checked (:meth:`request`), submitted and followed by :class:`Update` s on any thread
    (:meth:`submit`), and may be cancelled (:meth:`cancel`); the server sees nothing else of it."""

    #: Where its replies come from, in words (a checkpoint, a script).
    description: str
    #: Tokens one request may hold, prompt and reply (0: unbounded by the backend).
    context: int
    #: The tokenizer a request's text is counted in (None: the text is bounded only by the server's flags).
    tokenizer: object
    #: Images one request may hold.
    max_images: int
    #: Requests submitted and not finished.
    in_flight: int

    def summary(self) -> str:
        """One line for the server's startup log: what it serves and how much memory it holds."""

    def health(self) -> dict:
        """What ``/health`` shows of it (JSON-serialisable counts)."""

    def request(self, messages: Sequence[Message], images: Sequence, sampling: SamplingParams, *,
                system: str | None = None):
        """A chat's request, checked before it costs anything; :class:`Refused` for one it cannot run, ValueError
        for a chat it cannot take. (A test double of an HTTP endpoint may raise
        :class:`fire_jax.serving.limits.BadRequest` to answer with a status of its own.)"""

    def submit(self, request, on_update: Callable[[Update], None]):
        """Queue ``request`` (from :meth:`request`); ``on_update`` hears its updates, the last with a finish
        reason. Returns a ticket for :meth:`cancel`; :class:`Refused` ("stopping") once stopped."""

    def cancel(self, ticket) -> bool:
        """End a submitted request (its last update's reason "cancelled"); False when it had finished."""

    def start(self) -> "ServedBackend":
        """Take requests from now on."""

    def stop(self, drain: bool = True) -> None:
        """Take no more requests; finish those in flight (``drain``) or end them."""

    def warm_up(self) -> int:
        """Compile what requests will need now; returns how many shapes."""


class Serving:
    """A model on one engine of a fixed shape, started to take requests from any thread as they come: the
    backend a server serves a model on (and :meth:`InProcess.stream`'s). A request is made from a chat and
    checked before it costs anything (:meth:`request`), then submitted (:meth:`submit`) and followed by its
    :class:`Update` s; :meth:`cancel` frees its slot (a client gone away). ``shape``'s stop and pad ids are
    the chat tokenizer's; no log-probs (an update carries none). ``stats`` counts what the engine served
    (requests finished, cancelled, prompt tokens admitted, reused from cached prefixes, prefilled)."""

    def __init__(self, model, chat: ChatTokenizer, shape: EngineConfig, *, description: str = ""):
        self.model, self.chat, self.description = model, chat, description
        self.tokenizer, self.geometry = chat.tokenizer, model.cfg.geometry
        self._engine = Engine(model, shape.replace(stop_ids=chat.stop_ids, pad_id=chat.pad_id, logprobs=False),
                              tokenizer=chat.tokenizer)
        self.stats = self._engine.stats

    @property
    def context(self) -> int:
        """Tokens one request may hold, prompt bucket and max_tokens (cache columns a slot)."""
        return self._engine.cache_len

    @property
    def slots(self) -> int:
        return self._engine.slots

    @property
    def max_images(self) -> int:
        return self._engine.max_images

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the engine's KV cache: k and v of every layer, ``[slots, kv_heads, context, head_dim]``."""
        llm = self.model.cfg.llm
        return 2 * llm.layers * self.slots * llm.kv_heads * self.context * llm.head_dim * np.dtype(
            self.model.dtype).itemsize

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (waiting or in a slot)."""
        return self._engine.in_flight

    def summary(self) -> str:
        return (f"{self.description}; context {self.context} tokens x {self.slots} slots "
                f"(KV cache {self.kv_cache_bytes / 2 ** 30:.2f} GiB)")

    def health(self) -> dict:
        """Requests in flight, finished and cancelled, and prompt tokens admitted, reused from cached prefixes and
        prefilled."""
        return {"in_flight": self.in_flight, "finished": self.stats["requests"], "cancelled": self.stats["cancelled"],
                **{key: self.stats[key] for key in ("prompt_tokens", "reused_tokens", "prefilled_tokens")}}

    def request(self, messages: Sequence[Message], images: Sequence, sampling: SamplingParams, *,
                system: str | None = None) -> Request:
        """A chat's request (:func:`chat_request`: a ValueError when the template or an image cannot take it),
        checked against the engine: :class:`Refused` ("context", "invalid") for one it cannot run."""
        request = chat_request(self.chat, messages, images, sampling, system=system)
        try:
            self._engine.check(request)
        except ValueError as e:
            raise Refused.of(e) from None
        return request

    def submit(self, request: Request, on_update: Callable[[Update], None]):
        """Queue a request (made by :meth:`request`); ``on_update`` hears its :class:`Update` s on the engine's
        thread. Returns its ticket, for :meth:`cancel`. :class:`Refused` ("stopping") once :meth:`stop` was
        called, ("context", "invalid") for a request the engine cannot run."""
        def update(ticket, delta: str, reason: str | None) -> None:
            on_update(Update(delta, reason, ticket.text, len(ticket.ids), len(ticket.tokens), ticket.error))

        try:
            return self._engine.submit(request, update)
        except RuntimeError as e:
            raise Refused(str(e), "stopping") from None
        except ValueError as e:
            raise Refused.of(e) from None

    def cancel(self, ticket) -> bool:
        """Stop a submitted request (its last update's reason "cancelled"); False when it had finished."""
        return self._engine.cancel(ticket)

    def start(self) -> "Serving":
        """Start the engine's thread: requests run as they are submitted."""
        self._engine.start()
        return self

    def stop(self, drain: bool = True) -> None:
        """Take no more requests; finish those in flight (``drain``) or fail them; join the engine's thread."""
        self._engine.stop(drain=drain)

    def warm_up(self) -> int:
        """Compile every decode shape now (:meth:`fire_jax.infer.engine.Engine.warm_up`); returns how many."""
        return self._engine.warm_up()


#: The streaming engine: decode steps between two updates of a streamed text, and requests streamed at once.
STREAM_CHUNK = 2
STREAM_SLOTS = 4


class StreamingEngines:
    """The started engines streamed requests run on (each a :class:`Serving`), one per model and context: backends
    of one model (the demo's student and teacher when they are one checkpoint) stream on one engine.
    Thread-safe."""

    def __init__(self):
        self._engines: dict = {}
        self._lock = threading.Lock()

    def engine(self, model, chat: ChatTokenizer, context: int) -> Serving:
        with self._lock:
            key = (id(model), context)
            if key not in self._engines:
                shape = EngineConfig(slots=STREAM_SLOTS, cache_len=context, prefill_batch=1, chunk=STREAM_CHUNK,
                                     bucket_step=None)
                self._engines[key] = Serving(model, chat, shape).start()
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
        rows = self._requests(images, prompts, sampling, system)
        texts = self.generate_ids([r.prompt for r in rows], [r.pixel_values for r in rows],
                                  [r.image_sizes for r in rows], sampling, rng)
        return [text.strip() for text in texts]

    def _requests(self, images, prompts, sampling, system) -> list[Request]:
        return [chat_request(self.chat, messages, images_of(row), sampling or self.sampling, system=system,
                             tiles=TILES) for messages, row in zip(prompts, images)]

    def results(self, images, prompts: Sequence[Sequence[Message]], sampling: SamplingParams | None = None,
                rng=None, *, system: str | None = None) -> list[tuple[Request, Result]]:
        """:meth:`generate`'s rows as (the engine's request, its :class:`fire_jax.infer.requests.Result`): the
        prompt's token ids and tiles as the model read them and the token ids sampled (a stop id kept), for a
        caller that trains on what was sampled (the reinforcement stage's rollouts, :mod:`fire_jax.rl`)."""
        rows = self._requests(images, prompts, sampling, system)
        return self._run([r.prompt for r in rows], [r.pixel_values for r in rows], [r.image_sizes for r in rows],
                         sampling, rng)

    def generate_ids(self, prompts: Sequence[Sequence[int]], pixel_values, image_sizes,
                     sampling: SamplingParams | None = None, rng=None) -> list[str]:
        """The texts generated for token-id prompts (images expanded), each row's tiles (a list of
        ``[tiles, 3, T, T]`` arrays, None for a row without images, or one padded ``[batch, tiles, 3, T, T]``
        array) and each row's image size(s)."""
        return [result.text for _, result in self._run(prompts, pixel_values, image_sizes, sampling, rng)]

    def _run(self, prompts, pixel_values, image_sizes, sampling, rng) -> list[tuple[Request, Result]]:
        sampling = sampling or self.sampling
        requests = requests_for(prompts, pixel_values, image_sizes, sampling, rng)
        try:
            engine = self.engine(prompts, max(len(r.image_sizes) for r in requests), sampling.max_tokens)
            return list(zip(requests, engine.generate(requests)))
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

    def streaming_engine(self) -> Serving:
        """The started engine :meth:`stream` runs on, a :class:`Serving` (built at its first use, shared with the
        backends built with the same ``streaming``)."""
        return self.streaming.engine(self.model, self.chat, self.context)

    def stream(self, image, messages: Sequence[Message], on_delta: Callable[[str, int], None],
               sampling: SamplingParams | None = None) -> str:
        """:meth:`Backend.stream` on the started engine (its greedy tokens are those of :meth:`generate`)."""
        serving = self.streaming_engine()
        request = serving.request(messages, [] if image is None else images_of(image), sampling or self.sampling)
        updates: queue.SimpleQueue = queue.SimpleQueue()
        ticket = serving.submit(request, updates.put)
        try:
            while True:
                update = updates.get()
                if update.reason == "error":
                    raise update.error
                on_delta(update.delta, update.completion_tokens)
                if update.reason in ("stop", "length"):
                    return update.text.strip()
        except BaseException:
            serving.cancel(ticket)
            raise
