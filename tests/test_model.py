"""The Flax LLaVA-NeXT against transformers' PyTorch implementation (docs/model.md)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from fire_jax.convert import hf as convert
from fire_jax.core.geometry import ImageGeometry, select_best_resolution, unpadded_size
from fire_jax.models import KVCache, LlavaNext, LlavaNextConfig, LoRAParam, count_params, merge_lora, set_layer_layout
from hf_reference import IMAGE_TOKEN, PINPOINTS, hf_logits, jit_call, make_batch, rel_err, tiny_hf_model

TOL = 1e-4
# Three aspect ratios with images, a square one and a text-only example, in one padded batch.
SIZES = [(40, 70), (70, 40), None, (30, 90), (64, 64)]
TEXT = [(3, 5), (4, 2), (9, 0), (2, 7), (1, 1)]


@pytest.fixture(scope="module", params=[-2, -1], ids=["layer-2", "layer-1"])
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its checkpoint, checkpoint dir)."""
    directory = str(tmp_path_factory.mktemp(f"hf{request.param}"))
    hf = tiny_hf_model(directory, feature_layer=request.param)
    return hf, convert.load_hf_checkpoint(directory), directory


@pytest.fixture(scope="module")
def batch(pair):
    return make_batch(pair[1].cfg.geometry, SIZES, TEXT)


def _ours(model, batch):
    ids, mask, pv, idx, _ = batch
    return np.asarray(jit_call(model, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask)))


def _check_each_example(hf, model, batch, ours=None):
    ids, _, pv, _, lengths = batch
    ours = _ours(model, batch) if ours is None else ours
    errors = []
    for b, size in enumerate(SIZES):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        ref = hf_logits(hf, ids[b, :lengths[b]], pv[b, :tiles], size)
        errors.append(rel_err(ours[b, :lengths[b]], ref))
    return errors


def test_logits_match_hf_padded_mixed_batch(pair, batch):
    hf, model, _ = pair
    errors = _check_each_example(hf, model, batch)
    print("relative logit errors per example:", errors)
    assert max(errors) < TOL, errors


def test_image_features_and_packed_sequence_match_hf(pair, batch):
    hf, model, _ = pair
    ids, mask, pv, idx, lengths = batch
    b = 3  # the 30x90 image: a 1x3 grid whose rows are unpadded
    size = SIZES[b]
    tiles = model.cfg.geometry.num_tiles(size)
    ours = np.asarray(model.image_features(jnp.asarray(pv[b:b + 1])))[0, :tiles]
    with torch.no_grad():
        out = hf.model.get_image_features(torch.as_tensor(pv[b:b + 1, :tiles]), torch.as_tensor([size]),
                                          vision_feature_layer=hf.config.vision_feature_layer,
                                          vision_feature_select_strategy="default", return_dict=True)
        packed = torch.cat(out.pooler_output, 0).numpy()
        embeds = hf.model.get_input_embeddings()(torch.as_tensor(ids[b:b + 1, :lengths[b]]))[0].numpy()
    ours_embeds = np.asarray(model.embed(jnp.asarray(ids[b:b + 1]), jnp.asarray(pv[b:b + 1]),
                                         jnp.asarray(idx[b:b + 1])))[0, :lengths[b]]
    is_image = ids[b, :lengths[b]] == IMAGE_TOKEN
    assert is_image.sum() == packed.shape[0] == model.cfg.geometry.num_tokens(size)
    assert rel_err(ours_embeds[is_image], packed) < TOL
    np.testing.assert_array_equal(ours_embeds[~is_image], embeds[~is_image])
    # The base tile's features are the first 16 image tokens, unchanged by packing.
    assert rel_err(ours[0], packed[:16]) < TOL


