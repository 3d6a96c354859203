"""Loopback servers for the demo and FIRE-100K tests: a free 127.0.0.1 port, readiness by polling, kill on exit."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


@contextlib.contextmanager
def server(module: str, args: list[str], ready_path: str, timeout: float = 120):
    """``python -m module --port P *args`` on a free loopback port; yields (process, http://127.0.0.1:P)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # tests/ on the path: a server started with --plugin scripted_model finds the tests' scripted endpoints
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__))]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    process = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:  # poll for readiness
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited with {process.returncode}:\n{process.stdout.read()}")
            try:
                urllib.request.urlopen(base + ready_path, timeout=1).close()
                break
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    raise RuntimeError(f"{module} did not answer on {base}{ready_path} in {timeout} s")
                time.sleep(0.2)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
