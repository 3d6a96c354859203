"""The vision stage that must see: facts read from captions, the LLaVA's views, the auxiliary heads' loss, the tower
probe (experiments/vision_probe.py), and the base stage's instruction data on right answers."""

import importlib.util
import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from fire_jax.core.config import load_config
from fire_jax.data.synthetic import DENSE_HEADS, FACT_HEADS, IGNORE, caption_facts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "fire_jax", "assets", "synthetic_fire")


def _probe_module():
    spec = importlib.util.spec_from_file_location("vision_probe", os.path.join(ROOT, "experiments", "vision_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _head(color, shape):
    return [name for name, _ in FACT_HEADS].index(f"count {color} {shape}")


def test_caption_facts_hand_read():
    facts = caption_facts("2 red circles, 1 blue square and 1 green triangle.")
    assert facts[_head("red", "circle")] == 2 and facts[_head("blue", "square")] == 1
    assert facts[_head("green", "triangle")] == 1 and facts[_head("red", "square")] == 0
    assert sum(facts[:-1]) == 4 and facts[-1] == IGNORE
    facts = caption_facts("Five green bars, 52, 71, 77, 54 and 75 percent high from the left; bar 3 is the tallest.")
    assert facts[-1] == 2 and set(facts[:-1]) == {IGNORE}
    with pytest.raises(ValueError, match="not a synthetic caption"):
        caption_facts("2 red hexagons.")


def test_every_shipped_caption_agrees_with_its_question():
    """Each training caption's facts answer its record's question with the groundtruth."""
    from fire_jax.data.synthetic import RAINBOW, parse_answer

    with open(os.path.join(ASSETS, "captions.json")) as f:
        captions = {r["image"]: r["caption"] for r in json.load(f)}
    with open(os.path.join(ASSETS, "train.json")) as f:
        train = json.load(f)
    for record in train:
        facts = caption_facts(captions[record["image"]])
        task, truth = parse_answer(record["groundtruth"]["value"])
        question = record["question"]["value"]
        if task == "bars":
            assert facts[-1] == truth
        elif task == "count":
            color, shape = question.split("How many ")[1].split(" are")[0].split()
            assert facts[_head(color, shape.rstrip("s"))] == truth + 1
        else:
            shape = question.split("the ")[-1].rstrip("?")
            assert facts[_head(RAINBOW[truth], shape)] >= 1


def test_fact_classes_of_the_config_are_the_heads():
    model = load_config("configs/clip.py:see").model
    assert tuple(model.fact_classes) == tuple(c for _, c in FACT_HEADS)
    assert tuple(model.dense_classes) == tuple(c for _, c in DENSE_HEADS)


def test_fact_loss_hand_computed():
    from fire_jax.models.clip import fact_loss

    # Two images, heads of 2 and 3 classes; image 1's second head does not apply.
    logits = [jnp.array([[1.0, 0.0], [0.0, 2.0]])[:, None], jnp.array([[0.0, 0.0, math.log(2)], [5.0, 0.0, 0.0]])[:, None]]
    facts = jnp.array([[0, 2], [1, -1]])
    nll = [-math.log(math.e / (math.e + 1)), -math.log(2 / 4), -math.log(math.e ** 2 / (1 + math.e ** 2))]
    loss, correct = fact_loss(logits, facts)
    assert float(loss) == pytest.approx(sum(nll) / 3, rel=1e-6)
    assert np.asarray(correct).tolist() == [[True, True], [True, False]]
    # Two reads an image ("token" pooling): the loss is the reads' mean, the class the reads' summed log-probs.
    two = [jnp.stack([h[:, 0], h[:, 0]], 1) for h in logits]
    loss_two, correct_two = fact_loss(two, facts)
    assert float(loss_two) == pytest.approx(sum(nll) / 3, rel=1e-6)
    assert np.asarray(correct_two).tolist() == [[True, True], [True, False]]


def test_caption_batches_carry_the_llava_views_and_facts():
    """configs/clip.py:tiny,see reads the tiny LLaVA's any-resolution tiles and the caption facts; a generated source
    draws fresh images under a split name of its own, the same ones for the same seed."""
    from fire_jax.core.geometry import ImageGeometry
    from fire_jax.data.captions import CaptionPipeline

    config = load_config("configs/clip.py:tiny,see")
    config.data.sources = dict(generated=dict(generate=16, seed=3))
    config.data.batch_size = 8
    vision = config.model.vision
    pipeline = CaptionPipeline(config.data, vision.image_size, eos_token_id=1, patch_size=vision.patch_size)
    batch = next(pipeline)
    geometry = ImageGeometry(tile_size=vision.image_size, patch_size=vision.patch_size,
                             pinpoints=tuple(map(tuple, config.data.image_grid_pinpoints)))
    assert batch["view_pixels"].shape == (8, geometry.max_tiles, 3, vision.image_size, vision.image_size)
    assert batch["view_pixels"].dtype == np.float32 and batch["pixel_values"].shape == (8, 3, 32, 32)
    assert batch["facts"].shape == (8, len(FACT_HEADS))
    counts = (batch["feature_index"] >= 0).sum(1)
    # Each image's feature positions: LLaVA's tokens for it less its image_newlines.
    from fire_jax.data.synthetic import synthesize

    records, images, captions = synthesize(16, 3, "vision_generated")
    sizes = {i: (images[r["image"]].height, images[r["image"]].width) for i, r in enumerate(records)}
    expected = {i: int((geometry.feature_index(s) >= 0).sum()) for i, s in sizes.items()}
    assert sorted(counts.tolist()) == sorted(expected[i] for i in pipeline._order()[:8])
    again = CaptionPipeline(config.data, vision.image_size, eos_token_id=1, patch_size=vision.patch_size)
    assert np.array_equal(next(again)["facts"], batch["facts"])
    with open(os.path.join(ASSETS, "test.json")) as f:
        test_images = {r["image"] for r in json.load(f)}
    assert not test_images & {r["image"] for r in records} and records[0]["image"].startswith("vision_generated")


def test_clip_with_fact_heads_trains_and_exports_without_them(tmp_path):
    """A few steps of the tiny vision stage: the auxiliary loss falls, the contrastive pass is not run (its weight
    is 0: no contrastive metric, the loss is the heads' alone), and the export is a plain CLIPModel."""
    from fire_jax.convert.clip import load_clip_checkpoint
    from fire_jax.models.config import CLIPConfig
    from fire_jax.train.loop import train

    config = load_config("configs/clip.py:tiny,see")
    config.data.batch_size = config.train.batch_size = 16
    config.data.sources.generated.generate = 32
    config.train.update(total_steps=8, checkpoint_every=8, lr=3e-3)
    summary = train(config, str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["fact_loss"] < rows[0]["fact_loss"]
    assert config.loss.contrastive_weight == 0 and not any("contrastive_loss" in row for row in rows)
    assert rows[0]["loss"] == pytest.approx(rows[0]["fact_loss"] + rows[0]["dense_loss"], rel=1e-5)
    assert summary["step"] == 8
    from safetensors.numpy import load_file

    keys = load_file(str(tmp_path / "export" / "clip" / "model.safetensors"))
    assert keys and not any("fact" in k for k in keys)
    assert load_clip_checkpoint(str(tmp_path / "export" / "clip")).cfg.vision == \
        CLIPConfig.from_dict(config.model).vision


def test_instruction_records_answer_the_groundtruth():
    """The seeing lineage's base stage learns what it sees from right answers: every instruct_right.json record's
    answer is its record's groundtruth, in the first turn's words; instruct.json keeps the first answers."""
    with open(os.path.join(ASSETS, "instruct_right.json")) as f:
        instruct = json.load(f)
    with open(os.path.join(ASSETS, "instruct.json")) as f:
        first = {r["id"]: r for r in json.load(f)}
    with open(os.path.join(ASSETS, "train.json")) as f:
        train = {r["id"]: r for r in json.load(f)}
    assert len(instruct) == len(train) == len(first) == 720
    wrong = 0
    for record in instruct:
        source = train[record["id"][:-len("_instruct")]]
        thought, answer = record["conversations"][1]["value"].split("\nAnswer: ")
        assert answer.strip() == source["groundtruth"]["value"]
        assert thought == source["conversations"][0]["value"].split("\nAnswer: ")[0]
        assert first[record["id"]]["conversations"][1]["value"] == source["conversations"][0]["value"]
        wrong += record["conversations"][1] != first[record["id"]]["conversations"][1]
    assert 300 < wrong < 420  # about half of the first answers are wrong


def test_probe_reads_each_question_from_its_head():
    probe = _probe_module()
    with open(os.path.join(ASSETS, "test.json")) as f:
        records = json.load(f)[:6]  # count, bars, colour, twice
    n = len(records)
    probs = [np.full((n, c), 1.0 / c) for _, c in FACT_HEADS]
    from fire_jax.data.synthetic import RAINBOW, parse_answer

    for i, record in enumerate(records):  # put the truth in the head the question names
        task, truth = parse_answer(record["groundtruth"]["value"])
        question = record["question"]["value"]
        if task == "bars":
            probs[-1][i] = np.eye(5)[truth]
        elif task == "count":
            color, shape = question.split("How many ")[1].split(" are")[0].split()
            probs[_head(color, shape.rstrip("s"))][i] = np.eye(8)[truth + 1]
        else:
            shape = question.split("the ")[-1].rstrip("?")
            probs[_head(RAINBOW[truth], shape)][i] = np.eye(8)[1]
    assert probe.answer_accuracy(probs, records) == {"bars": 1.0, "color": 1.0, "count": 1.0}


def test_probe_on_a_tiny_tower():
    """The probe's features on the tiny LLaVA's tower at random: one vector a test image, the averaged features
    beside the whole-image tile's; its regression separates facts the features carry."""
    from flax import nnx

    from fire_jax.core.geometry import ImageGeometry
    from fire_jax.models.clip import CLIPVisionTower
    from fire_jax.models.config import VisionConfig

    probe = _probe_module()
    model = load_config("configs/tiny.py").model
    vision = VisionConfig(**model.vision.to_dict())
    geometry = ImageGeometry(tile_size=vision.image_size, patch_size=vision.patch_size,
                             pinpoints=tuple(map(tuple, model.image_grid_pinpoints)))
    records, images = probe.load_split("test")
    tower = CLIPVisionTower(vision, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    features = probe.tower_features(tower, geometry, images[:12])
    assert features.shape == (12, vision.width * (1 + geometry.tokens_per_tile))
    assert np.isfinite(features).all() and np.std(features[:, 0]) > 0
    # The regression: facts that are a linear function of the features are read back exactly.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    facts = np.stack([np.argmax(x[:, :3], 1), np.argmax(x[:, 3:], 1)], 1).astype(np.int32)
    predict = probe.fit_heads(x, facts, [3, 3])
    assert all((p.argmax(1) == facts[:, h]).mean() > 0.9 for h, p in enumerate(predict(x)))


@pytest.mark.parametrize("pooling, reads", [("tile", 1), ("token", 16)])
def test_fact_logits_read_the_tile_or_every_token(pooling, reads):
    """"tile": one read an image from the averaged features and the whole-image tile; "token": one read a patch
    of the whole-image tile. Padding positions (-1) of feature_index do not change a "tile" read."""
    from flax import nnx

    from fire_jax.models.clip import CLIPModel
    from fire_jax.models.config import CLIPConfig

    config = load_config("configs/clip.py:tiny,see").model
    config.fact_pooling = pooling
    model = CLIPModel(CLIPConfig.from_dict(config), rngs=nnx.Rngs(0))
    pixels = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 3, 32, 32)), jnp.float32)
    index = jnp.asarray([[0, 1, 2, 20, -1, -1], [0, 1, 2, 20, 21, 22]])
    logits, dense = model.fact_logits(pixels, index)
    assert [h.shape for h in logits] == [(2, reads, c) for _, c in FACT_HEADS]
    assert [h.shape for h in dense] == [(2, 16, c) for _, c in DENSE_HEADS]
    if pooling == "tile":
        trimmed = model.fact_logits(pixels[:1], index[:1, :4])[0]
        assert np.allclose(np.asarray(trimmed[0]), np.asarray(logits[0][:1]), atol=1e-5)
    else:  # the whole-image tile alone: the grid tiles change nothing
        other = pixels.at[:, 1:].set(0.0)
        assert np.allclose(np.asarray(model.fact_logits(other, index)[0][0]), np.asarray(logits[0]), atol=1e-5)


def test_dense_heads_read_their_hidden_state():
    """The dense heads are a linear map of each whole-image-tile patch at hidden state ``dense_layer``."""
    from flax import nnx

    from fire_jax.models.clip import CLIPModel
    from fire_jax.models.config import CLIPConfig

    config = load_config("configs/clip.py:tiny,see").model
    config.dense_layer = 1
    model = CLIPModel(CLIPConfig.from_dict(config), rngs=nnx.Rngs(0))
    pixels = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 3, 32, 32)), jnp.float32)
    _, dense = model.fact_logits(pixels, jnp.zeros((2, 4), jnp.int32))
    state = model.vision_tower.hidden_states(pixels[:, 0], 1)[1]  # [2, 16, width]
    expected = np.asarray(model.dense_heads(state))
    assert np.allclose(np.concatenate([np.asarray(d) for d in dense], -1), expected, atol=1e-5)
    # the read layer's features are the tower's own output
    assert np.allclose(np.asarray(model.vision_tower.hidden_states(pixels[:, 0], 2)[2]),
                       np.asarray(model.vision_tower(pixels[:, 0])), atol=1e-6)


