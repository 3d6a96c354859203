"""Generation throughput: fire_jax.infer.generate against transformers' generate, same CPU, same run.

    python benchmarks/decode.py                       # dim 256, 4 layers, vocab 32000, prompt 512, 128 new
    python benchmarks/decode.py --dim 512 --layers 8 --batches 1,8
    python benchmarks/decode.py --gguf smollm2-135m-instruct --prompt 128 --new 64   # the main job's LLM
    python benchmarks/decode.py --gguf smollm2-135m-instruct --temperature 1 --batches 1,16   # sampled (RL rollouts)

A Llama-shaped LLaVA-NeXT with random weights (a tiny vision tower, never
run: prompts are text-only) is built in PyTorch, saved, and loaded into
fire_jax, so both sides run the same weights in float32. Every prompt has
``--prompt`` tokens and every sequence runs the full ``--new`` tokens (no stop
ids). Each configuration is run once to warm up (JAX compiles, PyTorch
allocates), then timed, best of ``--repeats`` (3). "prefill" is a run with one
new token; "decode" is the rest: (time(new) - time(1)) over ``batch * (new - 1)``
tokens.

``--temperature T`` > 0 samples instead, both sides from the whole vocabulary (top_k 0, top_p 1: the reinforcement
stage's rollouts), each sequence still running the full ``--new`` tokens.

``--gguf`` (a model name of ``fire_jax.convert.fetch`` or a ``.gguf`` path) runs that file's LLM instead, both
sides reading its weights (transformers: ``from_pretrained(folder, gguf_file=name)``), dequantized to float32,
and adds the memory-bandwidth bound at batch 1: every float32 weight read once per token, at the rate this
machine streams a 1 GiB array in the same run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def build(directory: str, dim: int, layers: int, vocab: int):
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=128)
    heads = dim // 64
    text = LlamaConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=64, intermediate_size=4 * dim,
                       max_position_embeddings=4096, tie_word_embeddings=False)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=vocab - 1,
                          image_grid_pinpoints=[[32, 64], [64, 32]], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    model.save_pretrained(directory)
    return model


def stream_rate(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a jitted sum over a ``gib`` GiB float32 array: the rate weights can be read from memory."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2 ** 28),), jnp.float32)
    f = jax.jit(jnp.sum)
    return x.nbytes / timed(lambda: f(x).block_until_ready(), repeats)


def timed(fn, repeats: int) -> float:
    """Best of ``repeats`` runs after one warm-up (compile / allocate): the machine may be shared."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", default="", help="a GGUF model (name or path): its LLM, its weights, both sides")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled from the whole "
                        "vocabulary on both sides")
    parser.add_argument("--chunk", type=int, default=0, help="decode steps per engine dispatch (EngineConfig.chunk; "
                        "0: its default)")
    args = parser.parse_args(argv)

    import jax
    import torch
    from flax import nnx

    from fire_jax.convert.hf import load_hf_checkpoint
    from fire_jax.infer.decode import generate
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams

    if args.gguf:
        from transformers import AutoModelForCausalLM

        from fire_jax.convert.fetch import resolve_model
        from fire_jax.convert.load import load_model

        path = resolve_model(args.gguf)
        model = load_model(path)
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  torch_dtype=torch.float32).eval()
        llm = model.cfg.llm
        args.vocab = llm.vocab_size
        described = (f"{os.path.basename(path)} ({llm.layers} layers, dim {llm.dim}, {llm.heads}/{llm.kv_heads} "
                     f"heads, vocab {llm.vocab_size}, tied {llm.tie_word_embeddings})")
    else:
        directory = tempfile.mkdtemp(prefix="decode_bench_")
        hf = build(directory, args.dim, args.layers, args.vocab)
        model = load_hf_checkpoint(directory, lora=None)
        described = f"random weights, dim {args.dim}, {args.layers} layers, vocab {args.vocab}"
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} | torch {torch.__version__} "
          f"({torch.get_num_threads()} threads) | {os.cpu_count()} CPUs | load average "
          "{:.2f} {:.2f} {:.2f} before".format(*os.getloadavg()))
    print(f"model: {described}; prompt {args.prompt}, {args.new} new tokens, float32, "
          + (f"sampled at temperature {args.temperature:g}\n" if args.temperature > 0 else "greedy\n"))

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = np.random.default_rng(batch).integers(0, args.vocab - 1, (batch, args.prompt))
        ids = torch.as_tensor(prompts)

        def ours(new):
            sampling = SamplingParams(max_tokens=new, stop_ids=(), temperature=args.temperature)
            engine = EngineConfig(**({"chunk": args.chunk} if args.chunk else {}))
            rng = jax.random.key(1) if args.temperature > 0 else None
            return lambda: generate(model, list(prompts), sampling=sampling, engine=engine, rng=rng).tokens

        def theirs(new):
            def run():
                with torch.no_grad():
                    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      do_sample=args.temperature > 0, pad_token_id=0, eos_token_id=None,
                                      **(dict(temperature=args.temperature, top_k=0, top_p=1.0)
                                         if args.temperature > 0 else {}))
                assert out.shape[1] == args.prompt + new
            return run

        row = {"batch": batch}
        for name, make in (("jax", ours), ("hf", theirs)):
            total, prefill = timed(make(args.new), args.repeats), timed(make(1), args.repeats)
            row[name] = (batch * args.new / total, batch * (args.new - 1) / max(total - prefill, 1e-9), prefill)
        rows.append(row)
        print(f"batch {batch} done", flush=True)

    print()
    print("| batch | fire_jax tok/s | HF tok/s | ratio | fire_jax decode tok/s | HF decode tok/s | decode ratio "
          "| prefill s (jax / HF) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        (j, jd, jp), (h, hd, hp) = row["jax"], row["hf"]
        print(f"| {row['batch']} | {j:.0f} | {h:.0f} | {j / h:.2f}x | {jd:.0f} | {hd:.0f} | {jd / hd:.2f}x "
              f"| {jp:.2f} / {hp:.2f} |")
    print("load average {:.2f} {:.2f} {:.2f} after".format(*os.getloadavg()))
    if args.gguf:
        weights = sum(x.size for x in jax.tree.leaves(nnx.state(model.language_model, nnx.Param))) * 4
        rate = stream_rate()
        batch1 = [row for row in rows if row["batch"] == 1]
        print(f"\nmemory-bandwidth bound at batch 1: {weights / 2 ** 20:.0f} MiB of float32 LLM weights read once a "
              f"token at {rate / 1e9:.1f} GB/s (a 1 GiB array streamed) -> {rate / weights:.0f} tokens/s"
              + (f"; fire_jax decodes {batch1[0]['jax'][1]:.0f} ({batch1[0]['jax'][1] / (rate / weights):.0%} of it)"
                 if batch1 else ""))


if __name__ == "__main__":
    from fire_jax.core.hugepages import reexec_with_huge_pages

    reexec_with_huge_pages()  # both sides of the comparison run in this process
    main()
