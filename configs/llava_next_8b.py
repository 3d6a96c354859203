# LLaVA-NeXT-8B (llama3-llava-next-8b) at its real sizes (docs/model.md).
# Model sizes only: configs/fire.py (training) and configs/eval_*.py:8b build on it, e.g.
#   python -m fire_jax.train --config configs/fire_student.py --workdir DIR
"""LLaVA-NeXT-8B: CLIP ViT-L/14-336, 2-layer GELU connector, Llama-3-8B, LoRA r64 on q,k."""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(dict(
        vision=dict(image_size=336, patch_size=14, width=1024, layers=24, heads=16, mlp_dim=4096, feature_layer=-2),
        # 128256 Llama-3 tokens + <image> (128256) + <pad>, padded to a multiple of 64 as the
        # llava-hf checkpoint stores its embedding and lm_head.
        llm=dict(vocab_size=128320, dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp_dim=14336,
                 rope_theta=500000.0, rope_scaling=None),
        lora=dict(rank=64, alpha=256.0, dropout=0.05, targets=("q", "k"), train_layers=0),  # 0: every layer
        image_token_id=128256,
        image_grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)),
        image_mode="anyres",
        pad_newline=False,
        remat="full",
        scan_layers=True,  # training runs the 32 layers as one lax.scan: XLA keeps one layer's memory live
        dtype="bfloat16",
        param_dtype="bfloat16",
    ))
    return config