def test_layout_facts_hand_placed():
    """Two red circles and a blue square on a 40 x 80 image, a 2 x 2 grid: a centre at (x, y) falls in patch
    (y * 2 // 40, x * 2 // 80); a bars image marks each bar's top and the tallest's."""
    from fire_jax.data.synthetic import DENSE_HEADS, layout_facts

    pairs = [name for name, _ in DENSE_HEADS]
    red, blue = pairs.index("red circle centres"), pairs.index("blue square centres")
    rows = layout_facts([("red", "circle", (2, 2, 12, 12)), ("red", "circle", (20, 4, 30, 14)),
                         ("blue", "square", (50, 25, 60, 35))], (40, 80), 2)
    assert [r[red] for r in rows] == [2, 0, 0, 0] and [r[blue] for r in rows] == [0, 0, 0, 1]
    assert all(r[-2:] == [IGNORE, IGNORE] for r in rows) and sum(map(sum, (r[:-2] for r in rows))) == 3
    bars = [("red", "bar", (x, 40 - h, x + 3, 39)) for x, h in zip((2, 18, 34, 50, 66), (10, 30, 25, 12, 8))]
    rows = layout_facts(bars, (40, 80), 2)
    # tops at y 30, 10, 15, 28, 32 and centre x 4, 20, 36, 52, 68: patches 2, 0, 0, 3, 3
    assert [r[-2] for r in rows] == [3, 0, 1, 5] and [r[-1] for r in rows] == [1, 0, 0, 0]
    assert all(set(r[:-2]) == {IGNORE} for r in rows)


