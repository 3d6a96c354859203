"""What this machine computes: the float32 matmul rate that every absolute time of the project is quoted beside.

The same job takes very different times on two 2-core machines of the same CPU family (docs/performance.md,
"The main job"), so a time alone says little. The main job prints its minutes beside this rate, and the benchmarks use it as their roofline.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one float32 ``n x n`` matmul under ``jax.jit`` on the default device, best of ``repeats`` calls
    after a warm-up (the machine may be shared, so the best call is the machine's rate)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best
