"""Host-side image layout for a padded token batch, and a jitted full forward to logits.

Shared by :mod:`fire_jax.infer.decode` and the ``tools/hf_*.py`` scripts,
which read Hugging Face style arrays (``input_ids`` with expanded image
placeholders, ``pixel_values [batch, crops, 3, H, W]``, ``image_sizes [batch, 2]``).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.data.images import pad_tiles
from fire_jax.core.geometry import place_images


def normalise_sizes(image_sizes, batch: int) -> list[list[tuple[int, int]]]:
    """Per example, the list of its images' (h, w): each entry may be None, one (h, w) or a list of them."""
    if image_sizes is None:
        return [[] for _ in range(batch)]
    if len(image_sizes) != batch:
        raise ValueError(f"image_sizes has {len(image_sizes)} entries for {batch} examples")
    out = []
    for sizes in image_sizes:
        if sizes is None or len(sizes) == 0:
            out.append([])
        elif np.ndim(sizes) == 1:
            out.append([tuple(int(v) for v in sizes)])
        else:
            out.append([tuple(int(v) for v in s) for s in sizes])
    return out


def hf_image_sizes(input_ids: np.ndarray, image_sizes: np.ndarray | None, image_token_id: int) -> list:
    """HF's ``image_sizes [batch, 2]`` (one image per example) as per-example lists.

    An example without image placeholder tokens is text-only, whatever its row says.
    """
    has_image = (np.asarray(input_ids) == image_token_id).any(axis=1)
    if image_sizes is None:
        if has_image.any():
            raise ValueError(f"examples {np.flatnonzero(has_image).tolist()} have image tokens but no image_sizes")
        return [None] * len(has_image)
    return [tuple(int(v) for v in size) if image else None for size, image in zip(np.asarray(image_sizes), has_image)]


def read_hf_inputs(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` of HF-style inputs; ``input_ids`` is required."""
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    if "input_ids" not in arrays:
        raise KeyError(f"{path}: no 'input_ids' array (has {sorted(arrays)})")
    return arrays


def image_inputs(model, input_ids: np.ndarray, pixel_values: np.ndarray | None,
                 sizes: Sequence[Sequence[Sequence[int]]]):
    """(pixel_values ``[batch, tiles, 3, H, W]``, image_index ``[batch, seq]``) for a padded batch, or (None, None).

    Tiles are padded with zeros to ``geometry.max_tiles`` (at least), so every
    batch has the same tile count and the forward compiles once; rows beyond
    ``pixel_values``' batch (padding rows) get zero tiles.
    """
    if not any(sizes):
        return None, None
    if pixel_values is None:
        raise ValueError("image sizes given for some examples but no pixel_values")
    cfg = model.cfg
    pixel_values = np.asarray(pixel_values, np.float32)
    tiles = max(pixel_values.shape[1], cfg.geometry.max_tiles)
    padded = pad_tiles(list(pixel_values), tiles=tiles, batch=len(input_ids))
    return padded, place_images(input_ids, cfg.image_token_id, sizes, cfg.geometry, tiles)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, state, input_ids, pixel_values, image_index, attention_mask, positions):
    model = nnx.merge(graphdef, state)
    return model(input_ids, pixel_values, image_index, attention_mask, positions).astype(jnp.float32)


def forward_logits(model, input_ids: np.ndarray, *, pixel_values: np.ndarray | None = None,
                   image_sizes: Sequence | None = None, attention_mask: np.ndarray | None = None,
                   positions: np.ndarray | None = None) -> np.ndarray:
    """float32 logits ``[batch, seq, vocab]`` of one full forward (no cache).

    ``positions`` default to ``arange(seq)``, as HF's forward without
    ``position_ids``; pass ``cumsum(mask) - 1`` for left-padded rows as generate does.
    """
    input_ids = np.asarray(input_ids, np.int32)
    sizes = normalise_sizes(image_sizes, len(input_ids))
    pixel_values, image_index = image_inputs(model, input_ids, pixel_values, sizes)
    if attention_mask is None:
        attention_mask = np.ones(input_ids.shape, bool)
    if positions is None:
        positions = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int32), input_ids.shape)
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, input_ids, pixel_values, image_index,
                               np.asarray(attention_mask, bool), np.asarray(positions, np.int32)))