def test_generated_layouts_agree_with_their_captions():
    """Summed over the patches, the dense heads give each caption's counts (below MAX_CENTRES a patch), and the
    patch marked tallest holds the caption's tallest bar's top."""
    from fire_jax.data.synthetic import MAX_CENTRES, layout_facts, synthesize

    layouts = {}
    records, images, captions = synthesize(60, 5, "layout_check", layouts)
    for record in records:
        name = record["image"]
        facts = caption_facts(captions[name])
        rows = np.asarray(layout_facts(layouts[name], (images[name].height, images[name].width), 4))
        if facts[-1] != IGNORE:
            assert (rows[:, -1] == 1).sum() == 1 and rows[rows[:, -1] == 1, -2][0] >= facts[-1] + 1
            assert set(rows[:, -2].tolist()) <= set(range(6)) and (rows[:, -2] > 0).sum() <= 5
        else:
            sums = rows[:, :-2].sum(0)
            capped = (rows[:, :-2] == MAX_CENTRES).any(0)
            assert ((sums == np.asarray(facts[:-1])) | capped).all()


def test_dense_loss_hand_computed():
    from fire_jax.models.clip import dense_loss

    # One image, two patches, heads of 2 and 3 classes; head 1 does not apply to patch 1.
    logits = [jnp.array([[[0.0, 0.0], [math.log(3), 0.0]]]), jnp.array([[[0.0, 0.0, 0.0], [9.0, 0.0, 0.0]]])]
    targets = jnp.array([[[1, 2], [0, -1]]])
    loss, correct = dense_loss(logits, targets)
    nll = [math.log(2), math.log(3), -math.log(3 / 4)]
    assert float(loss) == pytest.approx(sum(nll) / 2, rel=1e-6)  # summed over heads, averaged over 2 patches
    assert np.asarray(correct).tolist() == [[[False, False], [True, False]]]


