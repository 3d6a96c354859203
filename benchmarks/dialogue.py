"""Free dialogues (a student and a teacher, FIRE-Bench's loop) with the engine's prefix cache off and on.

    python benchmarks/dialogue.py                        # configs/tiny.py's model, random weights
    python benchmarks/dialogue.py --model smollm2        # configs/smollm2_llava.py's shape, random weights
    python benchmarks/dialogue.py --model smollm2 --gguf # ... with the fetched SmolLM2-135M-Instruct weights
    python benchmarks/dialogue.py --workload generation  # FIRE-1M-style generation (tools/make_fire1m.py's loop)

:func:`fire_jax.dialogue.loop.run_dialogues` over ``--items`` items of the
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

``--workload generation`` times FIRE-1M-style data generation the same way:
:func:`fire_jax.dialogue.fire1m.make_fire_records` (Fig. 3b: 3 turns, no stop
on a score that does not rise, records written to a temporary JSONL), and
compares the written records instead of the texts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load_model(name: str, gguf: bool):
    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.infer.loading import load

    config = load_config(DEFAULT_CONFIG if name == "tiny" else os.path.join(ROOT, "configs", "smollm2_llava.py"))
    if name != "tiny" and not gguf:
        config.init.gguf = ""  # random weights of SmolLM2-135M's shape (its tokenizer is still the fetched one)
    loaded = load(config)
    if name == "tiny":  # unit-scale embeddings, as tests/test_engine.py: greedy texts vary instead of repeating
        embed = loaded.model.language_model.model.embed_tokens.embedding
        embed.set_value(embed.get_value() * 50)
    return loaded


def rising_teacher(loaded, sampling, engine, score_line: bool = False):
    """The model as the teacher, its reply to turn k scored k (so no dialogue stops before ``max_turns``);
    ``score_line`` writes that score into the reply ("Score: k.\nFeedback: <text>"), as FIRE records need."""
    from fire_jax.dialogue.agents import Feedback, Teacher
    from fire_jax.infer.backends import InProcess

    class RisingTeacher(Teacher):
        def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None):
            out = super().feedback(images, questions, groundtruths, answers, histories, rng=rng)
            histories = histories or [()] * len(out)
            scores = [len(h) + 1 for h in histories]
            return [Feedback(f"Score: {k}.\nFeedback: {f.text.strip() or '-'}" if score_line else f.text, float(k))
                    for f, k in zip(out, scores)]

    return RisingTeacher(InProcess(loaded.model, loaded.chat, sampling, engine=engine), history="latest")


def run(loaded, items, args, prefix_cache: bool) -> dict:
    import json
    import tempfile

    from fire_jax.dialogue.agents import Student
    from fire_jax.infer.backends import InProcess
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.dialogue.fire1m import make_fire_records
    from fire_jax.dialogue.loop import run_dialogues
    from fire_jax.dialogue.stop import FIRE_1M_GENERATION, StopRule

    sampling, engine = SamplingParams(max_tokens=args.max_new_tokens), EngineConfig(prefix_cache=prefix_cache)
    student = Student(InProcess(loaded.model, loaded.chat, sampling, engine=engine))
    teacher = rising_teacher(loaded, sampling, engine, score_line=args.workload == "generation")
    finished = []
    steps = 0
    start = time.perf_counter()
    if args.workload == "generation":
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "fire_1m.jsonl")
            make_fire_records(items, student, teacher, out, rule=FIRE_1M_GENERATION, batch_size=args.batch)
            wall = time.perf_counter() - start
            with open(out) as f:
                records = [json.loads(line) for line in f]
        texts = {r["id"]: r["conversations"] for r in records}
        turns = sum(r["round"] for r in records)
    else:
        steps = run_dialogues(items, student, teacher, StopRule(max_turns=args.turns), batch_size=args.batch,
                              on_finish=finished.append)
        wall = time.perf_counter() - start
        texts = {d.item.id: [(t.response, t.feedback) for t in d.turns] for d in finished}
        turns = sum(len(d.turns) for d in finished)
    stats = [agent.backend._engine.stats for agent in (student, teacher)]
    total = lambda key: sum(s[key] for s in stats)
    return dict(wall=wall, steps=steps, texts=texts, prompt=total("prompt_tokens"), reused=total("reused_tokens"),
                prefilled=total("prefilled_tokens"), generated=total("tokens"), turns=turns,
                in_steps=f" in {steps} steps" if steps else "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--gguf", action="store_true", help="smollm2: the fetched GGUF weights, not random ones")
    parser.add_argument("--workload", choices=("dialogues", "generation"), default="dialogues",
                        help="free dialogues (FIRE-Bench), or FIRE-1M-style generation (3 turns, records written)")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="dialogues in flight")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from fire_jax.core.config import resolve_path
    from fire_jax.data.items import load_triplets

    loaded = load_model(args.model, args.gguf)
    items = load_triplets(resolve_path("assets:synthetic_fire/test.json"), "assets:synthetic_fire/images",
                          max_examples=args.items)[:args.items]
    turns = 3 if args.workload == "generation" else args.turns
    print(f"{args.model}, {args.workload}: {len(items)} items, {args.batch} in flight, {turns} turns, "
          f"max_new_tokens {args.max_new_tokens}; load average " + "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    results = {}
    for name, on in (("off", False), ("on", True)):
        run(loaded, items, args, on)  # compiles every shape this workload meets
        results[name] = r = run(loaded, items, args, on)
        print(f"cache {name:3s}: wall {r['wall']:7.2f} s, {r['turns']} turns{r['in_steps']}, prompt tokens "
              f"{r['prompt']}, reused {r['reused']}, prefill tokens {r['prefilled']}, generated {r['generated']} "
              f"({r['generated'] / r['wall']:.1f} tokens/s, {r['prompt'] / r['wall']:.1f} prompt tokens/s)")
    off, on = results["off"], results["on"]
    print(f"texts identical with and without the cache: {off['texts'] == on['texts']} ({len(on['texts'])} "
          f"{'records' if args.workload == 'generation' else 'dialogues'}); load average "
          + "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    label = "generation" if args.workload == "generation" else "dialogue"
    print(f"{label}: prefill tokens {off['prefilled']} -> {on['prefilled']} "
          f"({off['prefilled'] / max(on['prefilled'], 1):.2f}x fewer), wall {off['wall']:.2f} -> {on['wall']:.2f} s "
          f"({off['wall'] / on['wall']:.2f}x faster)")


if __name__ == "__main__":
    from fire_jax.core.hugepages import reexec_with_huge_pages

    reexec_with_huge_pages()  # both sides of the comparison run in this process
    main()
