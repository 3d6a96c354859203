# CLIP (Radford et al. 2021) on the synthetic set's image-caption pairs: the vision tower the main job's LLaVA
# starts from, trained contrastively with a small text tower.
#   python -m fire_jax.train --config configs/clip.py --workdir /tmp/clip          # the SmolLM2 LLaVA's tower
#   python -m fire_jax.train --config configs/clip.py:tiny --workdir /tmp/clip_tiny  # configs/tiny.py's tower
"""CLIP training config (``model.kind="clip"``): fire_jax.models.clip.CLIPModel and the contrastive loss.

The vision tower has the shape of the LLaVA that will use it (arg "" : configs/smollm2_llava.py's, "tiny":
configs/tiny.py's), so ``init.vision_tower=<workdir>/export/clip`` in that LLaVA's config loads it. The text tower is
small (2 layers of 128) on the tiny BPE tokenizer of the synthetic set, its end token ``<|end_of_text|>`` (id 1).
Data: ``captions.json`` of the synthetic set, one caption per training image (fire_jax.data.synthetic.caption_records;
the test images have none). ``init.clip_checkpoint``: a HF CLIPModel folder to start from instead (e.g.
openai/clip-vit-large-patch14-336 with a matching ``model``).
"""

import ml_collections

from fire_jax.core.config import InputError, load_config, loss_config, mesh_config, train_config

TEXT = dict(vocab_size=512, max_positions=64, width=128, layers=2, heads=4, mlp_dim=512, eos_token_id=1)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in ("", "tiny"):
        raise InputError(f"configs/clip.py: arg must be '' or 'tiny', got {arg!r}")
    vision = load_config("configs/tiny.py" if arg else "configs/smollm2_llava.py").model.vision.to_dict()
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.init = ml_collections.ConfigDict(dict(clip_checkpoint=""))
    config.model = ml_collections.ConfigDict(dict(kind="clip", vision=vision, text=TEXT, projection_dim=64,
                                                  logit_scale_init=2.6592, dtype="float32", param_dtype="float32"))
    config.data = ml_collections.ConfigDict(dict(
        tokenizer="assets:tiny_tokenizer.json",
        sources=dict(captions=dict(json="assets:synthetic_fire/captions.json",
                                   image_root="assets:synthetic_fire/images")),
        max_len=TEXT["max_positions"], batch_size=64, seed=0, num_epochs=0))
    config.train = train_config(lr=1e-3, weight_decay=0.1, batch_size=64, total_steps=400, warmup_frac=0.05,
                                checkpoint_every=400, trainable=(".*",))
    config.loss = loss_config()
    config.mesh = mesh_config((1, 1, 1))
    return config
