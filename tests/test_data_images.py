"""Any-resolution preprocessing equals transformers' LlavaNextImageProcessorPil."""

import os

import numpy as np
import pytest
from PIL import Image

from fire_jax.data.images import CLIP_MEAN, expand_to_square, load_image, preprocess
from fire_jax.data.records import load_records
from fire_jax.core.geometry import DEFAULT_PINPOINTS, ImageGeometry

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "fire")
TINY = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)))
LLAVA_NEXT_8B = ImageGeometry(tile_size=336, patch_size=14, pinpoints=DEFAULT_PINPOINTS)
#: Real fixture images (RGB JPEG, greyscale PNG, RGBA PNG), each also resized to other aspect ratios.
FIXTURE_IMAGES = ("gqa_images_2325245.jpg", "geoqa+_images_3582.png", "chartqa_train_png_03025603003748.png")
SIZES = {"tiny": ((96, 128), (50, 128), (128, 50), (30, 60), (60, 30), (7, 5)),
         "8b": ((480, 640), (300, 1000), (1000, 300), (300, 600), (600, 300), (1121, 1500))}


def hf_processor(geometry):
    from transformers import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(size={"shortest_edge": geometry.tile_size},
                                      crop_size={"height": geometry.tile_size, "width": geometry.tile_size},
                                      image_grid_pinpoints=[list(p) for p in geometry.pinpoints])


def test_fixture_images_cover_modes():
    modes = {Image.open(os.path.join(FIXTURES, "images", name)).mode for name in FIXTURE_IMAGES}
    assert modes == {"RGB", "L", "RGBA"}


@pytest.mark.parametrize("name, geometry", [("tiny", TINY), ("8b", LLAVA_NEXT_8B)])
def test_pixel_values_equal_hf(name, geometry):
    processor = hf_processor(geometry)
    rng = np.random.default_rng(0)
    images = [Image.open(os.path.join(FIXTURES, "images", f)) for f in FIXTURE_IMAGES]
    images += [image.resize(size[::-1]) for image, size in zip(images * 2, SIZES[name])]
    images += [Image.fromarray(rng.integers(0, 256, (*size, 3), np.uint8)) for size in SIZES[name][:3]]
    translucent = rng.integers(0, 256, (*SIZES[name][1], 4), np.uint8)  # alpha varies: composited on white
    images += [Image.fromarray(translucent), Image.fromarray(translucent[..., :3]).convert("P")]
    images[-1].info["transparency"] = 0
    grids = set()
    for image in images:
        pixel_values, size = preprocess(load_image(image), geometry)
        reference = processor(image, return_tensors="np")
        assert size == (image.height, image.width) == tuple(reference["image_sizes"][0])
        assert pixel_values.shape == reference["pixel_values"][0].shape == (geometry.num_tiles(size), 3,
                                                                            geometry.tile_size, geometry.tile_size)
        assert pixel_values.dtype == np.float32
        assert np.abs(pixel_values - reference["pixel_values"][0]).max() < 1e-5
        grids.add(geometry.grid_shape(size))
    assert len(grids) >= 4


def test_padding_is_black_and_centred():
    image = Image.new("RGB", (64, 16), (255, 255, 255))  # w 64, h 16 -> pinpoint (32, 64): 16 rows of padding
    pixel_values, _ = preprocess(image, TINY)
    black = (0 - np.asarray(CLIP_MEAN)) / np.asarray([0.26862954, 0.26130258, 0.27577711])
    grid = np.concatenate([pixel_values[1], pixel_values[2]], axis=-1)  # [3, 32, 64]
    np.testing.assert_allclose(grid[:, :8], np.broadcast_to(black[:, None, None], (3, 8, 64)), rtol=1e-5)
    np.testing.assert_allclose(grid[:, 24:], np.broadcast_to(black[:, None, None], (3, 8, 64)), rtol=1e-5)
    assert (grid[:, 8:24] > 1.5).all()  # white image rows in the middle


