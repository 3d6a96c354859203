"""Generate FIRE-1M-style dialogues: a student and a teacher talk about (I, q, gt) triplets (FIRE Fig. 3b).

    python tools/make_fire1m.py --config configs/eval_free.py --input triplets.json --image_root DIR \\
        --out fire_1m_generated.jsonl [--max_items N] [--split fire_1m] [--config.teacher.adapter=FD_LLAVA ...]

The agents, decoding and score threshold come from the evaluation config
(``student``, ``teacher``, ``decode``, ``free.threshold``, ``free.teacher_history``).
Inputs: FIRE records (their conversations ignored) or plain {"image",
"question", "groundtruth", "source"?, "id"?} objects, JSON array or JSONL.
Dialogues stop at a score >= 8 or after --max_turns (3); those whose score
did not improve are dropped. Kept records (the released FIRE schema, image paths
relative to --image_root) are appended to --out, dropped ones to
<out>.dropped.jsonl; a rerun continues. At the end the output is read back
through fire_jax.data.records and its bad records (expected: none) printed.
"""

import dataclasses
import os

from absl import flags, logging

from fire_jax.core.cli import define_config_flag, run_absl
from fire_jax.core.config import CONFIGS_DIR
from fire_jax.dialogue.stop import FIRE_1M_GENERATION

_CONFIG = define_config_flag(__name__, "make_fire1m", os.path.join(CONFIGS_DIR, "eval_free.py"),
                             "evaluation config (agents, decoding)", kind="setting")
_INPUT = flags.DEFINE_multi_string("input", None, "triplet or FIRE records file (repeatable)", required=True)
_IMAGE_ROOT = flags.DEFINE_string("image_root", None, "the inputs' image paths are relative to it", required=True)
_OUT = flags.DEFINE_string("out", None, "JSONL of generated FIRE records", required=True)
_MAX_ITEMS = flags.DEFINE_integer("max_items", 0, "a fixed random subset of this many triplets (0: all)",
                                  lower_bound=0)
_MAX_TURNS = flags.DEFINE_integer("max_turns", FIRE_1M_GENERATION.max_turns, "turns at most per dialogue",
                                  lower_bound=1)
_SPLIT = flags.DEFINE_string("split", "fire_1m", "the records' split field")


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    from fire_jax.data.bad_records import BadRecords
    from fire_jax.data.records import load_records
    from fire_jax.data.items import load_triplets
    from fire_jax.dialogue.fire1m import make_fire_records
    from fire_jax.eval.fire_bench import build_agents

    config = _CONFIG.value
    bad = BadRecords()
    items = load_triplets(_INPUT.value, _IMAGE_ROOT.value, on_bad_record=config.on_bad_record, bad=bad,
                          max_examples=_MAX_ITEMS.value)
    print(f"{len(items)} triplets from {', '.join(_INPUT.value)}")
    print(bad.report("input bad records"))
    student, teacher = build_agents(config, config.free.teacher_history)
    rule = dataclasses.replace(FIRE_1M_GENERATION, max_turns=_MAX_TURNS.value, threshold=config.free.threshold)
    rng = None
    if config.decode.temperature > 0:
        import jax

        rng = jax.random.key(config.seed)
    kept, dropped = make_fire_records(items, student, teacher, _OUT.value, image_root=_IMAGE_ROOT.value,
                                     split=_SPLIT.value, rule=rule, batch_size=config.decode.batch_size, rng=rng)
    print(f"{kept} records kept in {_OUT.value}")
    print(dropped.report("dialogues dropped"))
    records, reread = load_records(_OUT.value, _IMAGE_ROOT.value)
    print(f"read back through fire_jax.data.records: {len(records)} records")
    print(reread.report("bad records"))


if __name__ == "__main__":
    run_absl(main, "make_fire1m")
