"""Limits on what one HTTP request may ask of :mod:`fire_jax.serving.server` and :mod:`fire_jax.serving.demo`,
checked before work.

A request is refused with one clear 4xx error, before it costs the server
memory or reaches the engine, when

- its body is over ``max_body_bytes`` (413; the ``Content-Length`` header is
  checked before reading, a chunked body as it arrives) or takes longer than
  ``body_timeout_s`` to arrive (408);
- its JSON is nested deeper than ``max_json_depth`` (400), uses ``NaN`` /
  ``Infinity`` literals (400), or is not JSON at all (400);
- its text is longer, in characters, than the context could hold even at the
  tokenizer's longest token (400 ``context_length_exceeded``, counted before
  tokenising anything: a 100 MB text is never tokenised);
- it has more images than allowed (400, counted before decoding any), an
  image's base64 payload is over ``max_image_bytes`` (413), its format is not
  PNG, JPEG, WebP or GIF or is not the one its ``data:image/...`` URI declares
  (400), or its header declares more than ``max_pixels`` pixels (413, read
  from the header before the pixels are decoded; Pillow's own decompression
  bomb check is a 413 too);
- a sampling field is of the wrong type, not finite, or out of its range
  (400): :func:`sampling` reads them all, so the engine only ever sees values
  it can hold (an int32 ``top_k``, a finite temperature).

:func:`add_arguments` gives both servers the same flags, and
:func:`uvicorn_settings` turns them into uvicorn's own connection limits: the
connections and tasks at once (``limit_concurrency``: uvicorn answers past
it with a plain-text 503), the idle keep-alive timeout, the size of a
request's head (``h11_max_incomplete_event_size``) and the graceful-shutdown
timeout; a timeout on a request's head, which uvicorn lacks, is
:func:`head_timeout_protocol`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
import sys
import traceback
import warnings

from PIL import Image

from fire_jax.infer.sampling import SamplingParams

#: data: URI MIME types -> the Pillow format each must decode as (nothing else is opened: no EPS / PostScript).
IMAGE_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                 "image/gif": "GIF"}
#: Stop strings: at most this many, each at most this many characters (the engine rescans the text for each).
MAX_STOP, MAX_STOP_CHARS = 4, 1000
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadRequest(Exception):
    """A request refused with ``status`` (4xx, or 503 for a full queue), its message and an OpenAI error code."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


@dataclasses.dataclass
class Limits:
    max_body_bytes: int = 48 << 20  # 4 images of 8 MiB as base64 (~43 MiB) and their messages
    body_timeout_s: float = 30.0
    max_json_depth: int = 32
    max_image_bytes: int = 8 << 20
    max_pixels: int = 4096 * 4096
    max_images: int = 4
    max_text_chars: int = 0  # 0: from the context (see text_chars_bound)


# ------------------------------------------------------------------------------------------------
# Bodies
# ------------------------------------------------------------------------------------------------


async def read_body(http, limits: Limits) -> bytes:
    """A request's body, at most ``max_body_bytes`` (413) and within ``body_timeout_s`` (408)."""
    declared = http.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(400, f"bad Content-Length {declared[:40]!r}", "invalid_request_error")
        if int(declared) > limits.max_body_bytes:
            raise BadRequest(413, f"request body of {declared} bytes is over the limit of {limits.max_body_bytes} "
                                  "bytes", "request_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BadRequest(413, f"request body is over the limit of {limits.max_body_bytes} bytes",
                                 "request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(408, f"request body not received within {limits.body_timeout_s:g} s",
                         "request_timeout") from None


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar: 0), walked without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth


def parse_json(raw: bytes, max_depth: int) -> dict:
    """A JSON object body, nested at most ``max_depth`` deep; BadRequest (400) otherwise."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(400, f"request JSON is nested deeper than {max_depth} levels", "json_too_deep") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN / Infinity, a 5,000-digit number
        raise BadRequest(400, f"request body is not valid JSON: {str(e)[:200]}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if json_depth(body) > max_depth:
        raise BadRequest(400, f"request JSON is nested deeper than {max_depth} levels", "json_too_deep")
    return body


async def json_body(http, limits: Limits | None = None) -> dict:
    """A request's JSON object body within ``limits`` (:func:`read_body`, :func:`parse_json`)."""
    limits = limits or Limits()
    return parse_json(await read_body(http, limits), limits.max_json_depth)


