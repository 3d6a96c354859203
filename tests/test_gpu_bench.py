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
    # 4 dialogues x 2 turns: turn 1 prompts 120 tokens, turn 2 120 + 4 answer + 40 feedback; turn 2 reuses the
    # keys of turn 1's prompt and answer (all but the answer's last token, which was fed but never written)
    assert off["prompt_tokens"] == 4 * (120 + 164) and on["reused_tokens"] == 4 * (120 + 4 - 1)
    assert on["same_tokens_as_off"] is True and on["identical_answers"] == 4 * 2 and on["mean_common_prefix"] == 4
    assert on["first_logprob_max_diff"] < 1e-4
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["prefill_s"] > 0 for r in rows if r["kind"] == "decode")
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header + one line per row
    assert lines[-2].startswith(f"dialogue: prefill tokens {off['prefilled_tokens']:,} -> {on['prefilled_tokens']:,} (")


def test_cudnn_attention_is_the_gpu_default():
    assert gpu.attention_kernel("gpu", "cudnn") == "cudnn" and gpu.attention_kernel("gpu", "xla") == "auto"
    assert gpu.attention_kernel("cpu", "cudnn") == "auto"
    assert "attention_kernel" in gpu.main.__code__.co_names  # main sets the kernel before any part runs


def test_parts_pick_and_order_the_rows():
    rows = gpu.main(["--tiny", "--repeats", "1", "--parts", "dialogue,decode", "--decode_batches", "1"],
                    print_fn=lambda line: None)
    assert [r["kind"] for r in rows] == ["dialogue", "dialogue", "decode"]


def test_flops_per_token_8b():
    """Llama-3-8B: 6.98B dense layer params + the 525M lm_head; 4N is two thirds of 6N plus the LoRA factors'
    weight gradients (r64 on q: 4096 -> 4096, on k: 4096 -> 1024)."""
    from fire_jax.models import LlamaConfig, LoraConfig

    flops = gpu.flops_per_token(LlamaConfig(), LoraConfig(), 3072)
    assert abs(flops["dense_params"] - (32 * 218_103_808 + 4096 * 128320)) == 0
    assert flops["forward"] == 2 * flops["dense_params"] + 2 * 32 * 3072 * 32 * 128
    assert flops["4N"] - 2 * flops["forward"] == 4 * 32 * 64 * ((4096 + 4096) + (4096 + 1024))


def test_agreement_stops_at_a_dialogues_first_differing_turn():
    """Once a turn's answers differ, the dialogue's later prompts differ too: they are not compared."""
    off = [[([1, 2, 3], [-0.5, -1, -1]), ([4, 5, 6], [-1.0, -1, -1])],
           [([7, 8, 9], [-0.25, -1, -1]), ([1, 1, 1], [-2.0, -1, -1])]]
    on = [[([1, 2, 3], [-0.5, -1, -1]), ([4, 9, 9], [-1.5, -1, -1])],
          [([7, 8, 0], [-0.375, -1, -1]), ([1, 1, 1], [-9.0, -1, -1])]]
    assert gpu._agreement(off, on) == dict(same_tokens_as_off=False, identical_answers=1,
                                           mean_common_prefix=(3 + 2 + 1) / 3, first_logprob_max_diff=0.5)
