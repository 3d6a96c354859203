"""Orbax checkpoints: trainable params + optimizer + step, the data iterator position, the config.

Keeps the last ``keep`` checkpoints plus the one with the lowest loss, writes
asynchronously (training continues while the host writes), and is written by
all processes together in multi-host runs.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        preservation = policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preservation, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, config: dict, metrics: dict | None = None,
             force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        return self.manager.save(step, args=args, metrics=metrics, force=force)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int] | None:
        """(state, data iterator state, step) of ``step`` (default: latest), or None if there is none.

        ``abstract_state``: the state's structure with shardings (e.g. the trainer's initial state),
        so every array comes back already placed on the mesh.
        """
        step = self.manager.latest_step() if step is None else step
        if step is None:
            return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return restored.state, restored.data, step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
