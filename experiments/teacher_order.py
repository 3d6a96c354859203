"""How many updates the FD teacher needs to point the right way and to score the distance, on the reference side
(transformers + peft).

The main job's FD teacher learns when an answer is right from a few hundred examples but writes a direction
("Your count is too low.") at chance. This experiment trains the pretrained SmolLM2-135M-Instruct with LoRA
(rank 32, alpha 64, on q, k, v, o: the main job's teacher adapter) on wrong answers of the synthetic set's three
tasks, each scored by the synthetic rule (``fire_jax.data.synthetic.exact_feedback``'s text), and every
``--every`` steps measures the direction: for every ordered pair (groundtruth, answer) at most
``MAX_OFFSET`` apart, with the feedback forced up to the direction word ("Score: 6.\\nFeedback: Your count is
too"), is the right word (" low") likelier than the other (" high")? Chance is half. And the distance score:
with the feedback forced up to "Score: ", is the rule's score for that distance (6, 4, 2 or 1 for 1 to 4 apart,
``synthetic.WRONG_SCORES``) the likeliest of the four? (Chance is a quarter; "1" also begins "10", the score
of a right answer.)

Two prompts:

- ``--prompt teacher``: the FD teacher's sequence without the image (system, user "Question: ...\\nGroundtruth:
  ...", user TEACHER_INSTRUCTION, user r_k with its thought, as in the shipped teacher turns), the labels the
  whole feedback, as the main job's teacher stage trains it;
- ``--prompt short``: one user message "Groundtruth: ...\\nAnswer: ..." (the student's answer sentence alone).

The learning rate is constant (AdamW, no warm-up, no clipping): the point is the number of updates, apart from
a schedule. Nothing of fire_jax's model or trainer runs; fire_jax only writes the sentences.

Levers on the plateau before the direction is learned:

- ``--contrast``: each step's examples judge one answer against groundtruths on both sides of it (and at other
  distances), so an answer's usual direction cannot lower the step's loss and only the groundtruth can;
- ``--b2``: AdamW's second-moment decay (0.999 remembers the large gradients of the first steps, where the
  format is learned, for about a thousand steps, and scales the later, smaller ones down);
- ``--warmup N``: first N steps of 8 on the short prompt, then ``--steps`` on ``--prompt``: the order learned
  with the two values side by side, before the teacher's prompt puts 150 tokens between them;
- ``--init pissa``: the adapter starts from the principal singular vectors of each weight (PiSSA, Meng et al.
  2024, peft's ``init_lora_weights="pissa"``; the base keeps the residual), not from B = 0, where the gradient of
  an attention pattern that LoRA must change through both q and k starts at zero;
- ``--loraplus R``: B's learning rate R times A's (LoRA+, Hayou et al. 2024, which finds R = 16 faster).

    python experiments/teacher_order.py --tasks count --steps 200 --batch 2      # ~8 minutes on 2 cores
    python experiments/teacher_order.py --steps 300 --batch 2                    # the three tasks, ~28 minutes
    python experiments/teacher_order.py --prompt short --tasks count --steps 80 --batch 4
    python experiments/teacher_order.py --steps 160 --batch 2 --every 40 --warmup 150  # ~15 minutes
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fire_jax.convert.fetch import prepare  # noqa: E402
from fire_jax.data import synthetic  # noqa: E402
from fire_jax.data.chat import SYSTEM, TEACHER_INSTRUCTION  # noqa: E402

def direction_words(name: str) -> tuple[str, str]:
    """The word where the task's two hints differ: (towards a higher value, towards a lower one), e.g. low, high."""
    task = synthetic.TASKS[name]()
    up, down = task.hint(True).split(), task.hint(False).split()
    return next((u.strip(".,"), d.strip(".,")) for u, d in zip(up, down) if u != d)


def question(name: str, rng: random.Random) -> str:
    """A question of the task as the generator asks it (its drawing is thrown away)."""
    return synthetic.TASKS[name]().draw(rng, synthetic.IMAGE_SIZES[0])[1]


def pairs(tasks) -> list[tuple[str, int, int]]:
    """Every (task, groundtruth, answer) with a wrong answer at most MAX_OFFSET away (0-based values)."""
    return [(name, truth, given) for name in tasks for truth in range(synthetic.TASKS[name].size)
            for given in range(synthetic.TASKS[name].size)
            if truth != given and abs(truth - given) <= synthetic.MAX_OFFSET]


