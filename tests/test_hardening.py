"""Request limits of fire_jax.serve (fire_jax.serving.limits): each bad request gets one 4xx JSON error before it costs
the server work, and the server keeps serving. Checked in process where that proves the point, and on a loopback
server with limits set low by flag."""

import base64
import concurrent.futures
import io
import json
import signal
import socket
import struct
import threading
import time
import types
import urllib.request
import zlib

import pytest
from PIL import Image

from fire_jax.infer.sampling import SamplingParams
from fire_jax.serving.limits import (SAMPLING_DEFAULTS, BadRequest, Limits, check_text, json_depth, open_data_uri,
                                     parse_json, sampling)


def refused(call, *args):
    with pytest.raises(BadRequest) as e:
        call(*args)
    return e.value.status, e.value.code


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG holding only its header (IHDR) and IEND: it declares width x height pixels and has none."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


# ------------------------------------------------------------------------------------------------
# In process
# ------------------------------------------------------------------------------------------------


def test_sampling_defaults_when_fields_are_omitted():
    """The settings a request gets for the fields it leaves out (null counts as left out)."""
    assert SAMPLING_DEFAULTS == dict(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[],
                                     stream=False, n=1, ignore_eos=False)
    expected = SamplingParams(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, seed=7, stop=())
    assert sampling({"seed": 7}) == (expected, False)
    assert sampling({"seed": 7, "temperature": None, "top_k": None, "stream": None, "stop": None}) == (expected, False)
    assert sampling({"seed": 7, "ignore_eos": True}) == (expected.replace(stop_ids=()), False)  # no stop token
    assert sampling({"seed": 7, "ignore_eos": False})[0].stop_ids is None  # the engine's
    seeds = {sampling({})[0].seed for _ in range(4)}  # no seed: a random one per request
    assert len(seeds) > 1 and all(0 <= s < 2 ** 32 for s in seeds)
    assert sampling({"seed": -1, "max_tokens": 8.0, "max_completion_tokens": 5, "top_k": 2 ** 31 - 1, "stop": "x",
                     "stream": True}) == (expected.replace(seed=2 ** 32 - 1, max_tokens=5, top_k=2 ** 31 - 1,
                                                           stop=("x",)), True)


@pytest.mark.parametrize("field,value", [
    ("top_k", 2 ** 31), ("top_k", 1e30), ("top_k", -1), ("top_k", 2.5), ("top_k", "5"), ("top_k", True),
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -0.5), ("temperature", 2.5),
    ("temperature", "hot"), ("top_p", 1.5), ("top_p", float("nan")), ("max_tokens", float("inf")),
    ("max_tokens", 0), ("max_tokens", 2 ** 31), ("max_completion_tokens", 1e400), ("seed", 2 ** 64),
    ("seed", "1"), ("n", 2), ("stream", "no"), ("stream", 1), ("ignore_eos", 1), ("ignore_eos", "true"),
    ("stop", ["a"] * 5), ("stop", [1]),
    ("stop", "x" * 1001)])
def test_a_bad_field_is_one_400(field, value):
    status, code = refused(sampling, {field: value})
    assert (status, code) == (400, "invalid_request_error")


def test_json_bodies_bounded_in_depth_and_literals():
    nested = []
    for _ in range(30):
        nested = [nested]
    assert parse_json(b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}", 32) == {"a": nested}
    assert refused(parse_json, b'{"a": ' + b"[" * 32 + b"]" * 32 + b"}", 32) == (400, "json_too_deep")
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert refused(parse_json, deep, 32) == (400, "json_too_deep")
    for raw in (b'{"top_k": NaN}', b'{"t": -Infinity}', b'{"seed": ' + b"9" * 5000 + b"}", b"[1]", b"\xff",
                b'{"a": '):
        assert refused(parse_json, raw, 32)[0] == 400
    assert json_depth({"a": [{"b": [1]}], "c": 2}) == 4 and json_depth(3) == 0


