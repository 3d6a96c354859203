"""Greedy generation from a Hugging Face LLaVA-NeXT or LLaVA-1.5 checkpoint, or a GGUF file's LLM, with fire_jax
(to set beside HF ``generate``).

    python tools/hf_generate.py --model DIR|FILE.gguf [--adapter LORA_DIR] --inputs IN.npz --max_new_tokens N --out OUT.npz

IN.npz as for ``tools/hf_logits.py`` (``input_ids`` padded on either side, with
``attention_mask``; text-only for a ``.gguf`` model; LLaVA-1.5: one tile per image, no ``image_sizes``).
Stops on ``--stop_ids`` (default: the
checkpoint's generation_config.json ``eos_token_id``, or the GGUF file's EOS id; with neither, none).
OUT.npz gets ``generated_ids [B, N]`` int32: the stop token kept, -1 after it,
and ``logprobs [B, N]`` of the generated tokens.
"""

import argparse
import importlib.util
import json
import os

import numpy as np

from fire_jax.core.cli import int_at_least
from fire_jax.convert.gguf import read_gguf
from fire_jax.convert.load import load_model
from fire_jax.infer.decode import generate, unpad
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.forward import read_hf_inputs


def _hf_logits_tool():
    """tools/hf_logits.py (its ``model_inputs``), wherever this script is run from."""
    spec = importlib.util.spec_from_file_location("hf_logits", os.path.join(os.path.dirname(__file__), "hf_logits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_stop_ids(model: str) -> tuple[int, ...]:
    if model.endswith(".gguf"):
        eos = read_gguf(model).eos_id
    else:
        path = os.path.join(model, "generation_config.json")
        eos = json.load(open(path)).get("eos_token_id") if os.path.exists(path) else None
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory (config.json + safetensors) or a .gguf file (its LLM alone)")
    parser.add_argument("--adapter", default=None,
                        help="a LoRA folder of the original LLaVA format (adapter_config.json, adapter weights, "
                             "non_lora_trainables.bin: the FIRE release's teacher) merged into --model; a LoRA folder "
                             "given as --model goes on the base its adapter_config.json names")
    parser.add_argument("--inputs", required=True, help="input .npz")
    parser.add_argument("--max_new_tokens", type=int_at_least(1), required=True)
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("--stop_ids", type=lambda s: tuple(int(i) for i in s.split(",") if i), default=None,
                        help="comma-separated stop token ids ('' for none)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights and compute dtype")
    args = parser.parse_args(argv)
    if not os.path.exists(args.model):
        parser.error(f"argument --model: {args.model!r} does not exist")
    if not os.path.isfile(args.inputs):
        parser.error(f"argument --inputs: {args.inputs!r} is not a file")
    model = load_model(args.model, dtype=args.dtype, param_dtype=args.dtype, adapter=args.adapter)
    inputs = read_hf_inputs(args.inputs)
    ids = inputs["input_ids"]
    stop_ids = default_stop_ids(args.model) if args.stop_ids is None else args.stop_ids
    sampling = SamplingParams(max_tokens=args.max_new_tokens, stop_ids=stop_ids)
    pixel_values, image_sizes = _hf_logits_tool().model_inputs(model, inputs)
    out = generate(model, unpad(ids, inputs.get("attention_mask")), pixel_values=pixel_values,
                   image_sizes=image_sizes, sampling=sampling)
    np.savez(args.out, generated_ids=out.tokens, logprobs=out.logprobs)
    print(f"{args.out}: generated_ids {out.tokens.shape}, stop ids {stop_ids}, tokens per row {out.lengths.tolist()}")


if __name__ == "__main__":
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line(os.path.basename(__file__)[:-3])(main)()
