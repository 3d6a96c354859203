"""Any-resolution image geometry shared by the data pipeline and the model.

LLaVA-NeXT ("anyres", "spatial_unpad") cuts an image into a base tile plus a
grid of tiles, encodes each tile into a ``grid x grid`` map of patch features,
stitches the grid tiles into one map, removes the rows/columns that only
covered padding, and appends ``image_newline`` after every row. Everything here
is plain Python/numpy, so the host can compute, per example, where every
feature vector lands in the token sequence; the device then only gathers.

Sizes follow the Hugging Face convention: ``(height, width)`` everywhere.

A model's *conventions* (:data:`CONVENTIONS`) say how its checkpoint's own code prepared its inputs, where two
codebases differ for the same weights:

- ``"transformers"`` (llava-hf checkpoints): ``image_grid_pinpoints`` read as (height, width), as transformers'
  ``select_best_resolution`` reads them; the unpadded size rounded (``int(round(x, 7))``); transparency
  composited on white; the template's BOS alone.
- ``"release"`` (the original LLaVA format, the FIRE release's models, read as MM-FIRE/FIRE's
  ``llava/mm_utils.py`` and ``llava/model/llava_arch.py`` read them): pinpoints read as (width, height), the
  first of tied pinpoints kept (``mm_utils.py`` ``select_best_resolution``), so an image that fits every
  pinpoint gets the first one, 336 wide and 672 tall for the FIRE checkpoints; the unpadded size truncated
  (``unpad_image``'s ``int()``); alpha dropped (``Image.open(...).convert('RGB')``); the tokenizer's BOS before
  the template's text (``mm_utils.py`` ``tokenizer_image_token``); each input cut at the checkpoint's
  ``tokenizer_model_max_length`` after the image features are placed (``llava_arch.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

#: LLaVA-NeXT's grid pinpoints for a 336 px tile, as (height, width).
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

#: How a model's inputs are prepared (module docstring): transformers' way, or the FIRE release's.
CONVENTIONS = ("transformers", "release")

#: Index used in ``image_index`` arrays for "this token is text".
TEXT = -1
#: Marker in :meth:`ImageGeometry.feature_index` for the image_newline vector.
NEWLINE = -2


def select_best_resolution(image_size: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The pinpoint that maximises the effective resolution, ties to least waste.

    Effective resolution = min(area of the image scaled to fit the pinpoint,
    area of the original image); scaled sizes are truncated to integers, as
    LLaVA-NeXT does.
    """
    height, width = int(image_size[0]), int(image_size[1])
    best, best_effective, best_wasted = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = ph * pw - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(ph), int(pw)), effective, wasted
    if best is None:
        raise ValueError(f"no pinpoint fits image size {image_size} (pinpoints {pinpoints})")
    return best


def grid_shape(image_size, pinpoints, tile_size: int) -> tuple[int, int]:
    """(rows, cols) of grid tiles for an image of ``image_size`` (h, w), pinpoints as (height, width)."""
    ph, pw = select_best_resolution(image_size, pinpoints)
    return ph // tile_size, pw // tile_size


