"""Test-wide setup: 8 host CPU devices for mesh tests, tests/ on the path, compiled programs freed per module.

Every XLA:CPU executable holds memory maps of its own (code and constants), and JAX keeps every program it
compiled alive in its caches. A module of this suite leaves 9,000-14,000 maps behind; the whole suite, run in
one process, passes Linux's default limit of 65,530 maps a process (``vm.max_map_count``), and the next
compile then fails inside LLVM with a segmentation fault or an abort. So the compiled programs are dropped
after each module (``jax.clear_caches``): about 1,200 maps stay. Modules share few shapes, so little is
compiled twice.
"""

import gc
import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    yield
    import jax

    jax.clear_caches()
    gc.collect()
