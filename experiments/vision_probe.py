"""What a vision tower's features say about the synthetic images: a linear probe per question type.

    python experiments/vision_probe.py --clip runs/see/clip/export/clip --config configs/smollm2_llava.py:see   # the see lineage
    python experiments/vision_probe.py --llava runs/smollm2/base/export/hf_merged  # the tower inside the base model

The features are the ones LLaVA reads: the tower's hidden state at ``feature_layer`` on the image's any-resolution
tiles (the whole-image tile and the grid), averaged over the positions LLaVA places in its sequence (unpadded,
image_newline left out), beside the whole-image tile's features patch by patch. A softmax regression per head of ``fire_jax.data.synthetic.FACT_HEADS`` (the count of
each of the 18 (colour, shape) pairs, the tallest bar) is fitted on the 720 training images, with the facts
their captions state, and answers the 90 test questions, which have no caption: a count question by the count
head of the pair it names, a colour question by the colour whose pair with the named shape is the likeliest to
be present, a bar question by the tallest-bar head. Printed per task beside a tower of the same shape at random
and the raw pixels (the whole-image tile at 16 x 16, flattened), each fitted the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ASSETS = "assets:synthetic_fire"


def _images(records, root):
    from fire_jax.data.images import load_image

    return [load_image(os.path.join(root, r["image"])) for r in records]


def tower_features(tower, geometry, images, batch: int = 64) -> np.ndarray:
    """``[n, width * (1 + patches)]``: the tower's features at its feature layer, averaged over the positions LLaVA
    places, then the whole-image tile's patch by patch (what the vision stage's heads read)."""
    import jax
    import jax.numpy as jnp

    from fire_jax.data.captions import llava_views
    from fire_jax.data.images import normalise

    run = jax.jit(lambda pixels: tower(pixels))
    out = []
    for start in range(0, len(images), batch):
        views, index = llava_views(images[start:start + batch], geometry)
        pixels = normalise(views.reshape(-1, *views.shape[2:]))
        features = np.asarray(run(jnp.asarray(pixels))).reshape(len(views), -1, tower.cfg.width)
        for f, positions in zip(features, index):
            base = f[:geometry.tokens_per_tile].reshape(-1)
            out.append(np.concatenate([f[positions[positions >= 0]].mean(0), base]))
    return np.stack(out)


def pixel_features(images, side: int = 16) -> np.ndarray:
    """The raw-pixel baseline: each image resized to ``side`` x ``side`` (the whole-image tile), flattened."""
    from fire_jax.data.images import _resize, normalise

    return np.stack([normalise(_resize(im, (side, side))[None])[0].reshape(-1) for im in images])


def fit_heads(features: np.ndarray, facts: np.ndarray, classes, *, steps: int = 400, l2: float = 1e-3,
              seed: int = 0):
    """One softmax regression per head (standardised features, L2 ``l2``, full-batch Adam); a head is fitted
    on the rows where it applies (facts >= 0). Returns a function features -> list of ``[n, classes]`` probs."""
    import jax
    import jax.numpy as jnp
    import optax

    mean, std = features.mean(0), features.std(0) + 1e-6
    x = jnp.asarray((features - mean) / std)
    total = sum(classes)
    bounds = np.cumsum(classes)[:-1].tolist()
    key = jax.random.key(seed)
    params = {"w": jax.random.normal(key, (x.shape[1], total)) * 0.01, "b": jnp.zeros(total)}
    facts = jnp.asarray(facts)

    def loss(p):
        heads = jnp.split(x @ p["w"] + p["b"], bounds, axis=-1)
        nll = 0.0
        for h, logits in enumerate(heads):
            applies = facts[:, h] >= 0
            logp = jax.nn.log_softmax(logits, -1)
            picked = jnp.take_along_axis(logp, jnp.maximum(facts[:, h], 0)[:, None], -1)[:, 0]
            nll = nll - jnp.sum(jnp.where(applies, picked, 0.0)) / jnp.maximum(applies.sum(), 1)
        return nll / len(classes) + l2 * jnp.sum(p["w"] ** 2)

    tx = optax.adam(0.05)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        updates, s = tx.update(g, s)
        return optax.apply_updates(p, updates), s

    for _ in range(steps):
        params, state = step(params, state)

    def predict(f):
        z = jnp.asarray((f - mean) / std) @ params["w"] + params["b"]
        return [np.asarray(jax.nn.softmax(h, -1)) for h in jnp.split(z, bounds, axis=-1)]

    return predict


def answer_accuracy(probs, records) -> dict[str, float]:
    """Per task, the share of ``records`` (test FIRE records) whose question the probe's heads answer right."""
    from fire_jax.data.synthetic import RAINBOW, SHAPES, parse_answer

    hits: dict[str, list[bool]] = {}
    for i, record in enumerate(records):
        task, truth = parse_answer(record["groundtruth"]["value"])
        question = record["question"]["value"].lower()
        if task == "bars":
            guess = int(np.argmax(probs[-1][i]))
        elif task == "count":
            color, shape = question.split("how many ")[1].split(" are")[0].split()
            head = RAINBOW.index(color) * len(SHAPES) + SHAPES.index(shape.rstrip("s"))
            guess = int(np.argmax(probs[head][i][1:]))  # a count question's answer is 1..7
        else:
            shape = question.split("the ")[-1].rstrip("?")
            present = [1 - probs[c * len(SHAPES) + SHAPES.index(shape)][i][0] for c in range(len(RAINBOW))]
            guess = int(np.argmax(present))
        hits.setdefault(task, []).append(guess == truth)
    return {task: float(np.mean(v)) for task, v in sorted(hits.items())}


