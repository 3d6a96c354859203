# A tiny LLaVA-NeXT (CLIP 32 px tiles, 2-layer Llama) for CPU tests and the demo.
#   python -m fire_jax.train --config configs/tiny.py --workdir /tmp/fire_tiny
"""Tiny model: same architecture as LLaVA-NeXT-8B, sizes small enough for seconds on CPU."""

import ml_collections

from fire_jax.core.config import loss_config, mesh_config, train_config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    # hf_checkpoint: a llava-hf or original LLaVA folder ("" = random weights); adapter: a LoRA folder of the
    # original format merged into it (the FIRE release's teacher)
    config.init = ml_collections.ConfigDict(dict(hf_checkpoint="", adapter=""))
    config.model = dict(
        vision=dict(image_size=32, patch_size=8, width=64, layers=3, heads=4, mlp_dim=128, feature_layer=-2),
        llm=dict(vocab_size=512, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=128,
                 rope_theta=500000.0, rope_scaling=None),
        lora=dict(rank=8, alpha=32.0, dropout=0.05, targets=("q", "k"), train_layers=0),
        image_token_id=511,
        image_grid_pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)),
        image_mode="anyres",
        pad_newline=False,
        remat="none",
        scan_layers=False,
        dtype="float32",
        param_dtype="float32",
    )
    config.model = ml_collections.ConfigDict(config.model)
    # Input pipeline (fire_jax.data.pipeline.InputPipeline): the shipped synthetic FIRE set.
    config.data = ml_collections.ConfigDict(dict(
        tokenizer="assets:tiny_tokenizer.json",  # a tokenizer.json; "assets:" = fire_jax/assets
        image_token="<image>",  # its id must equal model.image_token_id
        pad_token="<pad>",
        template="",  # a shipped chat template's name or a .jinja file; "" = the tokenizer's, else llama3
        role="student",  # or "teacher"
        teacher_history="full",  # or "latest"
        sources=dict(synthetic=dict(json="assets:synthetic_fire/train.json",
                                    image_root="assets:synthetic_fire/images", weight=1.0)),
        eval_sources=dict(synthetic=dict(json="assets:synthetic_fire/test.json",
                                         image_root="assets:synthetic_fire/images", weight=1.0)),
        on_bad_record="skip",  # or "error"
        max_len=768,  # tokens, image features included (teacher sequences: ~520-640)
        buckets=(256, 384, 512, 640, 768),
        batch_size=8,  # global; each process gets batch_size // process_count
        shuffle=True,
        seed=0,
        num_epochs=0,  # 0: repeat forever
        num_threads=0,  # grain read threads (0: in the calling thread)
        num_workers=0,  # grain worker processes (0: none)
    ))
    config.train = train_config(lr=3e-3, batch_size=8, total_steps=60, warmup_frac=0.1, loss_chunk=128,
                                checkpoint_every=20)
    config.loss = loss_config(max_turns=4)
    config.mesh = mesh_config((-1, 1, 1))
    return config
