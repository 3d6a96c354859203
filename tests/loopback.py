"""Loopback servers for the server, demo and FIRE-100K tests: a port the server binds itself (``--port 0``),
readiness by polling, its log shown when a test fails, kill on exit."""

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
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


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


#: The logs of the servers running now, by name: a failing test shows them (tests/conftest.py).
LOGS: dict[str, str] = {}
#: The line a server prints once it listens, with the port it bound (``--port 0``: the system's pick).
_ANNOUNCED = re.compile(r"(?:listening|demo) on http://127\.0\.0\.1:(\d+)/")


def log_tail(path: str, chars: int = 20000) -> str:
    with open(path, errors="replace") as f:
        text = f.read()
    return text if len(text) <= chars else "...\n" + text[-chars:]


@contextlib.contextmanager
def server(module: str, args: list[str], ready_path: str, timeout: float = 120):
    """``python -m module --port 0 *args``: the server binds a free loopback port itself and prints it (no port
    is picked here and released before the server takes it, which another test's server could take first);
    yields (process, http://127.0.0.1:PORT) once ``ready_path`` answers. Its output goes to a log file
    (``process.log_path``), which a failing test shows: printed when the test fails inside the block, added to
    the report while the server runs (a fixture's server; :data:`LOGS`, tests/conftest.py)."""
    env = child_env()
    # tests/ on the path: a server started with --plugin scripted_model finds the tests' scripted endpoints
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__))]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    log, log_path = tempfile.mkstemp(prefix=f"{module.rsplit('.', 1)[-1]}-", suffix=".log")
    process = subprocess.Popen([sys.executable, "-m", module, "--port", "0", *args], env=env, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
    os.close(log)
    process.log_path = log_path  # for a test that reads what the server said
    name = f"{module} {' '.join(args)} (pid {process.pid}, {log_path})"
    LOGS[name] = log_path
    deadline = time.time() + timeout
    try:
        base = None
        while True:  # the announced port, then readiness
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited with {process.returncode}:\n{log_tail(log_path)}")
            if base is None:
                announced = _ANNOUNCED.search(log_tail(log_path, 10 ** 9))
                base = announced and f"http://127.0.0.1:{announced.group(1)}"
            if base is not None:
                try:
                    urllib.request.urlopen(base + ready_path, timeout=1).close()
                    break
                except (urllib.error.URLError, OSError):
                    pass
            if time.time() > deadline:
                raise RuntimeError(f"{module} did not answer on {base or 'its port'}{ready_path} in {timeout} s:\n"
                                   f"{log_tail(log_path)}")
            time.sleep(0.2)
        try:
            yield process, base
        except BaseException:  # a test failed inside the block: its report shows this (captured output)
            print(f"log of {name}:\n{log_tail(log_path)}")
            raise
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        del LOGS[name]
        os.unlink(log_path)