def test_llama31_rope_scaling_matches_hf_under_jit(tmp_path):
    """A Llama-3.1 config (rope_type llama3) through the jitted forward, greedy decode and one train step,
    each against transformers; the config hashes (jit keys its cache on the graphdef)."""
    from fire_jax.infer.decode import generate
    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.infer.forward import forward_logits
    from fire_jax.core.config import loss_config, train_config
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = tiny_hf_model(str(tmp_path), rope_scaling=scaling)
    model = convert.load_hf_checkpoint(str(tmp_path))
    assert model.cfg.llm.rope_scaling["factor"] == 8.0 and dict(model.cfg.llm.rope_scaling) == scaling
    assert hash(model.cfg) == hash(LlavaNextConfig.from_dict(json.loads(json.dumps(_as_model_dict(model.cfg)))))
    ids = np.random.default_rng(1).integers(0, 500, 300)  # past the original context: scaling matters
    reference = hf_logits(hf, ids)
    assert rel_err(forward_logits(model, ids[None])[0], reference) < TOL  # jitted forward
    # Greedy decode (prefill + KV cache under jit) against HF's generate.
    new = 6
    ours = generate(model, [ids.tolist()], sampling=SamplingParams(max_tokens=new, stop_ids=())).tokens[0]
    with torch.no_grad():
        theirs = hf.generate(input_ids=torch.as_tensor(ids)[None], max_new_tokens=new, do_sample=False,
                             min_new_tokens=new, pad_token_id=0)[0, len(ids):].numpy()
    np.testing.assert_array_equal(ours, theirs)
    # One jitted train step: its loss is HF's mean cross-entropy over the labelled tokens (LoRA B = 0).
    labelled = np.zeros(len(ids), np.float32)
    labelled[250:] = 1.0
    batch = {"input_ids": ids[None].astype(np.int32), "attention_mask": np.ones((1, len(ids)), np.int32),
             "loss_mask": labelled[None], "turn_ids": np.where(labelled > 0, 2, -1)[None].astype(np.int32),
             "pixel_values": np.zeros((1, model.cfg.geometry.max_tiles, 3, 32, 32), np.float32),
             "image_index": np.full((1, len(ids)), -1, np.int32)}
    trainer = Trainer(model, train_config(batch_size=1, loss_chunk=128), loss_config(), 4,
                      make_mesh((1, 1, 1), jax.devices()[:1]))
    _, metrics = trainer.step(trainer.initial_state, batch, jax.random.key(0))
    logp = torch.log_softmax(torch.as_tensor(reference[:-1]), -1)
    nll = -logp[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])].numpy()
    expected = nll[249:].mean()  # token t is predicted at t - 1
    assert abs(float(metrics["loss"]) - expected) < 1e-4 * expected, (float(metrics["loss"]), expected)


def test_tied_embeddings_one_matrix_through_save_transformers_and_a_train_step(tmp_path):
    """tie_word_embeddings: no lm_head variable, logits = hidden @ embedding.T; saved without an lm_head key,
    read by transformers as tied (same logits) and back by us (a checkpoint's lm_head copy skipped); the
    train step's loss is transformers' cross-entropy."""
    import dataclasses

    from safetensors.numpy import load_file, save_file
    from transformers import LlavaNextForConditionalGeneration

    from fire_jax.core.config import loss_config, train_config
    from fire_jax.models import LlamaConfig, VisionConfig
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    llm = LlamaConfig(vocab_size=512, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=128,
                      tie_word_embeddings=True)
    cfg = LlavaNextConfig(vision=VisionConfig(image_size=32, patch_size=8, width=64, layers=3, heads=4, mlp_dim=128),
                          llm=llm, lora=None, image_token_id=IMAGE_TOKEN, image_grid_pinpoints=PINPOINTS)
    tied = LlavaNext(cfg, rngs=nnx.Rngs(0))
    untied = LlavaNext(dataclasses.replace(cfg, llm=dataclasses.replace(llm, tie_word_embeddings=False)),
                       rngs=nnx.Rngs(0))
    assert tied.language_model.lm_head is None
    assert count_params(untied.language_model) - count_params(tied.language_model) == 512 * 64
    embedding = tied.language_model.model.embed_tokens.embedding[...]
    ids = np.random.default_rng(3).integers(0, 500, 40)
    hidden, _ = tied.hidden_states(jnp.asarray(ids[None]))
    np.testing.assert_array_equal(np.asarray(tied.logits(hidden)), np.asarray(hidden @ embedding.T))
    ours = np.asarray(tied(jnp.asarray(ids[None])))[0]

    out = str(tmp_path / "tied")
    convert.save_hf_checkpoint(tied, out)
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is True
    assert not any("lm_head" in key for key in load_file(os.path.join(out, "model.safetensors")))
    hf = LlavaNextForConditionalGeneration.from_pretrained(out).eval()
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    reference = hf_logits(hf, ids)
    assert rel_err(ours, reference) < TOL
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"]
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    again = convert.load_hf_checkpoint(out, lora=None)
    assert again.cfg.llm.tie_word_embeddings and again.language_model.lm_head is None
    np.testing.assert_array_equal(again.language_model.model.embed_tokens.embedding[...], embedding)

    labelled = np.zeros(len(ids), np.float32)
    labelled[20:] = 1.0
    batch = {"input_ids": ids[None].astype(np.int32), "attention_mask": np.ones((1, len(ids)), np.int32),
             "loss_mask": labelled[None], "turn_ids": np.where(labelled > 0, 2, -1)[None].astype(np.int32),
             "pixel_values": np.zeros((1, cfg.geometry.max_tiles, 3, 32, 32), np.float32),
             "image_index": np.full((1, len(ids)), -1, np.int32)}
    trainer = Trainer(again, train_config(batch_size=1, loss_chunk=128), loss_config(), 4,
                      make_mesh((1, 1, 1), jax.devices()[:1]))
    _, metrics = trainer.step(trainer.initial_state, batch, jax.random.key(0))
    logp = torch.log_softmax(torch.as_tensor(reference[:-1]), -1)
    expected = -logp[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])].numpy()[19:].mean()
    assert abs(float(metrics["loss"]) - expected) < 1e-4 * expected, (float(metrics["loss"]), expected)


