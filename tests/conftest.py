"""Test-wide setup: 8 host CPU devices for mesh tests, tests/ on the path, one XLA compilation cache.

The suite builds the same tiny models in many modules and in the subprocesses of its CLI and server tests
(train, evaluate, serve, the demo, the main job), so the same programs are compiled again and again. JAX's
persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, inherited by every subprocess and shared by
pytest-xdist's workers) compiles each once per machine; its key holds the program, the compile options and
the JAX version, so a stale entry is never used. ``FIRE_JAX_TEST_XLA_CACHE=""`` turns it off.
"""

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_cache = os.environ.get("FIRE_JAX_TEST_XLA_CACHE",
                        os.path.join(tempfile.gettempdir(), f"fire_jax_test_xla_cache_{os.getuid()}"))
if _cache:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
sys.path.insert(0, os.path.dirname(__file__))
