"""Continuous batching vs fixed batches vs transformers generate, at 1 / 8 / 32 concurrent clients.

    python benchmarks/serve.py                          # dim 256 x 4 layers, vocab 32000 (as benchmarks/decode.py)
    python benchmarks/serve.py --clients 32 --repeats 3 [--no_hf] [--dim 512 --layers 8]
    python benchmarks/serve.py --runner                 # a batch runner's calls: fixed batches vs the engine

The same mixed workload (``--requests`` text prompts of 16..400 tokens,
max_tokens 4..64, so rows end at different steps) on one randomly
initialised Llama-shaped LLaVA-NeXT (float32, the same weights on both
sides), greedy, no stop ids. ``clients`` closed-loop clients: each sends its
next request when its last one is answered.

- engine: the clients' threads submit to :class:`fire_jax.infer.engine.Engine`
  (``clients`` slots, and the server's default of 32 slots when fewer clients;
  built as ``fire_jax.serve`` builds it: no log-probs, the shortest cache that
  holds the workload);
- fixed: the clients' requests in batches of ``clients`` through
  :func:`fire_jax.infer.decode.generate` (every row waits for the longest; a
  client waits for its batch);
- transformers: the same batches through HF ``generate`` (left padding).

Every path first runs the whole workload once untimed, so every shape it
meets is compiled (JAX) or allocated (PyTorch) before the clock starts; then
best of ``--repeats`` timed runs. tokens/s = generated tokens (a row's tokens
beyond its max_tokens are not counted) over wall time; latency = from a
request's submission to its answer (for a fixed batch, the batch's time).

``--runner`` asks whether the batch runners (free dialogues, FIRE-1M
generation, VLRMBench: calls of ``--calls`` prompts) gain from the engine
underneath: the same requests as fixed batches (``decode.generate``), as one
engine call per batch (what an in-process agent does: a slot per row, one
decode width), and given to the engine all at once (what a runner could do
with requests that do not depend on each other, e.g. one VLRMBench task).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def workload(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab - 2, int(rng.integers(16, 400))).tolist(), int(rng.integers(4, 65)))
            for _ in range(n)]


def batches(requests, size: int):
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def best(run, repeats: int):
    """(tokens/s, latencies) of the fastest of ``repeats`` timed runs, after one untimed run of the same work."""
    run()
    return max((run() for _ in range(repeats)), key=lambda r: r[0])


def cache_len(requests, bucket_step: int | None = None, **_) -> int:
    """The shortest cache (a multiple of 64) that holds every request's prompt bucket + max_tokens."""
    from fire_jax.infer.buckets import Buckets

    return -(-max(Buckets(64, bucket_step).prompt(len(p)) + m for p, m in requests) // 64) * 64


def engine_path(model, requests, clients: int, slots: int, repeats: int, **engine_kwargs):
    from fire_jax.infer.engine import Engine
    from fire_jax.infer.requests import Request
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams

    engine = Engine(model, EngineConfig(**{"bucket_step": None, **engine_kwargs}, slots=slots, chunk=16,
                                        cache_len=cache_len(requests, **engine_kwargs),
                                        logprobs=False))  # as fire_jax.serve builds it
    engine.warm_up()  # which (width, window) shapes a run meets depends on the threads' timing
    engine.start()

    def run():
        todo, lock, latencies, tokens = list(requests), threading.Lock(), [], [0]

        def client():
            while True:
                with lock:
                    if not todo:
                        return
                    prompt, max_tokens = todo.pop(0)
                start = time.perf_counter()
                result = engine.submit(Request(prompt, SamplingParams(max_tokens=max_tokens, stop_ids=()))).wait()
                with lock:
                    latencies.append(time.perf_counter() - start)
                    tokens[0] += len(result.tokens)

        start = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tokens[0] / (time.perf_counter() - start), latencies

    try:
        return best(run, repeats)
    finally:
        engine.stop()


def fixed_path(model, requests, clients: int, repeats: int):
    from fire_jax.infer.decode import generate
    from fire_jax.infer.sampling import SamplingParams

    def run():
        latencies, tokens, start = [], 0, time.perf_counter()
        for batch in batches(requests, clients):
            began = time.perf_counter()
            generate(model, [p for p, _ in batch], pad_rows=clients,
                     sampling=SamplingParams(max_tokens=max(m for _, m in batch), stop_ids=()))
            latencies += [time.perf_counter() - began] * len(batch)
            tokens += sum(m for _, m in batch)
        return tokens / (time.perf_counter() - start), latencies

    return best(run, repeats)


def hf_path(hf, requests, clients: int, repeats: int):
    import torch

    def run():
        latencies, tokens, start = [], 0, time.perf_counter()
        for batch in batches(requests, clients):
            began = time.perf_counter()
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, (p, _) in enumerate(batch):
                ids[b, width - len(p):] = torch.tensor(p)
                mask[b, width - len(p):] = 1
            new = max(m for _, m in batch)
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)
            latencies += [time.perf_counter() - began] * len(batch)
            tokens += sum(m for _, m in batch)
        return tokens / (time.perf_counter() - start), latencies

    return best(run, repeats)


