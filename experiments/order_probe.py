"""Does the main job's LLM order two values in context? The comparison the FD teacher's direction needs.

The FD teacher learns "Score: 10" (the answer equals the groundtruth) from a few hundred examples, but not which
way a wrong answer is off ("too low" / "too high"). This probe asks the pretrained SmolLM2-135M-Instruct, with no
training, to order every pair of counts 1..7 as the synthetic set writes them, after 0 to N solved examples in
the context (few-shot):

    Groundtruth: There are 5.
    Answer: There are 2.
    The answer is too  -> " low" or " high"?

and counts the pairs where the right word is the likelier. Chance is half. The reference side (transformers on
the fetched GGUF file) runs it, so nothing of fire_jax's own model code is in question.

``--train_steps N`` then asks whether the order can be *learned* from a short prompt: fire_jax's own trainer
(the main job's student stage: LoRA on the SmolLM2 LLaVA's LLM, text only) on random pairs as single-turn
instruction data ("Groundtruth: There are 5.\nAnswer: There are 2.\nIs the answer too low or too high?" ->
"Too low."), from the main job's base model (``--base``), then greedy answers on all 42 pairs:

    python experiments/order_probe.py                  # 0, 8 and 32 shots, 42 ordered pairs each
    python experiments/order_probe.py --shots "" --train_steps 50 --base runs/smollm2/base/export/hf_merged
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fire_jax.convert.fetch import prepare  # noqa: E402

#: Every ordered pair (groundtruth, answer) of two different counts 1..7.
PAIRS = [(t, a) for t in range(1, 8) for a in range(1, 8) if t != a]


def word(truth: int, answer: int) -> str:
    """Which way the answer is off: "low" or "high"."""
    return "low" if answer < truth else "high"


def example(truth: int, answer: int, solved: bool = True) -> str:
    text = f"Groundtruth: There are {truth}.\nAnswer: There are {answer}.\nThe answer is too"
    return text + (f" {word(truth, answer)}.\n\n" if solved else "")


def question(truth: int, answer: int) -> str:
    return f"Groundtruth: There are {truth}.\nAnswer: There are {answer}.\nIs the answer too low or too high?"


def train_and_score(base: str, steps: int, workdir: str, seed: int) -> None:
    """The main job's student stage on the order question alone (text only), then greedy answers on every pair."""
    import json

    from fire_jax.core.config import load_config
    from fire_jax.data.chat import Message
    from fire_jax.eval.fire_bench import agent_from_section
    from fire_jax.stages.main_job import train_stage

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng = random.Random(seed)
    os.makedirs(workdir, exist_ok=True)
    data = os.path.join(workdir, "order.json")
    with open(data, "w") as f:
        json.dump([{"id": f"order_{i}", "source": "order", "conversations": [
            {"from": "human", "value": question(t, a)}, {"from": "gpt", "value": f"Too {word(t, a)}."}]}
            for i, (t, a) in enumerate(rng.choice(PAIRS) for _ in range(8 * steps))], f)
    config = load_config(os.path.join(root, "configs", "main_job.py"))
    train = config.student_train
    train.init.hf_checkpoint = os.path.abspath(base)
    train.data.sources = {"order": {"json": data, "weight": 1.0}}
    train.data.update({"batch_size": 8, "buckets": (128,)})
    train.train.update({"batch_size": 8, "total_steps": steps, "checkpoint_every": steps})
    run = train_stage(train, os.path.join(workdir, "train"), "order question")
    evaluation = config.eval_free
    evaluation.student = {"name": "order", "init": os.path.abspath(base), "adapter": run}
    backend = agent_from_section(evaluation, "student").backend
    replies = backend.generate([()] * len(PAIRS), [[Message("user", question(t, a))] for t, a in PAIRS])
    right = sum(r.strip().lower().startswith(f"too {word(t, a)}") for (t, a), r in zip(PAIRS, replies))
    print(f"after {steps} steps of 8: right on {right} of {len(PAIRS)} pairs ({right / len(PAIRS):.2f}; chance 0.50)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name of fire_jax.convert.fetch.MODELS")
    parser.add_argument("--shots", default="0,8,32", help="comma-separated numbers of solved examples before each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train_steps", type=int, default=0, help="> 0: then train on the order question (above)")
    parser.add_argument("--base", default="runs/smollm2/base/export/hf_merged", help="the main job's base model")
    parser.add_argument("--workdir", default="runs/order_probe")
    args = parser.parse_args()
    if args.shots:
        few_shot(args)
    if args.train_steps:
        train_and_score(args.base, args.train_steps, args.workdir, args.seed)


def few_shot(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare(args.model)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    low, high = (tokenizer(w).input_ids[0] for w in (" low", " high"))
    rng = random.Random(args.seed)
    for shots in (int(s) for s in args.shots.split(",")):
        right = 0
        for truth, answer in PAIRS:
            context = "".join(example(*rng.choice(PAIRS)) for _ in range(shots)) + example(truth, answer, False)
            with torch.no_grad():
                logits = model(tokenizer(context, return_tensors="pt").input_ids).logits[0, -1]
            right += bool((logits[low] > logits[high]) == (answer < truth))
        print(f"{shots:3d} shots: the right word is the likelier on {right} of {len(PAIRS)} pairs "
              f"({right / len(PAIRS):.2f}; chance 0.50)")


if __name__ == "__main__":
    main()
