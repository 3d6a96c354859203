"""An OpenAI-compatible chat server over the continuous-batching engine, each model on its serving backend
(:class:`fire_jax.infer.backends.Serving`, built by :func:`fire_jax.infer.factory.serving`).

    python -m fire_jax.serve                                   # the main job's student + teacher, else a random tiny model
    python -m fire_jax.serve --port 8000 --model student=WORKDIR_OR_ADAPTER_OR_HF_DIR --model teacher=...
    python -m fire_jax.serve --config configs/fire_student.py --init HF_BASE --model fd=PEFT_ADAPTER
    python -m fire_jax.serve --plugin scripted_model --model fixed=scripted:replies.json  # tests/: fixed replies

Listens on 127.0.0.1 unless --host says otherwise. Routes:

- ``POST /v1/chat/completions``: ``messages`` with text and ``image_url`` parts
  given as ``data:`` URIs (several images per request; remote URLs are refused,
  the server fetches nothing), ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream`` (server-sent events);
- ``GET /v1/models``; ``GET /health``.

Each model's context (``--cache_len``, cache columns per slot) defaults to
:func:`default_cache_len`: up to 4 images of its largest tile grid and 16,384
characters of prompt text in its tokenizer's tokens, plus the default 256 new tokens; the startup line prints it
and the KV cache's size (lower ``--slots`` to shrink it). A request that does
not fit gets 400 ``context_length_exceeded``.

Prompts are rendered as in training (:mod:`fire_jax.data.chat`): the Llama-3
template with fire_jax's system prompt (a request's own system message
replaces it), and each image becomes the ``<image>`` placeholder, expanded to
the image's anyres token count; an image part followed by text reads
``<image>\\n{text}``, as the training prompts do.

Bad input gets a 4xx JSON error in OpenAI's shape (``{"error": {"message", "type", "code"}}``),
checked before the request reaches the engine, so it fails alone: every
field typed and bounded, and the body's size, read time and nesting, the
text's length and the images' count, size, format and declared pixels
bounded before anything is tokenised or decoded (:mod:`fire_jax.serving.limits`,
its flags: ``--max_body_bytes``, ``--max_pixels``, ...). A model's queue
(``--max_queue``) counts every request it admitted until its last token;
past it, 503 with Retry-After. A client that disconnects before its reply
is done cancels its request (the engine frees the slot); SIGTERM / Ctrl-C
stop accepting, finish the requests in flight for ``--graceful_timeout``
seconds at most, then end those still running, each with a clean answer
(a JSON 503 ``shutting_down``; a stream gets an error event, then
``[DONE]``) and one line in the log, then exit. ``--port 0`` takes a free
port; the line "listening on http://HOST:PORT/v1" says which.

Every model is served on the backend protocol (:class:`fire_jax.infer.backends.ServedBackend`). A
``--plugin MODULE`` is imported first and may register served kinds of its own on that protocol
(:func:`fire_jax.infer.factory.register_serving`): the tests' ``scripted:FILE.json`` endpoints
(``tests/scripted_model.py``) answer the demo's and FIRE-100K-style generation's clients with fixed strings,
delays and errors.
"""

from __future__ import annotations

import sys

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from fire_jax.core.cli import require_model_config
from fire_jax.core.config import DEFAULT_CONFIG, apply_overrides, load_config, split_overrides
from fire_jax.data.chat import Message
from fire_jax.infer.backends import Refused, Update
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer import factory
from fire_jax.serving.defaults import default_models
from fire_jax.serving.limits import (SAMPLING_DEFAULTS, BadRequest, Limits, OneLineLog, add_arguments, check_text,
                                     image_urls, json_body, limits_of, longest_token_chars, open_data_uri, run_server,
                                     sampling, text_chars_bound)