def _as_model_dict(cfg):
    import dataclasses

    d = dataclasses.asdict(cfg)
    d["llm"]["rope_scaling"] = dict(cfg.llm.rope_scaling)
    return d


def test_every_shipped_model_config_hashes():
    from fire_jax.core.config import load_config

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    for name in ("tiny.py", "llava_next_8b.py"):
        model = load_config(os.path.join(root, name)).model
        model.llm.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        cfg = LlavaNextConfig.from_dict(model)
        assert hash(cfg) == hash(LlavaNextConfig.from_dict(model)) and cfg == LlavaNextConfig.from_dict(model)


def test_geometry_matches_hf_functions():
    from transformers.image_processing_utils import select_best_resolution as hf_best
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    geo = ImageGeometry()
    rng = np.random.default_rng(0)
    for h, w in rng.integers(20, 2000, (200, 2)):
        best = select_best_resolution((h, w), geo.pinpoints)
        assert best == tuple(hf_best((int(h), int(w)), [list(p) for p in geo.pinpoints]))
        rows, cols = geo.grid_shape((h, w))
        fake = torch.zeros(1, rows * 24, cols * 24)
        assert unpadded_size((h, w), rows, cols, 24) == tuple(unpad_image(fake, (int(h), int(w))).shape[1:])


def test_lora_zero_b_is_identity_merge_and_peft_export(pair, batch, tmp_path):
    hf, model, directory = pair
    ids, mask, pv, idx, lengths = batch
    base = _ours(model, batch)
    lora_state = nnx.state(model, LoRAParam)
    assert len(jax.tree.leaves(lora_state)) == 2 * 2 * model.cfg.llm.layers  # A and B on q and k
    # B = 0 at init: the adapter changes nothing.
    np.testing.assert_array_equal(_ours(model, batch), base)
    # Give B random values: the output moves; merged LoRA equals unmerged.
    rng = np.random.default_rng(0)
    lora_model = convert.load_hf_checkpoint(directory)
    for layer in lora_model.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.lora_b[...] = jnp.asarray(rng.standard_normal(proj.lora_b[...].shape) * 0.05, jnp.float32)
    with_lora = _ours(lora_model, batch)
    assert rel_err(with_lora, base) > 1e-3
    adapter_dir = str(tmp_path / "adapter")
    convert.save_peft_adapter(lora_model, adapter_dir)
    merged = _ours(merge_lora(lora_model), batch)
    assert rel_err(merged, with_lora) < 1e-5
    assert not jax.tree.leaves(nnx.state(lora_model, LoRAParam))
    # The PEFT adapter on the PyTorch model gives fire_jax's LoRA logits.
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    try:
        errors = _check_each_example(peft_model, lora_model, batch, ours=with_lora)
    finally:
        peft_model.unload()
    assert max(errors) < TOL, errors
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"]) == (64, 256.0)


