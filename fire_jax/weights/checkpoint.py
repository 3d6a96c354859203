"""Orbax checkpoints of a train workdir, for training and inference alike (a model is built by
:mod:`fire_jax.weights.build`).

- :class:`Checkpointer`: orbax checkpoints of a train workdir (``WORKDIR/checkpoints/STEP/``), items
  ``params`` (the trained weights, float32), ``optimizer`` (step and AdamW moments), ``data`` (the
  iterator position) and ``config``. Keeps the last ``keep`` plus the one with the lowest loss, writes
  asynchronously, and is written by all processes together in multi-host runs. Each step also holds an item
  ``checksums``: two 32-bit sums over the words of every array, computed at save time; a restore recomputes them
  and ends, on a mismatch, with :class:`CheckpointDamaged` naming the step, item and array (a flipped byte in an
  array file is otherwise read back silently). A train run's resume falls back to the previous good step,
  saying so, and moves the damaged one aside. A save that cannot be written (a full disk) ends in one
  :class:`fire_jax.core.config.WriteFailed` naming the step, its directory and the space left, as soon as the
  background write has failed (:meth:`Checkpointer.check`); the steps before it are left as they were.
- :func:`restore_params`: the trained weights of a workdir into a model, without an optimizer or trainer:
  evaluation does not depend on how the run was optimised. Workdirs written before the ``params`` item
  existed (one ``state`` item) load too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from fire_jax.core.config import InputError, WriteFailed, error_number, json_error_at, write_failed
from fire_jax.weights.build import trainable_filter


class CheckpointDamaged(InputError):
    """A checkpoint step that does not read back as it was written: an orbax JSON file that does not parse, an
    array file that does not decode, or an array whose checksum differs from the one saved with it. The message
    names the step directory, the item and the array or file."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


#: The checksum recorded per array in a step's ``checksums`` item (:func:`array_checksums`).
CHECKSUM_ALGORITHM = "fmix32-sum-2x32"
_CHECKSUM_SEEDS = (0x243F6A88, 0x13198A2E)
#: Orbax's JSON files in a step directory (and its items' directories).
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata", "process_0")
#: What a read error of tensorstore / OCDBT says when an array file does not decode (as opposed to a target
#: that does not match the saved tree, which is the run's config, not damage).
_READ_ERROR = re.compile(r"DATA_LOSS|OCDBT|TensorStore|tensorstore|Error (?:opening|reading|decoding)|[Cc]orrupt")


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """The bits of ``x`` as uint32 words, in ``x``'s shape (and sharding): one word per element of up to 32 bits,
    two (a trailing axis) per 64-bit element."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
        raise TypeError(f"no checksum for dtype {x.dtype}")
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sums(x):
    """Two 32-bit sums over ``x``'s words, each word mixed with its position (a bijection per position: any
    one changed word changes both sums; integer sums do not depend on the order or sharding of the reduction)."""
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2 ** 32)
        stride *= words.shape[axis]
    return jnp.stack([jnp.sum(_fmix32(words ^ _fmix32(index + jnp.uint32(seed))), dtype=jnp.uint32)
                      for seed in _CHECKSUM_SEEDS])


#: One program per array shape, dtype and sharding, not one per tree: a model's hundreds of arrays share a few
#: dozen shapes, so a checkpoint traces and compiles a few dozen small programs instead of one with an input per
#: array (which took longer to trace than the steps it followed took to run).
_leaf_sums = jax.jit(_sums)


def _path_name(path) -> str:
    keys = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
    return "/".join(k for k in keys if k != "value") or "(root)"


def array_checksums(tree: Any) -> dict[str, str]:
    """``{array path: 16 hex digits}`` for every array of ``tree`` (:data:`CHECKSUM_ALGORITHM`), computed where
    the arrays are (sharded or not, one process or many: every process gets the same sums)."""
    sums = jax.tree.map(_leaf_sums, tree)
    out = {}
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
        local = value.addressable_data(0) if isinstance(value, jax.Array) else value  # a replicated (2,) array
        a, b = (int(v) for v in jax.device_get(local))
        out[_path_name(path)] = f"{a:08x}{b:08x}"
    return out


class _QuietSaveErrors(logging.Filter):
    """Drops orbax's own error logs (each a traceback), and asyncio's of orbax's tasks left unfinished: a save that
    fails reaches the run as one :class:`WriteFailed` line (:meth:`Checkpointer.check`). ``FIRE_JAX_TRACEBACK=1``
    keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or os.environ.get("FIRE_JAX_TRACEBACK"):
            return True
        if record.name != "asyncio":
            return f"{os.sep}orbax{os.sep}" not in record.pathname
        # asyncio's "Task / Future exception was never retrieved" of a failed save: orbax is named in the task's
        # repr, in its traceback, or (a tensorstore future, no traceback) in the path of the write that failed
        tb = record.exc_info[2] if record.exc_info else None
        return "orbax" not in record.getMessage() + "".join(traceback.format_tb(tb) if tb else [])


