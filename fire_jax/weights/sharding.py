"""Mesh and shardings: logical axis names on weights, mapped to (data, fsdp, tensor) by config rules.

Every weight carries ``axes`` metadata (see ``models/layers.py``). The config
lists rules ``(logical name, mesh axes)``; a weight dimension is sharded over
the first rule's mesh axes that divide it and are not yet used by another
dimension of the same weight, else replicated. So the tiny model runs on a
2x2x2 CPU mesh with the same rules as the 8B model on 8 GPUs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from fire_jax.core import axes as ax
from fire_jax.core.config import DEFAULT_RULES  # noqa: F401 (re-exported)
from fire_jax.models.partitioning import activation_sharding, logical_to_spec  # noqa: F401 (re-exported)

MESH_AXES = (ax.DATA, ax.FSDP, ax.TENSOR)

def make_mesh(shape: Sequence[int], devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one entry may be -1 for "all remaining devices".

    A shape without -1 may use fewer devices than there are (the first ones).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape {shape}: need 3 sizes for {MESH_AXES}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    else:
        devices = devices[:math.prod(shape)]
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {len(devices)}")
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings with the structure of ``state`` (an nnx State of Variables)."""

    def one(variable):
        axes = variable.get_metadata().get("axes") or (None,) * len(variable.shape)
        return NamedSharding(mesh, logical_to_spec(axes, variable.shape, rules, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
    """Leading (batch) dimension over the rules' ``batch`` mesh axes, the rest replicated."""
    batch_axes = tuple(dict(rules)["batch"])
    return NamedSharding(mesh, P(batch_axes, *([None] * (ndim - 1))))


#: Padding value per batch key when hosts pad to a common sequence length (-1: image_index "text").
_PAD_VALUES = {"image_index": -1, "turn_ids": -1}


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh, rules=DEFAULT_RULES) -> dict[str, jax.Array]:
    """Assemble global arrays from this process's slice of the batch (multi-host safe).

    Each host buckets its own sequence length; with several processes the hosts
    first agree on the longest and pad to it (padding is unattended and unlabelled).
    """
    if jax.process_count() > 1 and "input_ids" in batch:
        from jax.experimental import multihost_utils

        length = int(np.max(multihost_utils.process_allgather(np.int32(batch["input_ids"].shape[1]))))
        batch = {k: _pad_seq(k, v, length) for k, v in batch.items()}
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.dtype.kind in "OUS":  # example ids stay on the host
            continue
        sharding = batch_sharding(mesh, value.ndim, rules)
        out[key] = jax.make_array_from_process_local_data(sharding, value)
    return out


def _pad_seq(key: str, value, length: int):
    value = np.asarray(value)
    if value.ndim != 2 or value.dtype.kind in "OUS" or key == "image_sizes" or value.shape[1] >= length:
        return value
    return np.pad(value, ((0, 0), (0, length - value.shape[1])), constant_values=_PAD_VALUES.get(key, 0))
