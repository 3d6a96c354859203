"""An engine's shape: EngineConfig from config sections, the one sizing rule, and the Buckets every prefill and
decode chunk is padded to."""

import ml_collections
import pytest

from fire_jax.infer.buckets import Buckets
from fire_jax.infer.engine_config import MIN_CACHE_LEN, EngineConfig


def test_from_config_reads_the_engine_fields_of_a_section():
    section = ml_collections.ConfigDict(dict(max_new_tokens=16, temperature=0.5, batch_size=8, bucket_min=32,
                                             bucket_step=256, max_tiles=5, chunk=None))
    assert EngineConfig.from_config(section) == EngineConfig(bucket_min=32, bucket_step=256)
    assert EngineConfig.from_config(section, slots=4).slots == 4
    assert EngineConfig(stop_ids=[7, 3]).stop_ids == (7, 3)
    with pytest.raises(ValueError, match="engine chunk must be >= 1"):
        EngineConfig(chunk=0)


def test_prompt_buckets_fine_and_stepped():
    fine, stepped = Buckets(64), Buckets(64, 1024)
    assert [fine.prompt(n) for n in (1, 64, 65, 400, 512, 513, 1025, 3000)] == [64, 64, 128, 448, 512, 640, 1280,
                                                                                3072]
    assert [stepped.prompt(n) for n in (1, 64, 65, 1000, 1025, 3000)] == [64, 64, 128, 1024, 2048, 3072]
    assert stepped.prompt(600, room=1024) == 1024 and stepped.prompt(600, room=700) == 640  # past room: x64
    assert Buckets(16, 64).rest(20) == 32  # a prompt's rest after its cached prefix: the same rule


def test_windows_of_a_prefix_extension_and_of_a_decode_chunk():
    buckets = Buckets(64, None, cache_len=576)
    assert [buckets.window(n) for n in (1, 64, 65, 300, 600)] == [64, 64, 128, 512, 576]
    # A decode chunk's window is copied out and back (4 column passes): it pays when steps * (576 - w) > 4 * w.
    assert buckets.decode_window(100, steps=16) == 128 and buckets.decode_window(100, steps=1) == 576
    assert buckets.decode_window(500, steps=16) == 576
    assert buckets.decode_windows() == [64, 128, 256, 512, 576]


def test_one_sizing_rule_for_a_set_of_prompts():
    """generate and a server: the longest prompt's bucket + max_tokens exactly; a backend whose calls grow
    (doubling): the power of two from MIN_CACHE_LEN that holds it; slots one per prompt, at least ``slots``."""
    batch = EngineConfig(bucket_min=64, bucket_step=1024)
    sized = batch.sized_for([5, 70, 130], 12)
    assert (sized.slots, sized.cache_len, sized.max_images) == (3, 256 + 12, 4)
    assert batch.sized_for([5], 12, slots=8, images=6).slots == 8 and batch.sized_for([5], 12, images=6).max_images == 6
    assert MIN_CACHE_LEN == 256
    assert [batch.sized_for([n], 40, doubling=True).cache_len for n in (5, 200, 300, 1000, 1100)] == [
        256, 512, 1024, 2048, 4096]
    server = EngineConfig(bucket_step=None)  # fire_jax.serving.server.default_cache_len: 4 images and 3,427 text tokens
    assert server.sized_for([4 * 576 + 3427], 256).cache_len == 6144 + 256
    assert sized.bucket_step == 1024 and sized.chunk == batch.chunk  # the rest of the shape is kept


def test_the_kv_cache_is_laid_out_by_logical_axes():
    """An engine's cache rows (slots) go over the mesh's data axis and its KV heads over tensor where that divides
    them, by the rules the models' parameters use (fire_jax.core.config.DEFAULT_RULES)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from fire_jax.core.config import DEFAULT_RULES
    from fire_jax.infer.kernels import CACHE_AXES
    from fire_jax.models.partitioning import logical_to_spec

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 1, 2), ("data", "fsdp", "tensor"))
    spec = lambda name, shape: logical_to_spec(CACHE_AXES[name], shape, DEFAULT_RULES, mesh)
    assert spec("k", (8, 4, 16, 256)) == P("data", "tensor", None, None)
    assert spec("v", (8, 3, 256, 16)) == P("data", None, None, None)  # 3 KV heads: not split over 2
    assert spec("mask", (8, 256)) == P("data", None) and spec("hidden", (8, 64)) == P("data", None)
