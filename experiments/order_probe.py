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

    python experiments/order_probe.py                  # 0, 8 and 32 shots, 42 ordered pairs each
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fire_jax.convert.fetch import prepare  # noqa: E402


def example(truth: int, answer: int, solved: bool = True) -> str:
    text = f"Groundtruth: There are {truth}.\nAnswer: There are {answer}.\nThe answer is too"
    return text + (f" {'low' if answer < truth else 'high'}.\n\n" if solved else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name of fire_jax.convert.fetch.MODELS")
    parser.add_argument("--shots", default="0,8,32", help="comma-separated numbers of solved examples before each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare(args.model)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    low, high = (tokenizer(word).input_ids[0] for word in (" low", " high"))
    pairs = [(t, a) for t in range(1, 8) for a in range(1, 8) if t != a]
    rng = random.Random(args.seed)
    for shots in (int(s) for s in args.shots.split(",")):
        right = 0
        for truth, answer in pairs:
            context = "".join(example(*rng.choice(pairs)) for _ in range(shots)) + example(truth, answer, False)
            with torch.no_grad():
                logits = model(tokenizer(context, return_tensors="pt").input_ids).logits[0, -1]
            right += bool((logits[low] > logits[high]) == (answer < truth))
        print(f"{shots:3d} shots: the right word is the likelier on {right} of {len(pairs)} pairs "
              f"({right / len(pairs):.2f}; chance 0.50)")


if __name__ == "__main__":
    main()
