"""LLaVA-NeXT-8B on one GPU: the student LoRA train step, greedy decoding and multi-turn dialogues, one table.

    python benchmarks/gpu.py                 # one CUDA GPU (H200, H100, A100, ...): random bf16 8B weights
    python benchmarks/gpu.py --tiny          # the tiny config on CPU, end to end (tests/test_gpu_bench.py)

The 8B model (configs/llava_next_8b.py: Llama-3-8B, LoRA r64 on q,k, bf16
weights and activations) is built on the device with random weights: nothing is
downloaded. Batches are text only (the LLM is where the time goes; CLIP adds
one forward over the tiles).

- Train step: the student LoRA step (AdamW, chunked cross-entropy, full
  per-layer remat, stacked scanned layers, attention by cuDNN's flash kernel,
  falling back to XLA's if cuDNN rejects the shapes) at seq 3072, micro-batch
  1, 2 and 4, one micro-batch per step. MFU is stated two ways:
  "6N" = 3 x forward FLOPs per token (what full fine-tuning would do: forward,
  activation gradients, weight gradients) and "4N" = 2 x forward (frozen base:
  no weight gradients, the LoRA factors' are negligible); forward = 2 x dense
  LLM params (the embedding lookup excluded, lm_head included) + causal
  attention (QK^T and AV over half the pairs). Remat's recomputed forward is
  not counted (model FLOPs, not hardware FLOPs).
- Decode: ``fire_jax.infer.generate``, greedy, a random 1024-token prompt per
  row, ``--new`` tokens with no stop ids, at batch 1, 16, 64; the layers are
  unstacked first (``scan_layers=False``, the decoding layout). Prefill is
  timed as a 1-token generation; decode tok/s = batch x (new - 1) / (total - prefill).
- Multi-turn dialogues: the continuous-batching engine on ``--dialogues``
  concurrent dialogues of ``--turns`` turns (a ``--dialogue_prompt``-token first
  prompt; each turn adds its ``--new``-token answer and ``--feedback`` tokens),
  prefix caching off and on: wall time, generated tokens/s, prompt tokens
  prefilled of those requested, how many greedy answers are the same in both
  (each dialogue compared up to its first turn that differs) and the largest
  difference of a compared answer's first log-prob. Both modes run once
  untimed first (each compiles its own prefills).
- Peak memory: the device's ``peak_bytes_in_use`` after each row (cumulative).

``--parts`` picks and orders the parts (``dialogue,train,decode`` on a short lease);
``--deadline`` starts no row after that many seconds.

Each timing is the best of ``--repeats`` after a warm-up call (which compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import time

#: Dense bf16 peak FLOP/s by device kind (substring match), for MFU; --peak_tflops overrides.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def flops_per_token(llm, lora, seq: int) -> dict[str, float]:
    """Model FLOPs per trained token: forward, "6N" (3 x forward) and LoRA-only "4N" (2 x forward + LoRA grads)."""
    per_layer = (llm.dim * llm.heads * llm.head_dim * 2 + llm.dim * llm.kv_heads * llm.head_dim * 2
                 + 3 * llm.dim * llm.mlp_dim)
    dense = llm.layers * per_layer + llm.dim * llm.vocab_size  # + lm_head; the embedding is a lookup
    attention = 2 * 2 * llm.layers * seq * llm.heads * llm.head_dim / 2  # QK^T and AV, causal: half the pairs
    forward = 2 * dense + attention
    lora_params = 0 if lora is None else llm.layers * sum(
        lora.rank * (llm.dim + {"q": llm.heads, "k": llm.kv_heads, "v": llm.kv_heads}.get(t, 0) * llm.head_dim)
        for t in lora.targets)
    return {"dense_params": dense, "forward": forward, "6N": 3 * forward, "4N": 2 * forward + 4 * lora_params}


def _random_like(abstract, scale: float = 0.02):
    """Arrays of the shapes and dtypes in ``abstract``: floats ~ N(0, scale^2) (threefry), others zeros."""
    import functools

    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def fill(key, shape, dtype):
        if jnp.issubdtype(dtype, jnp.floating):
            return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
        return jnp.zeros(shape, dtype)

    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(treedef, [fill(k, tuple(x.shape), x.dtype) for k, x in zip(keys, leaves)])


def _best(fn, repeats: int) -> float:
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def attention_kernel(platform: str, requested: str) -> str:
    """The model's attention kernel for every part: cuDNN's on a GPU when asked (the default), else "auto"
    (XLA's on a GPU, the grouped CPU kernel elsewhere). Set once, before the first part, whatever their order."""
    return "cudnn" if platform == "gpu" and requested == "cudnn" else "auto"


def _agreement(off: list, on: list) -> dict:
    """Greedy answers of the cache-off and cache-on runs (``[turn][dialogue] = (tokens, logprobs)``) compared.

    A dialogue's prompts are the same in both runs up to and including its first turn whose answers differ;
    for those turns the first token's log-prob is compared (the reused keys and values are the only difference).
    """
    identical, max_diff, common = 0, 0.0, []
    for d in range(len(off[0])):
        for turn in range(len(off)):
            (a, la), (b, lb) = off[turn][d], on[turn][d]
            max_diff = max(max_diff, abs(la[0] - lb[0]))
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            common.append(same)
            if a != b:
                break
            identical += 1
    return dict(same_tokens_as_off=identical == len(off) * len(off[0]), identical_answers=identical,
                mean_common_prefix=sum(common) / len(common), first_logprob_max_diff=max_diff)


def _peak_gib(device) -> float | None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def main(argv=None, print_fn=print) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="configs/tiny.py on any backend (CPU test)")
    parser.add_argument("--seq", type=int, default=None, help="train sequence length (3072; tiny 64)")
    parser.add_argument("--micro", default=None, help="micro-batch sizes (1,2,4; tiny 1,2)")
    parser.add_argument("--decode_batches", default=None, help="decode batch sizes (1,16,64; tiny 1,2)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (1024; tiny 16)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per row (128; tiny 4)")
    parser.add_argument("--dialogues", type=int, default=None,
                        help="concurrent multi-turn dialogues on the engine (64; tiny 4), 0 to skip")
    parser.add_argument("--turns", type=int, default=None, help="turns a dialogue (3; tiny 2)")
    parser.add_argument("--feedback", type=int, default=None, help="tokens appended after each answer (64; tiny 40)")
    parser.add_argument("--dialogue_prompt", type=int, default=None, help="a dialogue's first prompt (1024; tiny 120)")
    parser.add_argument("--parts", default="train,decode,dialogue",
                        help="which parts to run, in this order (a lease-limited run puts the one it needs first)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"), help="GPU attention kernel")
    parser.add_argument("--peak_tflops", type=float, default=None, help="device bf16 peak, for MFU")
    parser.add_argument("--out", default=None, help="write the rows as JSON here after each one (a partial run keeps them)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from the start after which no new row is begun (the rows done are printed)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    seq = args.seq or (64 if tiny else 3072)
    micros = [int(x) for x in (args.micro or ("1,2" if tiny else "1,2,4")).split(",")]
    decode_batches = [int(x) for x in (args.decode_batches or ("1,2" if tiny else "1,16,64")).split(",")]
    prompt_len, new = args.prompt or (16 if tiny else 1024), args.new or (4 if tiny else 128)
    dialogues = (4 if tiny else 64) if args.dialogues is None else args.dialogues
    turns, feedback = args.turns or (2 if tiny else 3), args.feedback or (40 if tiny else 64)
    first_prompt = args.dialogue_prompt or (120 if tiny else 1024)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - {"train", "decode", "dialogue"} or len(set(parts)) != len(parts):
        parser.error(f"--parts {args.parts!r}: name each of train, decode, dialogue at most once")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from fire_jax.core.config import load_config
    from fire_jax.infer.decode import generate
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.models import LlavaNext, LlavaNextConfig, set_attention, set_layer_layout
    from fire_jax.core.config import loss_config, train_config
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    start_all = time.perf_counter()
    device = jax.devices()[0]
    config = load_config(os.path.join(ROOT, "configs", "tiny.py" if tiny else "llava_next_8b.py"))
    config.model.update(scan_layers=True, remat="full")
    cfg = LlavaNextConfig.from_dict(config.model)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device.device_kind), None)
    flops = flops_per_token(cfg.llm, cfg.lora, seq)
    print_fn(f"jax {jax.__version__}, {device.platform}: {device.device_kind}; model {'tiny' if tiny else '8B'} "
             f"(LLM dense {flops['dense_params'] / 1e9:.2f}B params, {cfg.param_dtype}); "
             f"peak {peak or 'unknown'} TFLOP/s")
    print_fn(f"FLOPs per token at seq {seq}: 6N-style {flops['6N'] / 1e9:.1f} G, "
             f"LoRA-only 4N {flops['4N'] / 1e9:.1f} G")

    # Random weights made on the device, one small jit per distinct (shape, dtype): jitting the whole
    # constructor makes one module with every initialiser in it, which XLA:GPU took over 8 minutes to compile.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LlavaNext(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, _random_like(abstract))
    print_fn(f"built in {time.perf_counter() - start_all:.0f}s")

    rows = []

    def record(row):
        rows.append(row)
        print_fn("row " + json.dumps(row))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": device.device_kind, "jax": jax.__version__, "seq": seq, "prompt": prompt_len,
                           "new": new, "rows": rows}, f, indent=1)

    def out_of_time(what):
        if args.deadline is not None and time.perf_counter() - start_all > args.deadline:
            print_fn(f"deadline {args.deadline:.0f}s passed: {what} skipped")
            return True
        return False

    on_gpu = device.platform == "gpu"
    set_attention(model, attention_kernel(device.platform, args.attention))
    kernel = lambda: ("cudnn" if model.cfg.attention == "cudnn" else "xla") if on_gpu else "grouped (CPU)"

    def with_fallback(what, fn):
        """fn(), and again with XLA's attention if cuDNN's rejects the shapes (it does some, at compile time)."""
        try:
            return fn()
        except Exception as error:  # noqa: BLE001
            if model.cfg.attention != "cudnn":
                raise
            print_fn(f"cuDNN attention failed in {what} ({type(error).__name__}: {str(error)[:200]}); using XLA's")
            set_attention(model, "auto")
            return fn()

    def train_part():
        set_layer_layout(model, True)  # the stacked, scanned layers of training
        rng = np.random.default_rng(0)
        for micro in micros:
            if out_of_time(f"train micro-batch {micro}"):
                continue
            ids = rng.integers(0, cfg.llm.vocab_size - 2, (micro, seq)).astype(np.int32)
            loss_mask = np.zeros((micro, seq), np.float32)
            loss_mask[:, seq // 2:] = 1.0
            batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones((micro, seq), jnp.int32),
                     "loss_mask": jnp.asarray(loss_mask), "turn_ids": jnp.asarray(np.where(loss_mask > 0, 2, -1))}

            def timed_step():
                trainer = Trainer(model, train_config(batch_size=micro, loss_chunk=512, lr=1e-5), loss_config(),
                                  1000, make_mesh((1, 1, 1), [device]))
                holder = {"state": trainer.initial_state}

                def step():
                    holder["state"], metrics = trainer.step(holder["state"], batch, jax.random.key(0))
                    jax.block_until_ready(metrics["loss"])

                return _best(step, args.repeats)

            seconds = with_fallback(f"the train step at micro-batch {micro}", timed_step)
            tokens = micro * seq / seconds
            record(dict(kind="train", batch=micro, seconds=seconds, tokens_per_s=tokens, attention=kernel(),
                        mfu_6n=None if peak is None else tokens * flops["6N"] / (peak * 1e12),
                        mfu_4n=None if peak is None else tokens * flops["4N"] / (peak * 1e12),
                        peak_gib=_peak_gib(device)))
            print_fn(f"train micro-batch {micro} done ({time.perf_counter() - start_all:.0f}s)")

    def decode_part():
        set_layer_layout(model, False)  # decoding reads each layer's weights in place
        rng = np.random.default_rng(0)
        for batch_size in decode_batches:
            if out_of_time(f"decode batch {batch_size}"):
                continue
            prompts = list(rng.integers(0, cfg.llm.vocab_size - 2, (batch_size, prompt_len)))

            def run(n):
                return lambda: generate(model, prompts, sampling=SamplingParams(max_tokens=n, stop_ids=()),
                                        engine=EngineConfig(bucket_min=min(64, prompt_len))).tokens

            total, prefill = with_fallback(f"the prefill at batch {batch_size}",
                                           lambda: (_best(run(new), args.repeats), _best(run(1), args.repeats)))
            record(dict(kind="decode", batch=batch_size, seconds=total, prefill_s=prefill,
                        tokens_per_s=batch_size * new / total,
                        decode_tokens_per_s=batch_size * (new - 1) / (total - prefill) if total > prefill else None,
                        peak_gib=_peak_gib(device), attention=kernel()))
            print_fn(f"decode batch {batch_size} done ({time.perf_counter() - start_all:.0f}s)")

    from fire_jax.infer.engine import Engine
    from fire_jax.infer.requests import Request

    def dialogue_run(prefix_cache: bool) -> dict:
        """``dialogues`` concurrent dialogues of ``turns`` turns on one engine: each turn's prompt is the last
        one, its answer and ``feedback`` new tokens (a student's next prompt in a free dialogue). The same
        random tokens every call."""
        turn_rng = np.random.default_rng(1)
        prompts = [turn_rng.integers(0, cfg.llm.vocab_size - 2, first_prompt).tolist() for _ in range(dialogues)]
        longest = first_prompt + turns * (new + feedback)
        engine = Engine(model, EngineConfig(slots=dialogues, cache_len=longest + 2 * new + 64, bucket_step=None,
                                            prefix_cache=prefix_cache))
        start = time.perf_counter()
        generated, answers = 0, []
        for _ in range(turns):
            results = engine.generate([Request(p, SamplingParams(max_tokens=new, stop_ids=())) for p in prompts])
            generated += sum(len(r.tokens) for r in results)
            answers.append([(r.tokens, r.logprobs) for r in results])
            prompts = [p + r.tokens + turn_rng.integers(0, cfg.llm.vocab_size - 2, feedback).tolist()
                       for p, r in zip(prompts, results)]
        seconds = time.perf_counter() - start
        return dict(kind="dialogue", batch=dialogues, prefix_cache=prefix_cache, seconds=seconds,
                    tokens_per_s=generated / seconds, turns=turns, attention=kernel(),
                    answers=answers,
                    **{k: int(engine.stats[k]) for k in ("prompt_tokens", "reused_tokens", "prefilled_tokens")})

    def dialogue_part():
        if not dialogues or out_of_time("multi-turn dialogues"):
            return
        set_layer_layout(model, False)

        def warm_up():  # each mode compiles its own programs: whole-prompt prefills of the later turns (off),
            for mode in (False, True):  # cached-prefix prefills (on)
                dialogue_run(mode)

        with_fallback("the engine's prefills", warm_up)
        for prefix_cache in (False, True):
            runs = [dialogue_run(prefix_cache) for _ in range(max(1, args.repeats))]
            row = min(runs, key=lambda r: r["seconds"])
            row["peak_gib"] = _peak_gib(device)
            answers = row.pop("answers")
            if prefix_cache:  # greedy: the same answers with and without the cache?
                row.update(_agreement(off_answers, answers))
            off_answers = answers
            record(row)
        print_fn(f"multi-turn dialogues done ({time.perf_counter() - start_all:.0f}s)")

    for part in parts:
        {"train": train_part, "decode": decode_part, "dialogue": dialogue_part}[part]()

    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
    print_fn("")
    print_fn("| part | batch | s | tok/s | MFU 6N | MFU 4N (LoRA) | prefill s | decode tok/s | peak GiB | note |")
    print_fn("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if r["kind"] == "train":
            print_fn(f"| train seq {seq} | {r['batch']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{fmt(r['mfu_6n'], '.1%')} | {fmt(r['mfu_4n'], '.1%')} | | | {fmt(r['peak_gib'], '.1f')} | "
                     f"remat full, attention {r['attention']} |")
        elif r["kind"] == "dialogue":
            print_fn(f"| engine, {r['turns']}-turn dialogues, prompt {first_prompt}, {new} new + {feedback} a turn | "
                     f"{r['batch']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | | | | | "
                     f"{fmt(r['peak_gib'], '.1f')} | prefix cache {'on' if r['prefix_cache'] else 'off'}: "
                     f"{r['prefilled_tokens']:,} of {r['prompt_tokens']:,} prompt tokens prefilled"
                     + ("" if "same_tokens_as_off" not in r else
                        f"; answers identical to off: {r['identical_answers']} of {r['batch'] * r['turns']}, "
                        f"first-token log-prob |diff| <= {r['first_logprob_max_diff']:.2g}")
                     + f", attention {r['attention']} |")
        else:
            print_fn(f"| greedy decode, prompt {prompt_len}, {new} new | {r['batch']} | {r['seconds']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | | | {r['prefill_s']:.3f} | {fmt(r['decode_tokens_per_s'], '.0f')} | "
                     f"{fmt(r['peak_gib'], '.1f')} | prefill attention {r['attention']} |")
    pair = [r for r in rows if r["kind"] == "dialogue"]
    if len(pair) == 2:
        off, on = pair
        print_fn(f"dialogue: prefill tokens {off['prefilled_tokens']:,} -> {on['prefilled_tokens']:,} "
                 f"({off['prefilled_tokens'] / max(on['prefilled_tokens'], 1):.2f}x fewer), wall "
                 f"{off['seconds']:.2f} -> {on['seconds']:.2f} s ({off['seconds'] / on['seconds']:.2f}x faster)")
    print_fn(f"total {time.perf_counter() - start_all:.0f}s")
    return rows


if __name__ == "__main__":
    main()
