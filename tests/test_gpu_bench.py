"""benchmarks/gpu.py runs end to end on CPU with --tiny: every table row is there, with finite figures."""

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gpu  # noqa: E402


def test_tiny_gpu_benchmark_runs_on_cpu():
    lines = []
    rows = gpu.main(["--tiny", "--repeats", "1"], print_fn=lines.append)
    assert [(r["kind"], r["batch"]) for r in rows] == [("train", 1), ("train", 2), ("decode", 1), ("decode", 2),
                                                      ("dialogue", 4), ("dialogue", 4)]
    off, on = rows[-2:]
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True) and off["prompt_tokens"] == on["prompt_tokens"]
    assert off["reused_tokens"] == 0 and off["prefilled_tokens"] == off["prompt_tokens"]
    assert on["reused_tokens"] > 0 and on["prefilled_tokens"] == on["prompt_tokens"] - on["reused_tokens"]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["prefill_s"] > 0 for r in rows if r["kind"] == "decode")
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header + one line per row


def test_flops_per_token_8b():
    """Llama-3-8B: 6.98B dense layer params + the 525M lm_head; 4N is two thirds of 6N plus the LoRA factors'
    weight gradients (r64 on q: 4096 -> 4096, on k: 4096 -> 1024)."""
    from fire_jax.models import LlamaConfig, LoraConfig

    flops = gpu.flops_per_token(LlamaConfig(), LoraConfig(), 3072)
    assert abs(flops["dense_params"] - (32 * 218_103_808 + 4096 * 128320)) == 0
    assert flops["forward"] == 2 * flops["dense_params"] + 2 * 32 * 3072 * 32 * 128
    assert flops["4N"] - 2 * flops["forward"] == 4 * 32 * 64 * ((4096 + 4096) + (4096 + 1024))