def test_images_checked_before_decoding():
    """Formats from the allowlist, as declared, their header's pixels within the limit; PIL's bomb check 413."""
    small = Image.new("RGB", (10, 6), (200, 10, 10))
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")):
        assert open_data_uri(uri(encoded(small, fmt), mime), 10_000, 60).size == (10, 6)
    png = encoded(small, "PNG")
    assert refused(open_data_uri, uri(png, "image/jpeg"), 10_000, 60) == (400, "invalid_image")  # not as declared
    assert refused(open_data_uri, uri(encoded(small, "EPS"), "image/png"), 10_000, 60) == (400, "invalid_image")
    assert refused(open_data_uri, uri(encoded(small, "BMP"), "image/bmp"), 10_000, 60) == (
        400, "unsupported_image_format")
    assert refused(open_data_uri, uri(png, "image/png"), 10_000, 59) == (413, "image_too_large")
    assert refused(open_data_uri, uri(png, "image/png"), len(png) - 10, 60) == (413, "image_too_large")
    bomb = uri(png_header(100_000, 100_000))  # 10^10 pixels declared in 57 bytes: refused unread
    assert refused(open_data_uri, bomb, 10_000, 4096 * 4096) == (413, "image_too_large")
    assert refused(open_data_uri, bomb, 10_000, 10 ** 12) == (413, "image_too_large")  # PIL's own bomb check
    assert refused(open_data_uri, uri(png[:40]), 10_000, 60) == (400, "invalid_image")  # truncated
    with pytest.raises(BadRequest) as e:  # PIL's message would be the repr of the decoder's buffer
        open_data_uri(uri(b"this is not a PNG"), 10_000, 60)
    assert e.value.message == "image could not be decoded: the data is not a PNG, JPEG, WebP or GIF image"
    assert refused(open_data_uri, "https://example.com/cat.png", 10_000, 60) == (400, "remote_image_url")


def test_a_text_over_the_context_is_refused_before_tokenising():
    """build_request measures the text in characters (the context times the longest token) and counts the images
    before tokenising or decoding anything: this model's tokenizer and images would fail the test if reached."""
    from fire_jax.serving.server import build_request

    def untouchable(*_, **__):
        raise AssertionError("tokenised or decoded")

    served = types.SimpleNamespace(backend=types.SimpleNamespace(max_images=4, request=untouchable),
                                   max_text_chars=1000)
    body = lambda content: {"model": "m", "messages": [{"role": "system", "content": "s" * 10},
                                                       {"role": "user", "content": content}]}
    assert refused(build_request, served, body("x" * 991), Limits()) == (400, "context_length_exceeded")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,not decoded"}}
    assert refused(build_request, served, body([image] * 3), Limits(max_images=2)) == (400, "too_many_images")
    assert refused(build_request, served, body([image, {"type": "text", "text": "y" * 2000}]), Limits()) == (
        400, "context_length_exceeded")
    assert refused(check_text, ["a\ud800"], 0)[0] == 400  # no tokenizer takes a lone surrogate
    check_text(["z" * 10 ** 6], 0)  # 0: no bound


