# A small LLaVA-NeXT on a real pretrained LLM, for laptop CPUs: SmolLM2-135M-Instruct (fetched once from PyPI)
# under a small CLIP-style tower trained from scratch, on the shipped synthetic FIRE set.
#   python -m fire_jax.train --config configs/smollm2_llava.py --workdir /tmp/smollm2_llava
"""LLaVA-NeXT with SmolLM2-135M-Instruct as the LLM (the main job's model; ``configs/main_job.py``).

- LLM: SmolLM2-135M-Instruct from its GGUF file (``init.gguf``, a name of ``fire_jax.convert.fetch.MODELS``
  or a .gguf path): Llama architecture, 30 layers, dim 576, 9 / 3 heads, RoPE base 100000, tied embeddings.
  The vocabulary gets one row more for ``<image>`` (id 49152), as llava-hf appends it; the tie is kept.
- Chat template: the file's own (ChatML), through ``tokenizer_config.json`` beside the tokenizer.
- Vision: a CLIP-style ViT (pre-LN, quick_gelu) on 32 px tiles of 8 px patches, 16 tokens a tile, trained from
  scratch: no pretrained CLIP is reachable here, and the synthetic images are a few dozen pixels wide.
- anyres over 32 x 64 / 64 x 32 canvases (a base tile + a 1 x 2 or 2 x 1 grid, unpadded, image_newline), the
  2-layer GELU connector.
- LoRA rank 32 on the attention projections q, k, v, o, no dropout. The paper's q, k only (Sec. 5.1) is
  ``--config.model.lora.targets="('q','k')"``; v and o let the few hundred examples a CPU budget allows move
  what the model writes, not only where it attends, for 15% more step time than q, k alone.
"""

import ml_collections

from fire_jax.core.config import InputError, loss_config, mesh_config, train_config

MODEL = "smollm2-135m-instruct"
TOKENIZER = f"cache:{MODEL}/tokenizer/tokenizer.json"  # written by fire_jax.convert.fetch.prepare on first use
SMOLLM2_135M = dict(vocab_size=49153, dim=576, layers=30, heads=9, kv_heads=3, head_dim=64, mlp_dim=1536,
                    norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True)


#: arg "see": the tower of the main job's seeing lineage (``configs/main_job.py:smollm2,see``): 64 px tiles of 16 px
#: patches, the same 16 tokens a tile (every synthetic image fits its grid at its own size or larger, where a 64 x 64
#: image was read at 32 x 32, its count shapes 5 px wide), 5 layers, the fourth read: the vision stage's dense heads
#: read the second (what each patch holds), its fact heads the fourth (the image's facts, on every token).
SEEING_VISION = dict(image_size=64, patch_size=16, width=128, layers=5, heads=4, mlp_dim=512, feature_layer=-2)
SEEING_PINPOINTS = ((64, 128), (128, 64))


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in ("", "see"):
        raise InputError(f"configs/smollm2_llava.py: arg must be '' or 'see', got {arg!r}")
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.init = ml_collections.ConfigDict(dict(gguf=MODEL, hf_checkpoint=""))
    config.model = ml_collections.ConfigDict(dict(
        vision=dict(image_size=32, patch_size=8, width=128, layers=2, heads=4, mlp_dim=512, feature_layer=-2),
        llm=SMOLLM2_135M,
        lora=dict(rank=32, alpha=64.0, dropout=0.0, targets=("q", "k", "v", "o"), train_layers=0),
        image_token_id=49152,
        image_grid_pinpoints=((32, 64), (64, 32)),
        image_mode="anyres",
        pad_newline=False,
        remat="none",
        scan_layers=True,
        dtype="float32",
        param_dtype="float32",
    ))
    config.data = ml_collections.ConfigDict(dict(
        tokenizer=TOKENIZER, image_token="<image>", pad_token="<pad>",  # no <pad>: pads with EOS (masked)
        role="student", teacher_history="full",
        sources=dict(synthetic=dict(json="assets:synthetic_fire/train.json",
                                    image_root="assets:synthetic_fire/images", weight=1.0)),
        eval_sources=dict(synthetic=dict(json="assets:synthetic_fire/test.json",
                                         image_root="assets:synthetic_fire/images", weight=1.0)),
        on_bad_record="skip", max_len=512, buckets=(128, 192, 256, 320, 384, 512), batch_size=8, shuffle=True,
        seed=0, num_epochs=0, num_threads=0, num_workers=0,
    ))
    config.train = train_config(lr=1e-3, batch_size=8, total_steps=40, warmup_frac=0.1, loss_chunk=128,
                                checkpoint_every=20)
    config.loss = loss_config(max_turns=4)
    config.mesh = mesh_config((-1, 1, 1))
    if arg == "see":
        config.model.vision = ml_collections.ConfigDict(SEEING_VISION)
        config.model.image_grid_pinpoints = SEEING_PINPOINTS
    return config
