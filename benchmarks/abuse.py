"""Abusive requests against a live fire_jax.serve on loopback: each one's status, whether the server still answers,
and its resident memory before and after.

    python benchmarks/abuse.py                      # starts python -m fire_jax.serve on a free 127.0.0.1 port
    python benchmarks/abuse.py --cases top_k,nested --timeout 30

The server runs the config's random tiny model (``--model tiny=random``) with
``--cache_len 512 --slots 2 --max_queue 4 --body_timeout 2 --head_timeout 2`` and otherwise its
default limits (a 48 MiB body, 4096 x 4096 pixels, 4 images, JSON 32 deep).
Each case is one request (the queue case: 8 at once) with a per-request
timeout; the run stops at ``--deadline`` seconds. After each case ``/health``
is asked (alive) and the server's VmRSS read from /proc. Prints one table:
case, HTTP status, error code, alive, RSS before and after and the peak so far
(MiB), seconds.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmHWM``: its peak so far) in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def png_header(width: int, height: int) -> bytes:
    """A PNG of its header only: it declares width x height pixels and holds none."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def small_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (30, 140, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def chat(content, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **kw}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post(base: str, body, timeout: float) -> tuple[int | str, str]:
    """(status, error code or "") of a POST to /v1/chat/completions; a transport failure as its name."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            return reply.status, ""
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return e.code, f"(not JSON: {text[:30]!r})"
    except (OSError, urllib.error.URLError) as e:
        return type(e).__name__, ""


def raw(base: str, head: bytes, body: bytes, timeout: float, send: int | None = None) -> tuple[int | str, str]:
    """(status, error code) of a request written on a socket: ``send`` body bytes at most (a client that stalls
    or declares more than it sends)."""
    host, port = base.rsplit("//", 1)[1].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(head)
            body = body if send is None else body[:send]
            for i in range(0, len(body), 1 << 20):  # stop sending once the server answers (e.g. 413 mid-body)
                if select.select([sock], [], [], 0)[0]:
                    break
                try:
                    sock.sendall(body[i:i + (1 << 20)])
                except OSError:
                    break
            reply = b""
            while b"\r\n\r\n" not in reply:
                piece = sock.recv(65536)
                if not piece:
                    return "closed", ""
                reply += piece
            status_line, _, rest = reply.partition(b"\r\n")
            sock.settimeout(2)
            try:
                while True:
                    piece = sock.recv(65536)
                    if not piece:
                        break
                    rest += piece
            except OSError:
                pass
        status = int(status_line.split()[1])
        try:
            return status, json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return status, ""
    except OSError as e:
        return type(e).__name__, ""


def head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % length)


def chunked_head() -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")


def chunked(body: bytes, size: int = 1 << 20) -> bytes:
    return b"".join(b"%x\r\n" % len(body[i:i + size]) + body[i:i + size] + b"\r\n"
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def cases(base: str, timeout: float) -> dict:
    """name -> a function returning (status, code)."""
    png = small_png()
    hi = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '

    def queue():
        barrier = threading.Barrier(8)

        def one(k):
            barrier.wait()
            return post(base, chat(f"tell me {k}", max_tokens=380), timeout)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = [status for status, _ in pool.map(one, range(8))]
        return f"{got.count(200)}x200 {got.count(503)}x503", "queue_full"

    return {
        "normal request": lambda: post(base, chat("hello"), timeout),
        "top_k 2**31": lambda: post(base, chat("hi", top_k=2 ** 31), timeout),
        "top_k 1e30": lambda: post(base, chat("hi", top_k=1e30), timeout),
        "top_k NaN": lambda: post(base, hi + b'"top_k": NaN}', timeout),
        "temperature 1e400 (inf)": lambda: post(base, hi + b'"temperature": 1e400}', timeout),
        "max_tokens 1e400": lambda: post(base, hi + b'"max_tokens": 1e400}', timeout),
        "stream \"no\"": lambda: post(base, chat("hi", stream="no"), timeout),
        "model as a list": lambda: post(base, dict(chat("hi"), model=["tiny"]), timeout),
        "JSON nested 100k deep": lambda: post(base, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                              timeout),
        "body declared 200 MB": lambda: raw(base, head(200 << 20), b"", timeout),
        "body 200 MB sent (chunked)": lambda: raw(base, chunked_head(), chunked(b" " * (200 << 20)), timeout),
        "text 40 MB (under the body limit)": lambda: post(base, chat("x" * (40 << 20)), timeout),
        "text 120 MB": lambda: raw(base, head(len(big := json.dumps(chat("x" * (120 << 20))).encode())), big,
                                   timeout),
        "5 images (4 allowed)": lambda: post(base, chat([image_part(data_uri(png))] * 5), timeout),
        "PNG declaring 10^10 pixels": lambda: post(base, chat([image_part(data_uri(png_header(10 ** 5, 10 ** 5)))]),
                                                   timeout),
        "EPS image": lambda: post(base, chat([image_part(data_uri(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n",
                                                                  "image/png"))]), timeout),
        "PNG declared image/jpeg": lambda: post(base, chat([image_part(data_uri(png, "image/jpeg"))]), timeout),
        "body stalled after 10 bytes": lambda: raw(base, head(1000), b"{" * 1000, timeout, send=10),
        "connection silent (head timeout)": lambda: raw(base, b"", b"", timeout),
        "header stalled mid-line": lambda: raw(base, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 12", b"", timeout),
        "8 at once, --max_queue 4": queue,
        "normal request again": lambda: post(base, chat("hello"), timeout),
    }


def alive(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
            return reply.status == 200
    except OSError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    process = subprocess.Popen(
        [sys.executable, "-m", "fire_jax.serve", "--port", str(port), "--model", "tiny=random", "--cache_len", "512",
         "--slots", "2", "--max_queue", "4", "--body_timeout", "2", "--head_timeout", "2"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    start = time.time()
    try:
        while not alive(base):
            if process.poll() is not None or time.time() - start > 180:
                raise SystemExit(f"the server did not start (exit {process.poll()})")
            time.sleep(0.5)
        wanted = [w for w in args.cases.split(",") if w]
        rows = []
        for name, run in cases(base, args.timeout).items():
            if wanted and not any(w in name for w in wanted):
                continue
            if time.time() - start > args.deadline:
                rows.append((name, "skipped (deadline)"))
                continue
            before = rss_mib(process.pid) if process.poll() is None else float("nan")
            t0 = time.perf_counter()
            status, code = run()
            seconds = time.perf_counter() - t0
            up = process.poll() is None and alive(base)
            after = rss_mib(process.pid) if process.poll() is None else float("nan")
            peak = rss_mib(process.pid, "VmHWM") if process.poll() is None else float("nan")
            rows.append((name, str(status), code, "yes" if up else "NO", f"{before:.0f}", f"{after:.0f}",
                         f"{peak:.0f}", f"{seconds:.1f}"))
        header = ("case", "status", "code", "alive", "RSS before MiB", "RSS after MiB", "peak RSS MiB", "s")
        rows = [row + ("",) * (len(header) - len(row)) for row in rows]
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
        print(line(header))
        print("-+-".join("-" * w for w in widths))
        for row in rows:
            print(line(row))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    main()
