"""Training: mesh equivalence, masks reaching the loss, learning, exact resume, preemption, NaN guard."""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fire_jax.data.config import load_config
from fire_jax.data.pipeline import InputPipeline
from fire_jax.models import LlavaNext, LlavaNextConfig, LoRAParam
from fire_jax.train import loop
from fire_jax.train.loss import token_weights
from fire_jax.train.sharding import make_mesh, put_batch
from fire_jax.train.step import Trainer

ROOT = os.path.join(os.path.dirname(__file__), "..")


def tiny_config(**train):
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    config.data.batch_size = config.train.batch_size = 4
    config.data.buckets = (256,)
    config.data.max_len = 256
    config.mesh.shape = (2, 1, 2)  # the loop on a sharded mesh: checkpoints hold sharded arrays
    config.train.update({**dict(total_steps=8, checkpoint_every=100, warmup_frac=0.0, lr=1e-2), **train})
    return config


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    cfg = LlavaNextConfig.from_dict(config.model)
    pipeline = InputPipeline(config.data, cfg.geometry, image_token_id=cfg.image_token_id)
    batch = next(pipeline)
    return config, cfg, batch


def _one_step(config, cfg, batch, shape):
    devices = jax.devices()[:int(np.prod(shape))]
    mesh = make_mesh(shape, devices)
    trainer = Trainer(LlavaNext(cfg, rngs=nnx.Rngs(0)), config.train, config.loss, 8, mesh)
    frozen_before = jax.device_get(trainer.frozen)
    state, metrics = trainer.step(trainer.initial_state, put_batch(batch, mesh), jax.random.key(0))
    return trainer, jax.device_get(state), jax.device_get(metrics), frozen_before


def test_mesh_2x2x2_equals_one_device(setup):
    config, cfg, batch = setup
    config = tiny_config(train_connector=True, accum_steps=2)
    _, one, m1, frozen_before = _one_step(config, cfg, batch, (1, 1, 1))
    trainer8, eight, m8, _ = _one_step(config, cfg, batch, (2, 2, 2))
    assert len(trainer8.mesh.devices.reshape(-1)) == 8
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # Adam's first update is ~lr * sign(grad): parameters agree to 0.1% of one step (lr 1e-2).
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * config.train.lr)
    # Frozen weights are bit-identical after a step; LoRA B moved away from zero.
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(jax.device_get(trainer8.frozen))):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(nnx.state(trainer8.model(eight), LoRAParam)))
    # The connector trained (train_connector=True) and is float32 in the optimizer.
    assert "multi_modal_projector" in str(jax.tree_util.tree_structure(one.params))


