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


#: XLA flags of every test process (tests/conftest.py sets them in the suite's own process, child_env in its
#: subprocesses): LLVM's -O0 for XLA:CPU's generated code. Most of the suite's time is compiling many small
#: programs, and -O0 compiles them faster. XLA's own HLO optimisations still run (the level changes LLVM's
#: passes only), and the parity tests hold at their tolerances. docs/testing.md has the figures.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a test's subprocess: the suite's XLA flags, and ``devices`` host devices (one when
    None, instead of the 8 the suite's own process has), plus ``extra``."""
    flags = TEST_XLA_FLAGS if devices is None else f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"
    return {**os.environ, "XLA_FLAGS": flags, **extra}


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
    env = child_env()
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
