"""The HTTP server's own cost: closed-loop clients against ``python -m fire_jax.serve`` on loopback.

    python benchmarks/serve_http.py                                  # this checkout
    python benchmarks/serve_http.py --against /tmp/before --rounds 2  # and another checkout, alternating: ratios

The config's random tiny model (``--model tiny=random --cache_len 512 --slots 8``) answers ``--requests`` chat
requests (5..64 words, max_tokens 8..47, greedy, every other one streamed) sent by ``clients`` closed-loop
clients (each sends its next request when its last is answered). The tiny model decodes in microseconds, so the
time is mostly the server's own: the checks, the chat template, the backend, the event loop and HTTP. Each
server first runs the workload once untimed (every shape it meets compiled), then ``--repeats`` timed runs, each
timed in wall seconds and in the server process's CPU seconds (user + system, all its threads: what the server
itself spent, which other jobs on a shared machine disturb less than the wall time).
With ``--against DIR`` (another checkout of fire_jax, e.g. ``git worktree add DIR HEAD~1``) the two servers run
in turn, ``--rounds`` times each, since a shared machine's load drifts; the table gives each run's median and
best seconds, this checkout's medians over the other's, and whether both gave the same replies (greedy: they
must).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@contextlib.contextmanager
def server(repo: str):
    """``python -m fire_jax.serve`` of the checkout ``repo`` on a free loopback port; yields (its base URL, its
    process id)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"), PYTHONPATH=repo)
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_http-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "fire_jax.serve", "--port", "0", "--model", "tiny=random",
                                "--cache_len", "512", "--slots", "8"], cwd=repo, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        base, deadline = None, time.time() + 300
        while base is None or not _answers(base + "/health"):
            if process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server of {repo} did not start; its log: {log.name}")
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)/", open(log.name).read())
            base = found and f"http://127.0.0.1:{found.group(1)}"
            time.sleep(0.5)
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(30)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


def ask(base: str, i: int):
    """Request ``i`` of the workload: (text, finish reason, usage or None when streamed)."""
    stream = i % 2 == 1
    body = {"model": "tiny", "temperature": 0, "max_tokens": 8 + (i * 7) % 40, "stream": stream,
            "messages": [{"role": "user", "content": "word " * (5 + (i * 13) % 60) + str(i)}]}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        data = reply.read().decode()
    if not stream:
        answer = json.loads(data)
        return answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"], answer["usage"]
    chunks = [json.loads(event[6:]) for event in data.split("\n\n") if event.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"], None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has spent, all its threads (Linux's /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_runs(base: str, pid: int, requests: int, clients: int, repeats: int):
    """(wall seconds of each timed run, the server's CPU seconds of each, the replies), after one untimed run."""
    def run():
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            start, cpu = time.perf_counter(), cpu_seconds(pid)
            replies = list(pool.map(lambda i: ask(base, i), range(requests)))
            return time.perf_counter() - start, cpu_seconds(pid) - cpu, replies

    run()
    runs = [run() for _ in range(repeats)]
    return [wall for wall, _, _ in runs], [cpu for _, cpu, _ in runs], runs[-1][2]


def main(argv=None):
    from fire_jax.core.results import markdown_table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="another checkout of fire_jax, run in turn with this one")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="times each checkout's server runs (in turn)")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO, **({"other": os.path.abspath(args.against)} if args.against else {})}
    clients = [int(c) for c in args.clients.split(",")]
    results = {}  # (round, checkout, clients) -> (seconds, replies)
    for k in range(args.rounds):
        for name in (list(checkouts) if k % 2 == 0 else list(checkouts)[::-1]):
            with server(checkouts[name]) as (base, pid):
                for c in clients:
                    results[k, name, c] = timed_runs(base, pid, args.requests, c, args.repeats)
    median = statistics.median
    rows = []
    for (k, name, c), (wall, cpu, replies) in sorted(results.items()):
        row = [k + 1, name, c, f"{median(wall):.2f}", f"{min(wall):.2f}", f"{args.requests / median(wall):.0f}",
               f"{median(cpu):.2f}"]
        if "other" in checkouts:
            other_wall, other_cpu, other_replies = results[k, "other", c]
            row += ["", "", ""] if name == "other" else [
                f"{median(wall) / median(other_wall):.2f}", f"{median(cpu) / median(other_cpu):.2f}",
                "yes" if replies == other_replies else "NO"]
        rows.append(row)
    header = ["round", "checkout", "clients", "median s", "best s", "requests/s", "server CPU s"]
    header += ["wall / other's", "CPU / other's", "same replies"] if "other" in checkouts else []
    print(f"{args.requests} requests, {args.repeats} timed runs each (medians); this: {REPO}"
          + (f"; other: {checkouts['other']}" if args.against else ""))
    print(markdown_table(header, rows, align="rlrrrrr" + "rrl" * bool(args.against)))


if __name__ == "__main__":
    main()