def runner_paths(model, batch: int, n: int, repeats: int, **engine_kwargs) -> dict:
    """tokens/s of n requests in calls of ``batch``: fixed batches, one engine call per batch, one engine call."""
    from fire_jax.infer.decode import generate
    from fire_jax.infer.engine import Engine
    from fire_jax.infer.requests import Request
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams

    requests = workload(n, model.cfg.llm.vocab_size - 1, seed=1)
    tokens = sum(m for _, m in requests)
    engine_kwargs = {"bucket_step": 1024, **engine_kwargs}  # an agent's engine pads prompts as generate does
    engine = Engine(model, EngineConfig(**engine_kwargs, slots=batch, cache_len=cache_len(requests, **engine_kwargs),
                                        chunk=16, min_width=batch, logprobs=False))
    as_requests = lambda group: [Request(p, SamplingParams(max_tokens=m, stop_ids=())) for p, m in group]
    paths = {
        "fixed batches (generate)": lambda: [
            generate(model, [p for p, _ in group], pad_rows=batch,
                     sampling=SamplingParams(max_tokens=max(m for _, m in group), stop_ids=()))
            for group in batches(requests, batch)],
        "engine, one call per batch": lambda: [engine.generate(as_requests(group))
                                               for group in batches(requests, batch)],
        "engine, all requests at once": lambda: engine.generate(as_requests(requests)),
    }

    def timed(run):
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return tokens / min(times)

    return {name: timed(run) for name, run in paths.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no_hf", action="store_true")
    parser.add_argument("--runner", action="store_true", help="the batch runners' comparison instead")
    parser.add_argument("--calls", default="8,16,32", help="--runner: rows per call")
    parser.add_argument("--prefill_batch", type=int,
                        help="the engine's rows per prefill at most (default: the Engine's)")
    parser.add_argument("--prefill_tokens", type=int, help="the engine's padded tokens per prefill at most (default: "
                        "the Engine's)")
    parser.add_argument("--bucket_step", type=int, help="the engine's prompt buckets (buckets.Buckets): powers of two "
                        "up to this step (default: none, the server's finer buckets; --runner: 1024, as an agent's)")
    args = parser.parse_args()
    engine_kwargs = {k: getattr(args, k) for k in ("prefill_batch", "prefill_tokens", "bucket_step")
                     if getattr(args, k) is not None}

    import jax
    import torch

    from decode import build
    from fire_jax.convert.hf import load_hf_checkpoint

    torch.set_num_threads(os.cpu_count())
    directory = tempfile.mkdtemp(prefix="serve_bench_")
    hf = build(directory, args.dim, args.layers, args.vocab)
    model = load_hf_checkpoint(directory, lora=None)
    requests = workload(args.requests, args.vocab - 1)
    load = os.getloadavg()
    if args.runner:
        print(f"load average {load[0]:.2f} at start; model dim {args.dim}, {args.layers} layers; best of "
              f"{args.repeats} after a warm-up run\n")
        print("| calls of | requests | path | tokens/s | vs fixed |\n|---:|---:|---|---:|---:|")
        for batch in map(int, args.calls.split(",")):
            rates = runner_paths(model, batch, args.requests, args.repeats, **engine_kwargs)
            fixed = rates["fixed batches (generate)"]
            for name, rate in rates.items():
                print(f"| {batch} | {args.requests} | {name} | {rate:.0f} | {rate / fixed:.2f}x |", flush=True)
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
        return
    print(f"jax {jax.__version__} | torch {torch.__version__} ({torch.get_num_threads()} threads) | {os.cpu_count()} "
          f"CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    print(f"{len(requests)} requests, prompts {min(len(p) for p, _ in requests)}..{max(len(p) for p, _ in requests)} "
          f"tokens, max_tokens {min(m for _, m in requests)}..{max(m for _, m in requests)}; model dim {args.dim}, "
          f"{args.layers} layers, vocab {args.vocab}, float32; best of {args.repeats} after a warm-up run\n")
    print("| clients | path | tokens/s | p50 s | p95 s | vs fixed | vs transformers |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for clients in map(int, args.clients.split(",")):
        rows = {f"engine ({clients} slots)": engine_path(model, requests, clients, clients, args.repeats,
                                                         **engine_kwargs)}
        if clients < 32:
            rows["engine (32 slots, the server's default)"] = engine_path(model, requests, clients, 32, args.repeats,
                                                                          **engine_kwargs)
        rows["fixed"] = fixed_path(model, requests, clients, args.repeats)
        if not args.no_hf:
            rows["transformers"] = hf_path(hf, requests, clients, args.repeats)
        for path, (rate, latencies) in rows.items():
            vs = lambda ref: f"{rate / rows[ref][0]:.2f}x" if ref in rows else "-"
            print(f"| {clients} | {path} | {rate:.0f} | {np.percentile(latencies, 50):.2f} | "
                  f"{np.percentile(latencies, 95):.2f} | {vs('fixed')} | {vs('transformers')} |", flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")


if __name__ == "__main__":
    main()
