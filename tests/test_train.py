"""Training: mesh equivalence, masks reaching the loss, learning, exact resume, preemption, NaN guard."""

import functools
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

from fire_jax.core.config import load_config
from fire_jax.data.pipeline import InputPipeline
from fire_jax.models import LlavaNext, LlavaNextConfig, LoRAParam, set_layer_layout
from fire_jax.weights.sharding import make_mesh, put_batch
from fire_jax.train import loop
from fire_jax.train.loss import token_weights
from fire_jax.train.step import Trainer
from hf_reference import jit_call
from loopback import child_env

ROOT = os.path.join(os.path.dirname(__file__), "..")


def tiny_config(**train):
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    config.data.batch_size = config.train.batch_size = 4
    config.data.buckets = (256,)
    config.data.max_len = 256
    config.mesh.shape = (2, 1, 2)  # the loop on a sharded mesh: checkpoints hold sharded arrays
    config.train.update({**dict(total_steps=8, checkpoint_every=100, warmup_frac=0.0, lr=1e-2), **train})
    return config


#: Adam's eps in the tests that compare two ways of running one step. With the default 1e-8, the first update
#: is lr * sign(g), so a gradient entry of ~1e-9 whose last bits differ between a sharded and a plain step can
#: move its parameter by 2 lr; a larger eps keeps the update continuous in g, and the comparison meaningful.
EQUIVALENCE_EPS = 1e-4


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


# ---------------------------------------------------------------------------- the step's loss by hand


def _role_batch(role):
    """Four rows of ``role`` with unequal turn sizes, the longest dialogue first: a turn-3 row, then rows that
    end at lower turns. Unlabelled prompt tokens (system, question, r_1 / the teacher's instruction) are
    attended, so a loss mask taken from attention, or everything before the last label, changes the loss."""
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    cfg = LlavaNextConfig.from_dict(config.model)
    pipeline = InputPipeline(config.data, cfg.geometry, image_token_id=cfg.image_token_id, role=role,
                             batch_size=32, shuffle=False)
    batch = next(pipeline)
    top = batch["turn_ids"].max(axis=1)
    rows = [int(np.flatnonzero(top == 3)[0])]
    rows += [int(r) for r in np.flatnonzero(top == 2)[:2]] + [int(np.flatnonzero(top == top.min())[-1])]
    batch = {k: v[rows] for k, v in batch.items()}
    length = int(batch["attention_mask"].sum(axis=1).max())
    return {k: (v[:, :length] if v.ndim == 2 and k != "image_sizes" else v) for k, v in batch.items()}


def _grads_kept():
    """An "optimizer" that leaves the parameters alone and keeps the step's gradients as its state."""
    import optax

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return optax.GradientTransformation(zeros, lambda grads, state, params=None: (zeros(grads), grads))