def test_save_round_trips_through_transformers(pair, batch, tmp_path):
    from transformers import LlavaNextForConditionalGeneration

    hf, model, _ = pair
    out = str(tmp_path / "saved")
    convert.save_hf_checkpoint(model, out, max_shard_bytes=200_000)  # force several shards
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    reloaded = LlavaNextForConditionalGeneration.from_pretrained(out).eval()
    assert max(_check_each_example(reloaded, model, batch)) < TOL
    again = convert.load_hf_checkpoint(out)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kv_cache_decoding_equals_full_forward(pair, batch):
    _, model, _ = pair
    ids, mask, pv, idx, _ = batch
    full = _ours(model, batch)
    prompt = 12
    cache = KVCache.init(model.cfg.llm, ids.shape[0], ids.shape[1], jnp.float32)
    logits, cache = jit_call(model, jnp.asarray(ids[:, :prompt]), jnp.asarray(pv), jnp.asarray(idx[:, :prompt]),
                             jnp.asarray(mask[:, :prompt]), cache=cache)
    steps = [np.asarray(logits)]
    for t in range(prompt, ids.shape[1]):
        logits, cache = jit_call(model, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(pv), jnp.asarray(idx[:, t:t + 1]),
                                 jnp.asarray(mask[:, t:t + 1]), cache=cache)
        steps.append(np.asarray(logits))
    decoded = np.concatenate(steps, axis=1)
    valid = mask.astype(bool)
    assert rel_err(decoded[valid], full[valid]) < 1e-5


def test_remat_and_pad_mode(pair, batch):
    _, model, directory = pair
    ids, mask, pv, idx, _ = batch
    remat = convert.load_hf_checkpoint(directory, remat="full")
    np.testing.assert_allclose(_ours(remat, batch), _ours(model, batch), rtol=1e-6, atol=1e-6)
    pad = convert.load_hf_checkpoint(directory, image_mode="pad")
    geo = pad.cfg.geometry
    assert geo.max_tiles == 1 and geo.num_tokens((40, 70)) == 16
    # One tile, its 16 features in raster order: exactly the anyres model's base-tile block.
    one = jnp.asarray(np.concatenate([[1, 2], np.full(16, IMAGE_TOKEN), [3]])[None])
    index = jnp.asarray(np.concatenate([[-1, -1], np.arange(16), [-1]])[None])
    a = pad.embed(one, jnp.asarray(pv[:1, :1]), index)
    b = model.embed(one, jnp.asarray(pv[:1]), index)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_stacked_layers_load_save_and_export_as_the_list(pair, batch, tmp_path):
    """scan_layers=True stores each LLM weight once as [layers, ...]: HF loading, saving, PEFT export and
    import, the KV-cache path and set_layer_layout give what the per-layer list gives."""
    _, model, directory = pair
    stacked = convert.load_hf_checkpoint(directory, scan_layers=True)
    q_kernel = stacked.language_model.model.layers.self_attn.q_proj.kernel
    assert q_kernel[...].shape == (model.cfg.llm.layers, model.cfg.llm.dim, model.cfg.llm.dim)
    assert q_kernel.get_metadata()["axes"] == ("layers", "embed", "heads")
    for i, layer in enumerate(model.language_model.model.layers):
        np.testing.assert_array_equal(np.asarray(q_kernel[...][i]), np.asarray(layer.self_attn.q_proj.kernel[...]))
    np.testing.assert_allclose(_ours(stacked, batch), _ours(model, batch), rtol=1e-5, atol=1e-5)
    # Saved from the stacked layout, read back into the list layout: the same tensors.
    convert.save_hf_checkpoint(stacked, str(tmp_path / "saved"))
    again = convert.load_hf_checkpoint(str(tmp_path / "saved"))
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A PEFT adapter written from random stacked factors loads into the list layout layer by layer, and back.
    rng = np.random.default_rng(1)
    for _, variable in nnx.to_flat_state(nnx.state(stacked, LoRAParam)):
        variable[...] = jnp.asarray(rng.standard_normal(variable[...].shape) * 0.05, jnp.float32)
    convert.save_peft_adapter(stacked, str(tmp_path / "adapter"))
    listed = convert.load_peft_adapter(convert.load_hf_checkpoint(directory), str(tmp_path / "adapter"))
    for i, layer in enumerate(listed.language_model.model.layers):
        np.testing.assert_array_equal(np.asarray(layer.self_attn.k_proj.lora_b[...]),
                                      np.asarray(stacked.language_model.model.layers.self_attn.k_proj.lora_b[...][i]))
    restacked = convert.load_peft_adapter(convert.load_hf_checkpoint(directory, scan_layers=True),
                                          str(tmp_path / "adapter"))
    for a, b in zip(jax.tree.leaves(nnx.state(stacked, LoRAParam)), jax.tree.leaves(nnx.state(restacked, LoRAParam))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with_lora = _ours(listed, batch)
    np.testing.assert_allclose(_ours(stacked, batch), with_lora, rtol=1e-5, atol=1e-5)
    # Decoding a stacked model (layer slices) equals its full forward; relayout keeps the function.
    ids, mask, pv, idx, _ = batch
    cache = KVCache.init(model.cfg.llm, ids.shape[0], ids.shape[1], jnp.float32)
    logits, cache = stacked(jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask), cache=cache)
    valid = mask.astype(bool)
    assert rel_err(np.asarray(logits)[valid], with_lora[valid]) < 1e-5
    assert set_layer_layout(stacked, False).cfg.scan_layers is False
    assert isinstance(stacked.language_model.model.layers, nnx.List)
    np.testing.assert_allclose(_ours(stacked, batch), with_lora, rtol=1e-5, atol=1e-5)