def unpadded_size(image_size, rows: int, cols: int, grid: int, *, truncate: bool = False) -> tuple[int, int]:
    """Height and width of the stitched feature map once padding is removed.

    The stitched map is ``(rows*grid, cols*grid)``; the image was resized
    keeping its aspect ratio and padded symmetrically, so the side that got
    padding loses ``2 * ((current - new) // 2)`` rows or columns. The new side is
    rounded to 7 decimals first (transformers), or truncated (``truncate``: the
    original LLaVA code's ``int()``).
    """
    height, width = int(image_size[0]), int(image_size[1])
    cur_h, cur_w = rows * grid, cols * grid
    cut = int if truncate else (lambda x: int(round(x, 7)))
    if width / height > cur_w / cur_h:
        new_h = cut(height * (cur_w / width))
        return cur_h - 2 * ((cur_h - new_h) // 2), cur_w
    new_w = cut(width * (cur_h / height))
    return cur_h, cur_w - 2 * ((cur_w - new_w) // 2)


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
    """The tiling rule of one model: tile size, patch size, pinpoints, mode.

    mode "anyres": base tile + grid, unpad, image_newline after each row.
    mode "pad": the image padded to a square and resized to one tile; its
    ``grid**2`` features, followed by one image_newline if ``pad_newline``
    (LLaVA-NeXT's code does this; the plain 576-token count does not).
    ``conventions``: :data:`CONVENTIONS` (the module docstring): how the
    pinpoints are read, the unpadded size rounded and transparency dropped.
    """

    tile_size: int = 336
    patch_size: int = 14
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    mode: str = "anyres"
    pad_newline: bool = False
    conventions: str = "transformers"

    def __post_init__(self):
        if self.conventions not in CONVENTIONS:
            raise ValueError(f"conventions must be one of {CONVENTIONS}, got {self.conventions!r}")
        if self.mode not in ("anyres", "pad"):
            raise ValueError(f"image mode must be 'anyres' or 'pad', got {self.mode!r}")
        if self.tile_size % self.patch_size:
            raise ValueError(f"tile_size {self.tile_size} is not a multiple of patch_size {self.patch_size}")
        object.__setattr__(self, "pinpoints", tuple(tuple(int(v) for v in p) for p in self.pinpoints))

    @property
    def pinpoints_hw(self) -> tuple[tuple[int, int], ...]:
        """The pinpoints as (height, width), in their order: the release reads each pair as (width, height)."""
        if self.conventions == "release":
            return tuple((w, h) for h, w in self.pinpoints)
        return self.pinpoints

    @property
    def release(self) -> bool:
        """Whether inputs are prepared as the FIRE release prepares them (``conventions="release"``)."""
        return self.conventions == "release"

    @property
    def grid(self) -> int:
        """Patches per tile side (24 for CLIP-L/14 at 336 px)."""
        return self.tile_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.grid * self.grid

    @property
    def max_tiles(self) -> int:
        """Tiles of the largest pinpoint plus the base tile."""
        if self.mode == "pad":
            return 1
        return 1 + max((h // self.tile_size) * (w // self.tile_size) for h, w in self.pinpoints)

    def grid_shape(self, image_size) -> tuple[int, int]:
        if self.mode == "pad":
            return (0, 0)
        return grid_shape(image_size, self.pinpoints_hw, self.tile_size)

    def num_tiles(self, image_size) -> int:
        rows, cols = self.grid_shape(image_size)
        return 1 + rows * cols

    def num_tokens(self, image_size) -> int:
        """Number of feature vectors (= placeholder tokens) for one image."""
        if self.mode == "pad":
            return self.tokens_per_tile + int(self.pad_newline)
        h, w = self.unpadded(image_size)
        return self.tokens_per_tile + h * (w + 1)

    def unpadded(self, image_size) -> tuple[int, int]:
        """(height, width) of an image's stitched grid features once its padding is removed."""
        rows, cols = self.grid_shape(image_size)
        return unpadded_size(image_size, rows, cols, self.grid, truncate=self.release)

    def feature_index(self, image_size) -> np.ndarray:
        """Where each of this image's tokens comes from, in sequence order.

        Returns int32 ``[num_tokens]``: ``t * tokens_per_tile + p`` for patch p
        of tile t (tile 0 is the base image), or ``-2`` for image_newline.
        """
        g, n = self.grid, self.tokens_per_tile
        base = np.arange(n, dtype=np.int32)
        if self.mode == "pad":
            return np.concatenate([base, np.full(int(self.pad_newline), NEWLINE, np.int32)])
        rows, cols = self.grid_shape(image_size)
        y, x = np.meshgrid(np.arange(rows * g), np.arange(cols * g), indexing="ij")
        # Stitched map position (y, x) lives in grid tile (y//g, x//g), patch (y%g, x%g).
        stitched = (1 + (y // g) * cols + (x // g)) * n + (y % g) * g + (x % g)
        h, w = self.unpadded(image_size)
        top, left = (rows * g - h) // 2, (cols * g - w) // 2
        kept = stitched[top:top + h, left:left + w]
        with_newline = np.concatenate([kept, np.full((h, 1), NEWLINE)], axis=1)
        return np.concatenate([base, with_newline.reshape(-1).astype(np.int32)])


def place_images(
    input_ids: np.ndarray,
    image_token_id: int,
    image_sizes: Sequence[Sequence[Sequence[int]]],
    geometry: ImageGeometry,
    max_tiles: int,
) -> np.ndarray:
    """Host-side layout: where every image feature lands in the token batch.

    Args:
      input_ids: int ``[batch, seq]`` with ``num_tokens(size)`` consecutive
        ``image_token_id`` placeholders per image (the Hugging Face
        "expanded" convention).
      image_sizes: per example, the (h, w) of each of its images, in order.
      max_tiles: tiles per example on the device (images of one example are
        stored one after the other, their tiles concatenated).

    Returns:
      int32 ``[batch, seq]``: for an image token, the index into the example's
      feature bank ``[max_tiles * tokens_per_tile + 1]`` (the last entry is
      image_newline); :data:`TEXT` (-1) for a text token.
    """
    input_ids = np.asarray(input_ids)
    n = geometry.tokens_per_tile
    newline_slot = max_tiles * n
    index = np.full(input_ids.shape, TEXT, np.int32)
    for b, sizes in enumerate(image_sizes):
        positions = np.flatnonzero(input_ids[b] == image_token_id)
        parts, tile_offset = [], 0
        for size in sizes:
            src = geometry.feature_index(size)
            parts.append(np.where(src == NEWLINE, newline_slot, src + tile_offset * n))
            tile_offset += geometry.num_tiles(size)
        if tile_offset > max_tiles:
            raise ValueError(f"example {b}: its images need {tile_offset} tiles, more than max_tiles={max_tiles}")
        src = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        if len(src) != len(positions):
            raise ValueError(
                f"example {b}: {len(positions)} image placeholder tokens but its images "
                f"{[tuple(s) for s in sizes]} give {len(src)} features")
        index[b, positions] = src
    return index