DEFAULT_MAX_TOKENS = SAMPLING_DEFAULTS["max_tokens"]  # a request's max_tokens when it names none
#: Characters of prompt text the default context holds besides the images: the served workloads' longest prompts
#: with room to spare (the longest of VLRMBench's 58 shipped IC prompts, the release's prompt and the record, is
#: 10,048 characters: 2,116 tokens with SmolLM2's tokenizer, 5,716 with the tiny 512-piece one).
PROMPT_TEXT_CHARS = 16384
#: Images per request (the engine's limit; the release's vLLM server is started with --limit-mm-per-prompt image=4).
MAX_IMAGES = 4
#: A served model's engine shape (slots, prefill sizes, chunk and prefix cache from the flags; cache columns from
#: --cache_len or :func:`default_cache_len`): the fine prompt buckets (``bucket_step`` None, docs/serving.md) and
#: no log-probs (the API returns none).
SERVER_ENGINE = EngineConfig(bucket_step=None, logprobs=False)
#: Seconds uvicorn's own graceful timeout runs past --graceful_timeout: the time the requests ended at
#: --graceful_timeout have to send their 503 or last event before uvicorn would cancel them mid-response.
GRACEFUL_MARGIN_S = 10.0


def prompt_text_tokens(tokenizer, chars: int = PROMPT_TEXT_CHARS) -> int:
    """Tokens ``chars`` characters of prompt text take in ``tokenizer`` (a ``tokenizers`` tokenizer), at its
    characters a token on VLRMBench's release prompts (4.4 for SmolLM2's and Llama-3's tokenizers, 1.7 for
    the tests' tiny one)."""
    from fire_jax.vlrmbench.tasks import TASK_PROMPTS

    sample = "\n".join(TASK_PROMPTS.values())
    return -(-chars * len(tokenizer.encode(sample).ids) // len(sample))


def default_cache_len(geometry, text_tokens: int, max_images: int = MAX_IMAGES,
                      new_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """The context ``--cache_len 0`` gives a model: the prompt bucket of ``max_images`` images of the model's
    largest tile grid (``geometry``: :class:`fire_jax.core.geometry.ImageGeometry`) and ``text_tokens`` of text
    (:func:`prompt_text_tokens` of its tokenizer), plus ``new_tokens`` to generate (the server's default
    max_tokens)."""
    image_tokens = max(geometry.num_tokens(pinpoint) for pinpoint in geometry.pinpoints_hw)
    return SERVER_ENGINE.sized_for([max_images * image_tokens + text_tokens], new_tokens).cache_len


@dataclasses.dataclass
class Served:
    name: str
    backend: Any  # a fire_jax.infer.backends.ServedBackend: Serving, or a kind a plugin registered
    max_text_chars: int = 0  # characters of text a request may hold (its context at the longest token); 0: any


# ------------------------------------------------------------------------------------------------
# Requests -> prompts
# ------------------------------------------------------------------------------------------------


def parse_messages(messages, limits: Limits, max_text_chars: int = 0):
    """(system text or None, [Message], [PIL image]) from OpenAI chat messages, images as ``<image>\\n``.

    Every part is checked and the images counted and the text measured (``max_text_chars``, 0: no bound)
    before any image is decoded: a request over a limit costs no decoding."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list")
    system, out, urls, texts_of = None, [], [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(400, f"messages[{i}]: needs a role of 'system', 'user' or 'assistant'")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise BadRequest(400, f"messages[{i}]: 'content' must be a string or a list of parts")
        texts, count = [], 0
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url" and message["role"] == "user":
                count += 1  # placed before the message's text, as the template places images
            else:
                raise BadRequest(400, f"messages[{i}].content[{j}]: expected a 'text' part"
                                      + (" or an 'image_url' part" if message["role"] == "user" else ""))
        urls += image_urls(parts)
        texts_of.append((message["role"], texts, count))
    if len(urls) > limits.max_images:
        raise BadRequest(400, f"{len(urls)} images; at most {limits.max_images} per request", "too_many_images")
    check_text((text for _, texts, _ in texts_of for text in texts), max_text_chars)
    for role, texts, count in texts_of:
        text = "\n".join(texts)
        if role == "system":
            system = text
        else:
            out.append(Message(role, text, images=count))
    if not out or out[-1].role != "user":
        raise BadRequest(400, "the last message must be a user message")
    images = [open_data_uri(url, limits.max_image_bytes, limits.max_pixels) for url in urls]
    return system, out, images


def build_request(served: Served, body: dict, limits: Limits):
    """The backend's request of a chat completion body: every field checked and typed
    (:func:`fire_jax.serving.limits.sampling`), the text measured and the images counted before anything is
    decoded or tokenised, then the prompt checked against the context (400 ``context_length_exceeded``)."""
    settings, _ = sampling(body)
    model_limits = dataclasses.replace(limits, max_images=min(limits.max_images, served.backend.max_images))
    system, messages, images = parse_messages(body.get("messages"), model_limits, served.max_text_chars)
    try:  # the agents' way from a chat to a request (the training template, each image expanded for its size)
        return served.backend.request(messages, images, settings, system=system)
    except Refused as e:
        if e.kind == "context":
            raise BadRequest(400, f"{e}; serve with a larger --cache_len", "context_length_exceeded") from None
        raise BadRequest(400, str(e), "invalid_request_error") from None
    except ValueError as e:  # the template or an image cannot take the chat
        raise BadRequest(400, str(e)) from None


class Admitted:
    """The requests a model has admitted and not yet finished, counted from admission (while waiting, being
    prefilled and decoding alike) to their last update: what ``--max_queue`` bounds. Thread-safe (the backend's
    engine thread lets requests go); letting one go twice is a no-op."""

    def __init__(self, limit: int):
        self.limit, self._lock = limit, threading.Lock()
        self._held: dict[object, Any] = {}  # key -> its ticket once submitted (None before)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def reserve(self) -> object:
        """A key holding a place for a request about to be submitted, or BadRequest 503 when all are taken."""
        with self._lock:
            if len(self._held) >= self.limit:
                raise BadRequest(503, f"queue full ({self.limit} requests in flight); retry later", "queue_full",
                                 {"Retry-After": "1"})
            key = object()
            self._held[key] = None
            return key

    def submitted(self, key, ticket) -> None:
        with self._lock:
            if key in self._held:  # not finished already
                self._held[key] = ticket

    def release(self, key) -> None:
        with self._lock:
            self._held.pop(key, None)

    def tickets(self) -> list:
        with self._lock:
            return [t for t in self._held.values() if t is not None]


class GracefulTimeout:
    """The end of a shutdown's grace: :meth:`start` (at SIGTERM / Ctrl-C, in the server's event loop) sets
    :attr:`passed` ``seconds`` later. A request still running then ends at once (:meth:`ended` logs it) with a
    503 ``shutting_down``, a stream with an error event and ``[DONE]``, before uvicorn's own timeout would cancel
    it mid-response (a plain-text 500 or a stream cut short, and a traceback in the log)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.passed = asyncio.Event()

    def start(self) -> None:
        asyncio.get_running_loop().call_later(self.seconds, self.passed.set)

    @property
    def message(self) -> str:
        return (f"the server is shutting down and this request did not finish within its graceful timeout "
                f"({self.seconds:g} s); send it again to another server or later")

    def ended(self, rid: str, name: str, how: str) -> None:
        print(f"graceful timeout of {self.seconds:g} s passed: request {rid} to {name!r} ended ({how})", flush=True)


async def _next_update(updates: asyncio.Queue, grace: GracefulTimeout) -> Update | None:
    """The next :class:`fire_jax.infer.backends.Update` of a request, or None once the graceful timeout has
    passed."""
    if grace.passed.is_set():
        return None
    get, passed = asyncio.ensure_future(updates.get()), asyncio.ensure_future(grace.passed.wait())
    await asyncio.wait({get, passed}, return_when=asyncio.FIRST_COMPLETED)
    passed.cancel()
    if get.done():
        return get.result()
    get.cancel()
    return None


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------


def create_app(models: dict[str, Served], *, max_queue: int = 256, limits: Limits | None = None,
               graceful_timeout: float = 60.0, debug: bool = False):
    """The FastAPI app serving ``models``; ``max_queue`` requests in flight per model (admitted and not finished)
    before 503; ``limits`` (:class:`fire_jax.serving.limits.Limits`) on every request before it reaches a model.
    ``app.state.grace.start()`` (at SIGTERM) gives the requests in flight ``graceful_timeout`` seconds
    (:class:`GracefulTimeout`)."""
    limits = limits or Limits()
    admitted = {name: Admitted(max_queue) for name in models}
    grace = GracefulTimeout(graceful_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        backends = [served.backend for served in models.values()]
        for backend in backends:
            backend.start()
        yield
        # uvicorn has finished the requests in flight, or its graceful-shutdown timeout has passed: cancel
        # what is left, so the backends stop now
        for name, served in models.items():
            for ticket in admitted[name].tickets():
                served.backend.cancel(ticket)
        for backend in backends:
            backend.stop(drain=True)

    app = FastAPI(title="fire_jax", lifespan=lifespan)
    app.state.grace = grace
    app.add_middleware(OneLineLog, prog="fire_jax.serve", debug=debug, failed=lambda e: (500, {"error": {
        "message": "the server failed on this request; its log says why", "type": "server_error",
        "code": "server_error", "param": None}}))

    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return _health(models, admitted)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "fire_jax"}
                                           for name in models]}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await _chat_completion(http, models, admitted, limits, grace)

    return app


