"""Logical axis names -> mesh axes, for weights and for activations.

Weights carry ``axes`` metadata; activations are pinned with :func:`constrain`
at a few places (embeddings, every layer's output, the final hidden state) so
XLA keeps FSDP semantics: the batch stays sharded and weights are gathered,
never the other way round. Outside :func:`activation_sharding` (tests,
single-device use) :func:`constrain` does nothing, so models stay mesh-agnostic.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_ACTIVE: list[tuple[Mesh, tuple]] = []


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], rules, mesh: Mesh) -> P:
    """PartitionSpec for one array from its logical axis names."""
    rules = dict((name, tuple(mesh_axes)) for name, mesh_axes in rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        chosen = []
        for mesh_axis in rules.get(name, ()) if name else ():
            size = mesh.shape[mesh_axis]
            if mesh_axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size) == 0:
                chosen.append(mesh_axis)
        used.update(chosen)
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return P(*spec)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules):
    """While tracing inside this context, :func:`constrain` pins activations to ``mesh`` by ``rules``."""
    _ACTIVE.append((mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names (e.g. ``("batch", None, None)``), if a mesh is active."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, x.shape, rules, mesh)))