def test_pad_mode():
    geometry = ImageGeometry(tile_size=32, patch_size=8, mode="pad")
    image = Image.new("RGB", (60, 20), (255, 0, 0))
    pixel_values, size = preprocess(image, geometry)
    assert pixel_values.shape == (1, 3, 32, 32) and size == (20, 60)
    square = expand_to_square(image)
    assert square.size == (60, 60) and square.getpixel((0, 0)) == tuple(int(255 * m) for m in CLIP_MEAN)
    assert square.getpixel((30, 30)) == (255, 0, 0)


def test_every_fixture_image_preprocesses():
    records, bad = load_records([os.path.join(FIXTURES, f) for f in ("fire_100k_demo.json", "fire_1m_demo.json")],
                                os.path.join(FIXTURES, "images"))
    assert len(records) == 188 and dict(bad) == {"missing_image": 1}
    for record in records:
        pixel_values, size = preprocess(load_image(os.path.join(FIXTURES, "images", record.image)), TINY)
        assert pixel_values.shape == (TINY.num_tiles(size), 3, 32, 32)
        assert np.isfinite(pixel_values).all()


def test_pad_tiles_lays_out_rows_of_any_tile_count():
    """The one tile layout: rows zero-padded behind their tiles, the axis fixed, rounded up, or capped."""
    from fire_jax.data.images import normalise, pad_tiles

    rng = np.random.default_rng(0)
    a, b = rng.random((3, 3, 4, 4), np.float32), rng.random((1, 3, 4, 4), np.float32)
    out = pad_tiles([a, None, b])
    assert out.shape == (3, 3, 3, 4, 4)
    np.testing.assert_array_equal(out[0], a)
    assert not out[1].any() and not out[2, 1:].any()
    np.testing.assert_array_equal(out[2, :1], b)
    assert pad_tiles([a, b], multiple=2).shape[:2] == (2, 4)
    assert pad_tiles([a], tiles=5, batch=4).shape[:2] == (4, 5)
    with pytest.raises(ValueError, match="need 3 tiles, more than generate.max_tiles=2"):
        pad_tiles([a], tiles=2, limit_name="generate.max_tiles=2")
    raw = rng.integers(0, 256, (2, 4, 4, 3)).astype(np.uint8)
    np.testing.assert_array_equal(pad_tiles([raw], tiles=3, fill=normalise)[0, :2], normalise(raw))
    assert pad_tiles([None], tiles=2, tile_size=4).shape == (1, 2, 3, 4, 4)


def test_tile_cache_tiles_an_image_once_and_drops_the_least_recently_used(tmp_path):
    """A path, the same bytes, or the same PIL image is tiled once; past max_bytes the least recently used
    entry goes; the cached tiles equal preprocess's."""
    from fire_jax.data.images import TileCache

    rng = np.random.default_rng(0)
    paths = []
    for k, (h, w) in enumerate([(20, 50), (40, 30), (30, 30)]):
        paths.append(str(tmp_path / f"{k}.png"))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)).save(paths[-1])
    cache = TileCache()
    first = cache.get(paths[0], TINY)
    assert cache.get(paths[0], TINY) is first and (cache.hits, cache.misses) == (1, 1)
    np.testing.assert_array_equal(first[0], preprocess(load_image(paths[0]), TINY)[0])
    assert first[1] == (20, 50)
    data = open(paths[1], "rb").read()
    assert cache.get(data, TINY) is cache.get(bytes(data), TINY) and cache.misses == 2
    image = load_image(paths[2])
    assert cache.get(image, TINY) is cache.get(image, TINY) and cache.misses == 3
    other = ImageGeometry(tile_size=16, patch_size=8, pinpoints=((16, 16),))
    assert cache.get(paths[0], other)[0].shape[-1] == 16 and cache.misses == 4  # per geometry
    b0, b1, b2 = (preprocess(load_image(p), TINY)[0].nbytes for p in paths)
    small = TileCache(max_bytes=b0 + max(b1, b2))
    small.get(paths[0], TINY), small.get(paths[2], TINY)
    small.get(paths[0], TINY)  # paths[0] used last: paths[2] is now the least recently used
    small.get(paths[1], TINY)
    assert [key[0][1] for key in small.entries] == [paths[0], paths[1]] and small.bytes == b0 + b1
