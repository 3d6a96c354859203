# LLaVA-1.5-Vicuna-7B (llava-hf llava-1.5-7b-hf, transformers' LlavaForConditionalGeneration) at its real sizes: the
# base of FIRE-LLaVA-1.5 in the FIRE paper's Table A6 (docs/model.md). Model sizes only:
# configs/fire.py:<recipe>,base=llava_15_vicuna_7b trains on it.
"""LLaVA-1.5-Vicuna-7B: CLIP ViT-L/14-336 on one padded-to-square tile (576 tokens, no image_newline), 2-layer GELU
connector, Vicuna-7B-v1.5 (Llama-2), LoRA r64 on q,k."""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(dict(
        vision=dict(image_size=336, patch_size=14, width=1024, layers=24, heads=16, mlp_dim=4096, feature_layer=-2),
        # lmsys/vicuna-7b-v1.5, 32064 rows in the llava-hf layout (<image> 32000, <pad> 32001).
        llm=dict(vocab_size=32064, dim=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp_dim=11008,
                 norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None),
        lora=dict(rank=64, alpha=256.0, dropout=0.05, targets=("q", "k"), train_layers=0),  # 0: every layer
        image_token_id=32000,
        # LLaVA-1.5 (image_aspect_ratio "pad"): each image padded to a square of the CLIP mean colour, resized to
        # one 336 tile; its 24 x 24 features replace 576 <image> tokens. The pinpoints are unused.
        image_grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)),
        image_mode="pad",
        pad_newline=False,
        architecture="llava",
        remat="full",
        scan_layers=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ))
    return config
