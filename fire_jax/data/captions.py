"""Image-caption batches for CLIP training (``configs/clip.py``).

A source is a JSON list of ``{"id", "image", "caption"}`` records (the synthetic set's ``captions.json``,
:func:`fire_jax.data.synthetic.caption_records`) with an ``image_root``, or ``{"generate": N, "seed": S}``: N
images the synthetic set's generator draws afresh with their captions. Each image is resized to one square
tile (bicubic, as LLaVA-NeXT's whole-image tile 0) and CLIP-normalised; each caption is tokenized and ends in
the text tower's end token, padded after it. Batches are full (a contrastive batch's negatives are the other
pairs in it), reshuffled every epoch from ``data.seed``; the position is JSON state for checkpoints.

Two options make the batches a vision stage's for a LLaVA rather than a plain CLIP's:

- ``data.views="anyres"`` with ``data.image_grid_pinpoints``: each image also as the LLaVA that will read the
  tower tiles it (the whole-image tile and the any-resolution grid, :func:`fire_jax.data.images.tiles`), with
  ``feature_index``, the positions of the features LLaVA places in its sequence (unpadded, image_newline
  left out; -1 pads), so a loss can be put on exactly what the LLM will see;
- ``data.facts=True``: ``facts``, the classes :func:`fire_jax.data.synthetic.caption_facts` reads from each
  caption (how many of each coloured shape, which bar is the tallest), targets of auxiliary heads that a
  contrastive loss alone leaves unlearned: a batch of 64 captions is told apart by the colours drawn alone;
- ``data.layout=True`` (with facts): ``dense_facts`` ``[n, patches, heads]``, what each patch of the whole-image
  tile holds (:func:`fire_jax.data.synthetic.layout_facts`: the shapes centred in it, the bar tops), for the
  images the generator draws; a caption file's images have no layout (every dense head ignored).
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Mapping

import numpy as np

from fire_jax.core.config import InputError, resolve_path
from fire_jax.core.geometry import ImageGeometry
from fire_jax.core.results import read_json
from fire_jax.data.image_files import image_path
from fire_jax.data.images import _resize, load_image, normalise, tiles


class CaptionPipeline:
    """The training loop's data interface (as :class:`fire_jax.data.pipeline.InputPipeline`) over captions."""

    def __init__(self, config: Mapping[str, Any], image_size: int, *, eos_token_id: int, process_count: int = 1,
                 patch_size: int = 0):
        from tokenizers import Tokenizer

        from fire_jax.data.synthetic import DENSE_HEADS, IGNORE, caption_facts, layout_facts

        if process_count != 1:
            raise ValueError("CLIP training runs in one process (its contrastive batch is not split over hosts)")
        self.batch_size, self.max_len = int(config["batch_size"]), int(config["max_len"])
        self.seed, self.num_epochs = int(config.get("seed", 0)), int(config.get("num_epochs") or 0)
        tokenizer = Tokenizer.from_file(resolve_path(config["tokenizer"]))
        views, self.with_facts = config.get("views", "tile"), bool(config.get("facts", False))
        if views not in ("tile", "anyres"):
            raise InputError(f"data.views must be 'tile' or 'anyres', got {views!r}")
        if self.with_facts and views != "anyres":
            raise InputError("data.facts=True needs data.views='anyres': the heads read the LLaVA's tiles")
        self.with_layout = bool(config.get("layout", False))
        if self.with_layout and not self.with_facts:
            raise InputError("data.layout=True needs data.facts=True: the dense heads train beside the fact heads")
        grid = image_size // patch_size if patch_size else 0
        geometry = None
        if views == "anyres":
            if not config.get("image_grid_pinpoints") or not patch_size:
                raise InputError("data.views='anyres' needs data.image_grid_pinpoints (the LLaVA's) and the "
                                 "tower's patch size")
            geometry = ImageGeometry(tile_size=image_size, patch_size=patch_size,
                                     pinpoints=tuple(map(tuple, config["image_grid_pinpoints"])))
        pixels, ids, views_pixels, facts, dense = [], [], [], [], []
        self.source_sizes, self.stated_sizes = {}, {}
        for name, source in config["sources"].items():
            self.source_sizes[name] = 0
            for where, record, image, layout in _source_records(name, source):
                tokens = tokenizer.encode(record["caption"], add_special_tokens=False).ids + [eos_token_id]
                if len(tokens) > self.max_len:
                    raise InputError(f"{where}: caption of {len(tokens)} tokens, data.max_len is {self.max_len}")
                ids.append(tokens)
                pixels.append(_resize(image, (image_size, image_size)))  # uint8: normalised a batch at a time
                if geometry is not None:
                    views_pixels.append(image)
                if self.with_facts:
                    try:
                        facts.append(caption_facts(record["caption"]))
                    except ValueError as e:
                        raise InputError(f"{where}: field 'caption': {e}") from None
                if self.with_layout:
                    dense.append(layout_facts(layout, (image.height, image.width), grid) if layout is not None
                                 else [[IGNORE] * len(DENSE_HEADS)] * (grid * grid))
                self.source_sizes[name] += 1
        if len(ids) < self.batch_size:
            raise InputError(f"data: {len(ids)} captions, fewer than one batch of {self.batch_size}")
        self.pixel_values = np.stack(pixels)  # [n, t, t, 3] uint8
        self.input_ids = np.zeros((len(ids), max(map(len, ids))), np.int32)  # padding after the end token
        for i, tokens in enumerate(ids):
            self.input_ids[i, :len(tokens)] = tokens
        self.lengths = np.array([len(t) for t in ids])
        self.extra: dict[str, np.ndarray] = {}
        if geometry is not None:
            self.extra["view_pixels"], self.extra["feature_index"] = llava_views(views_pixels, geometry)
        if self.with_facts:
            self.extra["facts"] = np.asarray(facts, np.int32)
        if self.with_layout:
            self.extra["dense_facts"] = np.asarray(dense, np.int32)
        self.num_examples, self.process_count = len(ids), 1
        self.bad_records, self.dropped = collections.Counter(), collections.Counter()
        self.epoch, self.position = 0, 0

    def examples_per_process(self, epochs: float) -> int:
        return int(self.num_examples * epochs)

    def steps(self, epochs: float) -> int:
        return math.ceil(self.examples_per_process(epochs) / self.batch_size)

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_examples)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position + self.batch_size > self.num_examples:  # full batches only: the rest goes to the next epoch
            self.epoch, self.position = self.epoch + 1, 0
        if self.num_epochs and self.epoch >= self.num_epochs:
            raise StopIteration
        rows = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        batch = {"pixel_values": normalise(self.pixel_values[rows]), "input_ids": self.input_ids[rows],
                 "attention_mask": (np.arange(self.input_ids.shape[1])[None] < self.lengths[rows, None]).astype(np.int32),
                 **{k: v[rows] for k, v in self.extra.items()}}
        if "view_pixels" in batch:
            views = batch["view_pixels"]
            batch["view_pixels"] = normalise(views.reshape(-1, *views.shape[2:])).reshape(
                *views.shape[:2], 3, *views.shape[2:4])
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def close(self) -> None:
        pass

    def report(self) -> str:
        return f"captions: {self.num_examples:,} pairs, epoch {self.epoch}, {self.position:,} read in it"