def error(status: int, message: str, code: str, headers=None) -> JSONResponse:
    """An OpenAI-shaped JSON error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}},
                        status_code=status, headers=headers)


def _add_error_handlers(app) -> None:
    """Bad requests, unknown routes and invalid bodies as :func:`error` JSON."""

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        return error(e.status, e.message, e.code, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return error(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else "http_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e):
        return error(400, str(e), "invalid_request_error")


def _health(models: dict[str, Served], admitted: dict[str, Admitted]) -> dict:
    return {"status": "ok", "models": {
        name: {"description": s.backend.description, "admitted": len(admitted[name]), **s.backend.health()}
        for name, s in models.items()}}


async def _chat_completion(http: HttpRequest, models: dict[str, Served], admitted: dict[str, Admitted],
                           limits: Limits, grace: GracefulTimeout):
    """One /v1/chat/completions request: admitted (503 when its model's queue is full), submitted to its model's
    backend, answered whole or streamed; a client that goes away frees its slot; past the graceful timeout, a
    503."""
    body = await json_body(http, limits)
    name = body.get("model")
    if not isinstance(name, str):
        raise BadRequest(400, f"'model' must be a string, one of {sorted(models)}", "invalid_request_error")
    if name not in models:
        raise BadRequest(404, f"that model is not served; serving {sorted(models)}", "model_not_found")
    served = models[name]
    request = build_request(served, body, limits)
    stream = body.get("stream") is True  # a boolean: build_request checked it
    queue = admitted[name]
    key = queue.reserve()  # 503 when full; from here to its last update the request holds its place
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()

    def on_update(update: Update):  # the backend's engine thread
        if update.reason is not None:
            queue.release(key)
        loop.call_soon_threadsafe(updates.put_nowait, update)

    backend = served.backend
    try:
        ticket = backend.submit(request, on_update)
    except Refused as e:  # shutting down; else checked in build_request, kept for safety
        queue.release(key)
        if e.kind == "stopping":
            raise BadRequest(503, str(e), "shutting_down", {"Retry-After": "5"})
        raise BadRequest(400, str(e), "invalid_request_error")
    queue.submitted(key, ticket)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        return StreamingResponse(_stream(rid, created, name, updates, ticket, backend, grace),
                                 media_type="text/event-stream")
    try:
        last = await _wait_unless_disconnected(http, updates, grace)
    except BaseException:  # cancelled by the server (uvicorn's own shutdown timeout): free the slot
        backend.cancel(ticket)
        raise
    if last is None:  # the client went away: free its slot (no one reads the reply)
        backend.cancel(ticket)
        return error(499, "client disconnected", "client_disconnected")
    if last == "shutting_down":
        backend.cancel(ticket)
        grace.ended(rid, name, "503")
        return error(503, grace.message, "shutting_down", {"Retry-After": "5"})
    if last.reason == "error":
        return error(500, f"generation failed: {last.error}", "generation_failed")
    return {"id": rid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": last.text},
                         "finish_reason": last.reason}],
            "usage": {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                      "total_tokens": last.prompt_tokens + last.completion_tokens}}


async def _wait_unless_disconnected(http, updates: asyncio.Queue, grace: GracefulTimeout) -> Update | str | None:
    """The last update of a request (its finish reason set), "shutting_down" once the graceful timeout has
    passed, or None when its client disconnects first."""
    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":  # the body is read: only a disconnect comes
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        while True:
            update = asyncio.ensure_future(_next_update(updates, grace))
            await asyncio.wait({update, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not update.done():
                update.cancel()
                return None
            if update.result() is None:
                return "shutting_down"
            if update.result().reason is not None:
                return update.result()
    finally:
        watch.cancel()


async def _stream(rid, created, name, updates: asyncio.Queue, ticket, backend, grace: GracefulTimeout):
    """Server-sent events of one request; a client that disconnects cancels it (starlette cancels this
    generator when the connection closes)."""
    try:
        async for chunk in _events(rid, created, name, updates, grace):
            yield chunk
    finally:
        backend.cancel(ticket)  # a no-op once finished


async def _events(rid, created, name, updates: asyncio.Queue, grace: GracefulTimeout):
    """The events of a stream: the role, each piece of text, the finish reason, then ``[DONE]``; a failed
    generation, or one still running when the graceful timeout passes, an error event before ``[DONE]``."""
    def event(delta: dict, reason=None):
        chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
        return f"data: {json.dumps(chunk)}\n\n"

    yield event({"role": "assistant", "content": ""})
    while True:
        update = await _next_update(updates, grace)
        if update is None:
            grace.ended(rid, name, "an error event and [DONE]")
            failure = {"message": grace.message, "type": "server_error", "code": "shutting_down"}
            yield f"data: {json.dumps({'error': failure})}\n\n"
            break
        if update.reason == "error":
            yield f"data: {json.dumps({'error': {'message': str(update.error), 'type': 'server_error'}})}\n\n"
            break
        if update.delta:
            yield event({"content": update.delta})
        if update.reason is not None:
            yield event({}, update.reason)
            break
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------
# Models and the command line
# ------------------------------------------------------------------------------------------------


def load_models(config, specs: dict[str, str | None], init: str | None, shape: EngineConfig, cache_len: int = 0,
                warm_up: bool = False, max_text_chars: int = 0, max_images: int = MAX_IMAGES) -> dict[str, Served]:
    """The served models of ``specs``, each on a serving backend (:func:`fire_jax.infer.factory.serving`) of
    ``shape`` with ``cache_len`` columns a slot (0: :func:`default_cache_len`); a request's text is bounded by
    ``max_text_chars`` characters, 0: by the model's context times its tokenizer's longest token
    (:func:`fire_jax.serving.limits.text_chars_bound`)."""
    out = {}
    for name, checkpoint in specs.items():
        backend = factory.serving(checkpoint, shape.replace(max_images=max_images), config=config, init=init,
                          context=lambda chat: cache_len or default_cache_len(chat.geometry,
                                                                              prompt_text_tokens(chat.tokenizer)))
        chars = max_text_chars or (text_chars_bound(backend.context, longest_token_chars(backend.tokenizer))
                                   if backend.tokenizer is not None and backend.context else 0)
        out[name] = Served(name, backend, max_text_chars=chars)
        print(f"serving {name!r}: {backend.summary()}", flush=True)
        if warm_up:
            start = time.perf_counter()
            shapes = backend.warm_up()
            print(f"  {shapes} decode shapes compiled in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000,
                        help="0: a free port (the line 'listening on http://HOST:PORT/v1' says which)")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="config file[:arg] (default: configs/tiny.py); --config.<field>=<value> sets a field")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=CHECKPOINT",
                        help="a served model: an HF dir, a PEFT adapter, a train workdir, 'random', or a spec of a "
                             "kind a --plugin registers (repeatable)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first: it may register served model kinds on the backend protocol "
                             "(fire_jax.infer.factory.register_serving), e.g. the tests' scripted endpoints "
                             "(repeatable)")
    parser.add_argument("--init", help="base HF checkpoint for PEFT adapters (default: the config's init)")
    parser.add_argument("--slots", type=int, default=32, help="decode slots per model")
    parser.add_argument("--cache_len", type=int, default=0,
                        help="cache columns per slot, the context of a request (prompt bucket + max_tokens); 0 "
                             f"(default): room for {MAX_IMAGES} images of the model's largest tile grid and "
                             f"{PROMPT_TEXT_CHARS:,} characters of text in the model's tokens, plus max_tokens "
                             f"{DEFAULT_MAX_TOKENS} (e.g. 4352 for the SmolLM2 LLaVA, 10496 for the tiny one, "
                             "16640 for LLaVA-NeXT-8B)")
    parser.add_argument("--no_prefix_cache", action="store_true",
                        help="prefill every prompt whole (default: reuse the cached keys and values of a prompt's "
                             "longest cached prefix across requests: a dialogue's previous turn, a shared instruction)")
    parser.add_argument("--prefill_batch", type=int, default=8,
                        help="rows per prefill at most (waiting prompts of one length bucket)")
    parser.add_argument("--prefill_tokens", type=int, default=1024,
                        help="padded tokens per prefill at most (one prompt whatever its length): a batched prefill "
                             "pays per token only up to a size (docs/decoding.md, measurements)")
    parser.add_argument("--chunk", type=int, default=16, help="decode steps per dispatch at most")
    parser.add_argument("--warm_up", action="store_true",
                        help="compile every decode shape (widths x cache windows) before serving, so no request "
                             "waits for one (30 shapes for 32 slots x 576 columns; startup prints how long it took)")
    parser.add_argument("--max_queue", type=int, default=256,
                        help="requests in flight per model (waiting, prefilling or decoding) before 503")
    add_arguments(parser)
    args = parser.parse_args(argv)
    for spec in args.model:
        if "=" not in spec:
            parser.error(f"--model {spec!r}: expected NAME=CHECKPOINT")
    return args


def main(argv=None):
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    config = require_model_config(apply_overrides(load_config(args.config), overrides), args.config)
    for module in args.plugin:  # registers its kinds with fire_jax.infer.factory as it is imported
        importlib.import_module(module)
    if args.model:
        specs = {name: (None if path == "random" else path) for name, path in (s.split("=", 1) for s in args.model)}
        init = args.init
    else:
        specs, init, why = default_models()
        init = args.init or init
        print(f"no --model: serving {why}", flush=True)
    shape = SERVER_ENGINE.replace(slots=args.slots, prefill_batch=args.prefill_batch,
                                  prefill_tokens=args.prefill_tokens, chunk=args.chunk,
                                  prefix_cache=not args.no_prefix_cache)
    if args.max_images > MAX_IMAGES:
        raise ValueError(f"--max_images {args.max_images}: at most {MAX_IMAGES} (the engine's limit)")
    models = load_models(config, specs, init, shape, args.cache_len, args.warm_up, args.max_text_chars, args.max_images)
    app = create_app(models, max_queue=args.max_queue, limits=limits_of(args), graceful_timeout=args.graceful_timeout,
                     debug=args.debug)
    run_server(app, args, "listening on http://{host}:{port}/v1", on_stop=app.state.grace.start,
               graceful_margin_s=GRACEFUL_MARGIN_S)
