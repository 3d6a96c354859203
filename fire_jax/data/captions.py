"""Image-caption batches for CLIP training (``configs/clip.py``).

A source is a JSON list of ``{"id", "image", "caption"}`` records (the synthetic set's ``captions.json``,
:func:`fire_jax.data.synthetic.caption_records`) with an ``image_root``. Each image is resized to one square
tile (bicubic, as LLaVA-NeXT's whole-image tile 0) and CLIP-normalised; each caption is tokenized and ends in
the text tower's end token, padded after it. Batches are full (a contrastive batch's negatives are the other
pairs in it), reshuffled every epoch from ``data.seed``; the position is JSON state for checkpoints.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any, Mapping

import numpy as np

from fire_jax.core.config import InputError, resolve_path
from fire_jax.data.images import _resize, load_image, normalise


class CaptionPipeline:
    """The training loop's data interface (as :class:`fire_jax.data.pipeline.InputPipeline`) over captions."""

    def __init__(self, config: Mapping[str, Any], image_size: int, *, eos_token_id: int, process_count: int = 1):
        from tokenizers import Tokenizer

        if process_count != 1:
            raise ValueError("CLIP training runs in one process (its contrastive batch is not split over hosts)")
        self.batch_size, self.max_len = int(config["batch_size"]), int(config["max_len"])
        self.seed, self.num_epochs = int(config.get("seed", 0)), int(config.get("num_epochs") or 0)
        tokenizer = Tokenizer.from_file(resolve_path(config["tokenizer"]))
        pixels, ids = [], []
        self.source_sizes, self.stated_sizes = {}, {}
        for name, source in config["sources"].items():
            path, root = resolve_path(source["json"]), resolve_path(source["image_root"])
            with open(path, encoding="utf-8") as f:
                records = json.load(f)
            for i, record in enumerate(records):
                for field in ("image", "caption"):
                    if not isinstance(record.get(field), str) or not record[field]:
                        raise InputError(f"{path}: record {i} ({record.get('id', '?')}): field {field!r} must be a "
                                         f"non-empty string")
                tokens = tokenizer.encode(record["caption"], add_special_tokens=False).ids + [eos_token_id]
                if len(tokens) > self.max_len:
                    raise InputError(f"{path}: record {i} ({record.get('id', '?')}): caption of {len(tokens)} "
                                     f"tokens, data.max_len is {self.max_len}")
                ids.append(tokens)
                image_path = os.path.join(root, record["image"])
                if not os.path.isfile(image_path):
                    raise InputError(f"{path}: record {i} ({record.get('id', '?')}): field 'image': no file "
                                     f"{image_path}")
                image = load_image(image_path)
                pixels.append(normalise(_resize(image, (image_size, image_size))[None])[0])
            self.source_sizes[name] = len(records)
        if len(ids) < self.batch_size:
            raise InputError(f"data: {len(ids)} captions, fewer than one batch of {self.batch_size}")
        self.pixel_values = np.stack(pixels)
        self.input_ids = np.zeros((len(ids), max(map(len, ids))), np.int32)  # padding after the end token
        for i, tokens in enumerate(ids):
            self.input_ids[i, :len(tokens)] = tokens
        self.lengths = np.array([len(t) for t in ids])
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
        return {"pixel_values": self.pixel_values[rows], "input_ids": self.input_ids[rows],
                "attention_mask": (np.arange(self.input_ids.shape[1])[None] < self.lengths[rows, None]).astype(np.int32)}

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def close(self) -> None:
        pass

    def report(self) -> str:
        return f"captions: {self.num_examples:,} pairs, epoch {self.epoch}, {self.position:,} read in it"
