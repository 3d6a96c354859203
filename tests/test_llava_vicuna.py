"""The paper's other two bases against transformers (FIRE, Appendix Tables A5 and A6; docs/model.md):
LLaVA-1.5-Vicuna-7B (llava-hf llava-1.5-7b-hf, ``LlavaForConditionalGeneration``: one padded-to-square tile,
no image_newline) and LLaVA-NeXT-Vicuna-7B (llava-v1.6-vicuna-7b-hf: anyres with a Llama-2-style LLM), each on
a tiny random model with every norm and bias randomised: logits of a padded batch (several aspect ratios and a
text-only row) to a relative error of 1e-6 in fp32, the jitted forward, greedy decoding, one train step, saving,
PEFT export, the image processor and the tools."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from PIL import Image

from fire_jax.convert import hf as convert
from fire_jax.data.images import load_image, pad_tiles, preprocess
from fire_jax.core.geometry import ImageGeometry
from fire_jax.models import LlavaNextConfig, LoRAParam, count_params
from hf_reference import (IMAGE_TOKEN, hf_llava15_logits, hf_logits, jit_call, load_tool, make_batch, rel_err,
                          tiny_hf_llava15, tiny_hf_next_vicuna)

TOL = 1e-6  # relative logit error, fp32
# Images of several aspect ratios (wide, tall, very wide, square, tiny) and a text-only row, one padded batch.
SIZES = [(40, 70), (70, 40), None, (30, 90), (64, 64), (7, 5)]
TEXT = [(3, 5), (4, 2), (9, 0), (2, 7), (1, 1), (6, 3)]
NEW = 10
ARCHS = ("llava15", "next_vicuna")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch after JAX in one process on few cores is many times slower with more than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(architecture name, HF model, our model loaded from its checkpoint, checkpoint dir)."""
    directory = str(tmp_path_factory.mktemp(request.param))
    build = tiny_hf_llava15 if request.param == "llava15" else tiny_hf_next_vicuna
    hf = build(directory, embed_scale=8.0)  # larger embeddings make greedy outputs vary
    return request.param, hf, convert.load_hf_checkpoint(directory), directory


@pytest.fixture(scope="module")
def batch(pair):
    return make_batch(pair[2].cfg.geometry, SIZES, TEXT)


def _reference(arch, hf, ids, pixel_values, size):
    """HF logits of one unpadded example (``pixel_values`` its tiles)."""
    if arch == "llava15":
        return hf_llava15_logits(hf, ids, None if size is None else pixel_values)
    return hf_logits(hf, ids, pixel_values, size)


def _per_example_errors(pair, batch, ours):
    arch, hf, model, _ = pair
    ids, _, pv, _, lengths = batch
    errors = []
    for b, size in enumerate(SIZES):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        errors.append(rel_err(ours[b, :lengths[b]], _reference(arch, hf, ids[b, :lengths[b]], pv[b, :tiles], size)))
    return errors


def test_config_reads_the_architecture(pair):
    arch, hf, model, directory = pair
    cfg = model.cfg
    assert (cfg.llm.rope_theta, cfg.llm.kv_heads, cfg.llm.heads) == (10000.0, 4, 4)
    if arch == "llava15":
        assert (cfg.architecture, cfg.image_mode, cfg.pad_newline) == ("llava", "pad", False)
        assert model.image_newline is None and cfg.geometry.max_tiles == 1
        assert {cfg.geometry.num_tokens(s) for s in SIZES if s} == {16}  # grid**2, whatever the aspect ratio
        with pytest.raises(ValueError, match="image_newline"):
            convert.load_hf_checkpoint(directory, image_mode="anyres")
    else:
        assert (cfg.architecture, cfg.image_mode) == ("llava_next", "anyres") and model.image_newline is not None
    assert json.load(open(os.path.join(directory, "config.json")))["model_type"] == cfg.architecture


def test_logits_match_hf_padded_mixed_batch(pair, batch):
    ids, mask, pv, idx, _ = batch
    ours = np.asarray(pair[2](jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask)))
    errors = _per_example_errors(pair, batch, ours)
    print(f"{pair[0]}: relative logit errors per example (eager):", errors)
    assert max(errors) <= TOL, errors


