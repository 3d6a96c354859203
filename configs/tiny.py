# A tiny LLaVA-NeXT (CLIP 32 px tiles, 2-layer Llama) for CPU tests and the demo.
#   python -m fire_jax.run --config configs/tiny.py
"""Tiny model: same architecture as LLaVA-NeXT-8B, sizes small enough for seconds on CPU."""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = dict(
        vision=dict(image_size=32, patch_size=8, width=64, layers=3, heads=4, mlp_dim=128, feature_layer=-2),
        llm=dict(vocab_size=512, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=128,
                 rope_theta=500000.0, rope_scaling=None),
        lora=dict(rank=8, alpha=32.0, dropout=0.05, targets=("q", "k")),
        image_token_id=511,
        image_grid_pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)),
        image_mode="anyres",
        pad_newline=False,
        remat="none",
        dtype="float32",
        param_dtype="float32",
    )
    config.model = ml_collections.ConfigDict(config.model)
    return config