def test_a_finished_requests_result_is_there_when_its_listener_hears_the_reason(monkeypatch):
    """The engine thread ends a request with its finish reason to ``on_update``; the server's event loop may answer
    the client before the engine thread runs on. So the ticket's result is set before the listener hears: a
    listener reads it at once, and a server whose engine pauses while building the result (here 0.3 s) still
    answers 200 with the reply, not 500 for a missing result."""
    import asyncio

    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.infer import requests as requests_module
    from fire_jax.infer.backends import Serving
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.loading import load
    from fire_jax.infer.requests import Request, Ticket
    from fire_jax.serving.server import Served, create_app

    heard = []
    ticket = Ticket(Request([1, 2, 3], SamplingParams(max_tokens=2, stop_ids=())),
                    lambda t, delta, reason: heard.append((reason, t.result)))
    assert ticket.append([7], None, stop_ids=()) is None and ticket.append([9], None, stop_ids=()) == "length"
    ticket.finish("length", with_text=False)
    assert heard[0] == (None, None) and heard[-1][0] == "length" and heard[-1][1].tokens == [7, 9]

    built = requests_module.Result

    def slow_result(*args):
        time.sleep(0.3)  # the engine thread held between the last token and the result
        return built(*args)

    monkeypatch.setattr(requests_module, "Result", slow_result)
    loaded = load(load_config(DEFAULT_CONFIG))
    backend = Serving(loaded.model, loaded.chat, EngineConfig(bucket_step=None, slots=2, cache_len=256, chunk=4))
    app = create_app({"tiny": Served("tiny", backend)})
    body = json.dumps({"model": "tiny", "max_tokens": 3, "temperature": 0,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent = []

    async def call():
        connected = asyncio.Event()  # never set: the client stays
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            for message in messages:
                return message
            await connected.wait()

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)

    backend.start()
    try:
        asyncio.run(call())
    finally:
        backend.stop()
    reply = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert sent[0]["status"] == 200, reply
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 3
    assert isinstance(reply["choices"][0]["message"]["content"], str)


# ------------------------------------------------------------------------------------------------
# A loopback server with low limits
# ------------------------------------------------------------------------------------------------

MAX_QUEUE, SLOTS, MAX_BODY, MAX_PIXELS, BODY_TIMEOUT, HEAD_TIMEOUT = 4, 2, 300_000, 10_000, 0.5, 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_reference import tiny_hf_model

    directory = str(tmp_path_factory.mktemp("hardened"))
    tiny_hf_model(directory).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint):
    from loopback import server as loopback_server

    args = ["--model", f"tiny={checkpoint}", "--cache_len", "512", "--slots", str(SLOTS), "--max_queue",
            str(MAX_QUEUE), "--max_body_bytes", str(MAX_BODY), "--max_pixels", str(MAX_PIXELS), "--max_images", "2",
            "--body_timeout", str(BODY_TIMEOUT), "--head_timeout", str(HEAD_TIMEOUT)]
    with loopback_server("fire_jax.serve", args, "/health") as (process, base):
        yield process, base


def read_response(sock) -> tuple[int, dict]:
    """(status, JSON body) of the next response on a socket (its Content-Length read whole)."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    head_text, _, rest = reply.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head_text.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head_text.split()[1]), json.loads(rest[:length])


def raw_request(base: str, head: bytes, body: bytes = b"", pause_after: int | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a request written byte for byte on a socket; ``pause_after``: send that many body
    bytes and no more (a client that stalls)."""
    host, port = base.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + (body if pause_after is None else body[:pause_after]))
        return read_response(sock)


def post(base: str, body, timeout: float = 120) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_events(base: str, body: dict) -> list[str]:
    """The data of each server-sent event of a streamed chat completion, in order (``[DONE]`` as it is)."""
    request = urllib.request.Request(f"{base}/v1/chat/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({**body, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as reply:
        return [block[len("data: "):] for block in reply.read().decode().split("\n\n") if block]


def chat(content, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **kw}


def head(length: int | None, chunked: bool = False) -> bytes:
    size = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + size
            + b"Connection: close\r\n\r\n")


def test_bodies_over_the_limits_get_413_or_408(server):
    _, base = server
    status, reply = raw_request(base, head(200 * 2 ** 20))  # declared 200 MB: refused before a byte is read
    assert (status, reply["error"]["code"]) == (413, "request_too_large")
    chunk = b"x" * 100_000
    chunked = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
    status, reply = raw_request(base, head(None, chunked=True), chunked)  # no length declared: cut as it arrives
    assert (status, reply["error"]["code"]) == (413, "request_too_large")
    body = json.dumps(chat("hi")).encode()
    start = time.perf_counter()
    status, reply = raw_request(base, head(len(body)), body, pause_after=10)  # a client that stalls mid-body
    assert (status, reply["error"]["code"]) == (408, "request_timeout")
    assert time.perf_counter() - start < BODY_TIMEOUT + 10
    assert post(base, chat("still there?"))[0] == 200


