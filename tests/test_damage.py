"""Damaged checkpoints are found, named and never resumed from silently; metrics.jsonl is cut back on resume."""

import collections
import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from fire_jax.weights.checkpoint import CheckpointDamaged, Checkpointer
from fire_jax.core.config import InputError

State = collections.namedtuple("State", "step params opt_state")


def small_state(seed=0):
    rng = np.random.default_rng(seed)  # incompressible values: the array files hold the bytes as they are
    return State(jnp.int32(3), {"a": jnp.asarray(rng.random(4096, np.float32)), "b": {"c": jnp.ones((4, 4))}},
                 ({"mu": jnp.asarray(rng.random(2048, np.float32))},))


def save(directory, steps=(3,)):
    checkpointer = Checkpointer(str(directory))
    for step in steps:
        checkpointer.save(step, small_state(step), {"iterator": step}, {"x": 1}, metrics={"loss": 1.0}, force=True)
    checkpointer.wait()
    checkpointer.close()


def flip_array_byte(step_dir, item):
    """XOR 1 one byte in the middle of the item's largest array data file (OCDBT may hold that file twice, in
    the process's folder and the merged root's ``d/``: the byte is flipped in each copy)."""
    files = glob.glob(os.path.join(str(step_dir), item, "d", "*"))
    files += glob.glob(os.path.join(str(step_dir), item, "ocdbt.process_*", "d", "*"))
    size = max(os.path.getsize(f) for f in files)
    for path in (f for f in files if os.path.getsize(f) == size):
        data = bytearray(open(path, "rb").read())
        data[size // 2] ^= 1
        open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("item,array", [("params", "a"), ("optimizer", "opt_state/0/mu")])
def test_a_flipped_byte_names_the_checkpoint_item_and_array(tmp_path, item, array):
    save(tmp_path / "ck")
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    state, data, step = checkpointer.restore(small_state(3))  # an intact step restores, checksums and all
    assert (step, data) == (3, {"iterator": 3})
    np.testing.assert_array_equal(state.params["a"], small_state(3).params["a"])
    checkpointer.close()
    flip_array_byte(tmp_path / "ck" / "3", item)
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(CheckpointDamaged) as e:
        checkpointer.restore(small_state(3))
    assert str(e.value).startswith(f"checkpoint {tmp_path / 'ck' / '3'}: item {item}, array {array}: checksum ")
    assert str(e.value).endswith("the step is damaged") and isinstance(e.value, InputError)
    if item == "params":  # inference reads only the params item: checked too
        with pytest.raises(CheckpointDamaged, match=r"item params, array a: checksum"):
            checkpointer.restore_params(small_state(3).params)
    checkpointer.close()


def test_empty_metadata_names_the_file(tmp_path):
    save(tmp_path / "ck")
    (tmp_path / "ck" / "3" / "params" / "_METADATA").write_bytes(b"")
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(CheckpointDamaged) as e:
        checkpointer.restore(small_state(3))
    assert str(e.value) == (f"checkpoint {tmp_path / 'ck' / '3'}: file params/_METADATA is empty; "
                            "the step is damaged")
    checkpointer.close()
    (tmp_path / "ck" / "3" / "_CHECKPOINT_METADATA").write_text('{"item_handlers": ')
    with pytest.raises(CheckpointDamaged, match=r"/3: file _CHECKPOINT_METADATA is not valid JSON: Expecting value "
                                                r"at byte 18; the step is damaged"):
        Checkpointer(str(tmp_path / "ck")).restore(small_state(3))


def test_resume_falls_back_to_the_previous_good_step_saying_so(tmp_path, capsys):
    save(tmp_path / "ck", steps=(2, 3))
    flip_array_byte(tmp_path / "ck" / "3", "params")
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    state, data, step = checkpointer.restore(small_state(2), fallback=True)
    out = capsys.readouterr().out
    assert (step, data) == (2, {"iterator": 2})
    np.testing.assert_array_equal(state.params["a"], small_state(2).params["a"])
    assert f"checkpoint {tmp_path / 'ck' / '3'}: item params, array a: checksum" in out
    assert f"damaged step 3 moved to {tmp_path / 'ck.damaged' / '3'}; falling back to step 2" in out
    assert checkpointer.all_steps() == [2] and os.path.isdir(tmp_path / "ck.damaged" / "3")
    # The step is written again when the run gets there.
    checkpointer.save(3, small_state(3), {"iterator": 3}, {"x": 1}, force=True)
    checkpointer.wait()
    assert checkpointer.restore(small_state(3))[2] == 3
    checkpointer.close()


def test_every_step_damaged_ends_in_the_error_and_keeps_the_step(tmp_path):
    save(tmp_path / "ck")
    flip_array_byte(tmp_path / "ck" / "3", "optimizer")
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(CheckpointDamaged, match=r"item optimizer, array opt_state/0/mu: .*no earlier step to resume "
                                                r"from; it is left in place"):
        checkpointer.restore(small_state(3), fallback=True)
    assert checkpointer.all_steps() == [3]
    checkpointer.close()


def test_a_run_that_does_not_match_the_checkpoint_is_not_called_damage(tmp_path):
    save(tmp_path / "ck")
    other = small_state(3)._replace(params={"a": jnp.zeros(4095), "b": {"c": jnp.ones((4, 4))}})
    with pytest.raises(InputError, match=r"/3: item params does not match this run's model and optimizer") as e:
        Checkpointer(str(tmp_path / "ck")).restore(other, fallback=True)
    assert not isinstance(e.value, CheckpointDamaged)
    assert os.path.isdir(tmp_path / "ck" / "3")


def metric_lines(path, steps):
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def test_metrics_cut_back_to_the_resumed_step(tmp_path, capsys):
    from fire_jax.train.loop import cut_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(metric_lines(path, range(1, 8)) + '{"step": 8, "lo')
    cut_metrics(str(path), 4)
    assert path.read_text() == metric_lines(path, range(1, 5))
    assert capsys.readouterr().out.strip() == (
        f"{path}: cut back to step 4: 3 lines of steps 5-7 and a last line cut short written after that checkpoint "
        "dropped (those steps run again)")
    cut_metrics(str(path), 4)  # nothing past the step: untouched, nothing said
    assert path.read_text() == metric_lines(path, range(1, 5)) and capsys.readouterr().out == ""
    path.write_bytes(metric_lines(path, [1]).encode() + b'{"step": 2, "loss": "\xff"}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl: line 2: not a JSON record with a step"):
        cut_metrics(str(path), 1)