def probe(features_train, facts_train, features_test, test_records, classes) -> dict[str, float]:
    return answer_accuracy(fit_heads(features_train, facts_train, classes)(features_test), test_records)


def load_split(split: str):
    from fire_jax.core.config import resolve_path

    root = resolve_path(f"{ASSETS}/images")
    with open(resolve_path(f"{ASSETS}/{split}.json")) as f:
        records = json.load(f)
    return records, _images(records, root)


def train_facts(records) -> np.ndarray:
    from fire_jax.core.config import resolve_path
    from fire_jax.data.synthetic import caption_facts

    with open(resolve_path(f"{ASSETS}/captions.json")) as f:
        captions = {r["image"]: r["caption"] for r in json.load(f)}
    return np.asarray([caption_facts(captions[r["image"]]) for r in records], np.int32)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--clip", default="", help="an exported CLIP folder (a vision stage's export/clip)")
    where.add_argument("--llava", default="", help="a LLaVA checkpoint folder: its own tower")
    parser.add_argument("--config", default="configs/smollm2_llava.py",
                        help="the LLaVA config whose tower shape, feature layer and tiles are read (and the random "
                             "tower's shape)")
    parser.add_argument("--generated", type=int, default=3200,
                        help="fresh drawings added to the 720 training images to fit the regressions (0: none)")
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    from fire_jax.core.config import load_config
    from fire_jax.core.geometry import ImageGeometry
    from fire_jax.data.synthetic import FACT_HEADS
    from fire_jax.models.clip import CLIPVisionTower
    from fire_jax.models.config import VisionConfig

    llava = load_config(args.config).model
    vision = VisionConfig(**llava.vision.to_dict())
    geometry = ImageGeometry(tile_size=vision.image_size, patch_size=vision.patch_size,
                             pinpoints=tuple(map(tuple, llava.image_grid_pinpoints)))
    classes = [c for _, c in FACT_HEADS]
    train_records, train_images = load_split("train")
    test_records, test_images = load_split("test")
    facts = train_facts(train_records)
    if args.generated:
        from fire_jax.data.synthetic import caption_facts, synthesize

        records, images, captions = synthesize(args.generated, 7, "probe")
        train_images = train_images + [images[r["image"]] for r in records]
        facts = np.concatenate([facts, np.asarray([caption_facts(captions[r["image"]]) for r in records], np.int32)])
    towers = {"random tower": CLIPVisionTower(vision, dtype=jax.numpy.float32, param_dtype=jax.numpy.float32,
                                              rngs=nnx.Rngs(0))}
    if args.clip:
        from fire_jax.convert.clip import load_clip_checkpoint

        towers["trained tower"] = load_clip_checkpoint(args.clip).vision_tower
    elif args.llava:
        from fire_jax.weights.build import build_model

        config = load_config(args.config)
        config.init = dict(hf_checkpoint=args.llava)
        towers["trained tower"] = build_model(config).vision_tower
    results = {}
    for name, tower in towers.items():
        tower.cfg = vision  # read the LLaVA's feature layer
        results[name] = probe(tower_features(tower, geometry, train_images), facts,
                              tower_features(tower, geometry, test_images), test_records, classes)
    results["raw pixels"] = probe(pixel_features(train_images), facts, pixel_features(test_images), test_records,
                                  classes)
    tasks = sorted(next(iter(results.values())))
    print("probe accuracy on the 90 test questions (chance: count 1/7, bars 1/5, colour 1/6)")
    print(f"{'features':<16}" + "".join(f"{t:>8}" for t in tasks))
    for name, row in results.items():
        print(f"{name:<16}" + "".join(f"{row[t]:>8.3f}" for t in tasks))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
