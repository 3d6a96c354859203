"""What a LLaVA checkpoint folder is and how fire_jax will run it, read from its config.json (no weight is loaded):
its format, the input conventions it gets (fire_jax.core.geometry: the release's for the original LLaVA format,
transformers' for llava-hf's), the vocabulary and the ``<image>`` id, the anyres pinpoints as read and the grid a
few image sizes get, the prompt cut, the vision tower, and the parameters with the memory their weights take.

    python tools/checkpoint_info.py DIR            # a checkpoint folder
    python tools/checkpoint_info.py LORA_DIR       # a LoRA folder of the original format: its base, as merged

Use it before an evaluation of the release's models: the ``<image>`` id and the vocabulary come from the
checkpoint (an original-format one puts ``<image>`` at its ``vocab_size``), not from a document.
"""

import argparse
import json
import os

from fire_jax.convert import llava
from fire_jax.convert.hf import config_from_hf, read_config

#: Image sizes (height, width) whose grids are shown: two that tie on the FIRE checkpoints' pinpoints, two that
#: do not.
SIZES = ((200, 300), (300, 200), (480, 640), (300, 1200))


def describe(folder: str) -> dict:
    """The facts :func:`main` prints, as a dict."""
    import jax
    from flax import nnx

    from fire_jax.models import LlavaNext
    from fire_jax.models.layers import InitKeys

    lora = None
    if llava.is_llava_lora(folder):
        folder, lora = llava.adapter_base(folder), folder
    hf = read_config(folder)
    original = llava.is_llava_config(hf)
    cfg = llava.config_from_llava(hf, folder, lora=None) if original else config_from_hf(hf, lora=None)
    shapes = nnx.state(nnx.eval_shape(lambda: LlavaNext(cfg, rngs=InitKeys(0))), nnx.Param)
    params = sum(int(leaf.size) for leaf in jax.tree.leaves(shapes))
    geometry = cfg.geometry
    return {
        "folder": os.path.abspath(folder), "lora": lora,
        "format": "original LLaVA (LlavaLlamaForCausalLM)" if original else f"llava-hf ({cfg.architecture})",
        "conventions": cfg.conventions, "vocab_size": cfg.llm.vocab_size, "image_token_id": cfg.image_token_id,
        "image_mode": cfg.image_mode, "pinpoints_as_written": [list(p) for p in cfg.image_grid_pinpoints],
        "pinpoints_hw": [list(p) for p in geometry.pinpoints_hw],
        "grids": {f"{w}x{h}": {"grid_rows_cols": list(geometry.grid_shape((h, w))),
                               "image_tokens": geometry.num_tokens((h, w))} for h, w in SIZES},
        "max_input_tokens": cfg.max_input_tokens,
        "vision_tower": hf.get("mm_vision_tower") or "in the checkpoint",
        "parameters": params, "bf16_weights_gib": round(params * 2 / 2**30, 2),
    }


def main(argv=None, print_fn=print) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a checkpoint folder, or a LoRA folder of the original format")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    args = parser.parse_args(argv)
    info = describe(args.folder)
    if args.json:
        print_fn(json.dumps(info))
        return info
    print_fn(f"{info['folder']}: {info['format']}" + (f", with the LoRA folder {info['lora']} merged" if info["lora"]
                                                     else ""))
    print_fn(f"  input conventions: {info['conventions']} (override: --config.model.conventions=...)")
    print_fn(f"  vocabulary: {info['vocab_size']:,} ids; <image>: id {info['image_token_id']:,}")
    print_fn(f"  images: {info['image_mode']}; pinpoints as written {info['pinpoints_as_written']}, read as "
             f"(height, width) {info['pinpoints_hw']}")
    for size, grid in info["grids"].items():
        print_fn(f"    a {size} image: grid {grid['grid_rows_cols'][0]}x{grid['grid_rows_cols'][1]} (rows x cols), "
                 f"{grid['image_tokens']:,} image tokens")
    cut = info["max_input_tokens"]
    print_fn(f"  inputs cut at: {f'{cut:,} tokens (tokenizer_model_max_length)' if cut else 'no cut'}")
    print_fn(f"  vision tower: {info['vision_tower']}")
    print_fn(f"  parameters: {info['parameters']:,}; weights in bfloat16: {info['bf16_weights_gib']} GiB")
    return info


if __name__ == "__main__":
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line("checkpoint_info")(main)()