def _dots(jaxpr, times: int = 1) -> int:
    """dot_general equations in a jaxpr, scan bodies counted once per iteration."""
    n = 0
    for eqn in jaxpr.eqns:
        n += times * (eqn.primitive.name == "dot_general")
        length = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    n += _dots(inner if hasattr(inner, "eqns") else inner.jaxpr, times * length)
    return n


def test_lora_train_layers_trains_the_top_layers_and_runs_no_backward_below(tmp_path):
    """lora.train_layers=1 of 2: the same loss, the top layer's adapter gradients equal to those of training
    every layer, the bottom layer's exactly zero, in both layouts; and the backward pass has fewer than 0.6x the
    matrix products (none through the bottom layer: nothing below it trains)."""
    from fire_jax.models import LoraConfig

    tiny_hf_model(str(tmp_path))
    ids, mask, pv, idx, _ = (jnp.asarray(x) for x in make_batch(
        convert.load_hf_checkpoint(str(tmp_path)).cfg.geometry, [(40, 70), None], [(3, 5), (9, 0)]))

    def loss_and_grads(train_layers, scan_layers):
        lora = LoraConfig(rank=8, alpha=16.0, dropout=0.0, train_layers=train_layers)
        model = convert.load_hf_checkpoint(str(tmp_path), lora=lora)
        rng = np.random.default_rng(0)
        for _, variable in nnx.to_flat_state(nnx.state(model, LoRAParam)):  # non-zero A and B everywhere
            variable[...] = jnp.asarray(rng.standard_normal(variable[...].shape) * 0.05, jnp.float32)
        set_layer_layout(model, scan_layers)
        graphdef, factors, rest = nnx.split(model, LoRAParam, ...)
        weights = jnp.asarray(np.random.default_rng(1).standard_normal(ids.shape + (model.cfg.llm.vocab_size,)),
                              jnp.float32)

        def loss(factors):
            return jnp.sum(nnx.merge(graphdef, factors, rest)(ids, pv, idx, mask) * weights)

        backward = _dots(jax.make_jaxpr(jax.value_and_grad(loss))(factors).jaxpr) - _dots(
            jax.make_jaxpr(loss)(factors).jaxpr)
        value, grads = jax.jit(jax.value_and_grad(loss))(factors)
        layers = grads["language_model"]["model"]["layers"]
        per_layer = ([jax.tree.map(lambda g: g[i], layers) for i in range(2)] if scan_layers
                     else [layers[i] for i in range(2)])
        return float(value), [np.concatenate([np.ravel(g) for g in jax.tree.leaves(p)]) for p in per_layer], backward

    for scan_layers in (False, True):
        full_loss, (full_bottom, full_top), full_backward = loss_and_grads(0, scan_layers)
        loss, (bottom, top), backward = loss_and_grads(1, scan_layers)
        assert abs(loss - full_loss) <= 1e-6 * abs(full_loss)
        assert np.abs(full_bottom).max() > 0 and not np.any(bottom)
        # two compiled programs (one scan against two): equal to float32 rounding at the gradients' scale
        np.testing.assert_allclose(top, full_top, rtol=1e-5, atol=1e-5 * np.abs(full_top).max())
        assert backward < 0.6 * full_backward, (scan_layers, backward, full_backward)


