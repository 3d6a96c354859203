"""Any-resolution image preprocessing (LLaVA-NeXT), PIL + numpy only (docs/data.md, "Images").

Matches transformers' ``LlavaNextImageProcessorPil`` bit for bit: RGB
conversion (alpha composited on white), best pinpoint, aspect-preserving
bicubic resize (sizes rounded up, as HF does), centred black padding (the
extra pixel of an odd margin goes to the bottom/right), row-major tiles, the
whole image resized to a *square* tile as tile 0 (HF does not keep its aspect
ratio), then rescale 1/255 in float64 -> float32 and CLIP normalisation in
float32. Tile layout comes from :class:`fire_jax.core.geometry.ImageGeometry`.
"""

from __future__ import annotations

import collections
import hashlib
import io
import math
import threading

import numpy as np
from PIL import Image

from fire_jax.core.geometry import ImageGeometry, select_best_resolution

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _normalisation_table() -> np.ndarray:
    """float32 [3, 256]: the normalised value of every uint8 level, per channel.

    Computed exactly as HF does it ((x * 1/255 in float64) -> float32, then
    (x - mean) / std in float32), so a table lookup equals HF's arithmetic.
    """
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(CLIP_MEAN, np.float32), np.asarray(CLIP_STD, np.float32)
    return ((levels[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)


_TABLE = _normalisation_table()


#: What becomes of an image's transparency: composited on white (transformers' image processors), dropped
#: (the FIRE release opens every image with ``Image.open(...).convert('RGB')``: a transparent pixel keeps its
#: colour), or kept (an RGBA image, made RGB when it is tiled, by its model's conventions: :func:`tiles`).
ALPHA = ("white", "drop", "keep")


def load_image(source: str | bytes | Image.Image, *, alpha: str = "white") -> Image.Image:
    """A PIL image from a path, encoded bytes or a PIL image: RGB, its transparency handled as ``alpha`` says
    (:data:`ALPHA`; ``"keep"`` gives RGBA for an image with transparency)."""
    if alpha not in ALPHA:
        raise ValueError(f"alpha must be one of {ALPHA}, got {alpha!r}")
    image = source if isinstance(source, Image.Image) else Image.open(
        io.BytesIO(source) if isinstance(source, bytes) else source)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        if alpha == "keep":
            return image
        if alpha == "white":
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, image)
    return image.convert("RGB")


def normalise(tiles: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [tiles, H, W, 3] -> float32 [tiles, 3, H, W] with CLIP normalisation (into ``out`` if given)."""
    if out is None:
        out = np.empty((len(tiles), 3, *tiles.shape[1:3]), np.float32)
    for c in range(3):
        out[:, c] = _TABLE[c][tiles[..., c]]
    return out


def resized_size(image_size, target) -> tuple[int, int]:
    """(h, w) of an image of ``image_size`` resized to fit ``target`` keeping its aspect ratio (HF rounding)."""
    height, width = image_size
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def _resize(image: Image.Image, size) -> np.ndarray:
    """uint8 [h, w, 3], bicubic; PIL returns an unchanged copy when the size already matches."""
    return np.asarray(image.resize((size[1], size[0]), resample=Image.Resampling.BICUBIC))


def tiles(image: Image.Image, geometry: ImageGeometry) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 tiles of one image, before normalisation.

    Args:
      image: a PIL image (see :func:`load_image`); one with transparency is made RGB as the model's
        conventions say (``geometry.conventions``: composited on white, or its alpha dropped as the release does).
      geometry: the model's tiling rule.

    Returns:
      uint8 ``[geometry.num_tiles(size), tile, tile, 3]`` (tile 0 is the whole
      image) and the original ``(height, width)``.
    """
    if image.mode != "RGB":
        image = load_image(image, alpha="drop" if geometry.release else "white")
    size = (image.height, image.width)
    t = geometry.tile_size
    if geometry.mode == "pad":
        return _resize(expand_to_square(image), (t, t))[None], size
    target = select_best_resolution(size, geometry.pinpoints_hw)
    new_h, new_w = resized_size(size, target)
    resized = _resize(image, (new_h, new_w))
    top, left = (target[0] - new_h) // 2, (target[1] - new_w) // 2
    canvas = np.zeros((*target, 3), np.uint8)  # [H, W, 3] black padding
    canvas[top:top + new_h, left:left + new_w] = resized
    rows, cols = target[0] // t, target[1] // t
    grid = canvas.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, t, t, 3)
    result = np.concatenate([_resize(image, (t, t))[None], grid])  # [1 + rows*cols, t, t, 3]
    assert len(result) == geometry.num_tiles(size)
    return result, size


def preprocess(image: Image.Image, geometry: ImageGeometry) -> tuple[np.ndarray, tuple[int, int]]:
    """pixel_values float32 ``[num_tiles, 3, tile, tile]`` (HF layout) and ``(height, width)`` of one image."""
    uint8_tiles, size = tiles(image, geometry)
    return normalise(uint8_tiles), size


class TileCache:
    """Images decoded and tiled once: ``(tiles, (height, width))`` by image and geometry, least recently used
    dropped past ``max_bytes`` of tiles. A dialogue's student and teacher see its image at every turn; with
    one cache they decode and tile it once. An image is known by its path, the digest of its bytes, or (a PIL
    image) its identity, the image kept alive while cached so the identity is not reused (a file changed on
    disk while its path is cached is not read again). Thread-safe."""

    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(value, kept) -> int:
        return value[0].nbytes + (kept.width * kept.height * len(kept.getbands()) if kept is not None else 0)

    @staticmethod
    def key(image) -> tuple:
        if isinstance(image, str):
            return ("path", image)
        if isinstance(image, bytes):
            return ("bytes", hashlib.sha1(image).hexdigest())
        return ("object", id(image))

    def get(self, image: str | bytes | Image.Image, geometry: ImageGeometry) -> tuple[np.ndarray, tuple[int, int]]:
        key = (self.key(image), geometry)
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
                return self.entries[key][0]
        value = preprocess(load_image(image, alpha="keep"), geometry)  # transparency: by the model's conventions
        with self._lock:
            self.misses += 1
            if key not in self.entries:
                kept = image if key[0][0] == "object" else None  # a PIL image kept alive counts too
                self.entries[key] = (value, kept)
                self.bytes += self._size(value, kept)
            while self.bytes > self.max_bytes and len(self.entries) > 1:
                _, (evicted, kept) = self.entries.popitem(last=False)
                self.bytes -= self._size(evicted, kept)
        return value


def pad_tiles(rows, *, tiles: int = 0, multiple: int = 1, batch: int = 0, tile_size: int | None = None,
              fill=None, limit_name: str | None = None) -> np.ndarray:
    """Each row's tiles in one zero-padded float32 array ``[batch, tiles, 3, T, T]``: the one place a batch's
    tiles are laid out (training batches, generation, the forward pass, VLRMBench's multi-image prompts).

    rows: per row its tiles (float32 ``[n, 3, T, T]``, or uint8 ``[n, T, T, 3]`` with ``fill=normalise``), or
    None for a row without an image. The tile axis is ``tiles`` when > 0 (a row with more raises), else the
    longest row rounded up to a multiple of ``multiple`` (so a run compiles few shapes). ``batch`` > len(rows)
    adds zero rows (padding rows). ``fill(row_tiles, out=view)`` writes a row in place (default: a copy).
    ``limit_name`` names ``tiles`` in the error ("generate.max_tiles=5").
    """
    present = [r for r in rows if r is not None and len(r)]
    needed = max((len(r) for r in present), default=0)
    axis = tiles or max(-(-needed // multiple) * multiple, 1)
    if needed > axis:
        raise ValueError(f"a sample's images need {needed} tiles, more than {limit_name or f'the {axis} allowed'}")
    if tile_size is None:
        if not present:
            raise ValueError("pad_tiles: no row has tiles; pass tile_size")
        tile_size = present[0].shape[2] if fill is None else present[0].shape[1]
    out = np.zeros((max(batch, len(rows)), axis, 3, tile_size, tile_size), np.float32)
    for b, row in enumerate(rows):
        if row is not None and len(row):
            if fill is None:
                out[b, :len(row)] = row
            else:
                fill(row, out=out[b, :len(row)])
    return out


def expand_to_square(image: Image.Image) -> Image.Image:
    """LLaVA's "pad" mode: centre the image on a square of the CLIP mean colour."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    background = tuple(int(255 * m) for m in CLIP_MEAN)
    square = Image.new("RGB", (side, side), background)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square
