"""Default training / loss / mesh sub-configs (SPEC section 4), shared by the config files."""

import ml_collections

from fire_jax.train.sharding import DEFAULT_RULES


def train_config(**overrides) -> ml_collections.ConfigDict:
    """AdamW lr 2e-4, wd 0, betas (0.9, 0.999), eps 1e-8; 3% warm-up then cosine; clip 1.0; batch 64; 1 epoch."""
    config = ml_collections.ConfigDict(dict(
        lr=2e-4, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, warmup_frac=0.03, clip_norm=1.0,
        batch_size=64,  # global; must equal data.batch_size
        accum_steps=1,  # micro-batches per step (the global batch is split, gradients summed)
        epochs=1.0,
        total_steps=0,  # 0: epochs * examples / batch_size
        train_connector=False,  # True reproduces the released checkpoints (connector trained too)
        trainable=(),  # regexes over frozen-weight paths to train as well (the tiny demo: (".*",))
        loss_chunk=512,  # tokens of the flattened micro-batch per logits chunk in the loss (labelled ones only)
        checkpoint_every=500,
        keep_checkpoints=3,
        export=True,  # PEFT adapter at the end
        export_merged=False,  # and merged HF weights
    ))
    config.update(overrides)
    return config


def loss_config(**overrides) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(dict(
        normalize="token",  # mean over the global batch's labelled tokens; "turn": mean of per-turn means
        max_turns=8,  # turn indices reported separately in the metrics (higher ones pooled as "> max_turns")
        student_first_turn=False,  # also label the student's r_1 (SPEC 3: the release did; the paper, Eq. 5, not)
    ))
    config.update(overrides)
    return config


def mesh_config(shape=(-1, 1, 1)) -> ml_collections.ConfigDict:
    """(data, fsdp, tensor) sizes, -1 = the rest; rules map logical axis names to mesh axes."""
    return ml_collections.ConfigDict(dict(shape=tuple(shape), rules=tuple((k, tuple(v)) for k, v in DEFAULT_RULES)))
