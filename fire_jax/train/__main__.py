"""Train a student or a teacher.

    python -m fire_jax.train --config configs/tiny.py --workdir /tmp/tiny
    python -m fire_jax.train --config configs/fire_student.py --workdir gs://... --config.train.lr=1e-4
    python -m fire_jax.train --config configs/fire_rl.py:tiny --workdir /tmp/rl   # a config with an ``rl`` section:
                                                                                # the reinforcement stage

Multi-host: run the same command on every host with ``--coordinator HOST:PORT
--num_processes N --process_id I`` (or the environment that
``jax.distributed.initialize()`` detects on TPU pods / SLURM).
"""


from absl import flags

from fire_jax.core.cli import Stopped, define_config_flag, run_absl

_CONFIG = define_config_flag(__name__, "fire_jax.train", None,
                             "config file (get_config(arg)); path:arg for sweeps", kind="train")
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, metrics and exports go here", required=True)
_COORDINATOR = flags.DEFINE_string("coordinator", None, "jax.distributed coordinator address HOST:PORT")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes (multi-host)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (multi-host)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() with auto-detection")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "stop after this many steps (then resume later)")


def main(argv):
    del argv
    import jax
    from absl import logging

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO

    if _COORDINATOR.value or _DISTRIBUTED.value:
        jax.distributed.initialize(coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                                   process_id=_PROCESS_ID.value)
    if _CONFIG.value.get("rl"):  # the student's reinforcement stage (fire_jax.rl: rollouts, then this trainer's step)
        from fire_jax.rl.stage import train_rl as train
    else:
        from fire_jax.train.loop import train

    summary = train(_CONFIG.value, _WORKDIR.value, max_steps=_MAX_STEPS.value)
    if summary["stopped_by"] is not None:  # exit 128 + the signal: a scheduler must not read the run as done
        raise Stopped(summary["stopped_by"], f"stopped by {summary['stopped_by'].name} at step {summary['step']} "
                                             f"of {summary['total_steps']}; the same command resumes")
    if jax.process_index() == 0:
        print(f"done: step {summary['step']}/{summary['total_steps']}, loss {summary['metrics'].get('loss')}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    run_absl(main, "fire_jax.train")