# ------------------------------------------------------------------------------------------------
# Texts
# ------------------------------------------------------------------------------------------------


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest token of a ``tokenizers`` tokenizer's vocabulary, special tokens included: no
    text of n characters encodes to fewer than n / this many tokens."""
    size = tokenizer.get_vocab_size()
    return max([1] + [len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(size)])


def text_chars_bound(context_tokens: int, token_chars: int) -> int:
    """The most characters of text a context of ``context_tokens`` tokens can hold at ``token_chars`` a token."""
    return context_tokens * token_chars


def check_text(texts, max_chars: int) -> None:
    """BadRequest (400 ``context_length_exceeded``) when ``texts`` hold more than ``max_chars`` characters in all
    (0: no bound), and 400 for a lone UTF-16 surrogate (no tokenizer takes one); counted, not tokenised."""
    total = 0
    for text in texts:
        total += len(text)
        if max_chars and total > max_chars:
            raise BadRequest(400, f"the text is over {max_chars} characters, more than the context can hold",
                             "context_length_exceeded")
        if _SURROGATE.search(text):
            raise BadRequest(400, "text holds a lone UTF-16 surrogate (not a Unicode character)")


# ------------------------------------------------------------------------------------------------
# Images
# ------------------------------------------------------------------------------------------------


def open_data_uri(url, max_bytes: int, max_pixels: int) -> Image.Image:
    """A PIL image from a ``data:image/{png,jpeg,webp,gif};base64,`` URI (RGBA when it has transparency: made RGB
    when it is tiled, as the model's conventions say), or BadRequest.

    Checked before decoding its pixels: the payload's size, the format (one of :data:`IMAGE_FORMATS`, the one
    declared), the pixel count its header declares."""
    from fire_jax.data.images import load_image

    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(400, "image_url must be a data: URI (data:image/png;base64,...); the server fetches no "
                              "remote URLs", "remote_image_url")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise BadRequest(400, "image data: URI must be base64-encoded", "invalid_image")
    mime = header[len("data:"):].split(";", 1)[0].strip().lower()
    if mime not in IMAGE_FORMATS:
        raise BadRequest(400, "image type is not accepted; send one of "
                              f"{', '.join(sorted(set(IMAGE_FORMATS) - {'image/jpg'}))}", "unsupported_image_format")
    if len(payload) * 3 // 4 > max_bytes:
        raise BadRequest(413, f"image of ~{len(payload) * 3 // 4} bytes is over the limit of {max_bytes} bytes",
                         "image_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=sorted(set(IMAGE_FORMATS.values())))  # the header only
            width, height = image.size
            if width * height > max_pixels:
                raise BadRequest(413, f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels",
                                 "image_too_large")
            if image.format != IMAGE_FORMATS[mime]:
                raise BadRequest(400, f"image declared as {mime} is {image.format}", "invalid_image")
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadRequest(413, f"image is over the decoder's pixel limit: {e}", "image_too_large") from None
    except BadRequest:
        raise
    except Image.UnidentifiedImageError:  # its message is the repr of our buffer: "<_io.BytesIO object at 0x...>"
        raise BadRequest(400, f"image could not be decoded: the data is not a {_FORMAT_NAMES} image",
                         "invalid_image") from None
    except binascii.Error:
        raise BadRequest(400, "image data: URI payload is not valid base64", "invalid_image") from None
    except (ValueError, OSError, SyntaxError, EOFError):  # Pillow's wording names its internals: ours instead
        raise BadRequest(400, f"image could not be decoded: the data is not a whole {IMAGE_FORMATS[mime]} image "
                              "(truncated or damaged)", "invalid_image") from None
    return load_image(image, alpha="keep")  # made RGB when tiled, by the model's conventions


_FORMAT_NAMES = "PNG, JPEG, WebP or GIF"


def image_urls(parts) -> list:
    """The ``image_url`` values of a message's content parts (what :func:`open_data_uri` takes), not decoded."""
    out = []
    for part in parts if isinstance(parts, list) else ():
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = part.get("image_url")
            out.append(url.get("url") if isinstance(url, dict) else url)
    return out


# ------------------------------------------------------------------------------------------------
# Sampling fields
# ------------------------------------------------------------------------------------------------


#: What a chat completion request gets for each field it leaves out (null counts as left out); ``seed``: a
#: random one.
SAMPLING_DEFAULTS = dict(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[], stream=False,
                         n=1, ignore_eos=False)