def _quiet_closed_loops(previous):
    """A ``sys.unraisablehook`` that drops "Event loop is closed": tensorstore's writes still in flight when an
    orbax save fails complete onto the event loop orbax has closed already (one traceback each)."""
    def hook(unraisable):
        if (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
                and not os.environ.get("FIRE_JAX_TRACEBACK")):
            return
        previous(unraisable)

    hook.quiet_closed_loops = True
    return hook


def _quiet_save_errors() -> None:
    """Install :class:`_QuietSaveErrors` and :func:`_quiet_closed_loops` (once)."""
    for name in ("absl", "asyncio"):  # orbax logs through absl
        logging.getLogger(name).addFilter(_QUIET_SAVE_ERRORS)  # a no-op when added already
    if not getattr(sys.unraisablehook, "quiet_closed_loops", False):
        sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)
    if not os.environ.get("FIRE_JAX_TRACEBACK"):  # orbax's writes left unstarted when a save failed, at exit
        warnings.filterwarnings("ignore", r"coroutine '[^']*(serialize|write_fragment)[^']*' was never awaited",
                                RuntimeWarning)


_QUIET_SAVE_ERRORS = _QuietSaveErrors()


class Checkpointer:
    """A train workdir's orbax checkpoints (items ``params``, ``optimizer``, ``data``, ``config``,
    ``checksums``; older ones hold ``state`` instead of the first two, and no checksums)."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True, clear_unfinished: bool = False):
        """``clear_unfinished``: remove the unfinished step a failed save left (``STEP.orbax-checkpoint-tmp``),
        and its space with it; for the run that writes the directory (a reader could remove a save in flight)."""
        self.directory = os.path.abspath(directory)
        preservation = policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preservation, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=clear_unfinished)
        _quiet_save_errors()
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "optimizer", "state", "data", "config",
                                                         "checksums"))
        self._saving: int | None = None  # the step of the save last started

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, config: dict, metrics: dict | None = None,
             force: bool = False) -> bool:
        """``state``: a train state with ``params`` (the trained weights) and ``step`` / ``opt_state``."""
        optimizer = {"step": state.step, "opt_state": state.opt_state}
        checksums = {"algorithm": CHECKSUM_ALGORITHM, "params": array_checksums(state.params),
                     "optimizer": array_checksums(optimizer)}
        args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                                  optimizer=ocp.args.StandardSave(optimizer),
                                  data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config),
                                  checksums=ocp.args.JsonSave(checksums))
        self.wait()  # the save before this one, its failure named as its own (orbax's save waits for it anyway)
        self._saving = step
        with self._writing():
            return self.manager.save(step, args=args, metrics=metrics, force=force)

    def check(self) -> None:
        """Raise :class:`WriteFailed` if a save that ran in the background has failed; a save still running is
        not waited for."""
        if not self.manager.is_saving_in_progress():
            self.wait()

    @contextlib.contextmanager
    def _writing(self):
        """A failure to write (an error that carries an errno: a full disk, a quota, a read-only filesystem)
        as one :class:`WriteFailed` naming the step being saved and the steps kept from before."""
        try:
            yield
        except WriteFailed:
            raise
        except Exception as e:  # noqa: BLE001 (orbax's thread errors: OSError, tensorstore's ValueError)
            if error_number(e) is None or self._saving is None:
                raise
            kept = [s for s in self.manager.all_steps() if s != self._saving]
            failed = write_failed(self.step_dir(self._saving), e)
            raise WriteFailed(f"checkpoint of step {self._saving}: {failed}; "
                              + (f"the steps before it are intact (latest: {max(kept)})" if kept else
                                 "no earlier checkpoint")) from e

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _items(self, step: int) -> set[str]:
        return set(os.listdir(self.step_dir(step)))

    def _check_json_files(self, step: int) -> None:
        """Each orbax JSON file of the step parses (orbax's own error, "Expecting value: line 1 column 1",
        names no file)."""
        root = self.step_dir(step)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "d" and not d.startswith("ocdbt.process_")]
            for name in sorted(filenames):
                if name not in _JSON_FILES:
                    continue
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    raw = f.read()
                try:
                    json.loads(raw)
                except json.JSONDecodeError as e:
                    what = "empty" if not raw.strip() else f"not valid JSON: {json_error_at(e.msg, f'byte {e.pos}')}"
                    raise CheckpointDamaged(f"checkpoint {root}: file {os.path.relpath(path, root)} is {what}; "
                                            f"the step is damaged", step) from None
                except UnicodeDecodeError as e:
                    raise CheckpointDamaged(f"checkpoint {root}: file {os.path.relpath(path, root)} is not UTF-8 "
                                            f"(byte {e.start}); the step is damaged", step) from None

    def _read(self, step: int, item: str, args: Any) -> Any:
        """One item of the step; a file that does not decode is :class:`CheckpointDamaged`, a target that does
        not match what was saved an :class:`InputError`, both naming the step and item."""
        try:
            return getattr(self.manager.restore(step, args=ocp.args.Composite(**{item: args})), item)
        except Exception as e:  # noqa: BLE001 (sorted below)
            if isinstance(e, InputError):
                raise
            detail = " ".join(str(e).split())
            if len(detail) > 400:
                detail = detail[:400] + "..."
            if isinstance(e, (OSError, json.JSONDecodeError, UnicodeDecodeError)) or _READ_ERROR.search(str(e)):
                array = re.search(r'reading "([^"]+?)/\.z(?:array|arr\.json)"', str(e))  # tensorstore's key
                where = f"item {item}, array {array.group(1)}" if array else f"item {item}"
                raise CheckpointDamaged(f"checkpoint {self.step_dir(step)}: {where}: could not be read "
                                        f"({detail}); the step is damaged", step) from e
            if isinstance(e, ValueError):
                raise InputError(f"checkpoint {self.step_dir(step)}: item {item} does not match this run's "
                                 f"model and optimizer: {detail}") from e
            raise

    def _checksums(self, step: int) -> dict | None:
        if "checksums" not in self._items(step):
            return None  # written before checksums were stored
        return self._read(step, "checksums", ocp.args.JsonRestore())

    def _verify(self, step: int, saved: dict | None, item: str, tree: Any) -> None:
        """Raise :class:`CheckpointDamaged` naming the first array of ``tree`` whose checksum differs from the
        one saved (or that was not saved)."""
        if saved is None:
            return
        if saved.get("algorithm") != CHECKSUM_ALGORITHM:
            raise CheckpointDamaged(f"checkpoint {self.step_dir(step)}: item checksums: unknown algorithm "
                                    f"{saved.get('algorithm')!r} (expected {CHECKSUM_ALGORITHM!r})", step)
        expected = saved.get(item) or {}
        got = array_checksums(tree)
        for name, value in got.items():
            if name not in expected:
                raise CheckpointDamaged(f"checkpoint {self.step_dir(step)}: item {item}, array {name}: no checksum "
                                        f"was saved for it; the step is damaged", step)
            if expected[name] != value:
                raise CheckpointDamaged(f"checkpoint {self.step_dir(step)}: item {item}, array {name}: checksum "
                                        f"{value} != {expected[name]} saved with it; the step is damaged", step)
        missing = sorted(set(expected) - set(got))
        if missing:
            raise CheckpointDamaged(f"checkpoint {self.step_dir(step)}: item {item}, array {missing[0]}: saved "
                                    f"but not restored", step)

    def restore(self, abstract_state: Any, step: int | None = None,
                fallback: bool = False) -> tuple[Any, dict, int] | None:
        """(state, data iterator state, step) of ``step`` (default: latest), or None if there is none; each array
        checked against the checksum saved with it (:class:`CheckpointDamaged` on a mismatch).

        ``abstract_state``: the state's structure with shardings (e.g. the trainer's initial state),
        so every array comes back already placed on the mesh. ``fallback`` (the latest step only): a damaged
        step is reported, moved aside (:meth:`set_aside`) and the previous step tried; when every step is
        damaged the last error is raised.
        """
        if step is not None or not fallback:
            return self._restore(abstract_state, step)
        while True:
            try:
                return self._restore(abstract_state, None)
            except CheckpointDamaged as e:
                if e.step is None:
                    raise
                if jax.process_index() == 0:
                    print(f"{e}", flush=True)
                previous = [s for s in self.all_steps() if s < e.step]
                if not previous:
                    raise CheckpointDamaged(f"{e} (no earlier step to resume from; it is left in place)",
                                            e.step) from None
                moved = self.set_aside(e.step)
                if jax.process_index() == 0:
                    print(f"damaged step {e.step} moved to {moved}; falling back to step {max(previous)}",
                          flush=True)

    def set_aside(self, step: int) -> str:
        """Move a damaged step out of the checkpoint directory, to ``<directory>.damaged/STEP`` (kept for a look,
        no longer a step of this run); returns where it went."""
        target = os.path.join(self.directory + ".damaged", str(step))
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.exists(target):
                shutil.rmtree(target)
            shutil.move(self.step_dir(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"fire_jax checkpoint set aside {step}")
        self.manager.reload()
        return target

    def _restore(self, abstract_state: Any, step: int | None) -> tuple[Any, dict, int] | None:
        step = self.manager.latest_step() if step is None else step
        if step is None:
            return None
        self._check_json_files(step)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        if "params" not in self._items(step):  # written before the params item existed
            state = self._read(step, "state", ocp.args.StandardRestore(target))
            return state, self._read(step, "data", ocp.args.JsonRestore()), step
        checksums = self._checksums(step)
        params = self._read(step, "params", ocp.args.StandardRestore(target.params))
        self._verify(step, checksums, "params", params)
        optimizer = self._read(step, "optimizer", ocp.args.StandardRestore(
            {"step": target.step, "opt_state": target.opt_state}))
        self._verify(step, checksums, "optimizer", optimizer)
        data = self._read(step, "data", ocp.args.JsonRestore())
        state = type(abstract_state)(optimizer["step"], params, optimizer["opt_state"])
        return state, data, step

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """(trained weights, step): only the ``params`` item, structured and placed like ``abstract_params``,
        checked against its checksums."""
        step = self.manager.latest_step() if step is None else step
        self._check_json_files(step)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)
        if "params" in self._items(step):
            params = self._read(step, "params", ocp.args.StandardRestore(target))
            self._verify(step, self._checksums(step), "params", params)
            return params, step
        # An older workdir: the whole train state in one item. Restored onto one device from its own metadata
        # (without a target orbax would place arrays by the saved shardings, which need the training topology),
        # then its params are kept.
        metadata = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), "state"))
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        saved = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), tree)
        restored = self._read(step, "state", ocp.args.StandardRestore(saved))
        return _like(target, restored["params"]), step

    def wait(self) -> None:
        with self._writing():
            self.manager.wait_until_finished()

    def close(self, wait: bool = True, quiet: bool = False) -> None:
        """Wait for the save in flight and close. ``wait=False``: let it go (a failing disk may never finish
        it); ``quiet``: ignore its failure (the run is ending on an error already)."""
        if not wait:
            return
        try:
            with self._writing():
                self.manager.close()
        except Exception:  # noqa: BLE001
            if not quiet:
                raise


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
    # Placed as the model's own weights, not by the shardings saved with the checkpoint (the training mesh, even
    # of one device): programs that take the model's state would otherwise compile once per placement.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32, sharding=x.sharding), params)
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