def _hand_loss(logits, batch, normalize, max_turns):
    """Eqs. 5-6 in numpy: token t+1 predicted at t, weighted by the batch's loss mask and turn ids.

    Returns (loss, per-token weights [B, S-1], nll [B, S-1], per-turn loss, per-turn token count)."""
    logits = np.asarray(logits, np.float64)[:, :-1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    targets = batch["input_ids"][:, 1:]
    nll = logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    labelled = batch["loss_mask"][:, 1:] > 0
    turns = batch["turn_ids"][:, 1:]
    turn_loss, turn_tokens = np.zeros(max_turns + 1), np.zeros(max_turns + 1)
    for t in range(max_turns + 1):
        in_turn = labelled & (turns == t)
        turn_tokens[t] = in_turn.sum()
        turn_loss[t] = nll[in_turn].sum() / max(in_turn.sum(), 1)
    if normalize == "token":
        weights = labelled / labelled.sum()
    else:
        present = np.flatnonzero(turn_tokens)
        weights = np.zeros(labelled.shape)
        for t in present:
            in_turn = labelled & (turns == t)
            weights[in_turn] = 1.0 / (len(present) * turn_tokens[t])
    return float((weights * nll).sum()), weights, turn_loss, turn_tokens


#: The plain forward's inputs, from a batch. The plain forward (jit_call) and its gradient run under jax.jit: one
#: program per batch shape, where eagerly, op by op, each of a few hundred primitives would compile on its own.
PLAIN_INPUTS = ("input_ids", "pixel_values", "image_index", "attention_mask")


@functools.partial(jax.jit, static_argnums=0)
def _plain_grads(graphdef, params, frozen, inputs, weights):
    """d/dparams of sum(weights * nll) through the plain forward."""

    def loss(p):
        out = nnx.merge(graphdef, p, frozen)(*inputs)[:, :-1]
        targets = inputs[0][:, 1:]
        nll = jax.nn.logsumexp(out, -1) - jnp.take_along_axis(out, targets[..., None], -1)[..., 0]
        return jnp.sum(weights * nll)

    return jax.grad(loss)(params)


@pytest.fixture(scope="module")
def hand_setup():
    """Per role: (config, model config, batch, the model with random non-zero LoRA B, its plain-forward logits)."""
    out = {}
    for role in ("student", "teacher"):
        config = tiny_config(lr=0.0)
        config.model.lora.dropout = 0.0  # the step and the plain forward see the same network
        cfg = LlavaNextConfig.from_dict(config.model)
        batch = _role_batch(role)
        model = LlavaNext(cfg, rngs=nnx.Rngs(1))
        rng = np.random.default_rng(0)
        lora = nnx.state(model, LoRAParam)  # B starts at zero: randomise it so A has a gradient too
        nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), lora))
        logits = jit_call(model, *(jnp.asarray(batch[k]) for k in PLAIN_INPUTS))
        out[role] = config, cfg, batch, model, np.asarray(logits)
    return out


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("normalize", ["token", "turn"])
@pytest.mark.parametrize("role", ["student", "teacher"])
def test_step_loss_and_gradients_equal_a_hand_computation(hand_setup, role, normalize, accum):
    from fire_jax.train import step as step_lib

    config, cfg, batch, model, logits = hand_setup[role]
    config.train.accum_steps = accum
    config.loss.normalize = normalize
    max_turns = config.loss.max_turns
    assert batch["turn_ids"].max() <= max_turns
    loss, weights, turn_loss, turn_tokens = _hand_loss(logits, batch, normalize, max_turns)
    assert (turn_tokens[1 if role == "teacher" else 2:4] > 0).all() and turn_tokens.sum() == batch["loss_mask"][:, 1:].sum()
    # Unlabelled attended tokens lie before the first label: the batch tells the loss mask from attention.
    assert all(batch["attention_mask"][r, :np.flatnonzero(batch["loss_mask"][r])[0]].sum() > 100 for r in range(4))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_lib, "make_optimizer", lambda cfg_, total: (_grads_kept(), lambda step: 0.0))
        trainer = Trainer(model, config.train, config.loss, 8, make_mesh((1, 1, 1), jax.devices()[:1]))
    state = jax.tree.map(jnp.copy, trainer.initial_state)  # the step donates it; the model keeps its LoRA
    state, metrics = trainer.step(state, put_batch(batch, trainer.mesh), jax.random.key(0))
    metrics, step_grads = jax.device_get(metrics), jax.device_get(state.opt_state)

    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["turn_tokens"], turn_tokens)
    np.testing.assert_allclose(metrics["turn_loss"], turn_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["labelled_tokens"], turn_tokens.sum())
    np.testing.assert_allclose(weights.sum(), 1.0)

    # The same loss under jax.grad, through a plain forward: the step's gradient of the trainable parameters.
    graphdef, params, frozen = nnx.split(model, step_lib.trainable_filter(config.train), ...)
    inputs = [jnp.asarray(batch[k]) for k in PLAIN_INPUTS]
    hand_grads = jax.device_get(_plain_grads(graphdef, params, frozen, inputs, jnp.asarray(weights, jnp.float32)))
    leaves = jax.tree.leaves(hand_grads)
    assert len(leaves) == len(jax.tree.leaves(step_grads)) == 2 * 2 * cfg.llm.layers  # q, k LoRA A and B
    for ours, ref in zip(jax.tree.leaves(step_grads), leaves):
        assert np.abs(ref).max() > 0
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(metrics["grad_norm"], np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in leaves)),
                               rtol=1e-5)