@pytest.mark.parametrize("remat,scan", [("full", False), ("full", True), ("none", True)])
def test_remat_and_scanned_layers_equal_the_plain_step(setup, remat, scan):
    config, cfg, batch = setup
    _, plain, m_plain, _ = _one_step(config, cfg, batch, (1, 1, 1))
    other = LlavaNextConfig.from_dict({**config.model.to_dict(), "remat": remat, "scan_layers": scan})
    _, state, m_other, _ = _one_step(config, other, batch, (1, 1, 1))
    np.testing.assert_allclose(m_other["loss"], m_plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_other["grad_norm"], m_plain["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * config.train.lr)


def test_only_labelled_tokens_reach_the_loss(setup):
    config, cfg, batch = setup
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    trainer = Trainer(LlavaNext(cfg, rngs=nnx.Rngs(0)), tiny_config(lr=0.0).train, config.loss, 8, mesh)
    rng = jax.random.key(0)

    def loss_of(b):
        state = jax.tree.map(jnp.copy, trainer.initial_state)  # the step donates its input state
        return float(jax.device_get(trainer.step(state, put_batch(b, mesh), rng)[1]["loss"]))

    base = loss_of(batch)
    changed = dict(batch)
    ids = batch["input_ids"].copy()
    for row in range(ids.shape[0]):
        labelled = np.flatnonzero(batch["loss_mask"][row])
        tail = np.arange(labelled[-1] + 1, ids.shape[1])  # after the last labelled token: cannot reach the loss
        ids[row, tail] = (ids[row, tail] + 7) % 500
    changed["input_ids"] = ids
    assert loss_of(changed) == base
    ids = batch["input_ids"].copy()
    first = np.flatnonzero(batch["loss_mask"][0])[0]
    ids[0, first] = (ids[0, first] + 7) % 500  # a labelled token: the loss must move
    changed["input_ids"] = ids
    assert loss_of(changed) != base


def test_turn_normalisation_weights():
    mask = jnp.array([[0, 1, 1, 1, 1, 0]], jnp.float32)
    turns = jnp.array([[-1, 2, 2, 2, 3, -1]])
    np.testing.assert_allclose(token_weights(mask, turns, "token", 4), [[0, .25, .25, .25, .25, 0]])
    np.testing.assert_allclose(token_weights(mask, turns, "turn", 4), [[0, 1 / 6, 1 / 6, 1 / 6, .5, 0]], rtol=1e-6)


def _curve(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_loss_goes_down_and_resume_is_exact(tmp_path):
    config = tiny_config(total_steps=10, train_connector=True)
    full = loop.train(config, str(tmp_path / "full"))
    curve = _curve(tmp_path / "full")
    assert full["step"] == 10 and len(curve) == 10
    assert np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.1, curve  # 6.21 -> 6.07 from a random model
    assert os.path.exists(tmp_path / "full" / "export" / "peft_adapter" / "adapter_model.safetensors")
    # Interrupted at step 4, resumed in a fresh run: same parameters and the same loss curve.
    part = str(tmp_path / "part")
    assert loop.train(config, part, max_steps=4)["step"] == 4
    resumed = loop.train(config, part)
    assert resumed["step"] == 10
    np.testing.assert_allclose(_curve(part), curve, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"].params)),
                    jax.tree.leaves(jax.device_get(resumed["state"].params))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sigterm_checkpoints_and_nan_names_examples(tmp_path, monkeypatch):
    config = tiny_config(total_steps=6)
    original = InputPipeline.__next__
    calls = {"n": 0}

    def next_with_sigterm(self):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(InputPipeline, "__next__", next_with_sigterm)
    summary = loop.train(config, str(tmp_path / "pre"))
    assert summary["step"] == 2
    assert sorted(os.listdir(tmp_path / "pre" / "checkpoints")) == ["2"]

    def next_with_nan(self):
        batch = original(self)
        batch["pixel_values"] = np.full_like(batch["pixel_values"], np.nan)
        return batch

    monkeypatch.setattr(InputPipeline, "__next__", next_with_nan)
    with pytest.raises(FloatingPointError, match=r"step 1.*synthetic_train_"):
        loop.train(config, str(tmp_path / "nan"))


def test_two_processes_write_a_checkpoint_one_process_restores(tmp_path):
    import portpicker
    from safetensors.numpy import load_file

    from fire_jax.train.checkpoint import Checkpointer

    workdir = str(tmp_path / "multi")
    port = portpicker.pick_unused_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    overrides = ["--config.train.total_steps=3", "--config.data.batch_size=4", "--config.train.batch_size=4",
                 "--config.data.buckets=(128, 256)", "--config.data.max_len=256"]  # hosts may pick different buckets
    procs = [subprocess.Popen(
        [sys.executable, "-m", "fire_jax.train", "--config", os.path.join(ROOT, "configs", "tiny.py"),
         "--workdir", workdir, "--coordinator", f"localhost:{port}", "--num_processes", "2", "--process_id", str(i),
         *overrides], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    assert "done: step 3/3" in outputs[0]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
    # One process (here: a 1-device mesh) restores what the 4-device, 2-process run wrote.
    config = tiny_config()
    cfg = LlavaNextConfig.from_dict(config.model)
    trainer = Trainer(LlavaNext(cfg, rngs=nnx.Rngs(0)), config.train, config.loss, 3,
                      make_mesh((1, 1, 1), jax.devices()[:1]))
    state, data_state, step = Checkpointer(os.path.join(workdir, "checkpoints")).restore(trainer.initial_state)
    assert step == 3 and int(state.step) == 3 and "iterator" in data_state
    adapter = load_file(os.path.join(workdir, "export", "peft_adapter", "adapter_model.safetensors"))
    q_b = np.asarray(trainer.model(state).language_model.model.layers[0].self_attn.q_proj.lora_b[...])
    np.testing.assert_array_equal(
        adapter["base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight"], q_b.T)
    assert np.abs(q_b).max() > 0


def test_abstract_trainer_lowers_without_allocating():
    from fire_jax.convert.hf import abstract_model

    config = tiny_config()
    cfg = LlavaNextConfig.from_dict(config.model)
    trainer = Trainer(abstract_model(cfg), config.train, config.loss, 8, make_mesh((1, 8, 1)), abstract=True)
    assert isinstance(jax.tree.leaves(trainer.frozen)[0], jax.ShapeDtypeStruct)
    batch = {k: jax.ShapeDtypeStruct((8, 64), jnp.int32) for k in ("input_ids", "attention_mask", "turn_ids",
                                                                     "image_index")}
    batch["loss_mask"] = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    memory = trainer.compiled_step(batch).lower(trainer.initial_state, trainer.frozen, batch, rng).compile()
    assert memory.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_fused_chunked_cross_entropy_values_and_gradients(chunk):
    from fire_jax.train.loss import chunked_cross_entropy

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((2, 13, 8)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((8, 30)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 30, (2, 13)))
    weights = jnp.asarray(rng.random((2, 13)), jnp.float32)

    def reference(h, k):
        logits = h @ k
        return jnp.sum(weights * (jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None],
                                                                                        -1)[..., 0]))

    def ours(h, k):
        return jnp.sum(weights * chunked_cross_entropy(h, k, targets, chunk)[0])

    np.testing.assert_allclose(ours(hidden, kernel), reference(hidden, kernel), rtol=1e-5)
    for a, b in zip(jax.grad(ours, (0, 1))(hidden, kernel), jax.grad(reference, (0, 1))(hidden, kernel)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    correct = chunked_cross_entropy(hidden, kernel, targets, chunk)[1]
    np.testing.assert_array_equal(correct, jnp.argmax(hidden @ kernel, -1) == targets)
