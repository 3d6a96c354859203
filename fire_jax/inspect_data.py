"""Print one rendered training example: labelled spans marked, the image block summarised.

    python -m fire_jax.inspect_data --config configs/tiny.py --index 3 --role teacher
    python -m fire_jax.inspect_data --config configs/main_job.py --stage teacher --index 3

A main-job config (``configs/main_job.py``) holds one training config per stage: ``--stage`` picks
``base``, ``teacher`` or ``student`` (its ``<stage>_train``), and the example is rendered as that stage
trains on it.

Labelled spans (the loss targets) appear as [[i|...]] for turn i (coloured
with --color); the image placeholder as "<image x N: base ... + grid RxC
unpadded HxW + H newlines>".
"""

import argparse
import os
import sys

import ml_collections
import numpy as np

from fire_jax.core.cli import input_errors_end_in_one_line
from fire_jax.core.config import InputError, apply_overrides, load_config, resolve_path, split_overrides
from fire_jax.data.chat import Encoded
from fire_jax.data.pipeline import Preprocessor
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.records import field_caps
from fire_jax.data.sources import geometry_from_model_config, open_source


def training_config(config, path: str, stage: str | None):
    """The training config to render: ``config`` itself, or a main-job config's ``<stage>_train``."""
    stages = sorted(key[:-len("_train")] for key in config
                    if key.endswith("_train") and isinstance(config[key], ml_collections.ConfigDict)
                    and "data" in config[key])
    if stage is None:
        if "data" in config:
            return config
        if stages:
            raise InputError(f"{path}: a main-job config with the stages {stages}: pick one with --stage")
        raise InputError(f"{path}: not a training config (no field 'data')")
    if stage not in stages:
        raise InputError(f"--stage {stage!r}: {path} has "
                         + (f"the stages {stages}" if stages else "no stages (a training config: drop --stage)"))
    return config[f"{stage}_train"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="config file, e.g. configs/tiny.py[:arg]; --config.<field>=<value> sets a field")
    parser.add_argument("--index", type=int, default=0, help="record index within the source")
    parser.add_argument("--role", choices=("student", "teacher"), help="default: config.data.role")
    parser.add_argument("--source", help="name in config.data.sources (default: the first)")
    parser.add_argument("--stage", help="with a main-job config: the stage whose training data to show "
                                            "(base, teacher or student)")
    parser.add_argument("--color", action="store_true", help="colour labelled spans (ANSI) instead of [[...]]")
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)

    config = training_config(apply_overrides(load_config(args.config), overrides), args.config, args.stage)
    data = config.data
    if not data.sources:
        raise InputError(f"{args.config}: config.data.sources is empty")
    tokenizer = resolve_path(data.tokenizer)
    if not os.path.exists(tokenizer) and config.get("init") and config.init.get("gguf"):
        raise InputError(f"{args.config}: tokenizer {tokenizer} is not there yet: it is written when the model "
                         f"{config.init.gguf!r} is fetched (the first training run, or now: python -m "
                         f"fire_jax.convert.fetch {config.init.gguf})")
    name = args.source or sorted(data.sources)[0]
    if name not in data.sources:
        raise InputError(f"--source {name!r}: no such source in config.data.sources; known: {sorted(data.sources)}")
    bad = BadRecords()
    records = open_source(data.sources[name], on_bad_record=data.on_bad_record, bad=bad,
                          caps=field_caps(data.get("field_caps")))
    if bad:
        print(bad.report("bad records skipped in this source"), file=sys.stderr)
    if not 0 <= args.index < len(records):
        usable = f"records 0..{len(records) - 1}" if len(records) else "no record"
        raise InputError(f"--index {args.index}: source {name!r} has {usable} "
                         f"({len(records):,} usable, {sum(bad.values()):,} bad records skipped)")
    record, image_source = records[args.index]
    preprocessor = Preprocessor(
        tokenizer_path=data.tokenizer, geometry=geometry_from_model_config(config.model),
        role=args.role or data.role, first_turn_labelled=config.loss.get("student_first_turn", False),
        teacher_history=data.teacher_history, max_len=data.max_len, image_token=data.image_token,
        pad_token=data.pad_token, template=data.get("template", ""))
    example = preprocessor((record, image_source))
    print(f"source {name!r}, record {args.index} of {len(records)}: id {record.id!r}, "
          f"source {record.source!r}, role {preprocessor.role}")
    if "dropped" in example:
        print(f"dropped by the pipeline: {example['dropped']}")
        return
    size = tuple(int(v) for v in example["image_size"])
    turns = example["turn_ids"]
    labelled = {int(t): int((turns == t).sum()) for t in np.unique(turns[turns > 0])}
    print(f"image {size[0]}x{size[1]} -> {len(example['tiles'])} tiles; {len(turns)} tokens, "
          f"labelled per turn {labelled}")
    print("-" * 80)
    chat = preprocessor.chat
    image_positions = np.flatnonzero(example["input_ids"] == chat.image_token_id)
    encoded = Encoded(input_ids=example["input_ids"], loss_mask=example["loss_mask"], turn_ids=turns,
                      image_start=int(image_positions[0]) if len(image_positions) else -1,
                      image_tokens=len(image_positions))
    print(chat.show(encoded, size, color=args.color))


if __name__ == "__main__":
    input_errors_end_in_one_line("fire_jax.inspect_data")(main)()
