"""Free dialogues (a student and a teacher, FIRE-Bench's loop) with the engine's prefix cache off and on.

    python benchmarks/dialogue.py                        # configs/tiny.py's model, random weights
    python benchmarks/dialogue.py --model smollm2        # configs/smollm2_llava.py's shape, random weights
    python benchmarks/dialogue.py --model smollm2 --gguf # ... with the fetched SmolLM2-135M-Instruct weights

:func:`fire_jax.infer.dialogue.run_dialogues` over ``--items`` items of the
shipped synthetic test set, ``--batch`` dialogues in flight, one model as the
student and the teacher (``history="latest"``, as free dialogues), greedy, as
``fire_jax.evaluate`` runs them. Each call goes through the agents'
continuous-batching engine; with the prefix cache on, the engine keeps every
dialogue's keys and values between calls: the student's prompt at turn k is
its prompt at turn k - 1 followed by r_{k-1} and f_{k-1}, the teacher's
repeats the question, groundtruth and instruction, so only the rest is
prefilled.

Random weights write no score line, so every dialogue would stop after its
first turn ("no_score"): here the teacher's reply to turn k is scored k (the
text is the model's own), so every dialogue runs ``--turns`` turns and both
settings run the same calls on the same prompts. Each setting runs once
untimed (every shape compiled), then timed with fresh agents (empty caches).
The texts of both settings are compared; prefill tokens are the prompt
tokens the engines computed (not reused), tokens/s the generated tokens over
the wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load_model(name: str, gguf: bool):
    from fire_jax.config import DEFAULT_CONFIG, load_config
    from fire_jax.infer.loading import load

    config = load_config(DEFAULT_CONFIG if name == "tiny" else os.path.join(ROOT, "configs", "smollm2_llava.py"))
    if name != "tiny" and not gguf:
        config.init.gguf = ""  # random weights of SmolLM2-135M's shape (its tokenizer is still the fetched one)
    loaded = load(config)
    if name == "tiny":  # unit-scale embeddings, as tests/test_engine.py: greedy texts vary instead of repeating
        embed = loaded.model.language_model.model.embed_tokens.embedding
        embed.set_value(embed.get_value() * 50)
    return loaded


def rising_teacher(loaded, decode):
    """The model as the teacher, its reply to turn k scored k (so no dialogue stops before ``max_turns``)."""
    from fire_jax.infer.agents import Feedback, Teacher

    class RisingTeacher(Teacher):
        def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None):
            out = super().feedback(images, questions, groundtruths, answers, histories, rng=rng)
            histories = histories or [()] * len(out)
            return [Feedback(f.text, float(len(h) + 1)) for f, h in zip(out, histories)]

    return RisingTeacher(loaded.model, loaded.chat, decode, history="latest", batch_size=0)


def run(loaded, items, args, prefix_cache: bool) -> dict:
    from fire_jax.infer.agents import Student
    from fire_jax.infer.decode import DecodeConfig
    from fire_jax.infer.dialogue import StopRule, run_dialogues

    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, prefix_cache=prefix_cache)
    student = Student(loaded.model, loaded.chat, decode)
    teacher = rising_teacher(loaded, decode)
    finished = []
    start = time.perf_counter()
    steps = run_dialogues(items, student, teacher, StopRule(max_turns=args.turns), batch_size=args.batch,
                          on_finish=finished.append)
    wall = time.perf_counter() - start
    stats = [agent._engine.stats for agent in (student, teacher)]
    total = lambda key: sum(s[key] for s in stats)
    texts = {d.item.id: [(t.response, t.feedback) for t in d.turns] for d in finished}
    return dict(wall=wall, steps=steps, texts=texts, prompt=total("prompt_tokens"), reused=total("reused_tokens"),
                prefilled=total("prefilled_tokens"), generated=total("tokens"),
                turns=sum(len(d.turns) for d in finished))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--gguf", action="store_true", help="smollm2: the fetched GGUF weights, not random ones")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="dialogues in flight")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from fire_jax.config import resolve_path
    from fire_jax.data.items import load_triplets

    loaded = load_model(args.model, args.gguf)
    items = load_triplets(resolve_path("assets:synthetic_fire/test.json"), "assets:synthetic_fire/images",
                          max_examples=args.items)[:args.items]
    print(f"{args.model}: {len(items)} items, {args.batch} in flight, {args.turns} turns, "
          f"max_new_tokens {args.max_new_tokens}")
    results = {}
    for name, on in (("off", False), ("on", True)):
        run(loaded, items, args, on)  # compiles every shape this workload meets
        results[name] = r = run(loaded, items, args, on)
        print(f"cache {name:3s}: wall {r['wall']:7.2f} s, {r['turns']} turns in {r['steps']} steps, prompt tokens "
              f"{r['prompt']}, reused {r['reused']}, prefill tokens {r['prefilled']}, generated {r['generated']} "
              f"({r['generated'] / r['wall']:.1f} tokens/s, {r['prompt'] / r['wall']:.1f} prompt tokens/s)")
    off, on = results["off"], results["on"]
    print(f"texts identical with and without the cache: {off['texts'] == on['texts']}")
    print(f"dialogue: prefill tokens {off['prefilled']} -> {on['prefilled']} "
          f"({off['prefilled'] / max(on['prefilled'], 1):.2f}x fewer), wall {off['wall']:.2f} -> {on['wall']:.2f} s "
          f"({off['wall'] / on['wall']:.2f}x faster)")


if __name__ == "__main__":
    main()