def llava_views(images, geometry: ImageGeometry) -> tuple[np.ndarray, np.ndarray]:
    """PIL images as a LLaVA of ``geometry`` tiles them: uint8 ``[n, max_tiles, t, t, 3]`` (zero tiles pad) and
    ``feature_index`` ``[n, max_tokens]``, the positions of the features it places in its sequence (tile-major,
    image_newline left out: it is the LLM's, not the tower's; -1 pads)."""
    indices = [geometry.feature_index((im.height, im.width)) for im in images]
    indices = [index[index >= 0] for index in indices]
    t = geometry.tile_size
    pixels = np.zeros((len(images), geometry.max_tiles, t, t, 3), np.uint8)
    feature_index = np.full((len(images), max(map(len, indices))), -1, np.int32)
    for i, (image, index) in enumerate(zip(images, indices)):
        view = tiles(image, geometry)[0]
        pixels[i, :len(view)] = view
        feature_index[i, :len(index)] = index
    return pixels, feature_index


def _source_records(name: str, source: Mapping[str, Any]):
    """(where, record, PIL image, layout) of one source: a JSON list of ``{"id", "image", "caption"}`` under
    ``image_root``, or ``{"generate": N, "seed": S}``: N images the synthetic set's generator draws afresh with
    their captions (:func:`fire_jax.data.synthetic.synthesize`, under a split name of their own, so never a test
    image), as many as a vision stage needs to learn what is drawn rather than which of 720 images it sees. The
    layout (what is drawn where, :attr:`fire_jax.data.synthetic.Task.layout`) is a generated image's; None for a
    caption file's."""
    if "generate" in source:  # 0: none (a config's way to leave the source out)
        from fire_jax.data.synthetic import synthesize

        layouts: dict = {}
        records, images, captions = synthesize(int(source["generate"]), int(source.get("seed", 0)), f"vision_{name}",
                                               layouts)
        for i, record in enumerate(records):
            yield (f"{name}: generated image {i}", {"id": record["id"], "caption": captions[record["image"]]},
                   images[record["image"]], layouts[record["image"]])
        return
    path, root = resolve_path(source["json"]), resolve_path(source["image_root"])
    records = read_json(path)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected a JSON list of {{\"id\", \"image\", \"caption\"}} records")
    for i, record in enumerate(records):
        where = f"{path}: record {i} ({record.get('id', '?')})"
        for field in ("image", "caption"):
            if not isinstance(record.get(field), str) or not record[field]:
                raise InputError(f"{where}: field {field!r} must be a non-empty string")
        path = image_path(root, record["image"], where)  # a BadRecordError (an InputError) out of the root
        if not os.path.isfile(path):
            raise InputError(f"{where}: field 'image': no file {path}")
        yield where, record, load_image(path), None