def test_shipped_instruction_and_caption_chats_are_the_generators():
    """instruct.json, instruct_right.json and caption_chats.json are what instruction_records and
    caption_chat_records write."""
    from fire_jax.data.synthetic import caption_chat_records, instruction_records

    def shipped(name):
        with open(os.path.join(ASSETS, name)) as f:
            return json.load(f)

    assert shipped("instruct.json") == instruction_records(shipped("train.json"))
    assert shipped("instruct_right.json") == instruction_records(shipped("train.json"), right=True)
    chats = shipped("caption_chats.json")
    assert chats == caption_chat_records(shipped("captions.json"))
    assert chats[0]["conversations"][0]["value"] == "<image>\nDescribe the image."


@pytest.mark.parametrize("change, message", [
    (dict(views="tile"), "data.facts=True needs data.views='anyres'"),
    (dict(fact_classes=()), "data.facts gives 19 facts an image, model.fact_classes has 0 heads"),
    (dict(fact_pooling="cls"), "model.fact_pooling must be 'tile' or 'token', got 'cls'"),
    (dict(dense_layer=4), "model.dense_layer must be a hidden state of the tower's, 1..3, got 4"),
    (dict(layout=True, facts=False), "data.layout=True needs data.facts=True"),
    (dict(dense_classes=()), "data.layout gives 20 dense facts a patch, model.dense_classes has 0 heads"),
])
def test_vision_stage_options_that_disagree_end_in_one_line(tmp_path, change, message):
    from fire_jax.core.config import InputError
    from fire_jax.train.loop import train

    config = load_config("configs/clip.py:tiny,see")
    for key, value in change.items():
        (config.data if key in ("views", "layout", "facts") else config.model)[key] = value
    with pytest.raises((InputError, ValueError), match=re.escape(message)):
        train(config, str(tmp_path))
