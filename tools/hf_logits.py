"""Logits of a Hugging Face LLaVA-NeXT or LLaVA-1.5 checkpoint (llava-hf's, or the original LLaVA format's, with a
LoRA folder of that format merged in by ``--adapter``), or of a GGUF file's LLM, computed by fire_jax (to set
beside transformers').

    python tools/hf_logits.py --model DIR|FILE.gguf [--adapter LORA_DIR] --inputs IN.npz --out OUT.npz

IN.npz holds HF-style arrays: ``input_ids [B, T]`` with expanded image
placeholders, optional ``pixel_values [B, crops, 3, H, W]`` and
``image_sizes [B, 2]`` (rows without image tokens are text-only; a ``.gguf`` model reads text only),
``attention_mask [B, T]`` and ``position_ids [B, T]`` (default ``arange(T)``,
as HF's forward). OUT.npz gets ``logits [B, T, V]`` float32. An original-format checkpoint's image placeholder
id is its ``vocab_size`` (the id llava-hf's conversion gives the ``<image>`` it appends), and V is its vocabulary.

A LLaVA-1.5 checkpoint (``LlavaForConditionalGeneration``, e.g. llava-hf/llava-1.5-7b-hf) takes one tile per
image and no ``image_sizes``: ``pixel_values [B, images, 3, H, W]``, or its processor's ``[images, 3, H, W]``
(the images of all rows in order, each row with ``576 * k`` image tokens having k of them; or one per row,
text-only rows' ignored).
"""

import argparse
import os

import numpy as np

from fire_jax.convert.load import load_model
from fire_jax.data.images import pad_tiles
from fire_jax.infer.forward import forward_logits, hf_image_sizes, read_hf_inputs


def llava15_inputs(cfg, input_ids: np.ndarray, pixel_values: np.ndarray | None):
    """(pixel_values ``[B, images, 3, H, W]``, per row a list of image sizes or None) of a LLaVA-1.5 batch."""
    per_tile = cfg.geometry.tokens_per_tile
    counts = (np.asarray(input_ids) == cfg.image_token_id).sum(axis=1)
    if (counts % per_tile).any():
        raise ValueError(f"rows {np.flatnonzero(counts % per_tile).tolist()}: image token counts {counts.tolist()} "
                         f"are not multiples of {per_tile} (one LLaVA-1.5 image)")
    images = counts // per_tile
    if not images.any():
        return None, [None] * len(images)
    if pixel_values is None:
        raise ValueError(f"rows {np.flatnonzero(images).tolist()} have image tokens but there are no pixel_values")
    pixel_values = np.asarray(pixel_values, np.float32)
    if pixel_values.ndim == 5:
        rows = [pixel_values[b, :k] for b, k in enumerate(images)]
    elif pixel_values.ndim == 4 and len(pixel_values) == images.sum():  # HF: every row's images, in order
        starts = np.cumsum(images) - images
        rows = [pixel_values[s:s + k] for s, k in zip(starts, images)]
    elif pixel_values.ndim == 4 and len(pixel_values) == len(images) and images.max() == 1:  # one per row
        rows = [pixel_values[b:b + k] for b, k in enumerate(images)]
    else:
        raise ValueError(f"pixel_values {pixel_values.shape}: expected [B, images, 3, H, W] or [images, 3, H, W] "
                         f"for {int(images.sum())} images in {len(images)} rows")
    tile = cfg.vision.image_size
    sizes = [[(tile, tile)] * int(k) if k else None for k in images]  # LLaVA-1.5's features do not depend on it
    return pad_tiles([r if len(r) else None for r in rows], tile_size=tile), sizes


def model_inputs(model, inputs: dict):
    """(pixel_values, image sizes per row) for fire_jax's forward / generate from HF-style inputs."""
    ids = inputs["input_ids"]
    if getattr(model.cfg, "architecture", "llava_next") == "llava":
        return llava15_inputs(model.cfg, ids, inputs.get("pixel_values"))
    return inputs.get("pixel_values"), hf_image_sizes(ids, inputs.get("image_sizes"), model.cfg.image_token_id)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory (config.json + safetensors) or a .gguf file (its LLM alone)")
    parser.add_argument("--adapter", default=None,
                        help="a LoRA folder of the original LLaVA format (adapter_config.json, adapter weights, "
                             "non_lora_trainables.bin: the FIRE release's teacher) merged into --model; a LoRA folder "
                             "given as --model goes on the base its adapter_config.json names")
    parser.add_argument("--inputs", required=True, help="input .npz")
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights and compute dtype")
    args = parser.parse_args(argv)
    if not os.path.exists(args.model):
        parser.error(f"argument --model: {args.model!r} does not exist")
    if not os.path.isfile(args.inputs):
        parser.error(f"argument --inputs: {args.inputs!r} is not a file")
    model = load_model(args.model, dtype=args.dtype, param_dtype=args.dtype, adapter=args.adapter)
    inputs = read_hf_inputs(args.inputs)
    pixel_values, image_sizes = model_inputs(model, inputs)
    logits = forward_logits(model, inputs["input_ids"], pixel_values=pixel_values, image_sizes=image_sizes,
                            attention_mask=inputs.get("attention_mask"), positions=inputs.get("position_ids"))
    np.savez(args.out, logits=logits)
    print(f"{args.out}: logits {logits.shape} {logits.dtype}")


if __name__ == "__main__":
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line(os.path.basename(__file__)[:-3])(main)()
