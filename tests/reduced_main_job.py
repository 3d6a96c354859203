"""configs/main_job.py:tiny,compare,see at test scale: ``--config tests/reduced_main_job.py[:STEPS]`` (12 steps a
stage by default). FD comes from a comparison stage and the base model from the seeing lineage, so every stage
runs. Every stage pads to one length bucket, so the stages (and the ablation's and the retrained teacher's) run one
step program, compiled once per run.

The stages train on one device, as the main job does on a CPU: the suite's process has 8 host devices, and a mesh
over them would split each batch of 8 into 8 shards and reduce the gradients across them. Their step is compiled
at XLA's default level over the suite's LLVM -O0 (conftest): it runs 50 times a module, and a step of 8 x 768
tokens takes about half the time at the default level.

``configs/main_job.py`` resolves to the source tree's from its root, else to the installed package's (an empty
environment with the wheel alone, tests/test_main_job.py)."""

from fire_jax.core.config import load_config


def get_config(arg: str = ""):
    steps = int(arg or 12)
    config = load_config("configs/main_job.py:tiny,compare,see")
    config.clip_train.train.update(dict(total_steps=steps, checkpoint_every=100))
    config.clip_train.data.batch_size = config.clip_train.train.batch_size = 16
    for stage in (config.align_train, config.base_train, config.compare_train, config.teacher_train,
                  config.student_train):
        stage.train.total_steps = steps
        stage.train.checkpoint_every = 100
        stage.train.xla_options = (("xla_backend_optimization_level", 2),)
        stage.data.buckets = (stage.data.max_len,)
        stage.mesh.shape = (1, 1, 1)
    for setting in (config.eval_fixed, config.eval_free):
        setting.test.max_examples = 6
        setting.decode.max_new_tokens = 12
    return config
