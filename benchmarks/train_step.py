"""Train-step speed against transformers + peft, 8B FLOPs per token, 8B memory on an 8-device mesh.

    python benchmarks/train_step.py                  # all three parts (CPU: a few minutes)
    python benchmarks/train_step.py --part speed     # tokens/s, ours vs PyTorch + peft, same config and batch
    python benchmarks/train_step.py --part profile   # where the speed part's step spends its time, per op class
    python benchmarks/train_step.py --part memory    # 8B student step lowered abstractly on 8 devices
    python benchmarks/train_step.py --part smollm2   # SmolLM2-135M-Instruct's weights (the main job's LLM), both sides

SmolLM2: the main job's model (configs/smollm2_llava.py: 30 layers, dim 576, 9 / 3 heads, vocab 49152, tied
embeddings, LoRA rank 32 on q, k, v, o), text-only, with the fetched GGUF file's weights on both sides
(transformers through ``from_pretrained(folder, gguf_file=name)``), at batch 8 x 256 with the last 16 tokens
labelled (a teacher example: the score and verdict) and at batch 8 x 512 with the second half labelled. Beside
the tokens/s: model FLOPs per second (4N-style: forward and activation gradients with full-vocabulary logits,
what PyTorch computes; ours skips the unlabelled logits), as a fraction of a float32 matmul's measured rate in
the same run (the roofline).

Speed: a small Llama-shaped LLaVA-NeXT (float32, CPU), LoRA on q,k, one AdamW
step per iteration on the same [batch, seq] text batch with the same loss mask.
Memory: the 8B student config at global batch 64 x 3072 tokens, compiled for
an 8-device (data 1, fsdp 8, tensor 1) mesh of host devices without allocating
weights; XLA's memory analysis gives the per-device figure.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from fire_jax.core.config import loss_config, train_config
from fire_jax.core.machine import matmul_rate  # noqa: E402
from fire_jax.models import LlavaNext, LlavaNextConfig  # noqa: E402
from fire_jax.weights.sharding import make_mesh  # noqa: E402
from fire_jax.train.step import Trainer  # noqa: E402

SMALL = dict(
    vision=dict(image_size=32, patch_size=8, width=64, layers=2, heads=4, mlp_dim=128),
    llm=dict(vocab_size=32000, dim=512, layers=4, heads=8, kv_heads=4, head_dim=64, mlp_dim=1408),
    lora=dict(rank=64, alpha=256.0, dropout=0.0, targets=("q", "k")),
    image_token_id=31999, image_grid_pinpoints=((32, 64), (64, 32), (64, 64)))


def _batch(batch, seq, vocab, seed=0, labelled=None):
    """Random ids; the last ``labelled`` tokens (default: the second half) are the labelled assistant turn."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab - 1, (batch, seq)).astype(np.int32)
    loss_mask = np.zeros((batch, seq), np.float32)
    loss_mask[:, seq - (labelled or seq // 2):] = 1.0
    return ids, loss_mask


def _time(fn, steps, repeats=3):
    """Seconds per call: the best of ``repeats`` means over ``steps`` calls, after a warm-up (the CPU is shared)."""
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def speed(batch: int, seq: int, steps: int, scan_layers: bool = False, remat: str = "none") -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from fire_jax.convert.hf import config_to_hf

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = LlavaNextConfig.from_dict({**SMALL, "scan_layers": scan_layers, "remat": remat})
    ids, loss_mask = _batch(batch, seq, cfg.llm.vocab_size)

    # ---- ours
    tc = train_config(lr=1e-4, batch_size=batch, loss_chunk=seq)
    trainer = Trainer(LlavaNext(cfg, rngs=nnx.Rngs(0)), tc, loss_config(), 1000, make_mesh((1, 1, 1)))
    jbatch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones_like(jnp.asarray(ids)),
              "loss_mask": jnp.asarray(loss_mask), "turn_ids": jnp.asarray(np.where(loss_mask > 0, 2, -1))}
    state = {"s": trainer.initial_state}
    rng = jax.random.key(0)

    def ours():
        state["s"], metrics = trainer.step(state["s"], jbatch, rng)
        jax.block_until_ready(metrics["loss"])

    # ---- PyTorch + peft on the same architecture and shapes
    from transformers import LlavaNextConfig as HFConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    hf = LlavaNextForConditionalGeneration(HFConfig(**config_to_hf(cfg)))
    peft_model = get_peft_model(hf, LoraConfig(r=64, lora_alpha=256, lora_dropout=0.0,
                                               target_modules=r".*language_model.*\.(q_proj|k_proj)"))
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4,
                                  weight_decay=0.0)
    tids = torch.as_tensor(ids, dtype=torch.long)
    labels = torch.where(torch.as_tensor(loss_mask) > 0, tids, torch.full_like(tids, -100))

    def reference():
        optimizer.zero_grad()
        loss = peft_model(input_ids=tids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in peft_model.parameters() if p.requires_grad], 1.0)
        optimizer.step()

    tokens = batch * seq
    load_before = _load()
    t_ours, t_ref = _time(ours, steps), _time(reference, steps)
    print(f"\ntrain step, LLaVA-NeXT LLM dim {cfg.llm.dim} x {cfg.llm.layers} layers, vocab {cfg.llm.vocab_size}, "
          f"LoRA r64 on q,k, batch {batch} x seq {seq}, float32, CPU ({os.cpu_count()} cores), fire_jax "
          f"scan_layers={scan_layers} remat={remat}; best of 3 x {steps} steps; {load_before} before, "
          f"{_load()} after")
    print(f"{'implementation':32s} {'s/step':>8s} {'tokens/s':>10s} {'ratio':>6s}")
    print(f"{'transformers + peft (PyTorch)':32s} {t_ref:8.3f} {tokens / t_ref:10.0f} {1.0:6.2f}")
    print(f"{'fire_jax (jax.jit)':32s} {t_ours:8.3f} {tokens / t_ours:10.0f} {t_ref / t_ours:6.2f}")