def test_8b_parameter_counts_abstract():
    import importlib.util

    spec = importlib.util.spec_from_file_location("c", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                    "llava_next_8b.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = LlavaNextConfig.from_dict(module.get_config().model)
    model = convert.abstract_model(cfg)
    llm = count_params(model.language_model, nnx.Param)
    vision = count_params(model.vision_tower, nnx.Param)
    connector = count_params(model.multi_modal_projector, nnx.Param)
    lora = count_params(model, LoRAParam)
    print(f"LLM {llm:,}  vision {vision:,}  connector {connector:,}  LoRA(q,k) {lora:,}  "
          f"share {lora / llm:.4%}")
    # Llama-3-8B with the llava-hf 128320-row embedding and lm_head.
    assert llm == 8_030_261_248 + 2 * 64 * 4096
    assert vision == 303_507_456
    assert connector == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert lora == 32 * 64 * ((4096 + 4096) + (4096 + 1024))
    assert 0.003 < lora / llm < 0.005


def test_traced_builds_draw_the_keys_of_nnx_rngs(backend_compiles):
    """abstract_model, fresh_lora_state and build_model on a mesh build the model under a trace with InitKeys:
    the keys of nnx.Rngs(seed), so the jitted LoRA init is the eager model's bit for bit and the abstract model
    has the eager one's graph and shapes."""
    from fire_jax.core.config import load_config
    from fire_jax.models import InitKeys

    rngs, keys = nnx.Rngs(7), InitKeys(7)
    for _ in range(4):
        np.testing.assert_array_equal(jax.random.key_data(keys.params()), jax.random.key_data(rngs.params()))
    cfg = LlavaNextConfig.from_dict(load_config(os.path.join(os.path.dirname(__file__), "..", "configs",
                                                             "tiny.py")).model)
    assert cfg.lora is not None
    eager = LlavaNext(cfg, rngs=nnx.Rngs(7))
    expected = nnx.to_flat_state(nnx.state(eager, LoRAParam))
    drawn = nnx.to_flat_state(convert.fresh_lora_state(cfg, 7))
    assert [path for path, _ in drawn] == [path for path, _ in expected] and len(expected) >= 4
    for (path, a), (_, b) in zip(drawn, expected):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    # Compiled once per (config, seed) in a process (each HF checkpoint load draws fresh factors), and each call
    # returns arrays of its own.
    with backend_compiles() as compiles:
        again = nnx.to_flat_state(convert.fresh_lora_state(cfg, 7))
    assert compiles == []
    for (_, a), (_, b) in zip(drawn, again):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
        assert a[...] is not b[...]
    abstract = convert.abstract_model(cfg)
    assert nnx.graphdef(abstract) == nnx.graphdef(eager)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(abstract))] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(eager))]


def test_blocked_and_single_query_attention_equal_the_reference():
    from fire_jax.models import layers

    rng = np.random.default_rng(0)
    b, t, heads, kv_heads, d = 2, 2 * layers.QUERY_CHUNK, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), jnp.float32)
    valid = jnp.asarray(np.arange(t)[None, :] < np.array([[t], [t - 100]]))
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :])[:, None]
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=d ** -0.5)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # the cache layout attention() takes
    attention = jax.jit(layers.attention, static_argnames=("causal", "keys_transposed"))
    np.testing.assert_allclose(attention(q, kh, vh, mask), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention(q, kh, vh, mask, causal=True), ref, rtol=1e-5, atol=1e-5)
    last = attention(q[:, -1:], kh, vh, mask[:, :, -1:])  # one decode step over the whole cache
    np.testing.assert_allclose(last, ref[:, -1:], rtol=1e-5, atol=1e-5)
    # The KV cache's keys, [batch, kv_heads, head_dim, len]: a decode step, and a prefill reading them.
    kt = kh.swapaxes(2, 3)
    np.testing.assert_allclose(attention(q[:, -1:], kt, vh, mask[:, :, -1:], keys_transposed=True), ref[:, -1:],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention(q, kt, vh, mask, causal=True, keys_transposed=True), ref, rtol=1e-5,
                               atol=1e-5)


