"""Synthetic FIRE conversations about drawn images, in the released schema.

Each image (PIL, a few dozen pixels) shows coloured shapes or bars; the
question has a checkable answer that depends on one visual property (a count,
a colour, the tallest bar). The student's first answer is wrong, the
teacher's feedback scores it and points at the error without giving the
answer ("too low", "a cool colour", "compare it with the bar on its right"),
and the next answer uses that hint. Some dialogues need a third round.
Everything is determined by the seed.
"""

from __future__ import annotations

import json
import os
import random

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "orange": (245, 140, 20), "yellow": (235, 210, 30),
          "green": (40, 170, 60), "blue": (40, 80, 220), "purple": (140, 50, 180)}
WARM = ("red", "orange", "yellow")
SHAPES = ("circle", "square", "triangle")
#: (height, width) of the drawn images: several aspect ratios, so every anyres grid occurs.
IMAGE_SIZES = ((64, 64), (48, 96), (96, 48), (40, 96), (96, 40), (56, 80))
POSITIONS = ("left", "middle", "right")
BACKGROUND = (238, 238, 238)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box, color) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)


def _place(rng: random.Random, size, count: int, side: int) -> list[tuple[int, int, int, int]]:
    """Up to ``count`` non-overlapping boxes of ``side`` px inside an image of (h, w)."""
    height, width = size
    boxes = []
    for _ in range(200 * count):
        if len(boxes) == count:
            break
        x, y = rng.randint(1, width - side - 1), rng.randint(1, height - side - 1)
        box = (x, y, x + side, y + side)
        if all(x + side + 2 < b[0] or b[2] + 2 < x or y + side + 2 < b[1] or b[3] + 2 < y for b in boxes):
            boxes.append(box)
    return boxes


def _response(thought: str, answer: str) -> str:
    return f"Thought: {thought}\nAnswer: {answer}\n\n"


def _feedback(score: int, text: str) -> str:
    return f"Score: {score}.\nFeedback: {text}\n"