def smollm2(shapes: list[tuple[int, int, int]], steps: int, model_spec: str = "smollm2-135m-instruct",
            scan_layers: bool = True) -> None:
    """LoRA train steps on SmolLM2-135M-Instruct's weights: fire_jax against transformers + peft."""
    import torch
    from peft import LoraConfig as PeftLora, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpu import flops_per_token

    torch.set_num_threads(os.cpu_count() or 1)
    path, model = smollm2_model(model_spec, scan_layers)
    llm, lora = model.cfg.llm, model.cfg.lora
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              torch_dtype=torch.float32)
    peft_model = get_peft_model(hf, PeftLora(r=32, lora_alpha=64, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    peak = matmul_rate()
    load_before = _load()
    rows = []
    for batch, seq, labelled in shapes:
        ids, loss_mask = _batch(batch, seq, llm.vocab_size, labelled=labelled)
        tc = train_config(lr=1e-4, batch_size=batch, loss_chunk=128)  # the main job's chunk
        trainer = Trainer(model, tc, loss_config(), 1000, make_mesh((1, 1, 1)))
        jbatch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones_like(jnp.asarray(ids)),
                  "loss_mask": jnp.asarray(loss_mask), "turn_ids": jnp.asarray(np.where(loss_mask > 0, 2, -1))}
        state = {"s": trainer.initial_state}
        rng = jax.random.key(0)
        flops = flops_per_token(llm, lora, seq)["4N"] * batch * seq

        def ours():
            state["s"], metrics = trainer.step(state["s"], jbatch, rng)
            jax.block_until_ready(metrics["loss"])

        tids = torch.as_tensor(ids, dtype=torch.long)
        labels = torch.where(torch.as_tensor(loss_mask) > 0, tids, torch.full_like(tids, -100))

        def reference():
            optimizer.zero_grad()
            peft_model(input_ids=tids, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in peft_model.parameters() if p.requires_grad], 1.0)
            optimizer.step()

        t_ours, t_ref = _time(ours, steps), _time(reference, steps)
        rows.append((batch, seq, int(loss_mask[0].sum()), t_ref, t_ours, flops))
        print(f"batch {batch} x {seq} done", flush=True)
    print(f"\ntrain step, SmolLM2-135M-Instruct ({os.path.basename(path)}, dequantized to float32 on both sides), "
          f"{llm.layers} layers, dim {llm.dim}, {llm.heads}/{llm.kv_heads} heads, vocab {llm.vocab_size}, tied; LoRA r32 "
          f"on q,k,v,o; CPU ({os.cpu_count()} cores); best of 3 x {steps} steps; {load_before} before, {_load()} after")
    print(f"float32 matmul rate, 2048^3 under jax.jit: {peak / 1e9:.0f} GFLOP/s")
    print("| batch x seq (labelled) | transformers + peft s/step | tokens/s | fire_jax s/step | tokens/s | ratio "
          "| model GFLOP/s (4N), peft / ours | of matmul rate, peft / ours |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for batch, seq, labelled, t_ref, t_ours, flops in rows:
        tokens = batch * seq
        print(f"| {batch} x {seq} ({labelled}) | {t_ref:.3f} | {tokens / t_ref:.0f} | {t_ours:.3f} | "
              f"{tokens / t_ours:.0f} | {t_ref / t_ours:.2f}x | {flops / t_ref / 1e9:.0f} / {flops / t_ours / 1e9:.0f} "
              f"| {flops / t_ref / peak:.0%} / {flops / t_ours / peak:.0%} |")


def smollm2_model(model_spec: str = "smollm2-135m-instruct", scan_layers: bool = True):
    """SmolLM2-135M-Instruct's LLM from its GGUF file, LoRA as configs/smollm2_llava.py (rank 32 on q, k, v, o)."""
    from fire_jax.convert.fetch import resolve_model
    from fire_jax.convert.gguf import TEXT_ONLY_VISION, llava_from_gguf
    from fire_jax.models import LoraConfig

    path = resolve_model(model_spec)
    lora = LoraConfig(rank=32, alpha=64.0, dropout=0.0, targets=("q", "k", "v", "o"))
    return path, llava_from_gguf(path, TEXT_ONLY_VISION, lora, scan_layers=scan_layers)


def profile(batch: int, seq: int, shape: str = "small") -> None:
    """Per-op time split of the speed part's step: a jax.profiler trace of two steps, leaf XLA ops classed
    by the shapes in their fused computation (a vocabulary-sized operand -> lm_head, MLP width -> MLP).
    ``shape="smollm2"``: the SmolLM2 part's model instead."""
    import collections
    import glob
    import gzip
    import json
    import re
    import tempfile

    model = smollm2_model()[1] if shape == "smollm2" else LlavaNext(LlavaNextConfig.from_dict(SMALL), rngs=nnx.Rngs(0))
    cfg = model.cfg
    ids, loss_mask = _batch(batch, seq, cfg.llm.vocab_size)
    trainer = Trainer(model, train_config(lr=1e-4, batch_size=batch, loss_chunk=seq),
                      loss_config(), 1000, make_mesh((1, 1, 1)))
    jbatch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones_like(jnp.asarray(ids)),
              "loss_mask": jnp.asarray(loss_mask), "turn_ids": jnp.asarray(np.where(loss_mask > 0, 2, -1))}
    state = {"s": trainer.initial_state}

    def step():
        state["s"], metrics = trainer.step(state["s"], jbatch, jax.random.key(0))
        jax.block_until_ready(metrics["loss"])

    step()
    directory = tempfile.mkdtemp(prefix="train_step_trace_")
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        step()
        step()
    trace = json.load(gzip.open(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)[0]))
    durations = collections.Counter()
    for event in trace["traceEvents"] if isinstance(trace, dict) else trace:
        if event.get("ph") == "X" and "dur" in event:
            durations[event["name"]] += event["dur"] / 2 / 1e3  # ms per step
    hlo = trainer.compiled_step(jbatch).lower(trainer.initial_state, trainer.frozen, jbatch,
                                              jax.random.key(0)).compile().as_text()
    bodies, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)
    calls = dict(re.findall(r"%?([\w.\-]+) = .*?calls=%?([\w.\-]+)", hlo))
    llm = cfg.llm

    def part(name):
        body = "\n".join(bodies.get(calls[name], []))
        dims = set(map(int, re.findall(r"\d+", " ".join(re.findall(r"\w+\[([\d,]*)\]", body)))))
        if " dot(" in body:
            if llm.vocab_size in dims:
                return "lm_head matmuls (logits, fused d hidden)"
            if llm.mlp_dim in dims:
                return "MLP matmuls"
            return "q, k, v, o projections (with LoRA), attention matmuls"
        if "exponential" in body or "reduce" in body:
            return "softmax, reductions"
        if "transpose" in body or "copy" in name:
            return "transposes, layout copies"
        return "elementwise, casts"

    parts = collections.Counter()
    for name, ms in durations.items():
        if name in calls:
            parts[part(name)] += ms
    total = sum(parts.values())
    print(f"\nper-op time split, one step ({total:.0f} ms of leaf XLA ops; {_load()})")
    for name, ms in parts.most_common():
        print(f"  {name:48s} {ms:8.1f} ms {ms / total:6.1%}")