def number(body: dict, name: str, kind: type, default, low=None, high=None):
    """``body[name]`` as ``kind`` (int or float), ``default`` when absent or null; 400 for a boolean, a string,
    NaN / Inf, a fractional int, or a value out of [low, high] when they are given (the bounds of the
    decode settings themselves are :class:`fire_jax.infer.sampling.SamplingParams`')."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(400, f"'{name}' must be a number, got {_show(value)}", "invalid_request_error")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(400, f"'{name}' must be finite, got {value}", "invalid_request_error")
    if kind is int and value != int(value):
        raise BadRequest(400, f"'{name}' must be an integer, got {value!r}", "invalid_request_error")
    if low is not None and not low <= value <= high:
        raise BadRequest(400, f"'{name}' must be in [{low}, {high}], got {_show(value)}", "invalid_request_error")
    return kind(value)


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(400, f"'{name}' must be true or false, got {_show(value)}", "invalid_request_error")
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def sampling(body: dict) -> tuple[SamplingParams, bool]:
    """The generation settings of a chat completion request and whether it streams, from its JSON fields
    (:data:`SAMPLING_DEFAULTS` for those left out): max_tokens (``max_completion_tokens`` first), temperature,
    top_p, top_k (0: off), an integer seed (taken mod 2**32; random when absent), stop (a string or up to 4),
    stream (a boolean), n (1 only), and vLLM's ``ignore_eos`` (a boolean: true decodes all of max_tokens, past
    the end of turn and EOS, as throughput benchmarks and shutdown tests need). Each field's JSON type is
    checked here, its range by :class:`fire_jax.infer.sampling.SamplingParams` (temperature in [0, 2], top_p in
    [0, 1], top_k and max_tokens within int32): a bad field is a 400."""
    d = SAMPLING_DEFAULTS
    if number(body, "n", int, d["n"], 1, 1 << 30) != 1:
        raise BadRequest(400, "only n=1 is supported")
    max_tokens = number(body, "max_tokens", int, d["max_tokens"])
    max_tokens = number(body, "max_completion_tokens", int, max_tokens)
    seed = number(body, "seed", int, None, -2 ** 63, 2 ** 64 - 1)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise BadRequest(400, f"'stop' must be a string or a list of up to {MAX_STOP} strings of at most "
                              f"{MAX_STOP_CHARS} characters")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=number(body, "temperature", float, d["temperature"]),
                                top_p=number(body, "top_p", float, d["top_p"]),
                                top_k=number(body, "top_k", int, d["top_k"]),
                                seed=(seed if seed is not None else int.from_bytes(os.urandom(4), "little")) % 2 ** 32,
                                stop=[s for s in stop if s],
                                stop_ids=() if boolean(body, "ignore_eos", d["ignore_eos"]) else None)
    except ValueError as e:
        raise BadRequest(400, str(e), "invalid_request_error") from None
    return params, boolean(body, "stream", d["stream"])


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------


def add_arguments(parser, max_images: bool = True) -> None:
    """The limit flags of both servers."""
    default = Limits()
    group = parser.add_argument_group("limits")
    group.add_argument("--max_body_bytes", type=int, default=default.max_body_bytes,
                       help="request body size before 413")
    group.add_argument("--body_timeout", type=float, default=default.body_timeout_s,
                       help="seconds a request body may take to arrive before 408")
    group.add_argument("--max_json_depth", type=int, default=default.max_json_depth)
    group.add_argument("--max_image_bytes", type=int, default=default.max_image_bytes,
                       help="an image's encoded size before 413")
    group.add_argument("--max_pixels", type=int, default=default.max_pixels,
                       help="an image's pixels (width x height, from its header, before decoding) before 413")
    if max_images:
        group.add_argument("--max_images", type=int, default=default.max_images, help="images per request")
    group.add_argument("--max_text_chars", type=int, default=0,
                       help="characters of text per request before 400; 0 (default): the context (cache columns) "
                            "times the tokenizer's longest token")
    group.add_argument("--max_connections", type=int, default=1024,
                       help="open connections and tasks at once; past it uvicorn answers 503 (limit_concurrency)")
    group.add_argument("--keep_alive_timeout", type=int, default=5, help="seconds an idle keep-alive connection "
                                                                         "stays open")
    group.add_argument("--head_timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's line and headers before it is "
                            "closed")
    group.add_argument("--max_header_bytes", type=int, default=16 << 10,
                       help="size of a request's line and headers (h11_max_incomplete_event_size)")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a request that fails unexpectedly (else one line)")
    group.add_argument("--graceful_timeout", type=int, default=60,
                       help="seconds SIGTERM waits for the requests in flight before cancelling them")


def head_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a timeout on a request's head: a connection that has not sent a whole request
    line and headers ``seconds`` after it opened (or after its last response) is closed. uvicorn has no such
    setting (its keep-alive timeout ends at the first byte), so a client could hold a connection open for ever
    by sending nothing, or a header a byte at a time."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11(H11Protocol):
        _head_timer = None
        _scope_at_arm = None

        def _arm(self) -> None:
            self._disarm()
            self._scope_at_arm = self.scope
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.scope is self._scope_at_arm and not self.transport.is_closing():
                self.transport.close()  # no request began since the timer was armed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.scope is not self._scope_at_arm:
                self._disarm()  # a request's head has arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutH11


def limits_of(args, max_images: int | None = None) -> Limits:
    return Limits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                  max_json_depth=args.max_json_depth, max_image_bytes=args.max_image_bytes,
                  max_pixels=args.max_pixels,
                  max_images=max_images if max_images is not None else getattr(args, "max_images", 4),
                  max_text_chars=args.max_text_chars)


class OneLineLog:
    """ASGI middleware: each failed request is one line on stderr, ``<prog>: <METHOD> <path> -> <status>`` (an
    error a handler raised: ``-> 500: <its class and message>``); nothing of the request body, so nothing a user
    sent and was refused, is written. An exception no handler turned into a response becomes ``failed(error)``'s
    ``(status, JSON body)`` instead of a 60-line traceback; ``debug`` (``--debug``) adds the traceback."""

    def __init__(self, app, prog: str, failed, debug: bool = False):
        self.app, self.prog, self.failed, self.debug = app, prog, failed, debug

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        where = f"{self.prog}: {scope.get('method', '?')} {scope.get('path', '?')}"
        try:
            await self.app(scope, receive, sending)
        except Exception as error:  # noqa: BLE001 - the one place a request's unexpected failure is reported
            print(f"{where} -> {status or 500}: {type(error).__name__}: {' '.join(str(error).split())[:300]}",
                  file=sys.stderr, flush=True)
            if self.debug:
                traceback.print_exc()
            if status is None:
                from starlette.responses import JSONResponse

                code, body = self.failed(error)
                await JSONResponse(body, status_code=code)(scope, receive, send)
            return
        if status is not None and status >= 400:
            print(f"{where} -> {status}", file=sys.stderr, flush=True)


def run_server(app, args, announce: str, *, on_stop=None, graceful_margin_s: float = 0.0) -> None:
    """Serve ``app`` with uvicorn on ``args.host`` / ``args.port``, its connections bounded by the flags of
    :func:`add_arguments` (:func:`uvicorn_settings`). Once it listens, ``announce`` is printed, formatted with the
    host and the port it bound: with ``--port 0`` the system picks a free port, and that line says which (tests
    start servers so, no port to race for). ``on_stop()`` runs in the server's event loop at the first SIGTERM /
    Ctrl-C; uvicorn's own graceful-shutdown timeout, past which it cancels what still runs, is
    ``--graceful_timeout`` plus ``graceful_margin_s``."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            self.event_loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if not self.should_exit:
                port = self.servers[0].sockets[0].getsockname()[1]
                print(announce.format(host=args.host, port=port), flush=True)

        def handle_exit(self, sig, frame) -> None:
            if on_stop is not None and not self.should_exit and getattr(self, "event_loop", None) is not None:
                self.event_loop.call_soon_threadsafe(on_stop)
            super().handle_exit(sig, frame)

    settings = uvicorn_settings(args)
    settings["timeout_graceful_shutdown"] += graceful_margin_s
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", **settings)).run()


def uvicorn_settings(args) -> dict:
    """uvicorn.run keyword arguments for the connection flags of :func:`add_arguments`."""
    return dict(limit_concurrency=args.max_connections, timeout_keep_alive=args.keep_alive_timeout,
                h11_max_incomplete_event_size=args.max_header_bytes, http=head_timeout_protocol(args.head_timeout),
                timeout_graceful_shutdown=args.graceful_timeout)