def test_jitted_forward_matches_hf(pair, batch):
    from fire_jax.infer.forward import forward_logits

    ids, mask, pv, _, lengths = batch
    ours = forward_logits(pair[2], ids, pixel_values=pv, image_sizes=SIZES, attention_mask=mask)
    errors = _per_example_errors(pair, batch, ours)
    print(f"{pair[0]}: relative logit errors per example (jit):", errors)
    assert max(errors) <= TOL, errors


def test_image_features_match_hf(pair, batch):
    arch, hf, model, _ = pair
    ids, _, pv, idx, lengths = batch
    b = 3  # the 30 x 90 image
    tiles = model.cfg.geometry.num_tiles(SIZES[b])
    kwargs = dict(vision_feature_layer=-2, vision_feature_select_strategy="default", return_dict=True)
    with torch.no_grad():
        if arch == "llava15":
            out = hf.model.get_image_features(torch.as_tensor(pv[b, :1]), **kwargs)
        else:
            out = hf.model.get_image_features(torch.as_tensor(pv[b:b + 1, :tiles]), torch.as_tensor([SIZES[b]]),
                                              **kwargs)
        packed = torch.cat(list(out.pooler_output), 0).numpy()
    embeds = np.asarray(model.embed(jnp.asarray(ids[b:b + 1]), jnp.asarray(pv[b:b + 1]), jnp.asarray(idx[b:b + 1])))
    is_image = ids[b, :lengths[b]] == IMAGE_TOKEN
    assert is_image.sum() == len(packed) == model.cfg.geometry.num_tokens(SIZES[b])
    assert rel_err(embeds[0, :lengths[b]][is_image], packed) <= TOL


def _hf_generate(arch, hf, prompts, pixel_values, sizes):
    """HF greedy generate on a left-padded batch of NEW tokens (no stop)."""
    from fire_jax.infer.engine import left_pad

    length = max(map(len, prompts))
    ids, mask, _ = left_pad(prompts, length, 0)
    kwargs = dict(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    if sizes is not None:
        if arch == "llava15":
            kwargs["pixel_values"] = torch.as_tensor(pixel_values[:, 0])  # one image per row: [rows, 3, H, W]
        else:
            kwargs.update(pixel_values=torch.as_tensor(pixel_values), image_sizes=torch.as_tensor(sizes))
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[:, length:].numpy()


def test_greedy_matches_hf_generate(pair, batch):
    from fire_jax.infer.decode import generate
    from fire_jax.infer.sampling import SamplingParams

    arch, hf, model, _ = pair
    ids, _, pv, _, lengths = batch
    prompts = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    ours = generate(model, prompts, pixel_values=pv, image_sizes=SIZES,
                    sampling=SamplingParams(max_tokens=NEW, stop_ids=())).tokens
    # HF cannot mix text-only and image rows in one batch: one batched call for each kind.
    with_image = [b for b, s in enumerate(SIZES) if s is not None]
    text_only = [b for b, s in enumerate(SIZES) if s is None]
    ref = np.zeros_like(ours)
    ref[with_image] = _hf_generate(arch, hf, [prompts[b] for b in with_image], pv[with_image],
                                   [SIZES[b] for b in with_image])
    ref[text_only] = _hf_generate(arch, hf, [prompts[b] for b in text_only], None, None)
    print(f"{arch}: greedy tokens, ours:\n", ours, "\nHF:\n", ref)
    np.testing.assert_array_equal(ours, ref)
    assert len({tuple(r) for r in ours}) == len(ours)  # the rows differ: the check is not vacuous


def test_train_step_loss_is_hf_cross_entropy(pair, batch):
    """One jitted train step on the padded image + text-only batch: its loss is transformers' mean
    cross-entropy over the labelled tokens (LoRA B = 0 at the start), and the step moves LoRA."""
    from fire_jax.core.config import loss_config, train_config
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    arch, hf, _, directory = pair
    model = convert.load_hf_checkpoint(directory, scan_layers=True)
    ids, mask, pv, idx, lengths = batch
    rows = [0, 2, 3]  # wide image, text-only, very wide image
    loss_mask = np.zeros(ids.shape, np.float32)
    for b in rows:
        loss_mask[b, lengths[b] - 4:lengths[b]] = 1.0  # the last 4 tokens of each row
    loss_mask = loss_mask[rows]
    step_batch = {"input_ids": ids[rows].astype(np.int32), "attention_mask": mask[rows].astype(np.int32),
                  "loss_mask": loss_mask, "turn_ids": np.where(loss_mask > 0, 2, -1).astype(np.int32),
                  "pixel_values": pv[rows], "image_index": idx[rows]}
    trainer = Trainer(model, train_config(batch_size=len(rows), loss_chunk=16), loss_config(), 4,
                      make_mesh((1, 1, 1), jax.devices()[:1]))
    initial = [np.array(x) for x in jax.tree.leaves(trainer.initial_state.params)]
    state, metrics = trainer.step(trainer.initial_state, step_batch, jax.random.key(0))
    nll = []
    for b in rows:
        tiles = 0 if SIZES[b] is None else model.cfg.geometry.num_tiles(SIZES[b])
        ref = _reference(arch, hf, ids[b, :lengths[b]], pv[b, :tiles], SIZES[b])
        logp = torch.log_softmax(torch.as_tensor(ref[:-1], dtype=torch.float64), -1)
        targets = torch.as_tensor(ids[b, 1:lengths[b]])
        nll.append(-logp[torch.arange(lengths[b] - 1), targets].numpy()[-4:])  # token t predicted at t - 1
    expected = float(np.concatenate(nll).mean())
    print(f"{arch}: train-step loss {float(metrics['loss']):.8f}, transformers {expected:.8f}")
    assert abs(float(metrics["loss"]) - expected) <= 1e-5 * expected, (float(metrics["loss"]), expected)
    after = jax.tree.leaves(state.params)
    assert int(state.step) == 1 and len(after) == len(initial) == 2 * 2  # A and B of q and k, layers stacked
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(initial, after))  # the step moved LoRA