def flops_per_token_8b() -> None:
    """Matmul FLOPs per trained token for the frozen-base LoRA step (LLaVA-NeXT-8B sizes, seq 3072)."""
    from gpu import flops_per_token

    flops = flops_per_token(LlavaNextConfig().llm, LlavaNextConfig().lora, 3072)
    print(f"\n8B step FLOPs per token (seq 3072): dense params {flops['dense_params'] / 1e9:.2f}B, "
          f"forward {flops['forward'] / 1e9:.1f} GFLOP")
    print(f"  model FLOPs, frozen base + LoRA: 4N-style = forward + input-gradient backward = "
          f"{flops['4N'] / 1e9:.1f} GFLOP/token (no weight gradients for frozen weights, so not 6N = "
          f"{flops['6N'] / 1e9:.1f})")
    print(f"  hardware FLOPs with full remat (forward recomputed): {(flops['4N'] + flops['forward']) / 1e9:.1f} "
          f"GFLOP/token")


def memory_8b(dtype: str | None, base: str = "llava_next_8b") -> None:
    """The FIRE student step of ``base`` (configs/fire.py's bases: llava_next_8b, llava_next_vicuna_7b,
    llava_15_vicuna_7b). ``dtype`` overrides the config's bfloat16 weights and activations. XLA:CPU computes bf16 dots in
    float32 and hoists those casts out of the micro-batch loop, so a bf16 analysis on CPU holds a float32
    copy of every frozen weight that a GPU would not; at float32 there is no cast, and any weight copy
    the step makes shows up as such."""
    from fire_jax.convert.hf import abstract_model
    from fire_jax.core.config import load_config

    config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "fire_student.py") + f":base={base}")
    if dtype:
        config.model.dtype = config.model.param_dtype = dtype
    cfg = LlavaNextConfig.from_dict(config.model)
    mesh = make_mesh((1, 8, 1))
    start = time.perf_counter()
    trainer = Trainer(abstract_model(cfg), config.train, config.loss, 1000, mesh, abstract=True)
    b, s, tiles = config.train.batch_size, config.data.max_len, cfg.geometry.max_tiles
    shapes = {"input_ids": (b, s), "attention_mask": (b, s), "loss_mask": (b, s), "turn_ids": (b, s),
              "pixel_values": (b, tiles, 3, cfg.vision.image_size, cfg.vision.image_size), "image_index": (b, s)}
    dtypes = {"loss_mask": jnp.float32, "pixel_values": jnp.float32}
    batch = {k: jax.ShapeDtypeStruct(v, dtypes.get(k, jnp.int32)) for k, v in shapes.items()}
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    compiled = trainer.compiled_step(batch).lower(trainer.initial_state, trainer.frozen, batch, rng).compile()
    mem = compiled.memory_analysis()
    gib = 2 ** 30
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    print(f"\n{base} student step, global batch {b} x {s} tokens ({config.train.accum_steps} micro-batches), "
          f"mesh (data 1, fsdp 8, tensor 1), remat {cfg.remat}, scan_layers {cfg.scan_layers}, weights and "
          f"activations {cfg.param_dtype}/{cfg.dtype}, compiled in {time.perf_counter() - start:.0f}s")
    print(f"  per device: arguments {mem.argument_size_in_bytes / gib:.2f} GiB, temporaries "
          f"{mem.temp_size_in_bytes / gib:.2f} GiB, outputs {mem.output_size_in_bytes / gib:.2f} GiB, "
          f"aliased {mem.alias_size_in_bytes / gib:.2f} GiB -> peak ~{total / gib:.2f} GiB (limit 80 GB = 74.5 GiB)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("all", "speed", "profile", "flops", "memory", "smollm2"), default="all")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scan_layers", action="store_true", help="speed: fire_jax with stacked, scanned layers")
    parser.add_argument("--remat", default="none", help="speed: fire_jax's remat policy")
    parser.add_argument("--shape", choices=("small", "smollm2"), default="small", help="profile: which model")
    parser.add_argument("--dtype", default=None, help="memory part: override the 8B config's bfloat16")
    parser.add_argument("--base", default="llava_next_8b",
                        help="memory part: the FIRE base model (llava_next_8b, llava_next_vicuna_7b, llava_15_vicuna_7b)")
    args = parser.parse_args()
    if args.part in ("all", "speed"):
        speed(args.batch, args.seq, args.steps, args.scan_layers, args.remat)
    if args.part in ("all", "profile"):
        profile(args.batch, args.seq, args.shape)
    if args.part in ("all", "flops"):
        flops_per_token_8b()
    if args.part in ("all", "memory"):
        memory_8b(args.dtype, args.base)
    if args.part in ("all", "smollm2"):
        smollm2([(8, 256, 16), (8, 512, 256)], max(2, args.steps // 2))


if __name__ == "__main__":
    from fire_jax.core.hugepages import reexec_with_huge_pages

    reexec_with_huge_pages()  # both sides of the comparison run in this process
    main()