def test_last_positions_alone_equal_the_full_forward(pair, batch):
    """hidden_states(..., last=...) (a prefill's next-token position per row; the top layer's queries and MLP
    run there alone) returns the full forward's hidden states at those positions, and writes the same cache,
    in both layer layouts."""
    _, model, directory = pair
    ids, mask, pv, idx, lengths = batch
    last = jnp.asarray(np.asarray(lengths) - 1, jnp.int32)  # right-padded rows end at different columns
    args = tuple(map(jnp.asarray, (ids, pv, idx, mask)))
    rows = np.arange(ids.shape[0])

    def run(m, last, with_cache):
        graphdef, state = nnx.split(m)

        @jax.jit
        def f(state, last):
            cache = KVCache.init(m.cfg.llm, ids.shape[0], ids.shape[1], jnp.float32) if with_cache else None
            return nnx.merge(graphdef, state).hidden_states(*args, cache=cache, last=last)

        out, cache = f(state, last)
        return np.asarray(out), cache

    for m in (model, convert.load_hf_checkpoint(directory, scan_layers=True)):
        for with_cache in ((False, True) if m is model else (False,)):
            full, full_cache = run(m, None, with_cache)
            picked, picked_cache = run(m, last, with_cache)
            assert picked.shape == (ids.shape[0], 1, m.cfg.llm.dim)
            np.testing.assert_allclose(picked[:, 0], full[rows, np.asarray(last)], rtol=1e-5, atol=1e-5)
            if with_cache:
                for a, b in zip(jax.tree.leaves(full_cache), jax.tree.leaves(picked_cache)):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_the_attention_kernel_is_a_model_config_field(pair, batch):
    """model.attention picks the kernel of every attention layer: the CPU kernel ("auto" here) and XLA's
    jax.nn.dot_product_attention give the same logits; set_attention switches a built model in place."""
    from fire_jax.models import layers, set_attention

    hf, model, directory = pair
    assert model.cfg.attention == "auto"
    auto = _ours(model, batch)
    xla = convert.load_hf_checkpoint(directory, attention="xla")
    kernels = {m.kernel for _, m in nnx.iter_modules(xla) if isinstance(getattr(m, "kernel", None), str)}
    assert kernels == {"xla"} and xla.cfg.attention == "xla"
    np.testing.assert_allclose(_ours(xla, batch), auto, rtol=1e-4, atol=1e-4)
    set_attention(xla, "cpu")
    assert xla.cfg.attention == "cpu"
    np.testing.assert_array_equal(_ours(xla, batch), auto)  # "auto" on CPU is the CPU kernel
    with pytest.raises(ValueError, match="model.attention must be one of"):
        set_attention(xla, "flash")
    with pytest.raises(ValueError, match="attention kernel 'flash'"):
        layers.attention(jnp.zeros((1, 2, 1, 4)), jnp.zeros((1, 1, 2, 4)), jnp.zeros((1, 1, 2, 4)), None,
                         kernel="flash")


@pytest.mark.parametrize("t,mask_heads,causal", [(48, 1, False), (48, 4, False), (1024, 1, False), (300, 1, True),
                                                (1024, 4, True)],
                         ids=["short", "per-head-mask", "blocked", "causal-blocks", "causal-blocks-remat"])
def test_cpu_attention_gradients_equal_the_reference(t, mask_heads, causal):
    """The CPU attention's hand-written backward (grouped queries, a padding + causal mask) against autodiff of
    jax.nn.dot_product_attention, for q, k and v; ``causal``: in blocks of CAUSAL_BLOCK queries over the keys up
    to each block's end (300: a partial last block; 1024: each block rematerialised)."""
    rng = np.random.default_rng(1)
    b, heads, kv_heads, d = 2, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    valid = jnp.asarray(np.arange(t)[None, :] >= np.array([[0], [5]]))  # row 1 left-padded
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None] & valid[:, None, None, :]
    mask = mask & jnp.asarray(rng.random((1, mask_heads, t, t)) < 0.9).at[..., 0].set(True)
    weights = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    # queries that see no key (row 1's padding) give an output nobody reads, which the causal blocks
    # average over fewer keys: out of the loss, as a padded position is out of the training loss
    weights = weights * jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(weights * fn(q, k, v))

    from fire_jax.models import layers

    heads_major = lambda x: x.transpose(0, 2, 1, 3)
    ours = jax.jit(jax.grad(loss(lambda q, k, v: layers.attention(q, heads_major(k), heads_major(v), mask,
                                                                  causal=causal)), (0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=d ** -0.5)),
                           (0, 1, 2)))(q, k, v)
    for a, r in zip(ours, ref):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