def test_save_and_peft_round_trip_through_transformers(pair, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    arch, hf, model, directory = pair
    ids, mask, pv, idx, _ = batch
    out = str(tmp_path / "saved")
    convert.save_hf_checkpoint(model, out, max_shard_bytes=200_000)  # several shards
    config = json.load(open(os.path.join(out, "config.json")))
    expected = "LlavaForConditionalGeneration" if arch == "llava15" else "LlavaNextForConditionalGeneration"
    assert config["architectures"] == [expected]
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded).__name__ == expected
    ours = np.asarray(jit_call(model, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask)))
    assert max(_per_example_errors((arch, reloaded, model, out), batch, ours)) <= TOL
    again = convert.load_hf_checkpoint(out)
    assert again.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Random LoRA B: the PEFT adapter on the PyTorch model gives our LoRA logits.
    rng = np.random.default_rng(0)
    lora_model = convert.load_hf_checkpoint(directory)
    for layer in lora_model.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.lora_b[...] = jnp.asarray(rng.standard_normal(proj.lora_b[...].shape) * 0.05, jnp.float32)
    with_lora = np.asarray(jit_call(lora_model, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx),
                                    jnp.asarray(mask)))
    assert rel_err(with_lora, ours) > 1e-3
    convert.save_peft_adapter(lora_model, str(tmp_path / "adapter"))
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    try:
        errors = _per_example_errors((arch, peft_model, lora_model, directory), batch, with_lora)
    finally:
        peft_model.unload()
    print(f"{arch}: PEFT adapter relative logit errors:", errors)
    assert max(errors) <= TOL, errors


def _test_images():
    rng = np.random.default_rng(0)
    sizes = [(40, 70), (70, 40), (31, 90), (64, 64), (7, 5), (480, 640), (1000, 301), (2, 300)]
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), np.uint8)) for s in sizes]
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures", "fire", "images")
    for name in ("gqa_images_2325245.jpg", "geoqa+_images_3582.png", "chartqa_train_png_03025603003748.png"):
        images.append(Image.open(os.path.join(fixtures, name)))  # RGB JPEG, greyscale PNG, RGBA PNG
    return images


