"""Test-wide setup: 8 host CPU devices for mesh tests, tests/ on the path, XLA:CPU's backend at -O0
(``loopback.TEST_XLA_FLAGS``, also in the subprocesses the tests start), one compilation cache per run,
compiled programs freed per module, and glibc's huge pages for the workers (``fire_jax.core.hugepages``; the commands
re-run themselves to get them, the workers start with them).

**One compilation cache per run.** The suite builds the same tiny models in many modules and in the
subprocesses of its CLI, server and main-job tests, and each training stage jits its own step, so the same
programs are compiled again and again. JAX's persistent compilation cache, in a fresh folder for each pytest
run (``JAX_COMPILATION_CACHE_DIR``, inherited by every subprocess), compiles each program once per run; its key
holds the program, the compile options and the JAX version. The folder is removed when the run ends, so no run
reads another's entries. ``FIRE_JAX_TEST_XLA_CACHE=off`` turns it off; ``FIRE_JAX_TEST_XLA_CACHE=DIR`` keeps one
in DIR.

**Compiled programs are freed per module.** Every XLA:CPU executable holds memory maps of its own (code and
constants), and JAX keeps every program it compiled alive in its caches. A module of this suite leaves
9,000-14,000 maps behind; the whole suite, run in one process, passes Linux's default limit of 65,530 maps a
process (``vm.max_map_count``), and the next compile then fails inside LLVM with a segmentation fault or an
abort. So the compiled programs are dropped after each module (``jax.clear_caches``): about 1,200 maps stay.
A later module that needs one of them again loads it from the compilation cache.
"""

import atexit
import contextlib
import gc
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from loopback import TEST_XLA_FLAGS  # noqa: E402  (tests/ is on the path from here)

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from fire_jax.core import hugepages  # noqa: E402

if hugepages.wanted():  # huge pages for the test workers and their subprocesses, as the commands take them
    os.environ["GLIBC_TUNABLES"] = hugepages.tunables()

_cache = os.environ.get("FIRE_JAX_TEST_XLA_CACHE", "")
if _cache != "off" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if not _cache:
        _cache = tempfile.mkdtemp(prefix="fire_jax_test_xla_cache_")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


#: Peak resident memory of one test worker, with headroom: PyTorch, transformers and JAX in one process, the real
#: SmolLM2 file in both frameworks (tests/test_gguf.py), and the subprocesses a CLI or server test starts.
WORKER_MEMORY = 5 << 30


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per usable core, as many as the available memory holds (at least one). A cgroup v2
    limit (a container's ``cpu.max``, ``memory.max``) counts when it is lower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = (_read("/sys/fs/cgroup/cpu.max") or "max").split()
    if quota[0] != "max" and len(quota) == 2:
        cores = min(cores, max(1, int(quota[0]) // int(quota[1])))
    meminfo = _read("/proc/meminfo") or ""
    available = next((int(line.split()[1]) << 10 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    limit = (_read("/sys/fs/cgroup/memory.max") or "max").strip()
    if limit.isdigit():
        used = (_read("/sys/fs/cgroup/memory.current") or "0").strip()
        room = int(limit) - (int(used) if used.isdigit() else 0)
        available = room if available is None else min(available, room)
    return max(1, min(cores, available // WORKER_MEMORY) if available else cores)


#: The files that take one worker longest, longest first (2026-12-08, 2 workers on a 2-core machine: the reduced
#: main job's file, its wheel built and installed, about 230 s, then 60-120 each; docs/testing.md). Under
#: ``loadfile`` they are queued first, so that the last files to start are short ones.
SLOW_FILES = ("test_main_job.py", "test_train.py", "test_serve.py", "test_infer.py",
              "test_engine.py", "test_model.py", "test_failures.py", "test_engine_prefix.py", "test_rl.py",
              "test_vlrm_runner.py", "test_gguf.py", "test_stopping.py", "test_llava_vicuna.py", "test_lmms_eval.py")


def pytest_configure(config):
    """With workers (``-n``) and no ``--dist`` given, each test file runs whole on one worker (``loadfile``): a
    module's fixtures (the reduced main job, the engines, the GGUF models) are built once, and its compiled
    programs are freed when it ends (below). The files are then queued in collection order, which
    :func:`pytest_collection_modifyitems` makes longest first; xdist's own order (most tests first) put
    ``test_wheel.py``, two tests and the longest file, among the last, and one worker idled while it ran."""
    args = config.invocation_params.args
    given = any(arg == "--dist" or arg.startswith("--dist=") for arg in args)
    if getattr(config.option, "dist", "no") == "load" and not given:
        config.option.dist = "loadfile"
        if not any(arg in ("--loadscope-reorder", "--no-loadscope-reorder") for arg in args):
            config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Under xdist (the workers collect), :data:`SLOW_FILES` first, longest first; every other file after them in
    its usual order, and each file's tests in theirs."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report shows the logs of the loopback servers running then (``loopback.LOGS``): a 500
    that is not the server's own answer is explained there."""
    from loopback import LOGS, log_tail

    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, path in list(LOGS.items()):
            with contextlib.suppress(OSError):
                report.sections.append((f"log of {name}", log_tail(path)))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def backend_compiles():
    """A context manager that lists the XLA backend compiles run inside its block (a load from the run's
    compilation cache counts too): ``with backend_compiles() as compiles: ...`` then ``compiles == []``."""
    import jax

    @contextlib.contextmanager
    def listen():
        compiles = []

        def on_event(event, seconds, **kwargs):
            if event.endswith("backend_compile_duration"):
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(on_event)
        try:
            yield compiles
        finally:
            jax.monitoring.unregister_event_duration_listener(on_event)

    return listen
