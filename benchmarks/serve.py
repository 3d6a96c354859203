"""Continuous batching vs fixed batches vs transformers generate, at 1 / 8 / 32 concurrent clients (issue 16).

    python benchmarks/serve.py [--requests 64] [--clients 1,8,32] [--no-hf]

The same mixed workload (text prompts of 16..400 tokens, max_tokens 4..64, so
rows end at different steps) on one randomly initialised LLaVA-NeXT-shaped
model, greedy, no stop ids:

- engine: ``clients`` threads, each sending its next request when the last
  one is answered, into :class:`fire_jax.infer.engine.Engine` (``clients`` slots);
- fixed: the requests in arrival order in batches of ``clients`` through
  :func:`fire_jax.infer.decode.generate` (every row waits for the longest);
- transformers: the same batches through HF ``generate`` (left padding).

Prints tokens/s (generated tokens over wall time) and per-request latency
p50 / p95 (a fixed batch's requests all finish when it does). Compiles are
warmed up first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def workload(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab - 2, int(rng.integers(16, 400))).tolist(), int(rng.integers(4, 65)))
            for _ in range(n)]


def run_engine(model, requests, clients):
    from fire_jax.infer.engine import Engine, Request

    engine = Engine(model, slots=clients, cache_len=576, prefill_batch=min(4, clients), chunk=16, stop_ids=())
    engine.generate([Request(p, max_tokens=m, stop_ids=()) for p, m in requests[:clients]])  # warm-up compiles
    for bucket in (64, 128, 256, 512):
        engine.generate([Request([1] * (bucket - 8), max_tokens=2, stop_ids=())])
    engine.start()
    todo = list(enumerate(requests))
    lock, latencies, tokens = threading.Lock(), [], [0]

    def client():
        while True:
            with lock:
                if not todo:
                    return
                _, (prompt, m) = todo.pop(0)
            start = time.perf_counter()
            result = engine.submit(Request(prompt, max_tokens=m, stop_ids=())).wait()
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += len(result.tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    engine.stop()
    return tokens[0] / wall, latencies


def run_fixed(model, requests, clients):
    from fire_jax.infer.decode import DecodeConfig, generate

    def batches():
        for i in range(0, len(requests), clients):
            yield requests[i:i + clients]

    for batch in batches():  # warm-up: every (bucket, max_new) shape
        generate(model, [[1]] * len(batch), config=DecodeConfig(max_new_tokens=max(m for _, m in batch), stop_ids=()),
                 pad_rows=clients)
        generate(model, [p for p, _ in batch], config=DecodeConfig(max_new_tokens=2, stop_ids=()), pad_rows=clients)
    latencies, tokens, start = [], 0, time.perf_counter()
    for batch in batches():
        out = generate(model, [p for p, _ in batch], config=DecodeConfig(max_new_tokens=max(m for _, m in batch),
                                                                          stop_ids=()), pad_rows=clients)
        tokens += sum(m for _, m in batch)  # a row's tokens beyond its max_tokens are discarded
        latencies += [time.perf_counter() - start] * len(batch)
        del out
    wall = time.perf_counter() - start
    return tokens / wall, latencies


def run_hf(hf, requests, clients):
    import torch

    latencies, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(requests), clients):
        batch = requests[i:i + clients]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, (p, _) in enumerate(batch):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(m for _, m in batch), do_sample=False,
                        min_new_tokens=max(m for _, m in batch), pad_token_id=0)
        tokens += sum(m for _, m in batch)
        latencies += [time.perf_counter() - start] * len(batch)
    return tokens / (time.perf_counter() - start), latencies


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()

    import torch

    from fire_jax.convert.hf import load_hf_checkpoint
    from hf_reference import tiny_hf_model

    torch.set_num_threads(os.cpu_count())
    directory = tempfile.mkdtemp()
    hf = tiny_hf_model(directory)
    model = load_hf_checkpoint(directory)
    requests = workload(args.requests, hf.config.text_config.vocab_size - 1)
    print(f"{len(requests)} requests, prompts {min(len(p) for p, _ in requests)}..{max(len(p) for p, _ in requests)} "
          f"tokens, max_tokens {min(m for _, m in requests)}..{max(m for _, m in requests)}; tiny LLaVA-NeXT "
          f"(tests/hf_reference.py), CPU")
    print("| clients | path | tokens/s | p50 s | p95 s | vs fixed | vs transformers |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for clients in map(int, args.clients.split(",")):
        rows = {"engine": run_engine(model, requests, clients), "fixed": run_fixed(model, requests, clients)}
        if not args.no_hf:
            rows["transformers"] = run_hf(hf, requests, clients)
        for path, (rate, lat) in rows.items():
            vs = lambda ref: f"{rate / rows[ref][0]:.2f}x" if ref in rows else "-"
            print(f"| {clients} | {path} | {rate:.0f} | {np.percentile(lat, 50):.2f} | {np.percentile(lat, 95):.2f} "
                  f"| {vs('fixed')} | {vs('transformers')} |", flush=True)


if __name__ == "__main__":
    main()
