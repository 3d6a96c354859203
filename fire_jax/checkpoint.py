"""Models and their checkpoints, for training and inference alike.

- :func:`build_model`: a config's model (random weights, or a Hugging Face checkpoint), optionally created
  straight onto a mesh.
- :func:`trainable_filter`: which weights a run trains (LoRA; the connector; ``train.trainable`` regexes).
- :class:`Checkpointer`: orbax checkpoints of a train workdir (``WORKDIR/checkpoints/STEP/``), items
  ``params`` (the trained weights, float32), ``optimizer`` (step and AdamW moments), ``data`` (the
  iterator position) and ``config``. Keeps the last ``keep`` plus the one with the lowest loss, writes
  asynchronously, and is written by all processes together in multi-host runs.
- :func:`restore_params`: the trained weights of a workdir into a model, without an optimizer or trainer:
  evaluation does not depend on how the run was optimised. Workdirs written before the ``params`` item
  existed (one ``state`` item) load too.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from fire_jax.models import LlavaNext, LlavaNextConfig, LoRAParam

#: The build options of ``config.model`` that a Hugging Face checkpoint does not set.
_RUNTIME_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "image_mode", "pad_newline")


def build_model(config, mesh=None, rules=None) -> LlavaNext:
    """Random weights (``config.seed``), a Hugging Face checkpoint when ``config.init.hf_checkpoint`` is set, or
    a GGUF file's LLM under a fresh vision tower when ``config.init.gguf`` is (and no checkpoint is).

    With ``mesh``, random weights are created already sharded by ``rules`` (each device makes only its
    shard: nothing lands on one device first); a Hugging Face checkpoint is read and then placed.
    """
    from fire_jax.sharding import DEFAULT_RULES, state_shardings

    init = config.get("init", {})
    checkpoint = init.get("hf_checkpoint") if init else None
    cfg = LlavaNextConfig.from_dict(config.model)
    if init and init.get("gguf") and not checkpoint:
        return _from_gguf(config, cfg, mesh, rules)
    if not checkpoint:
        if mesh is None:
            return LlavaNext(cfg, rngs=nnx.Rngs(config.seed))
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LlavaNext(cfg, rngs=nnx.Rngs(config.seed))))
        shardings = state_shardings(abstract, mesh, rules or DEFAULT_RULES)
        state = jax.jit(lambda: nnx.state(LlavaNext(cfg, rngs=nnx.Rngs(config.seed))), out_shardings=shardings)()
        return nnx.merge(graphdef, state)
    from fire_jax.convert.hf import load_hf_checkpoint

    overrides = {k: v for k, v in config.model.items() if k in _RUNTIME_FIELDS}
    model = load_hf_checkpoint(checkpoint, cfg.lora, seed=config.seed, **overrides)
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules or DEFAULT_RULES)))
    return model


def _from_gguf(config, cfg: LlavaNextConfig, mesh, rules) -> LlavaNext:
    """``config.init.gguf`` (a model name or a .gguf path): the file's LLM in a LLaVA whose vision tower,
    connector, image_newline and any rows past the file's vocabulary (the image token) start random."""
    from fire_jax.convert.fetch import prepare
    from fire_jax.convert.gguf import load_gguf_llm
    from fire_jax.sharding import DEFAULT_RULES, state_shardings

    model = LlavaNext(cfg, rngs=nnx.Rngs(config.seed))
    load_gguf_llm(model, prepare(config.init.gguf))
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules or DEFAULT_RULES)))
    return model


def trainable_filter(train_cfg):
    """What the optimizer sees: LoRA factors, the connector with ``train_connector``, and any frozen
    weight whose path ("language_model/model/layers/0/mlp/up_proj/kernel") fully matches one of the
    ``trainable`` regexes (big_vision-style; the tiny from-scratch demo trains everything with ".*")."""
    filters = [LoRAParam]
    if train_cfg.train_connector:
        filters.append(nnx.All(nnx.Param, nnx.PathContains("multi_modal_projector")))
    patterns = tuple(train_cfg.get("trainable", ()))
    if patterns:
        regex = re.compile("|".join(f"(?:{p})" for p in patterns))
        filters.append(nnx.All(nnx.Param, lambda path, _: regex.fullmatch("/".join(map(str, path))) is not None))
    return nnx.Any(*filters)


class Checkpointer:
    """A train workdir's orbax checkpoints (items ``params``, ``optimizer``, ``data``, ``config``; older ones
    hold ``state`` instead of the first two)."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        preservation = policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preservation, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "optimizer", "state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, config: dict, metrics: dict | None = None,
             force: bool = False) -> bool:
        """``state``: a train state with ``params`` (the trained weights) and ``step`` / ``opt_state``."""
        args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                                  optimizer=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
                                  data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config))
        return self.manager.save(step, args=args, metrics=metrics, force=force)

    def _items(self, step: int) -> set[str]:
        return set(os.listdir(os.path.join(self.directory, str(step))))

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int] | None:
        """(state, data iterator state, step) of ``step`` (default: latest), or None if there is none.

        ``abstract_state``: the state's structure with shardings (e.g. the trainer's initial state),
        so every array comes back already placed on the mesh.
        """
        step = self.manager.latest_step() if step is None else step
        if step is None:
            return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        if "params" not in self._items(step):  # written before the params item existed
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
            return restored.state, restored.data, step
        optimizer = {"step": target.step, "opt_state": target.opt_state}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target.params), optimizer=ocp.args.StandardRestore(optimizer),
            data=ocp.args.JsonRestore()))
        state = type(abstract_state)(restored.optimizer["step"], restored.params, restored.optimizer["opt_state"])
        return state, restored.data, step

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """(trained weights, step): only the ``params`` item, structured and placed like ``abstract_params``."""
        step = self.manager.latest_step() if step is None else step
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)
        if "params" in self._items(step):
            restored = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
            return restored.params, step
        # An older workdir: the whole train state in one item. Restored onto one device from its own metadata
        # (without a target orbax would place arrays by the saved shardings, which need the training topology),
        # then its params are kept.
        metadata = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), "state"))
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        saved = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), tree)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(saved)))
        return _like(target, restored.state["params"]), step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _like(target, raw):
    """``raw`` (nested dicts as orbax restores an untyped tree) in ``target``'s structure and dtypes."""
    flat_raw = {tuple(str(k) for k in path): value for path, value in _flatten_dict(raw)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    out = []
    for path, leaf in leaves:
        key = tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
        key = tuple(k for k in key if k != "value")
        if key not in flat_raw:
            raise KeyError(f"checkpoint has no parameter {'/'.join(key)}")
        out.append(jax.numpy.asarray(flat_raw[key], leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _flatten_dict(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten_dict(v, prefix + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten_dict(v, prefix + (i,))
    else:
        yield tuple(k for k in prefix if k != "value"), tree


def restore_params(model, workdir: str, train_cfg, *, step: int | None = None) -> int:
    """Set ``model``'s trained weights from the orbax checkpoint of a train workdir; returns its step.

    Only the ``params`` item is read, shaped by ``model`` and :func:`trainable_filter` (float32, as trained):
    no trainer, optimizer or mesh is built.
    """
    params = nnx.state(model, trainable_filter(train_cfg))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32), params)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        available = checkpointer.all_steps()
        if not available or (step is not None and step not in available):
            raise FileNotFoundError(f"train workdir {workdir}: no checkpoint"
                                    + (f" at step {step}; it has steps {sorted(available)}" if available else " yet"))
        restored, step = checkpointer.restore_params(abstract, step)
    finally:
        checkpointer.close()
    nnx.update(model, restored)
    return step