def test_build_model_on_a_mesh_makes_each_weight_sharded():
    """fire_jax.weights.build.build_model(config, mesh): the random weights are created already placed by the
    sharding rules (no whole-model copy on one device first), the same values as the eager build to float
    rounding (XLA fuses the initialisers' scaling under jit)."""
    from fire_jax.weights.build import build_model
    from fire_jax.weights.sharding import state_shardings

    config = tiny_config()
    mesh = make_mesh((2, 2, 2))
    on_mesh, eager = build_model(config, mesh), build_model(config)
    state = nnx.state(on_mesh)
    expected = state_shardings(state, mesh)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(eager)), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0, atol=1e-7)


def test_mesh_2x2x2_equals_one_device(setup):
    config, cfg, batch = setup
    config = tiny_config(train_connector=True, accum_steps=2, eps=EQUIVALENCE_EPS)
    _, one, m1, frozen_before = _one_step(config, cfg, batch, (1, 1, 1))
    trainer8, eight, m8, _ = _one_step(config, cfg, batch, (2, 2, 2))
    assert len(trainer8.mesh.devices.reshape(-1)) == 8
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # Adam's first update is lr * g / (|g| + eps): parameters agree to 0.1% of one step (lr 1e-2).
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
    config = tiny_config(eps=EQUIVALENCE_EPS)
    trainer_plain, plain, m_plain, _ = _one_step(config, cfg, batch, (1, 1, 1))
    other = LlavaNextConfig.from_dict({**config.model.to_dict(), "remat": remat, "scan_layers": scan})
    trainer_other, state, m_other, _ = _one_step(config, other, batch, (1, 1, 1))
    np.testing.assert_allclose(m_other["loss"], m_plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_other["grad_norm"], m_plain["grad_norm"], rtol=1e-5)
    # Scanned layers are stored stacked [layers, ...]: compare the trained models in the list layout.
    listed = set_layer_layout(trainer_other.model(state), False)
    assert listed.language_model.model.layers[0].self_attn.q_proj.lora_a[...].ndim == 2
    for a, b in zip(jax.tree.leaves(nnx.state(trainer_plain.model(plain))), jax.tree.leaves(nnx.state(listed)),
                    strict=True):
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


def test_xla_options_reach_the_steps_compile(setup):
    """``train.xla_options`` are the step program's compile options: a name XLA does not know is refused when
    the step compiles (a level of 2 is what tests/test_main_job.py's stages run under the suite's -O0)."""
    config, cfg, batch = setup
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    trainer = Trainer(LlavaNext(cfg, rngs=nnx.Rngs(0)), tiny_config(xla_options=(("xla_no_such_option", 1),)).train,
                      config.loss, 8, mesh)
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
        trainer.step(trainer.initial_state, put_batch(batch, mesh), jax.random.key(0))


def test_lr_schedules_warm_up_then_decay_or_hold():
    from fire_jax.core.config import InputError, train_config
    from fire_jax.train.step import make_optimizer

    def lrs(**cfg):
        _, schedule = make_optimizer(train_config(lr=1e-3, warmup_frac=0.1, **cfg), 100)
        return [float(schedule(step)) for step in (0, 5, 10, 55, 100)]

    # Warm-up to 1e-3 over 10 steps, then cosine: at step 55, half-way through the 90 decay steps, 1e-3 / 2.
    np.testing.assert_allclose(lrs(), [0.0, 5e-4, 1e-3, 5e-4, 0.0], atol=1e-9)
    np.testing.assert_allclose(lrs(lr_schedule="constant"), [0.0, 5e-4, 1e-3, 1e-3, 1e-3], atol=1e-9)
    _, schedule = make_optimizer(train_config(lr=1e-3, warmup_frac=0.0, lr_schedule="constant"), 100)
    assert float(schedule(0)) == pytest.approx(1e-3)  # no warm-up: the first step already at the peak
    with pytest.raises(InputError, match="lr_schedule"):
        lrs(lr_schedule="linear")


def test_turn_normalisation_weights():
    mask = jnp.array([[0, 1, 1, 1, 1, 0]], jnp.float32)
    turns = jnp.array([[-1, 2, 2, 2, 3, -1]])
    np.testing.assert_allclose(token_weights(mask, turns, "token", 4), [[0, .25, .25, .25, .25, 0]])
    np.testing.assert_allclose(token_weights(mask, turns, "turn", 4), [[0, 1 / 6, 1 / 6, 1 / 6, .5, 0]], rtol=1e-6)