def test_a_connection_that_sends_no_whole_head_is_closed(server):
    """--head_timeout: a silent connection and one stalled mid-header are closed; one sending its request in time
    keeps being served, and again after its response (keep-alive)."""
    _, base = server
    host, port = base.rsplit("//", 1)[1].split(":")
    for sent in (b"", b"GET /health HTTP/1.1\r\nHost: 127"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(sent)
            start = time.perf_counter()
            assert sock.recv(1024) == b""  # closed by the server, no reply
            assert time.perf_counter() - start < HEAD_TIMEOUT + 10
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, reply = read_response(sock)
            assert status == 200 and reply["status"] == "ok"


def test_bad_requests_get_one_json_400_and_the_server_lives(server):
    _, base = server
    small = encoded(Image.new("RGB", (20, 20), (9, 9, 9)), "PNG")
    image = lambda url: {"type": "image_url", "image_url": {"url": url}}
    cases = {
        "top_k 2**31": (chat("hi", top_k=2 ** 31), 400, "invalid_request_error"),
        "top_k 1e30": (chat("hi", top_k=1e30), 400, "invalid_request_error"),
        "top_k NaN": (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": NaN}', 400,
                      "invalid_json"),
        "max_tokens 1e400": (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                             b'1e400}', 400, "invalid_request_error"),
        "stream 'no'": (chat("hi", stream="no"), 400, "invalid_request_error"),
        "model as a list": (dict(chat("hi"), model=["tiny"]), 400, "invalid_request_error"),
        "nested 100k deep": (b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
                             "json_too_deep"),
        "text over the context": (chat("x" * 250_000), 400, "context_length_exceeded"),
        "3 images, 2 allowed": (chat([image("data:image/png;base64,AAAA")] * 3 + [{"type": "text", "text": "Q"}]),
                                400, "too_many_images"),
        "PNG declaring 10^10 pixels": (chat([image(uri(png_header(100_000, 100_000))), {"type": "text", "text": "Q"}]),
                                       413, "image_too_large"),
        "EPS": (chat([image(uri(b"%!PS-Adobe-3.0 EPSF-3.0\n", "application/postscript"))]), 400,
                "unsupported_image_format"),
        "PNG declared as JPEG": (chat([image(uri(small, "image/jpeg")), {"type": "text", "text": "Q"}]), 400,
                                 "invalid_image"),
    }
    for name, (body, status, code) in cases.items():
        got, reply = post(base, body)
        assert (name, got, reply["error"]["code"]) == (name, status, code)
        assert set(reply["error"]) >= {"message", "type", "code"}
    assert post(base, chat([image(uri(small)), {"type": "text", "text": "Q"}]))[0] == 200
    assert post(base, chat("still there?"))[0] == 200


def test_the_queue_counts_every_admitted_request(server):
    """--max_queue 4 on 2 slots: of 8 requests sent at once exactly 4 are admitted (2 decoding, 2 waiting or
    being prefilled), the others get 503."""
    _, base = server
    barrier = threading.Barrier(8)

    def one(k):
        barrier.wait()
        return post(base, chat(f"tell me {k}", max_tokens=380))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    codes = sorted(status for status, _ in replies)
    assert codes == [200] * MAX_QUEUE + [503] * (8 - MAX_QUEUE)
    assert all(reply["error"]["code"] == "queue_full" for status, reply in replies if status == 503)


def test_requests_past_the_graceful_timeout_end_cleanly(tmp_path):
    """SIGTERM with three requests that would take a minute, --graceful_timeout 1: through the openai client the
    plain one gets a JSON 503 shutting_down and the stream an error event, which a raw read shows followed by
    [DONE]; the server logs one line per request, no traceback, and exits."""
    import openai

    from loopback import get_json, server as loopback_server

    script = tmp_path / "slow.json"
    script.write_text(json.dumps({"rules": [{"contains": "slow", "reply": "late", "delay_s": 60}]}))
    with loopback_server("fire_jax.serve", ["--plugin", "scripted_model", "--model", f"m=scripted:{script}",
                                            "--graceful_timeout", "1"],
                         "/health") as (process, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "slow"}]

        def plain():
            with pytest.raises(openai.APIStatusError) as e:
                client.chat.completions.create(model="m", messages=messages)
            return e.value.status_code, e.value.body

        def streamed():
            pieces = []
            with pytest.raises(openai.APIError) as e:
                for chunk in client.chat.completions.create(model="m", messages=messages, stream=True):
                    pieces.append(chunk.choices[0].delta.role)
            return pieces, e.value.message, e.value.body

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = [pool.submit(plain), pool.submit(streamed),
                       pool.submit(stream_events, base, {"model": "m", "messages": messages})]
            while get_json(f"{base}/health")["models"]["m"]["requests"]["slow"] < 3:
                assert not any(reply.done() for reply in replies)
            start = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) in (0, -signal.SIGTERM)
            assert time.perf_counter() - start < 30
            (status, body), (roles, message, error), events = (reply.result() for reply in replies)
        log = open(process.log_path).read()
    said = ("the server is shutting down and this request did not finish within its graceful timeout (1 s); send it "
            "again to another server or later")
    assert (status, body["code"], body["message"]) == (503, "shutting_down", said)
    assert roles == ["assistant"] and message == said and error["code"] == "shutting_down"
    assert json.loads(events[-2])["error"] == {"message": said, "type": "server_error", "code": "shutting_down"}
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    ended = [line for line in log.splitlines() if line.startswith("graceful timeout of 1 s passed: request ")]
    assert len(ended) == 3 and sum(line.endswith("(503)") for line in ended) == 1
    assert "Traceback" not in log and "Error" not in log


