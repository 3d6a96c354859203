"""What a model writes for two values side by side: the comparison stage's own format, every ordered pair.

The ``smollm2,compare`` variant of the main job trains a comparison stage (``configs/main_job.py``,
``compare_train``) on text-only comparisons in the teacher's words (``synthetic.comparison_records``):

    Groundtruth: There are 5.
    Answer: There are 2.          -> "Score: 2.\\nFeedback: Your count is too low. Count them again.\\n"

This probe asks a model for that reply on every ordered pair of two different values of each task (counts 1..7,
bars 1..5, the six colours: 42 + 20 + 30 pairs, seen in training or not), greedy, through fire_jax's engine with
the main job's decode settings and the chat template's system prompt, as the stage trained. It scores each reply
with the exact judge's ``rule_check``: is the feedback the rule's direction, is the score the rule's distance
score. Run on the comparison stage's export it says what that stage learned before the teacher stage; on the
base model, what was there before it.

    python experiments/compare_probe.py --model runs/compare/compare/export/hf_merged
    python experiments/compare_probe.py --model runs/compare/compare/export/hf_merged --out probe.json
"""

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = os.path.join(ROOT, "configs", "main_job.py")


def pairs() -> list[tuple[str, str, str]]:
    """(task, groundtruth, answer) for every ordered pair of two different values of each synthetic task."""
    from fire_jax.data import synthetic

    out = []
    for name, make in synthetic.TASKS.items():
        task = make()
        out += [(name, task.answer(t), task.answer(a)) for t in range(task.size) for a in range(task.size) if t != a]
    return out


def probe(model_dir: str) -> list[dict]:
    """The model's greedy reply and its two checks for every pair."""
    from fire_jax.core.config import load_config
    from fire_jax.data.chat import Message
    from fire_jax.eval.fire_bench import model_config
    from fire_jax.infer.backends import InProcess
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.loading import load
    from fire_jax.infer.sampling import SamplingParams

    evaluation = load_config(CONFIG).eval_free  # the main job's free dialogues: their model and decode settings
    decode = evaluation.decode
    loaded = load(model_config(evaluation), model_dir)
    backend = InProcess(loaded.model, loaded.chat, SamplingParams.from_config(decode),
                        engine=EngineConfig.from_config(decode), batch_size=decode.batch_size,
                        description=loaded.description)
    todo = pairs()
    replies = backend.generate([()] * len(todo), [[Message("user", f"Groundtruth: {truth}\nAnswer: {answer}")]
                                                  for _, truth, answer in todo])
    return checked(todo, replies)


def checked(todo: list[tuple[str, str, str]], replies: list[str]) -> list[dict]:
    """Each pair's reply with the exact judge's two checks: the rule's direction, the rule's distance score."""
    from fire_jax.data.scores import parse_score
    from fire_jax.eval.judge import rule_check

    out = []
    for (task, truth, answer), reply in zip(todo, replies, strict=True):
        direction, distance = rule_check(f"Answer: {answer}", truth, reply, parse_score(reply))
        out.append(dict(task=task, groundtruth=truth, answer=answer, reply=reply, direction=direction,
                        distance=distance))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF model directory (a stage's export/hf_merged)")
    parser.add_argument("--out", default="", help="write every pair's reply and checks to this JSON file")
    args = parser.parse_args()
    rows = probe(args.model)
    counts = collections.Counter()
    for row in rows:
        counts[row["task"]] += 1
        counts[row["task"], "direction"] += row["direction"]
        counts[row["task"], "distance"] += row["distance"]
    print(f"{args.model}: pairs side by side, the rule's direction and distance score")
    print("| task | pairs | direction | distance score |\n|---|---:|---:|---:|")
    for task in dict.fromkeys(row["task"] for row in rows):
        print(f"| {task} | {counts[task]} | {counts[task, 'direction']} | {counts[task, 'distance']} |")
    print(f"| all | {len(rows)} | {sum(r['direction'] for r in rows)} | {sum(r['distance'] for r in rows)} |")
    scores = collections.Counter(row["reply"].split("\n")[0] for row in rows)
    print("first lines written most: " + ", ".join(f"{k!r} x {v}" for k, v in scores.most_common(4)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