def _curve(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_loss_goes_down_and_resume_is_exact(tmp_path):
    config = tiny_config(total_steps=16, train_connector=True)
    full = loop.train(config, str(tmp_path / "full"))
    curve = _curve(tmp_path / "full")
    assert full["step"] == 16 and len(curve) == 16
    assert np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.1, curve  # LoRA + connector from a random model
    assert os.path.exists(tmp_path / "full" / "export" / "peft_adapter" / "adapter_model.safetensors")
    # Interrupted at step 4, resumed in a fresh run: same parameters and the same loss curve.
    part = str(tmp_path / "part")
    assert loop.train(config, part, max_steps=4)["step"] == 4
    resumed = loop.train(config, part)
    assert resumed["step"] == 16
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

    from fire_jax.weights.checkpoint import Checkpointer

    workdir = str(tmp_path / "multi")
    port = portpicker.pick_unused_port()
    env = child_env(devices=2, JAX_PLATFORMS="cpu")
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

    both = lambda f: jax.jit(jax.value_and_grad(f, (0, 1)))(hidden, kernel)  # one program, not op by op
    (value, grads), (ref_value, ref_grads) = both(ours), both(reference)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    compiled = jax.jit(chunked_cross_entropy, static_argnums=3)
    correct = compiled(hidden, kernel, targets, chunk)[1]
    np.testing.assert_array_equal(correct, jnp.argmax(hidden @ kernel, -1) == targets)
    # With a mask, only its positions count: values there, zeros (and no gradient) elsewhere.
    mask = jnp.asarray(rng.random((2, 13)) < 0.3)

    def masked(h, k):
        return jnp.sum(weights * chunked_cross_entropy(h, k, targets, chunk, mask)[0])

    def reference_masked(h, k):
        logits = h @ k
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, weights * nll, 0.0))

    (value, grads), (ref_value, ref_grads) = both(masked), both(reference_masked)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    nll, correct = compiled(hidden, kernel, targets, chunk, mask)
    assert not np.any(np.asarray(nll)[~np.asarray(mask)]) and not np.any(np.asarray(correct)[~np.asarray(mask)])


def test_resume_skips_a_damaged_step_and_metrics_do_not_repeat(tmp_path, capsys):
    """A byte flipped in the latest step's params: the resume says so and goes on from the step before; the
    metrics of the steps run again are not in metrics.jsonl twice."""
    from test_damage import flip_array_byte

    config = tiny_config(total_steps=4, checkpoint_every=2, export=False)
    workdir = tmp_path / "run"
    assert loop.train(config, str(workdir), max_steps=3)["step"] == 3  # checkpoints 2 and 3, metrics of 1-3
    flip_array_byte(workdir / "checkpoints" / "3", "params")
    capsys.readouterr()
    assert loop.train(config, str(workdir))["step"] == 4
    out = capsys.readouterr().out
    assert f"checkpoint {workdir / 'checkpoints' / '3'}: item params, array " in out and "the step is damaged" in out
    assert "damaged step 3 moved to" in out and "falling back to step 2" in out
    assert f"resumed from {workdir}/checkpoints at step 2" in out
    assert "cut back to step 2: the line of step 3 written after that checkpoint dropped" in out
    with open(workdir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]


def test_a_stage_starts_from_another_s_lora(tmp_path):
    """``init.lora_from``: the model's LoRA factors start from a PEFT export (a stage continuing another's LoRA
    on the same base), the rest of the model as the config builds it."""
    from fire_jax.convert.hf import save_peft_adapter
    from fire_jax.models import LoRAParam
    from fire_jax.weights.build import build_model

    config = tiny_config()
    trained = build_model(config)
    keys = iter(jax.random.split(jax.random.key(7), 64))
    for layer in trained.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.lora_b[...] = 0.1 * jax.random.normal(next(keys), proj.lora_b[...].shape)
    save_peft_adapter(trained, str(tmp_path / "adapter"))
    config.init = dict(hf_checkpoint="", lora_from=str(tmp_path / "adapter"))
    continued = build_model(config)
    for a, b in zip(jax.tree.leaves(nnx.state(trained, LoRAParam)), jax.tree.leaves(nnx.state(continued, LoRAParam))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)
    fresh = build_model(tiny_config())
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree.leaves(nnx.state(fresh, LoRAParam)), jax.tree.leaves(nnx.state(continued, LoRAParam))))