def batch_items(items, size: int, contrast: bool, rng: random.Random) -> list[tuple[str, int, int]]:
    """A step's (task, groundtruth, answer) triples: drawn apart, or (``contrast``) one task and answer with
    ``size`` groundtruths, alternately above and below the answer where both sides exist."""
    if not contrast:
        return [rng.choice(items) for _ in range(size)]
    name, _, given = rng.choice(items)
    sides = [[t for n, t, g in items if n == name and g == given and (t > given) == up] for up in (True, False)]
    sides = [rng.sample(side, len(side)) for side in sides if side]
    return [(name, sides[i % len(sides)][(i // len(sides)) % len(sides[i % len(sides)])], given) for i in range(size)]


class Examples:
    """Token ids of one training example, and where its labels and its direction word start."""

    def __init__(self, tokenizer, prompt: str):
        self.tokenizer, self.prompt = tokenizer, prompt

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def __call__(self, name: str, truth: int, given: int, rng: random.Random):
        task = synthetic.TASKS[name]()
        up = truth > given
        # The thought is drawn apart from the answer, as in the shipped teacher turns.
        thought = rng.choice([task.first_thought(), task.refined_thought(True), task.refined_thought(False)])
        if self.prompt == "teacher":
            turns = [("user", f"Question: {question(name, rng)}\nGroundtruth: {task.answer(truth)}"),
                     ("user", TEACHER_INSTRUCTION), ("user", synthetic.response(thought, task.answer(given)))]
        else:
            turns = [("user", f"Groundtruth: {task.answer(truth)}\nAnswer: {task.answer(given)}")]
        messages = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": c} for r, c in turns]
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text, _ = synthetic.exact_feedback(task.answer(truth), task.answer(given))
        head = text[:text.index(" " + direction_words(name)[0 if up else 1])]  # the feedback up to its direction word
        full = self.ids(prompt + text + "<|im_end|>")
        before_score = self.ids(prompt + "Score: ")  # the score's digit is the next token
        assert full[:len(before_score)] == before_score, "the tokenizer merges the score into the text before it"
        return full, len(self.ids(prompt)), len(self.ids(prompt + head)), up, len(before_score)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name of fire_jax.convert.fetch.MODELS")
    parser.add_argument("--prompt", choices=("teacher", "short"), default="teacher")
    parser.add_argument("--tasks", default="count,bars,color")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--b2", type=float, default=0.999, help="AdamW's second-moment decay")
    parser.add_argument("--every", type=int, default=40,
                        help="measure the direction and the distance score every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0,
                        help="first this many steps of 8 on the short prompt, then --steps on --prompt")
    parser.add_argument("--contrast", action="store_true",
                        help="each batch judges one answer against groundtruths on both sides of it and at "
                             "different distances (a step's examples differ only by the groundtruth)")
    parser.add_argument("--init", choices=("default", "pissa"), default="default",
                        help="the adapter's start: peft's default (A Kaiming-uniform, B = 0) or PiSSA")
    parser.add_argument("--loraplus", type=float, default=1.0, help="B's learning rate as a multiple of A's")
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    path = prepare(args.model)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    init = True if args.init == "default" else "pissa"
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, init_lora_weights=init,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    tasks = args.tasks.split(",")
    items, example = pairs(tasks), Examples(tokenizer, args.prompt)
    word_ids = {t: tuple(tokenizer(" " + w).input_ids[0] for w in direction_words(t)) for t in tasks}
    scores = sorted(synthetic.WRONG_SCORES.values())
    digit_ids = [tokenizer(str(s), add_special_tokens=False).input_ids for s in scores]
    assert all(len(i) == 1 for i in digit_ids), digit_ids
    digit_ids = [i[0] for i in digit_ids]

    def direction() -> str:
        """Per task: pairs whose direction word is the right one, pairs whose distance score is, of all."""
        model.eval()
        right, scored, seen = dict.fromkeys(tasks, 0), dict.fromkeys(tasks, 0), dict.fromkeys(tasks, 0)
        rng = random.Random(1234)
        with torch.no_grad():
            for name, truth, given in items:
                full, _, head, up, score_at = example(name, truth, given, rng)
                logits = model(torch.tensor([full[:head]])).logits[0]
                towards_higher, towards_lower = word_ids[name]
                right[name] += bool((logits[-1, towards_higher] > logits[-1, towards_lower]) == up)
                likeliest = scores[int(torch.argmax(logits[score_at - 1, digit_ids]))]
                scored[name] += likeliest == synthetic.WRONG_SCORES[abs(truth - given)]
                seen[name] += 1
        model.train()
        return ", ".join(f"{t} {right[t]} / {seen[t]} (score {scored[t]})" for t in tasks)

    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [dict(params=[p for n, p in trained if "lora_B" not in n], lr=args.lr),
              dict(params=[p for n, p in trained if "lora_B" in n], lr=args.lr * args.loraplus)]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.b2), weight_decay=0.0)
    rng, start = random.Random(args.seed), time.time()

    def update(batch, make) -> float:
        """One AdamW step on the mean token loss of the examples ``make`` writes for ``batch``."""
        loss = 0.0
        for item in batch:
            full, labels_from, *_ = make(*item, rng)
            ids = torch.tensor([full])
            logits = model(ids).logits[0, labels_from - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, labels_from:]) / len(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    short = Examples(tokenizer, "short")
    for _ in range(args.warmup):
        loss = update(batch_items(items, 8, False, rng), short)
    if args.warmup:
        print(f"warm-up: {args.warmup} steps of 8 on the short prompt ({time.time() - start:.0f} s, last loss "
              f"{loss:.3f} a token)")
    print(f"{args.prompt} prompt, {args.tasks}, steps of {args.batch}, lr {args.lr}, b2 {args.b2}"
          + (", contrast batches" if args.contrast else "") + (f", {args.init} init" if args.init != "default" else "")
          + (f", LoRA+ ratio {args.loraplus:g}" if args.loraplus != 1 else ""))
    print(f"step 0: right direction (and distance score) on {direction()}", flush=True)
    for step in range(1, args.steps + 1):
        loss = update(batch_items(items, args.batch, args.contrast, rng), example)
        if step % args.every == 0 or step == args.steps:
            print(f"step {step} ({step * args.batch} examples, loss {loss:.3f} a token, "
                  f"{time.time() - start:.0f} s): right direction (and distance score) on {direction()}", flush=True)


if __name__ == "__main__":
    main()