@pytest.mark.parametrize("tile", [32, 336])
def test_pad_to_square_equals_the_llava_image_processor(tile):
    """LLaVA-1.5's preprocessing (llava/mm_utils.py expand2square: pad to a square of the CLIP mean colour, then
    resize) equals transformers' LlavaImageProcessor(Pil) with do_pad=True, shortest_edge = crop = the tile."""
    from transformers import LlavaImageProcessorPil

    processor = LlavaImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                       do_pad=True)
    geometry = ImageGeometry(tile_size=tile, patch_size=8 if tile == 32 else 14, mode="pad")
    shapes = set()
    for image in _test_images():
        ours, size = preprocess(load_image(image), geometry)
        reference = processor(image, return_tensors="np")["pixel_values"]
        assert ours.shape == reference.shape == (1, 3, tile, tile)
        np.testing.assert_array_equal(ours, reference)
        shapes.add(np.sign(size[0] - size[1]))
    assert shapes == {-1, 0, 1}  # wide, square and tall images


def test_llava15_end_to_end_from_images_matches_hf(tmp_path):
    """Images of several aspect ratios through our preprocessing and model equal the HF image processor and
    ``LlavaForConditionalGeneration``."""
    from transformers import LlavaImageProcessorPil

    hf = tiny_hf_llava15(str(tmp_path))
    model = convert.load_hf_checkpoint(str(tmp_path))
    processor = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                       do_pad=True)
    images = _test_images()[:6] + [None]
    rows, sizes, prompts = [], [], []
    rng = np.random.default_rng(1)
    for image in images:
        text = rng.integers(0, 500, 5).tolist()
        if image is None:
            rows.append(None), sizes.append(None), prompts.append(text)
            continue
        tiles, size = preprocess(load_image(image), model.cfg.geometry)
        rows.append(tiles), sizes.append(size), prompts.append(text[:2] + [IMAGE_TOKEN] * 16 + text[2:])
    pixel_values = pad_tiles(rows, tile_size=32)
    from fire_jax.infer.forward import forward_logits

    length = max(map(len, prompts))
    ids = np.array([p + [0] * (length - len(p)) for p in prompts])
    mask = np.array([[1] * len(p) + [0] * (length - len(p)) for p in prompts])
    ours = forward_logits(model, ids, pixel_values=pixel_values, image_sizes=sizes, attention_mask=mask)
    errors = []
    for b, (image, prompt) in enumerate(zip(images, prompts)):
        pv = None if image is None else processor(image, return_tensors="np")["pixel_values"]
        errors.append(rel_err(ours[b, :len(prompt)], hf_llava15_logits(hf, np.array(prompt), pv)))
    print("llava15 end to end: relative logit errors:", errors)
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize("arch", ARCHS)
def test_tools_read_either_architecture(arch, tmp_path):
    """tools/hf_logits.py and tools/hf_generate.py on a checkpoint folder of either architecture:
    pixel_values ``[batch, tiles, 3, H, W]`` (one tile for LLaVA-1.5, which may also pass HF's
    ``[batch, 3, H, W]`` and no image_sizes)."""
    from fire_jax.infer.decode import generate
    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.infer.engine import left_pad
    from fire_jax.infer.forward import forward_logits

    directory = str(tmp_path / "ckpt")
    hf = (tiny_hf_llava15 if arch == "llava15" else tiny_hf_next_vicuna)(directory, embed_scale=8.0)
    model = convert.load_hf_checkpoint(directory, lora=None)
    sizes = [(40, 70), None, (30, 90)]
    ids, mask, pv, _, lengths = make_batch(model.cfg.geometry, sizes, [(3, 5), (9, 0), (2, 7)])
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pv,
                  image_sizes=np.array([s or (0, 0) for s in sizes]))
    if arch == "llava15":  # HF's LLaVA processor output: [batch, 3, H, W], no image_sizes
        inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pv[:, 0])
    np.savez(tmp_path / "in.npz", **inputs)
    load_tool("hf_logits").main(["--model", directory, "--inputs", str(tmp_path / "in.npz"),
                                  "--out", str(tmp_path / "logits.npz")])
    logits = np.load(tmp_path / "logits.npz")["logits"]
    np.testing.assert_array_equal(logits, forward_logits(model, ids, pixel_values=pv, image_sizes=sizes,
                                                         attention_mask=mask))
    for b, size in enumerate(sizes):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        assert rel_err(logits[b, :lengths[b]], _reference(arch, hf, ids[b, :lengths[b]], pv[b, :tiles], size)) <= TOL
    prompts = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    padded, padded_mask, _ = left_pad(prompts, max(lengths), 0)
    np.savez(tmp_path / "gen_in.npz", **dict(inputs, input_ids=padded, attention_mask=padded_mask))
    load_tool("hf_generate").main(["--model", directory, "--inputs", str(tmp_path / "gen_in.npz"),
                                    "--max_new_tokens", "6", "--stop_ids", "", "--out", str(tmp_path / "gen.npz")])
    expected = generate(model, prompts, pixel_values=pv, image_sizes=sizes,
                        sampling=SamplingParams(max_tokens=6, stop_ids=())).tokens
    np.testing.assert_array_equal(np.load(tmp_path / "gen.npz")["generated_ids"], expected)


