"""The main job on the built-in tiny default.

    python -m fire_jax.run [--config configs/tiny.py]

Today: builds the configured LLaVA-NeXT (random weights), draws an image,
lays out its any-resolution tokens, runs a forward pass and a short greedy
generation with the KV cache, and prints what it did.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.geometry import place_images
from fire_jax.models import KVCache, LlavaNext, LlavaNextConfig, LoRAParam, count_params


def load_config(path: str):
    """``get_config(arg)`` of a config file; ``path`` may end in ``:arg``."""
    path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("fire_jax_config", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="config file (default: the built-in tiny config)")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if args.config is None:
        import os

        args.config = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
    config = load_config(args.config)
    cfg = LlavaNextConfig.from_dict(config.model)
    model = LlavaNext(cfg, rngs=nnx.Rngs(config.seed))
    print(f"model: LLaVA-NeXT, {count_params(model):,} frozen + {count_params(model, LoRAParam):,} LoRA params "
          f"({cfg.lora.targets if cfg.lora else 'no'} LoRA), image mode {cfg.image_mode}")

    geometry = cfg.geometry
    image_size = (int(geometry.tile_size * 1.2), int(geometry.tile_size * 2.1))  # a wide image
    rng = np.random.default_rng(config.seed)
    tiles = geometry.num_tiles(image_size)
    pixel_values = np.zeros((1, geometry.max_tiles, 3, geometry.tile_size, geometry.tile_size), np.float32)
    pixel_values[0, :tiles] = rng.standard_normal((tiles, 3, geometry.tile_size, geometry.tile_size))
    n_image = geometry.num_tokens(image_size)
    prompt = np.concatenate([[1, 2], np.full(n_image, cfg.image_token_id), rng.integers(3, 100, 6)])[None]
    image_index = place_images(prompt, cfg.image_token_id, [[image_size]], geometry, geometry.max_tiles)
    rows, cols = geometry.grid_shape(image_size)
    print(f"image {image_size[0]}x{image_size[1]}: {tiles} tiles (base + {rows}x{cols} grid), "
          f"{n_image} image tokens in a {prompt.shape[1]}-token prompt")

    start = time.perf_counter()
    cache = KVCache.init(cfg.llm, 1, prompt.shape[1] + args.new_tokens, jnp.dtype(cfg.dtype))
    logits, cache = model(jnp.asarray(prompt), jnp.asarray(pixel_values), jnp.asarray(image_index), cache=cache)
    generated = []
    token = jnp.argmax(logits[:, -1], axis=-1)
    for _ in range(args.new_tokens):
        generated.append(int(token[0]))
        logits, cache = model(token[:, None], cache=cache)
        token = jnp.argmax(logits[:, -1], axis=-1)
    elapsed = time.perf_counter() - start
    print(f"forward + {args.new_tokens} greedy tokens with the KV cache in {elapsed:.2f}s "
          f"on {jax.devices()[0].platform}: {generated}")
    return {"image_tokens": n_image, "generated": generated}


if __name__ == "__main__":
    main()
