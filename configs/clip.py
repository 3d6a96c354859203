# CLIP (Radford et al. 2021) on the synthetic set's image-caption pairs: the vision tower the main job's LLaVA
# starts from, trained contrastively with a small text tower.
#   python -m fire_jax.train --config configs/clip.py --workdir /tmp/clip          # the SmolLM2 LLaVA's tower
#   python -m fire_jax.train --config configs/clip.py:tiny --workdir /tmp/clip_tiny  # configs/tiny.py's tower
#   python -m fire_jax.train --config configs/clip.py:see --workdir /tmp/vision   # the seeing lineage's vision stage
"""CLIP training config (``model.kind="clip"``): fire_jax.models.clip.CLIPModel and the contrastive loss.

The vision tower has the shape of the LLaVA that will use it (arg "" : configs/smollm2_llava.py's, "tiny":
configs/tiny.py's, "see": configs/smollm2_llava.py:see's), so ``init.vision_tower=<workdir>/export/clip`` in that LLaVA's config loads it. The text tower is
small (2 layers of 128) on the tiny BPE tokenizer of the synthetic set, its end token ``<|end_of_text|>`` (id 1).
Data: ``captions.json`` of the synthetic set, one caption per training image (fire_jax.data.synthetic.caption_records;
the test images have none). With "see" ("tiny,see" for the tiny tower) it is a vision stage, trained on these
targets instead of the contrastive loss (``loss.contrastive_weight`` 0: beside it they learn less):

- auxiliary heads read the facts each caption states (``FACT_CLASSES``: every (colour, shape)'s count, the
  tallest bar) on *every* patch of the whole-image tile, at the layer LLaVA reads (``fact_pooling="token"``):
  each token the LLM gets of that tile must carry the image's facts, as a global colour is carried;
- dense heads (``DENSE_CLASSES``) read, two layers lower, what each patch itself holds: the shapes centred in it,
  the bar top in it (``data.layout``: the generator's record of what it drew where, as detection data gives a
  box per object), so that the layers between only have to gather facts the patches already hold;
- 25,600 fresh drawings join the 720 captions (a regression on the facts learns 720 images by heart).

``init.clip_checkpoint``: a HF CLIPModel folder to start from instead (e.g. openai/clip-vit-large-patch14-336 with a
matching ``model``).
"""

import ml_collections

from fire_jax.core.config import InputError, load_config, loss_config, mesh_config, train_config

#: The auxiliary heads (``fire_jax.data.synthetic.FACT_HEADS``, whose classes these are): how many of each of the
#: 18 (colour, shape) pairs (0..7), then which of the five bars is the tallest. A contrastive batch of 64 captions
#: is told apart by the colours drawn alone (in-batch accuracy 0.57, what a colour-only encoder reaches), so the
#: counts and the bar heights are never needed; these heads need them, on the features LLaVA reads.
FACT_CLASSES = (8,) * 18 + (5,)
#: The tallest bar weighs as four counts: a bars image has one fact, a shapes image eighteen.
FACT_HEAD_WEIGHTS = (1.0,) * 18 + (4.0,)
#: The dense heads (``fire_jax.data.synthetic.DENSE_HEADS``), on each patch of the whole-image tile at hidden state
#: DENSE_LAYER: the shapes of each (colour, shape) centred in it (0..3), which bar's top is in it, the tallest's.
DENSE_CLASSES = (4,) * 18 + (6, 2)
DENSE_LAYER = 2
GENERATED = 25600
TEXT = dict(vocab_size=512, max_positions=64, width=128, layers=2, heads=4, mlp_dim=512, eos_token_id=1)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    size, _, option = arg.partition(",")
    if size not in ("", "tiny", "see") or option not in ("", "see") or (size == "see" and option):
        raise InputError(f"configs/clip.py: arg must be '', 'tiny', 'see' or 'tiny,see', got {arg!r}")
    see = "see" in (size, option)
    llava = load_config("configs/tiny.py" if size == "tiny" else
                        "configs/smollm2_llava.py" + (":see" if see else "")).model
    vision = llava.vision.to_dict()
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.init = ml_collections.ConfigDict(dict(clip_checkpoint=""))
    config.model = ml_collections.ConfigDict(dict(kind="clip", vision=vision, text=TEXT, projection_dim=64,
                                                  logit_scale_init=2.6592, fact_classes=FACT_CLASSES if see else (),
                                                  fact_pooling="token" if see else "tile",
                                                  dense_classes=DENSE_CLASSES if see else (),
                                                  dense_layer=DENSE_LAYER if see else 0,
                                                  dtype="float32", param_dtype="float32"))
    sources = dict(captions=dict(json="assets:synthetic_fire/captions.json", image_root="assets:synthetic_fire/images"))
    if see:
        # Fresh drawings with their captions: on the 720 training images alone the heads are learned by heart
        # (every fact of every training image, the counts at chance on test images).
        sources["generated"] = dict(generate=0 if size == "tiny" else GENERATED, seed=1)
    config.data = ml_collections.ConfigDict(dict(
        tokenizer="assets:tiny_tokenizer.json", sources=sources,
        max_len=TEXT["max_positions"], batch_size=64, seed=0, num_epochs=0,
        # "see": the tiles and features the LLaVA reads, and the facts each caption states, for the heads.
        views="anyres" if see else "tile", image_grid_pinpoints=llava.image_grid_pinpoints, facts=see, layout=see))
    # "see" on the SmolLM2 LLaVA's tower: the counts and the tallest bar take longer than the colours to come
    steps = 1500 if size == "see" else 400
    config.train = train_config(lr=1e-3, weight_decay=0.1, batch_size=64, total_steps=steps, warmup_frac=0.05,
                                checkpoint_every=steps, trainable=(".*",))
    # "see": the auxiliary heads' and the dense heads' cross-entropies alone. Beside the contrastive loss (weight 1)
    # they learn less in the same 1,500 steps: the tallest-bar head's batch accuracy 0.53 against 0.95 without it,
    # the non-zero counts 0.12 against 0.27 (docs/main_job.md, "The seeing lineage").
    config.loss = loss_config(contrastive_weight=0.0 if see else 1.0, fact_weight=1.0,
                              fact_head_weights=FACT_HEAD_WEIGHTS if see else (), dense_weight=1.0)
    config.mesh = mesh_config((1, 1, 1))
    return config
