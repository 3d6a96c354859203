"""Test-wide setup: 8 host CPU devices for mesh tests, tests/ on the path, XLA:CPU's backend at -O0
(``loopback.TEST_XLA_FLAGS``, also in the subprocesses the tests start), one compilation cache per run, and
compiled programs freed per module.

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


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per usable core, as many as the available memory holds (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return max(1, min(cores, available // WORKER_MEMORY) if available else cores)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    yield
    import jax

    jax.clear_caches()
    gc.collect()