def test_a_plugin_kind_is_served_on_the_backend_protocol(tmp_path):
    """The tests' scripted endpoint has every member of the server's backend protocol, and is served as a model
    is: a slow request whose client goes away is cancelled, its place in the queue and its timer freed
    (/health: nothing admitted, nothing in flight), and the next request is answered."""
    import typing

    from fire_jax.infer.backends import ServedBackend
    from loopback import get_json, server as loopback_server
    from scripted_model import ScriptedBackend

    members = {name for name in dir(ServedBackend) if not name.startswith("_")} | set(
        typing.get_type_hints(ServedBackend))
    assert members == {"description", "context", "tokenizer", "max_images", "in_flight", "summary", "health",
                       "request", "submit", "cancel", "start", "stop", "warm_up"}
    script = tmp_path / "slow.json"
    script.write_text(json.dumps({"rules": [{"contains": "slow", "reply": "late", "delay_s": 60}], "default": "now"}))
    assert all(hasattr(ScriptedBackend(str(script)), name) for name in members)
    with loopback_server("fire_jax.serve", ["--plugin", "scripted_model", "--model", f"m=scripted:{script}"],
                         "/health") as (_, base):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "slow"}]}).encode()
        with pytest.raises(OSError):  # the client gives up after a second
            urllib.request.urlopen(urllib.request.Request(f"{base}/v1/chat/completions", body,
                                                          {"content-type": "application/json"}), timeout=1)
        deadline = time.perf_counter() + 20
        while (health := get_json(f"{base}/health")["models"]["m"])["in_flight"] or health["admitted"]:
            assert time.perf_counter() < deadline, health
            time.sleep(0.1)
        assert health == {"description": f"scripted replies from {script}", "admitted": 0, "in_flight": 0,
                          "requests": {"slow": 1}}
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "quick"}]}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/chat/completions", body,
                                                           {"content-type": "application/json"}), timeout=30) as r:
            assert json.loads(r.read())["choices"][0]["message"]["content"] == "now"


def test_engine_requests_past_the_graceful_timeout_end_cleanly():
    """The same with the engine: a plain request and a stream of 9,000 tokens each (ignore_eos), SIGTERM,
    --graceful_timeout 1: the plain one gets its 503, the stream its error event and [DONE] after the tokens so
    far (none, when the first compile takes the second); the server exits."""
    from loopback import get_json, server as loopback_server

    messages = [{"role": "user", "content": "go on"}]
    with loopback_server("fire_jax.serve", ["--model", "tiny=random", "--slots", "2", "--graceful_timeout", "1"],
                         "/health") as (process, base):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # ignore_eos: sampled from a random model both would otherwise end within a few hundred tokens
            body = {"model": "tiny", "messages": messages, "max_tokens": 9000, "ignore_eos": True}
            plain, streamed = pool.submit(post, base, body), pool.submit(stream_events, base, body)
            while get_json(f"{base}/health")["models"]["tiny"]["in_flight"] < 2:
                assert not plain.done() and not streamed.done()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) in (0, -signal.SIGTERM)
            (status, body), events = plain.result(), streamed.result()
        log = open(process.log_path).read()
    assert status == 503 and body["error"]["code"] == "shutting_down", (status, body)
    assert json.loads(events[-2])["error"]["code"] == "shutting_down" and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert sorted(line.rsplit("(", 1)[1] for line in log.splitlines() if line.startswith("graceful timeout")) == [
        "503)", "an error event and [DONE])"]
    assert "Traceback" not in log
