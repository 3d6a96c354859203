"""Logits of a Hugging Face LLaVA-NeXT checkpoint, or of a GGUF file's LLM, computed by fire_jax (to set
beside transformers').

    python tools/hf_logits.py --model DIR|FILE.gguf --inputs IN.npz --out OUT.npz

IN.npz holds HF-style arrays: ``input_ids [B, T]`` with expanded image
placeholders, optional ``pixel_values [B, crops, 3, H, W]`` and
``image_sizes [B, 2]`` (rows without image tokens are text-only; a ``.gguf`` model reads text only),
``attention_mask [B, T]`` and ``position_ids [B, T]`` (default ``arange(T)``,
as HF's forward). OUT.npz gets ``logits [B, T, V]`` float32.
"""

import argparse

import numpy as np

from fire_jax.convert.gguf import load_model
from fire_jax.infer.forward import forward_logits, hf_image_sizes, read_hf_inputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory (config.json + safetensors) or a .gguf file (its LLM alone)")
    parser.add_argument("--inputs", required=True, help="input .npz")
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("--dtype", default="float32", help="weights and compute dtype (float32, bfloat16)")
    args = parser.parse_args(argv)
    model = load_model(args.model, dtype=args.dtype, param_dtype=args.dtype)
    inputs = read_hf_inputs(args.inputs)
    ids = inputs["input_ids"]
    logits = forward_logits(model, ids, pixel_values=inputs.get("pixel_values"),
                            image_sizes=hf_image_sizes(ids, inputs.get("image_sizes"), model.cfg.image_token_id),
                            attention_mask=inputs.get("attention_mask"), positions=inputs.get("position_ids"))
    np.savez(args.out, logits=logits)
    print(f"{args.out}: logits {logits.shape} {logits.dtype}")


if __name__ == "__main__":
    main()