def _count_task(rng: random.Random, size):
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    side = max(8, min(size) // 5)
    boxes = _place(rng, size, rng.randint(1, 5) + 2, side)
    count = rng.randint(1, min(4, len(boxes)))
    image = Image.new("RGB", (size[1], size[0]), BACKGROUND)
    draw = ImageDraw.Draw(image)
    others = [(c, s) for c in COLORS for s in SHAPES if (c, s) != (color, shape)]
    for i, box in enumerate(boxes):
        box_color, box_shape = (color, shape) if i < count else rng.choice(others)
        _draw_shape(draw, box_shape, box, COLORS[box_color])
    thing = f"{color} {shape}s"
    question = f"How many {thing} are in the image?"
    guesses = [g for g in range(0, 6) if g != count]
    wrong = [rng.choice(guesses)]
    if rng.random() < 0.3 and abs(wrong[0] - count) > 1:
        wrong.append(wrong[0] + (1 if count > wrong[0] else -1))
    turns = []
    for guess in wrong:
        direction = "low" if guess < count else "high"
        more = "more" if guess < count else "fewer"
        score = 2 if abs(guess - count) > 1 else 5
        turns.append((_response(f"I count the {thing} in the image.", f"There are {guess} {thing}."),
                      _feedback(score, f"Your count is too {direction}. There are {more} than {guess} {thing}; "
                                       f"count them again.")))
    turns.append((_response(f"The feedback says there are {more} than {wrong[-1]}. I count again.",
                            f"There are {count} {thing}."),
                  _feedback(10, f"Correct! You counted the {thing} right.")))
    first = _response(f"I count the {thing} in the image.", f"There are {count} {thing}.")
    return image, question, f"There are {count} {thing}.", turns, first


def _color_task(rng: random.Random, size):
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    image = Image.new("RGB", (size[1], size[0]), BACKGROUND)
    side = int(min(size) * 0.7)
    top, left = (size[0] - side) // 2, (size[1] - side) // 2
    _draw_shape(ImageDraw.Draw(image), shape, (left, top, left + side, top + side), COLORS[color])
    question = f"What colour is the {shape}?"
    family = "warm" if color in WARM else "cool"
    wrong_family = [c for c in COLORS if (c in WARM) != (color in WARM)]
    same_family = [c for c in COLORS if (c in WARM) == (color in WARM) and c != color]
    wrong = [rng.choice(wrong_family)]
    if rng.random() < 0.3:
        wrong.append(rng.choice(same_family))
    turns = []
    for i, guess in enumerate(wrong):
        hint = (f"It is a {family} colour." if i == 0 else f"It is a {family} colour, but not {guess}.")
        thought = (f"The {shape} looks {guess} to me." if i == 0 else
                   f"The feedback says it is a {family} colour; the {shape} looks {guess} to me.")
        turns.append((_response(thought, f"The {shape} is {guess}."),
                      _feedback(2 if i == 0 else 5, f"The {shape} is not {guess}. Look at its colour again. {hint}")))
    turns.append((_response(f"The feedback says it is a {family} colour, so I look again.",
                            f"The {shape} is {color}."),
                  _feedback(10, f"Correct! The colour of the {shape} is right.")))
    first = _response(f"The {shape} looks {color} to me.", f"The {shape} is {color}.")
    return image, question, f"The {shape} is {color}.", turns, first


def _bar_task(rng: random.Random, size):
    height, width = size
    heights = rng.sample(range(int(height * 0.25), int(height * 0.9)), 3)
    tallest = max(range(3), key=lambda i: heights[i])
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    bar = max(4, width // 5)
    color = COLORS[rng.choice(list(COLORS))]
    for i, h in enumerate(heights):
        x = (2 * i + 1) * width // 6 - bar // 2
        draw.rectangle((x, height - h, x + bar - 1, height - 1), fill=color)
    question = "Which bar is the tallest: the left, middle or right one?"
    guess = rng.choice([i for i in range(3) if i != tallest])
    side = "right" if tallest > guess else "left"
    turns = [(_response("The bars have different heights.", f"The {POSITIONS[guess]} bar is the tallest."),
              _feedback(3, f"The {POSITIONS[guess]} bar is not the tallest. Look further to the {side} "
                           f"and compare the heights again.")),
             (_response(f"The feedback says to look further to the {side}.",
                        f"The {POSITIONS[tallest]} bar is the tallest."),
              _feedback(10, "Correct! You found the tallest bar."))]
    first = _response("The bars have different heights.", f"The {POSITIONS[tallest]} bar is the tallest.")
    return image, question, f"The {POSITIONS[tallest]} bar is the tallest.", turns, first


TASKS = {"count": _count_task, "color": _color_task, "bars": _bar_task}
#: Share of dialogues whose first answer is already right (one round, score 10): without them the
#: turn position alone would predict the score, and a teacher could learn that instead of comparing.
CORRECT_FIRST = 0.3


def generate(num: int, seed: int, split: str) -> tuple[list[dict], dict[str, Image.Image]]:
    """``num`` raw FIRE records (released schema) and their images, keyed by file name."""
    rng = random.Random(f"{seed}/{split}")
    records, images = [], {}
    for i in range(num):
        task = list(TASKS)[i % len(TASKS)]
        image, question, answer, turns, first = TASKS[task](rng, rng.choice(IMAGE_SIZES))
        if rng.random() < CORRECT_FIRST:
            turns = [(first, turns[-1][1])]
        name = f"{split}_{i:05d}.png"
        images[name] = image
        conversations = []
        for response, feedback in turns:
            conversations += [{"role": "student", "type": "response", "value": response},
                              {"role": "teacher", "type": "feedback", "value": feedback}]
        records.append({
            "id": f"synthetic_{split}_{i:05d}", "image": name,
            "question": {"role": "user", "value": question},
            "groundtruth": {"role": "user", "value": answer},
            "conversations": conversations, "source": f"synthetic_{task}", "round": len(turns),
            "score": [int(f.split()[1].rstrip(".")) for _, f in turns], "split": f"synthetic_{split}"})
    return records, images


def write_synthetic_fire(out_dir: str, *, num_train: int = 720, num_test: int = 90, seed: int = 0) -> dict[str, str]:
    """Write ``train.json``, ``test.json``, ``instruct.json`` (the train questions as single-turn
    instruction data, :func:`instruction_records`) and ``images/`` under ``out_dir``; returns the JSON paths."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    paths = {}
    for split, num in (("train", num_train), ("test", num_test)):
        records, images = generate(num, seed, split)
        for name, image in images.items():
            image.save(os.path.join(out_dir, "images", name), optimize=True)
        paths[split] = os.path.join(out_dir, f"{split}.json")
        _write_json(paths[split], records)
        if split == "train":
            paths["instruct"] = os.path.join(out_dir, "instruct.json")
            _write_json(paths["instruct"], instruction_records(records))
    return paths


def _write_json(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def instruction_records(records: list[dict]) -> list[dict]:
    """LLaVA-665K-style single-turn records (question -> first answer) from FIRE records.

    What an instruction-tuned VLM is trained on before FIRE: answering, never
    refining from feedback. The tiny pipeline's base model (its baseline) learns from these.
    """
    return [{"id": f"{r['id']}_instruct", "image": r["image"], "source": r["source"], "split": "instruct",
             "conversations": [{"from": "human", "value": "<image>\n" + r["question"]["value"]},
                               {"from": "gpt", "value": r["conversations"][0]["value"]}]}
            for r in records]


def corpus(records: list[dict]) -> list[str]:
    """The texts of raw records, for tokenizer training."""
    texts = []
    for record in records:
        texts += [record["question"]["value"], record["groundtruth"]["value"]]
        texts += [message["value"] for message in record["conversations"]]
    return texts