def _config(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("name", ["llava_next_vicuna_7b", "llava_15_vicuna_7b"])
def test_7b_parameter_counts_abstract(name):
    """Vicuna-7B-v1.5 (Llama-2-7B: 6,738,415,616 parameters at 32,000 rows) with llava-hf's 32,064-row embedding
    and lm_head; CLIP ViT-L/14-336 without its projection; the 2-layer connector; image_newline for NeXT only."""
    cfg = LlavaNextConfig.from_dict(_config(name).model)
    assert hash(cfg) == hash(LlavaNextConfig.from_dict(_config(name).model))
    model = convert.abstract_model(cfg)
    llm = count_params(model.language_model, nnx.Param)
    vision = count_params(model.vision_tower, nnx.Param)
    connector = count_params(model.multi_modal_projector, nnx.Param)
    lora = count_params(model, LoRAParam)
    total = count_params(model, nnx.Param)
    print(f"{name}: LLM {llm:,}  vision {vision:,}  connector {connector:,}  total {total:,}  LoRA(q,k) {lora:,}")
    assert llm == 6_738_415_616 + 2 * 64 * 4096
    assert vision == 303_507_456
    assert connector == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert lora == 32 * 64 * ((4096 + 4096) + (4096 + 4096))
    newline = 4096 if name == "llava_next_vicuna_7b" else 0
    assert total == llm + vision + connector + newline
    assert cfg.llm.vocab_size == 32064 and cfg.image_token_id == 32000 and cfg.llm.rope_theta == 10000.0
    if name == "llava_15_vicuna_7b":
        assert cfg.architecture == "llava" and cfg.geometry.num_tokens((480, 640)) == 576
    else:
        # a square 336 px image: a 1 x 2 grid whose padded half is cut
        assert cfg.architecture == "llava_next" and cfg.geometry.num_tokens((336, 336)) == 576 + 24 * 25


@pytest.mark.parametrize("base,arch,hf", [("llava_next_vicuna_7b", "llava_next", "/data/llava-v1.6-vicuna-7b-hf"),
                                          ("llava_15_vicuna_7b", "llava", "/data/llava-1.5-7b-hf"),
                                          ("llava_next_8b", "llava_next", "/data/llama3-llava-next-8b-hf")])
def test_fire_recipes_take_the_base_model(base, arch, hf):
    """configs/fire.py's base option: the student and teacher recipes on FIRE-LLaVA-Vicuna (Table A5) and
    FIRE-LLaVA-1.5 (Table A6): the base's model sizes, llava-hf checkpoint and tokenizer."""
    from fire_jax.core.config import load_config

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    for recipe in ("fire_student.py", "fire_teacher.py"):
        config = load_config(os.path.join(root, recipe) + f":base={base}")
        cfg = LlavaNextConfig.from_dict(config.model)
        assert cfg == LlavaNextConfig.from_dict(_config(base).model) and cfg.architecture == arch
        assert config.init.hf_checkpoint == hf and config.data.tokenizer == f"{hf}/tokenizer.json"
        assert config.data.role == ("student" if recipe == "fire_student.py" else "teacher")
        assert config.data.template == ("llama3" if base == "llava_next_8b" else "vicuna_v1")
    other = load_config(os.path.join(root, "fire.py") + f":fire_student,base={base},hf=/x,tokenizer=/t/tok.json")
    assert (other.init.hf_checkpoint, other.data.tokenizer) == ("/x", "/t/tok.json")
    from fire_jax.core.config import InputError

    with pytest.raises(InputError, match="base="):
        load_config(os.path.join(root, "fire.py") + ":fire_student,base=llava_2")


def _free_results(**extra):
    overall = dict(AT=0.9, ADR=1.2, ATR=0.6, RR=0.3, K=7, items=9, accuracy_by_turn=[0.5, 0.6, 0.7, 0.7, 0.8],
                   stops={"solved": 9})
    return {"student": {"name": "ours"}, "teacher": {"name": "fd"},
            "metrics": {"overall": overall, "per_source": {"textvqa": dict(overall)}}, **extra}


def test_report_prints_tables_a5_and_a6_beside_our_numbers():
    """The free-dialogue report: a run on a Vicuna base gets its appendix table (A5 or A6, the paper's rows and
    ours); a run of unknown base gets Table 4, A5 and A6."""
    from fire_jax.eval import report
    from fire_jax.dialogue.stop import FREE_DIALOGUE

    paper = report.paper_results()
    assert paper["tableA5_vicuna_7b"]["FIRE-LLaVA-Vicuna"] == [0.94, 1.11, 0.57, 0.27]
    assert paper["tableA6_llava15_vicuna_7b"]["FIRE-LLaVA-1.5"] == [0.94, 0.8, 0.61, 0.2]
    ours = "| **ours (fire_jax)** | 0.90 | 1.20 | 0.60 | 0.30 | 7 | 9 |"
    a6 = report.free_report(_free_results(model=_config("llava_15_vicuna_7b").model.to_dict()),
                            threshold=FREE_DIALOGUE.threshold)
    assert "### Table A6: free dialogues, overall (LLaVA-1.5-Vicuna-7B)" in a6 and ours in a6
    assert "| LLaVA-1.5-Vicuna (paper) | 1.00 | 0.62 | 0.46 | 0.12 |  |  |" in a6
    assert "| FIRE-LLaVA-1.5 (paper) | 0.94 | 0.80 | 0.61 | 0.20 |  |  |" in a6
    assert "Table 4" not in a6 and "Table A5" not in a6 and "Table 5" not in a6 and "(paper) | 46.57" not in a6
    a5 = report.free_report(_free_results(model=_config("llava_next_vicuna_7b").model.to_dict()),
                            threshold=FREE_DIALOGUE.threshold)
    assert "### Table A5: free dialogues, overall (LLaVA-NeXT-Vicuna-7B)" in a5 and ours in a5
    assert "| LLaVA-Next-Vicuna (paper) | 1.00 | 0.98 | 0.49 | 0.24 |  |  |" in a5
    assert "| FIRE-LLaVA-Vicuna (paper) | 0.94 | 1.11 | 0.57 | 0.27 |  |  |" in a5 and "Table A6" not in a5
    at_8b = report.free_report(_free_results(base="llava_next_8b"), threshold=FREE_DIALOGUE.threshold)
    assert "Table 4" in at_8b and "Table 5" in at_8b and "Table A5" not in at_8b
    unknown = report.free_report(_free_results(), threshold=FREE_DIALOGUE.threshold)
    assert all(f"### {title}" in unknown for _, title in report.BASE_TABLES.values())
    assert unknown.count(ours) == 3 and "Table 5" in unknown
    assert report.run_base({"model": _config("llava_next_8b").model.to_dict()}) == "llava_next_8b"
    assert report.run_base({"model": {"llm": {"vocab_size": 512}}}) is None
