# The student's reinforcement stage after FIRE-LLaVA: rollouts of sampled free dialogues, rewards from FD-LLaVA's
# scores, GRPO with a KL term to FIRE-LLaVA itself (its adapter folded in, a fresh one trained):
#   python -m fire_jax.train --config configs/fire_rl.py --workdir /runs/fire_rl_8b \
#     --config.student.adapter=/runs/fire_student --config.teacher.adapter=/runs/fire_teacher
#   python -m fire_jax.train --config configs/fire_rl.py:8b,teacher=api --workdir /runs/fire_rl_8b \
#     --config.student.adapter=/runs/fire_student --config.teacher.init='api:http://judge:8000/v1#judge'
#   python -m fire_jax.train --config configs/fire_rl.py:tiny --workdir /tmp/fire_rl_tiny   # random tiny student,
#                                                       the synthetic set's exact teacher: a smoke run in a minute
"""The reinforcement stage (docs/training.md, "Reinforcement from the teacher's scores"): FIRE-Bench's free-dialogue
settings (configs/eval_free.py: model, data, decoding, the stop rule, the student and teacher sections) with the
training items, the trainer's ``train`` (``objective="rl"``) and ``mesh``, and the ``rl`` section.

arg "8b" (default): LLaVA-NeXT-8B, FIRE-LLaVA's workdir as ``student.adapter`` and FD-LLaVA's as ``teacher.adapter``
(or any ``api:`` judge as ``teacher.init``), items from FIRE-100K's training split, the 8B recipes' mesh (FSDP over
all devices). "tiny": configs/tiny.py's random model, the exact teacher, the synthetic training set (the tests').
"""

import os

import ml_collections

from fire_jax.core.config import InputError, load_config, mesh_config, train_config

CONFIGS = os.path.dirname(os.path.abspath(__file__))


def rl_section(**overrides) -> ml_collections.ConfigDict:
    """The ``rl`` section: what a rollout draws and how its rewards become the update (fire_jax.train.policy)."""
    rl = ml_collections.ConfigDict(dict(
        items_per_step=8,  # items a rollout; train.batch_size = items_per_step * group_size (a row a dialogue)
        group_size=4,  # dialogues per item, the group advantages are relative to
        iterations=50,  # rollouts; the stage's optimizer steps are iterations * updates
        updates=1,  # optimizer steps on each rollout (> 1: the ratio moves off 1 and the clip acts)
        temperature=1.0, top_p=1.0,  # the student's sampling (the teacher's: config.decode, greedy)
        reward=dict(score=1.0, improvement=0.0),  # r_k = score * a_k/10 + improvement * (a_k - a_{k-1})/10
        gamma=0.5,  # a turn's return: the rewards from it on, the j-th later one times gamma^j
        advantage="grpo",  # or "rloo"
        normalize="token",  # or "sequence" (GRPO's 1/|o_i| per dialogue)
        clip=0.2,  # epsilon of the clipped ratio
        kl_coef=0.04,  # beta of the KL term to the reference (the student with its adapter off)
        buckets=(1024, 2048, 3072, 4096),  # token lengths a rollout's batch is padded to (the longest cuts)
        max_failed_rollouts=3,  # rollouts in a row with no readable reward before the stage ends
    ))
    rl.update(overrides)
    return rl


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    size, _, options = (arg or "8b").partition(",")
    if size not in ("8b", "tiny") or options not in ("", "teacher=api"):
        raise InputError(f"configs/fire_rl.py: arg must be '8b[,teacher=api]' or 'tiny', got {arg!r}")
    config = load_config(os.path.join(CONFIGS, "eval_free.py") + (":tiny" if size == "tiny" else ":8b"))
    del config["test"], config["setting"]
    if size == "tiny":
        config.item_source = dict(json="assets:synthetic_fire/train.json", image_root="assets:synthetic_fire/images",
                            max_examples=0)
        config.teacher = dict(name="exact teacher", init="exact:synthetic", adapter="")
        config.rl = rl_section(items_per_step=4, group_size=4, iterations=4, buckets=(256, 384, 512, 768))
        config.train = train_config(lr=1e-3, lr_schedule="constant", warmup_frac=0.0, loss_chunk=128,
                                    checkpoint_every=2)
        config.mesh = mesh_config((1, 1, 1))
    else:
        config.item_source = dict(tfds="/data/fire_tfds", split="fire_100k", max_examples=0)
        config.teacher.name, config.student.name = "FD-LLaVA", "FIRE-LLaVA + RL"
        if options:
            config.teacher.init = ""  # set to the judge's api:<base_url>#<model>
        config.rl = rl_section(items_per_step=16, group_size=8, iterations=200)
        config.train = train_config(lr=1e-5, lr_schedule="constant", warmup_frac=0.0, accum_steps=8,
                                    checkpoint_every=10)
        config.mesh = mesh_config((1, -1, 1))  # the 8B recipes' (configs/fire.py): FSDP over all devices
        config.model.remat = "full"  # the update's activations (the evaluations' config sets "none")
    rows = config.rl.items_per_step * config.rl.group_size
    config.train.update(dict(objective="rl", batch_size=rows, export_merged=True))
    config.decode.batch_size = rows  # the teacher scores a whole rollout's turns at once
    config.free.penalty_turns = 10.0
    return config
