"""Export a fire_jax model in the original LLaVA format (``LlavaLlamaForCausalLM``), so the FIRE release's own
scripts (MM-FIRE/FIRE ``llava/model/builder.py``, ``llava/eval/eval_feedback.py``) can run it.

    # merged: config.json, safetensors with the original keys, the base's tokenizer files
    python tools/export_llava.py --config configs/fire.py:fire_student,base=open_llava_next_8b \
        --checkpoint WORKDIR --out DIR [--dtype bfloat16]
    # as the release ships its teacher: base + LoRA (PEFT) + non_lora_trainables.bin (the connector)
    python tools/export_llava.py --config configs/fire.py:fire_teacher,base=open_llava_next_8b \
        --checkpoint WORKDIR --out DIR --lora [--base /data/open-llava-next-llama3-8b]

``--checkpoint`` is anything the evaluation takes (a train workdir, a PEFT adapter, a checkpoint folder); without
it, the config's model. The release loads a LoRA folder with ``--model-base BASE`` and a folder name containing
"lora"; a merged export needs "llava" in its folder name (its builder picks the model class by name).
"""

import argparse
import os
import shutil

from fire_jax.core.config import apply_overrides, load_config, resolve_path
from fire_jax.core.files import output_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def main(argv=None, print_fn=print):
    from fire_jax.convert.llava import save_llava_checkpoint, save_llava_lora
    from fire_jax.infer.loading import load
    from fire_jax.models import merge_lora

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config of the model (configs/*.py[:ARG])")
    parser.add_argument("--checkpoint", default=None, help="train workdir, PEFT adapter or checkpoint folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--lora", action="store_true", help="base + LoRA + non_lora_trainables.bin, not merged")
    parser.add_argument("--base", default="", help="--lora: the base folder adapter_config.json names "
                                                  "(default: the config's init.hf_checkpoint)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="merged: the weights' dtype (default: as the model holds them)")
    parser.add_argument("--vision_tower", default=None,
                        help="mm_vision_tower to write (default: openai/clip-vit-large-patch14-336 for that shape, "
                             "else a CLIP folder written into --out)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    config = apply_overrides(load_config(args.config), [o[len("--config."):] for o in overrides])
    loaded = load(config, args.checkpoint)
    print_fn(f"model: {loaded.description}")
    if args.lora:
        base = args.base or (config.init.get("hf_checkpoint") if config.get("init") else "") or ""
        if not base:
            parser.error("--lora: give --base (the folder the adapter goes on) or set config.init.hf_checkpoint")
        save_llava_lora(loaded.model, args.out, os.path.abspath(base), vision_tower=args.vision_tower)
    else:
        save_llava_checkpoint(merge_lora(loaded.model), args.out, vision_tower=args.vision_tower, dtype=args.dtype)
        # The tokenizer the model was loaded with: a checkpoint folder's own, else the config's.
        own = args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "tokenizer.json"))
        source = args.checkpoint if own else os.path.dirname(resolve_path(config.data.tokenizer))
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(source, name)):
                with output_file(os.path.join(args.out, name)) as temporary:
                    shutil.copyfile(os.path.join(source, name), temporary)
    print_fn(f"{args.out}: {'LoRA + non_lora_trainables.bin' if args.lora else 'merged'} in the original LLaVA format")


if __name__ == "__main__":
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line("export_llava")(main)()
