"""Synthetic FIRE conversations about drawn images, in the released schema, with no shortcuts.

Each image (PIL, a few dozen pixels) shows coloured shapes or bars; the
question has one exact answer on an ordered scale that depends on one visual
property: a count (1..7), the position of the tallest of five bars (1..5) or
the colour of one shape among others (six colours in rainbow order). The
groundtruth is the exact sentence the student should write after "Answer:".
Each image also gets a caption that says everything drawn on it (every shape
with its colour, how many of each, every bar's height): the image-text pairs
a CLIP learns to see from (:func:`caption_records`, training images only).

The student's first answer is right or off by ``D`` steps on that scale. Every
refinement moves one step the way the feedback points, so an answer off by
``D`` needs ``D`` more turns. ``D`` is drawn so that, at every turn position,
right and wrong answers are about equally common (P(D = 0) = 1/2, P(D = d) =
2^-(d+1), the tail folded into ``MAX_OFFSET``): the turn index does not predict
the score. First answers share one wording, refined answers another, whether
right or wrong, and right and wrong sentences differ only in the value: the
wording and the length do not predict the score either
(:func:`shortcut_report` measures it).

The teacher's feedback says which way to move ("too low", "further to the
right", "later in the rainbow") without quoting the answer, and scores the
distance: 10 when right, else ``WRONG_SCORES[D]`` (6, 4, 2, 1), so a refinement
that moves the right way always raises the score. Everything is determined by
the seed.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
from typing import Mapping, Sequence

from PIL import Image, ImageDraw

from fire_jax.core.files import output_file, write_text
from fire_jax.data.records import Turn, to_raw

#: Colours in rainbow order: the colour task's scale.
COLORS = {"red": (220, 40, 40), "orange": (245, 140, 20), "yellow": (235, 210, 30),
          "green": (40, 170, 60), "blue": (40, 80, 220), "purple": (140, 50, 180)}
RAINBOW = tuple(COLORS)
SHAPES = ("circle", "square", "triangle")
#: (height, width) of the drawn images: several aspect ratios, so every anyres grid occurs.
IMAGE_SIZES = ((64, 64), (48, 96), (96, 48), (40, 96), (96, 40), (56, 80))
BACKGROUND = (238, 238, 238)
MAX_COUNT = 7  # the count task's scale: 1..MAX_COUNT
NUM_BARS = 5  # the bar task's scale: bar 1..NUM_BARS from the left
MAX_OFFSET = 4  # the largest first-answer error: solvable within the free dialogues' 5 turns
#: Score of a wrong answer by its distance from the groundtruth (a right answer scores 10).
WRONG_SCORES = {1: 6, 2: 4, 3: 2, 4: 1}
RIGHT_SCORE = 10


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box, color) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)


def _shapes_caption(drawn: Sequence[tuple[str, str]]) -> str:
    """"2 red circles, 1 blue square and 1 green triangle.": each (colour, shape) drawn, with its count, most
    common first (then in rainbow and shape order)."""
    counts = collections.Counter(drawn)
    groups = sorted(counts, key=lambda g: (-counts[g], RAINBOW.index(g[0]), SHAPES.index(g[1])))
    parts = [f"{counts[g]} {g[0]} {g[1]}{'s' if counts[g] > 1 else ''}" for g in groups]
    return (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + "."


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


def response(thought: str, answer: str) -> str:
    """A student turn r_k in the released format."""
    return f"Thought: {thought}\nAnswer: {answer}\n\n"


def feedback(score: int, text: str) -> str:
    """A teacher turn f_k in the released format."""
    return f"Score: {score}.\nFeedback: {text}\n"


class Task:
    """One kind of question on an ordered scale of ``size`` values (0-based internally).

    ``draw`` makes (image, question, truth, caption) and leaves what it drew where in ``layout``: (colour, shape,
    box) per shape, (colour, "bar", box) per bar from the left, boxes (x0, y0, x1, y1) in pixels; ``answer(v)`` is the sentence for
    value ``v``; ``hint(up)`` the feedback that points up or down the scale;
    ``first_thought`` / ``refined_thought(up)`` the student's thoughts.
    """

    name = ""
    size = 0
    layout: list[tuple[str, str, tuple[int, int, int, int]]] = []

    def draw(self, rng: random.Random, image_size) -> tuple[Image.Image, str, int, str]:
        raise NotImplementedError

    def answer(self, value: int) -> str:
        raise NotImplementedError

    def hint(self, up: bool) -> str:
        raise NotImplementedError

    def first_thought(self) -> str:
        raise NotImplementedError

    def refined_thought(self, up: bool) -> str:
        raise NotImplementedError


class CountTask(Task):
    name, size = "count", MAX_COUNT

    def draw(self, rng, image_size):
        self.color, self.shape = rng.choice(RAINBOW), rng.choice(SHAPES)
        side = max(7, min(image_size) // 6)
        count = rng.randint(1, MAX_COUNT)
        boxes = _place(rng, image_size, count + rng.randint(0, 2), side)
        count = min(count, len(boxes))
        image = Image.new("RGB", (image_size[1], image_size[0]), BACKGROUND)
        draw = ImageDraw.Draw(image)
        others = [(c, s) for c in RAINBOW for s in SHAPES if (c, s) != (self.color, self.shape)]
        drawn = []
        for i, box in enumerate(boxes):
            color, shape = (self.color, self.shape) if i < count else rng.choice(others)
            _draw_shape(draw, shape, box, COLORS[color])
            drawn.append((color, shape))
        self.layout = [(color, shape, box) for (color, shape), box in zip(drawn, boxes)]
        return image, f"How many {self.thing} are in the image?", count - 1, _shapes_caption(drawn)

    @property
    def thing(self) -> str:
        return f"{self.color} {self.shape}s"

    def answer(self, value):
        return f"There are {value + 1}."

    def hint(self, up):
        return f"Your count is too {'low' if up else 'high'}. Count them again."

    def first_thought(self):
        return "I count them in the image."

    def refined_thought(self, up):
        return f"The feedback says my count is too {'low' if up else 'high'}, so I count again."


class BarTask(Task):
    name, size = "bars", NUM_BARS

    def draw(self, rng, image_size):
        height, width = image_size
        heights = rng.sample(range(int(height * 0.2), int(height * 0.95)), NUM_BARS)
        tallest = max(range(NUM_BARS), key=lambda i: heights[i])
        image = Image.new("RGB", (width, height), BACKGROUND)
        draw = ImageDraw.Draw(image)
        bar = max(3, width // (2 * NUM_BARS))
        color_name = rng.choice(RAINBOW)
        self.layout = []
        for i, h in enumerate(heights):
            x = (2 * i + 1) * width // (2 * NUM_BARS) - bar // 2
            draw.rectangle((x, height - h, x + bar - 1, height - 1), fill=COLORS[color_name])
            self.layout.append((color_name, "bar", (x, height - h, x + bar - 1, height - 1)))
        # Heights in percent of the image's, so the same bars read the same at every image size.
        percents = [round(100 * h / height) for h in heights]
        caption = (f"Five {color_name} bars, {', '.join(map(str, percents[:-1]))} and {percents[-1]} percent high "
                   f"from the left; bar {tallest + 1} is the tallest.")
        return image, f"Which bar is the tallest? The bars are numbered 1 to {NUM_BARS} from the left.", tallest, caption

    def answer(self, value):
        return f"Bar {value + 1} is the tallest."

    def hint(self, up):
        return f"The tallest bar is further to the {'right' if up else 'left'}. Compare the heights again."

    def first_thought(self):
        return "I compare the heights of the bars."

    def refined_thought(self, up):
        return f"The feedback says the tallest bar is further to the {'right' if up else 'left'}, so I compare again."


class ColorTask(Task):
    name, size = "color", len(RAINBOW)

    def draw(self, rng, image_size):
        self.shape = rng.choice(SHAPES)
        color = rng.randrange(len(RAINBOW))
        side = max(10, min(image_size) * 2 // 5)
        boxes = _place(rng, image_size, 1 + rng.randint(1, 2), side)
        image = Image.new("RGB", (image_size[1], image_size[0]), BACKGROUND)
        draw = ImageDraw.Draw(image)
        others = [s for s in SHAPES if s != self.shape]
        drawn = []
        for i, box in enumerate(boxes):
            if i == 0:
                drawn.append((RAINBOW[color], self.shape))
            else:  # distractors: other shapes, any colour
                shape = rng.choice(others)
                drawn.append((rng.choice(RAINBOW), shape))
            _draw_shape(draw, drawn[-1][1], box, COLORS[drawn[-1][0]])
        self.layout = [(color, shape, box) for (color, shape), box in zip(drawn, boxes)]
        return image, f"What colour is the {self.shape}?", color, _shapes_caption(drawn)

    def answer(self, value):
        return f"It is {RAINBOW[value]}."

    def hint(self, up):
        return f"The colour comes {'later' if up else 'earlier'} in the rainbow. Look again."

    def first_thought(self):
        return "I look at its colour."

    def refined_thought(self, up):
        return f"The feedback says the colour comes {'later' if up else 'earlier'} in the rainbow, so I look again."


TASKS = {"count": CountTask, "bars": BarTask, "color": ColorTask}


def first_offset(rng: random.Random) -> int:
    """D, the first answer's distance from the truth: 0 with probability 1/2, d with 2^-(d+1), tail at MAX_OFFSET."""
    offset = 0
    while offset < MAX_OFFSET and rng.random() < 0.5:
        offset += 1
    return offset


def dialogue(task: Task, truth: int, offset: int, rng: random.Random) -> list[Turn]:
    """The turns (r_k, f_k, a_k): a first answer ``offset`` steps from ``truth``, then one step per turn
    towards it."""
    sides = [s for s in (-1, 1) if 0 <= truth + s * offset < task.size] if offset else [1]
    value = truth + rng.choice(sides) * offset
    turns, thought = [], task.first_thought()
    while True:
        if value == truth:
            turns.append(Turn(response(thought, task.answer(value)),
                              feedback(RIGHT_SCORE, "Correct! Your answer is right."), RIGHT_SCORE))
            return turns
        up = truth > value
        score = WRONG_SCORES[abs(truth - value)]
        turns.append(Turn(response(thought, task.answer(value)), feedback(score, task.hint(up)), score))
        thought, value = task.refined_thought(up), value + (1 if up else -1)


def synthesize(num: int, seed: int, split: str, layouts: dict | None = None
               ) -> tuple[list[dict], dict[str, Image.Image], dict[str, str]]:
    """``num`` raw FIRE records (released schema, :func:`fire_jax.data.records.to_raw`), their images and their
    captions, both keyed by file name; ``layouts``, when given, gets each image's :attr:`Task.layout` by file name
    (what a vision stage's dense heads learn from, :func:`layout_facts`)."""
    rng = random.Random(f"{seed}/{split}")
    records, images, captions = [], {}, {}
    for i in range(num):
        task = TASKS[list(TASKS)[i % len(TASKS)]]()
        image, question, truth, caption = task.draw(rng, rng.choice(IMAGE_SIZES))
        offset = first_offset(rng)
        while offset and not any(0 <= truth + s * offset < task.size for s in (-1, 1)):
            offset = first_offset(rng)  # no value that far on this scale: draw again
        turns = dialogue(task, truth, offset, rng)
        name = f"{split}_{i:05d}.png"
        images[name] = image
        if layouts is not None:
            layouts[name] = list(task.layout)
        records.append(to_raw(f"synthetic_{split}_{i:05d}", name, question, task.answer(truth), turns,
                              source=f"synthetic_{task.name}", split=f"synthetic_{split}"))
        captions[name] = caption
    return records, images, captions


def write_synthetic_fire(out_dir: str, *, num_train: int = 720, num_test: int = 90, seed: int = 0) -> dict[str, str]:
    """Write ``train.json``, ``test.json``, ``instruct.json`` (the train questions as single-turn
    instruction data, :func:`instruction_records`), ``teacher_turns.json`` (:func:`turn_records` of the train
    set), ``captions.json`` (:func:`caption_records` of the train images: no test image is captioned), the same as
    chats (``caption_chats.json``, :func:`caption_chat_records`) and
    ``images/`` under ``out_dir``, and for the teacher's comparison lineage ``comparisons.json``
    (:func:`comparison_records` of the train set) and ``teacher_turns_quarter_right.json``; returns the JSON
    paths."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    paths = {}
    for split, num in (("train", num_train), ("test", num_test)):
        records, images, captions = synthesize(num, seed, split)
        for name, image in images.items():
            with output_file(os.path.join(out_dir, "images", name)) as temporary:
                image.save(temporary, format="PNG", optimize=True)
        paths[split] = os.path.join(out_dir, f"{split}.json")
        _write_json(paths[split], records)
        if split == "train":
            paths["instruct"] = os.path.join(out_dir, "instruct.json")
            _write_json(paths["instruct"], instruction_records(records))
            paths["instruct_right"] = os.path.join(out_dir, "instruct_right.json")
            _write_json(paths["instruct_right"], instruction_records(records, right=True))
            paths["teacher_turns"] = os.path.join(out_dir, "teacher_turns.json")
            _write_json(paths["teacher_turns"], turn_records(records, seed))
            paths["teacher_turns_quarter_right"] = os.path.join(out_dir, "teacher_turns_quarter_right.json")
            _write_json(paths["teacher_turns_quarter_right"], turn_records(records, seed, right_share=0.25))
            paths["comparisons"] = os.path.join(out_dir, "comparisons.json")
            _write_json(paths["comparisons"], comparison_records(records, seed))
            paths["captions"] = os.path.join(out_dir, "captions.json")
            _write_json(paths["captions"], caption_records(records, captions))
            paths["caption_chats"] = os.path.join(out_dir, "caption_chats.json")
            _write_json(paths["caption_chats"], caption_chat_records(caption_records(records, captions)))
    return paths


def _write_json(path: str, records: list[dict]) -> None:
    write_text(path, json.dumps(records, indent=1) + "\n")


def instruction_records(records: list[dict], *, right: bool = False) -> list[dict]:
    """LLaVA-665K-style single-turn records (question -> answer) from FIRE records: what an instruction-tuned VLM
    is trained on before FIRE, answering, never refining from feedback.

    ``right=False``: the dialogue's first answer, wrong about half the time (``instruct.json``, the default main
    job's base stage). ``right=True``: the groundtruth in the first turn's words (its thought, then "Answer: " and
    the groundtruth; ``instruct_right.json``), as LLaVA's instruction data are true: the dialogues' wrong first
    answers belong to FIRE's dialogues, not to what a base model learns to see (``configs/main_job.py:smollm2,see``).
    """
    out = []
    for r in records:
        answer = r["conversations"][0]["value"]
        if right:
            name, truth = parse_answer(r["groundtruth"]["value"])
            task = TASKS[name]()
            answer = response(task.first_thought(), task.answer(truth))
        out.append({"id": f"{r['id']}_instruct", "image": r["image"], "source": r["source"], "split": "instruct",
                    "conversations": [{"from": "human", "value": "<image>\n" + r["question"]["value"]},
                                      {"from": "gpt", "value": answer}]})
    return out


#: The instruction of the connector's alignment stage (LLaVA-1.5's first stage: image-caption pairs as chats).
DESCRIBE = "Describe the image."


def caption_chat_records(captions: list[dict]) -> list[dict]:
    """Caption records (:func:`caption_records`) as single-turn chats, ``"<image>\nDescribe the image."`` -> the
    caption: LLaVA's feature-alignment data (LLaVA-1.5 Sec. 4, the 558K captions), on which the connector learns
    to hand the LLM image tokens it can put into words before any question is asked."""
    return [{"id": f"{c['id']}_chat", "image": c["image"], "source": c["source"], "split": "caption",
             "conversations": [{"from": "human", "value": f"<image>\n{DESCRIBE}"},
                               {"from": "gpt", "value": c["caption"]}]} for c in captions]


#: Every (colour, shape) pair a shapes image may hold, in the order of the count heads (:data:`FACT_HEADS`) and the
#: dense heads (:data:`DENSE_HEADS`); :data:`PAIR_INDEX` maps a pair to its head.
PAIRS = tuple((color, shape) for color in RAINBOW for shape in SHAPES)
PAIR_INDEX = {pair: i for i, pair in enumerate(PAIRS)}

#: What :func:`caption_facts` reads from a caption, as (head name, classes): the count (0..MAX_COUNT) of every
#: (colour, shape) on a shapes image, then the tallest of the bars on a bars image. The vision stage's auxiliary
#: targets (``configs/clip.py``) and the tower probe (``experiments/vision_probe.py``) read the same heads.
FACT_HEADS = tuple((f"count {color} {shape}", MAX_COUNT + 1) for color, shape in PAIRS) + (
    ("tallest bar", NUM_BARS),)
IGNORE = -1  # a head that does not apply to an image (a count on a bars image, the tallest bar on a shapes image)


def caption_facts(caption: str) -> list[int]:
    """The facts a caption of :func:`synthesize` states, one class per head of :data:`FACT_HEADS` (``IGNORE`` where
    the head does not apply): "2 red circles and 1 blue square." -> count red circle 2, blue square 1, every other
    (colour, shape) 0, tallest bar IGNORE; "Five red bars, ...; bar 3 is the tallest." -> every count IGNORE,
    tallest bar 2 (0-based). Raises ValueError on a caption of another form."""
    facts = [IGNORE] * len(FACT_HEADS)
    bars = re.fullmatch(r"Five \w+ bars, .* percent high from the left; bar (\d) is the tallest\.", caption)
    if bars:
        facts[-1] = int(bars.group(1)) - 1
        return facts
    counts = dict.fromkeys(PAIRS, 0)
    for part in re.split(r", | and ", caption.rstrip(".")):
        match = re.fullmatch(r"(\d+) (\w+) (\w+?)s?", part)
        if not match or (match.group(2), match.group(3)) not in counts:
            raise ValueError(f"not a synthetic caption: {caption!r} (at {part!r})")
        counts[match.group(2), match.group(3)] = min(int(match.group(1)), MAX_COUNT)
    facts[:-1] = list(counts.values())
    return facts


#: The dense heads of a vision stage (:func:`layout_facts`), read on every patch of the whole-image tile: how many
#: shapes of each (colour, shape) pair have their centre in the patch (0..3), which bar's top is in it (0: none,
#: 1..5 from the left; the rightmost of two), and whether the tallest bar's top is (0 / 1). (Measured against
#: a bar-top count with the tallest's number, and against a yes/no head per bar: 500 steps of the vision stage
#: named the tallest bar on 0.53 of training images with these heads, 0.30 and 0.38 with those.)
MAX_CENTRES = 3
DENSE_HEADS = tuple((f"{color} {shape} centres", MAX_CENTRES + 1) for color, shape in PAIRS) + (
    ("bar top", NUM_BARS + 1), ("tallest bar top", 2))


def layout_facts(layout: Sequence[tuple], image_size: tuple[int, int], grid: int) -> list[list[int]]:
    """Where things are drawn, patch by patch: one row per patch of a ``grid`` x ``grid`` whole-image tile (the
    image resized to a square, as LLaVA-NeXT's tile 0; row-major), one class per head of :data:`DENSE_HEADS`
    (``IGNORE`` where it does not apply: the bar heads on a shapes image, the shape heads on a bars image), from
    a :attr:`Task.layout` of an image of ``image_size`` (h, w). A count is a sum over patches of the first heads,
    the tallest bar the bar top in the patch the last head marks: targets a patch's own pixels nearly decide,
    from which attention can gather the image's facts (:data:`FACT_HEADS`). Detection-style supervision, as
    LLaVA-1.5's grounding data (RefCOCO, Visual Genome boxes) gives its model."""
    height, width = image_size

    def cell(x: float, y: float) -> int:
        return min(grid - 1, int(y * grid / height)) * grid + min(grid - 1, int(x * grid / width))

    bars = [item for item in layout if item[1] == "bar"]
    rows = [[IGNORE] * len(DENSE_HEADS) for _ in range(grid * grid)]
    if bars:
        tallest = min(range(len(bars)), key=lambda i: bars[i][2][1])  # the smallest y0: the highest top
        for row in rows:
            row[-2:] = [0, 0]
        for i, (_, _, (x0, y0, x1, _)) in enumerate(bars):
            row = rows[cell((x0 + x1 + 1) / 2, y0)]
            row[-2] = i + 1
            row[-1] = max(row[-1], int(i == tallest))
        return rows
    for row in rows:
        row[:len(PAIRS)] = [0] * len(PAIRS)
    for color, shape, (x0, y0, x1, y1) in layout:
        row = rows[cell((x0 + x1) / 2, (y0 + y1) / 2)]
        k = PAIR_INDEX[color, shape]
        row[k] = min(row[k] + 1, MAX_CENTRES)
    return rows


def caption_records(records: list[dict], captions: Mapping[str, str]) -> list[dict]:
    """Image-caption pairs ``{"id", "image", "caption", "source"}``, one per record's image: what a CLIP
    (``configs/clip.py``) trains on before the VLM does, as LLaVA's tower is pretrained on image-text pairs."""
    return [{"id": f"{r['id']}_caption", "image": r["image"], "caption": captions[r["image"]], "source": r["source"]}
            for r in records]


def wrong_value(task, truth: int, rng: random.Random) -> int:
    """A wrong 0-based value for ``truth`` on ``task``'s scale: a side drawn uniformly among those the scale has
    room on, then a distance drawn uniformly among those that fit (1..MAX_OFFSET)."""
    side = rng.choice([s for s in (-1, 1) if 0 <= truth + s < task.size])
    return truth + side * rng.choice([d for d in range(1, MAX_OFFSET + 1) if 0 <= truth + side * d < task.size])


def turn_records(records: list[dict], seed: int = 0, right_share: float = 0.5) -> list[dict]:
    """One teacher record per turn k of each conversation, id ``<id>_t<k>``: its first k (r, f) pairs, the
    answer of r_k redrawn so that only comparing it with the groundtruth tells f_k.

    With ``data.teacher_history="latest"`` (only the last turn shown and labelled) these train the teacher the
    way free dialogues use it: f_k from r_k alone, every turn. Under the full history of Eq. 6 the synthetic
    scores are predictable from the previous feedback (each refinement moves one step the right way), so a
    teacher could learn f_k from f_{k-1} instead. And in the dialogues as written, a wrong refined answer is
    always still short of the truth on the side the previous feedback named, and its thought names that side
    ("The feedback says my count is too low, ..."): the feedback's direction is the thought's on every wrong
    refined turn (250 of the 587 wrong turns of the shipped set), which a teacher copies instead of comparing.
    So r_k's thought is drawn among the first one and both refined ones, apart from its answer, which is right
    with probability ``right_share``, else off on a side drawn uniformly among those the scale has room on, by a distance
    drawn uniformly among those that fit (1..MAX_OFFSET); f_k is :func:`exact_feedback`'s. The thought then
    says nothing of the feedback. The shipped ``teacher_turns.json`` has ``right_share`` 1/2, and
    ``teacher_turns_quarter_right.json`` 1/4, for the teacher stage after a comparison stage
    (``configs/main_job.py:smollm2,compare``): a teacher learns equality from a few hundred examples and the
    direction only from many updates on wrong answers.
    """
    if not 0 <= right_share <= 1:
        raise ValueError(f"right_share must be in [0, 1], got {right_share}")
    rng = random.Random(f"{seed}/teacher_turns")
    out = []
    for record in records:
        task = TASKS[parse_answer(record["groundtruth"]["value"])[0]]()
        truth = parse_answer(record["groundtruth"]["value"])[1]
        for k in range(1, len(record["conversations"]) // 2 + 1):
            value = truth
            if rng.random() >= right_share:
                value = wrong_value(task, truth, rng)
            thought = rng.choice([task.first_thought(), task.refined_thought(True), task.refined_thought(False)])
            text, score = exact_feedback(record["groundtruth"]["value"], task.answer(value))
            turns = record["conversations"][:2 * k - 2] + [
                {"role": "student", "type": "response", "value": response(thought, task.answer(value))},
                {"role": "teacher", "type": "feedback", "value": text}]
            out.append(dict(record, id=f"{record['id']}_t{k}", conversations=turns, round=k,
                            score=record["score"][:k - 1] + [score]))
    return out


def comparison_records(records: list[dict], seed: int = 0, per_record: int = 2, uniform: bool = False,
                       right_share: float = 0.0) -> list[dict]:
    """Text-only comparisons in the teacher's words, ``per_record`` for each record's groundtruth: the user message
    "Groundtruth: <groundtruth>\nAnswer: <answer>", the assistant the rule's feedback (:func:`exact_feedback`),
    the answer wrong, off on a side and by a distance drawn as in :func:`turn_records` (``uniform``: drawn
    uniformly among the task's other values instead, so the four distance scores come more evenly), or, with
    probability ``right_share``, the groundtruth itself ("Score: 10.\nFeedback: Correct! ..."). No image,
    no question, no instruction: the groundtruth stands beside the answer it judges.

    A pretrained LLM of 135M parameters orders no two values in context; through the teacher's own prompt, where
    the groundtruth comes some 150 tokens before the answer, its LoRA learns an order only after a plateau of a
    hundred updates or more per task. With the two values side by side the order comes within tens of updates.
    The main job's comparison stage (``configs/main_job.py:smollm2,compare``, the shipped ``comparisons.json``)
    trains on these before the teacher's stage, and ``experiments/teacher_order.py --warmup`` does the same on the reference side
    (docs/main_job.md).
    """
    if not 0 <= right_share < 1:
        raise ValueError(f"right_share must be in [0, 1), got {right_share}")
    rng = random.Random(f"{seed}/comparisons" + ("/uniform" if uniform else "")
                        + (f"/right{right_share}" if right_share else ""))
    out = []
    for record in records:
        groundtruth = record["groundtruth"]["value"]
        name, truth = parse_answer(groundtruth)
        task = TASKS[name]()
        for j in range(per_record):
            if right_share and rng.random() < right_share:
                value = truth
            elif uniform:
                value = rng.choice([v for v in range(task.size) if v != truth])
            else:
                value = wrong_value(task, truth, rng)
            text, _ = exact_feedback(groundtruth, task.answer(value))
            out.append({"id": f"{record['id']}_compare{j}", "source": record["source"], "split": "compare",
                        "conversations": [{"from": "human", "value": f"Groundtruth: {groundtruth}\nAnswer: "
                                                                     f"{task.answer(value)}"},
                                          {"from": "gpt", "value": text}]})
    return out


def corpus(records: list[dict]) -> list[str]:
    """The texts of raw records, for tokenizer training, with the system prompt and the teacher instruction
    once per record, as often as training sequences carry them (so BPE gives them short encodings)."""
    from fire_jax.data.chat import SYSTEM, TEACHER_INSTRUCTION

    texts = []
    for record in records:
        texts += [SYSTEM, TEACHER_INSTRUCTION]
        texts += [record["question"]["value"], record["groundtruth"]["value"]]
        texts += [message["value"] for message in record["conversations"]]
    return texts


# ---------------------------------------------------------------------------- shortcut check

#: Surface features a lazy teacher could score from instead of comparing the answer with the groundtruth.
SURFACE_FEATURES = {
    "turn index": lambda turn, r: turn,
    "first 4 words of the response": lambda turn, r: " ".join(r.split()[:4]),
    "the thought": lambda turn, r: r.split("\nAnswer:")[0],
    "response length (characters)": lambda turn, r: len(r),
    "response length (words)": lambda turn, r: len(r.split()),
}


def _answer(response_text: str) -> str:
    return response_text.split("Answer:")[-1].strip()


def judged_turns(records: Sequence[Mapping]) -> list[tuple[int, str, bool]]:
    """(turn index, response, right) for every student turn of raw records, judged against the groundtruth."""
    out = []
    for record in records:
        truth = record["groundtruth"]["value"]
        responses = [m["value"] for m in record["conversations"] if m["role"].lower() == "student"]
        out += [(k, r, _answer(r) == truth) for k, r in enumerate(responses, 1)]
    return out


def shortcut_report(train: Sequence[Mapping], test: Sequence[Mapping]) -> dict:
    """How well trivial predictors of "right" (the answer is the groundtruth) do, fitted on ``train`` and scored on ``test``.

    Each predictor sees one surface feature of a student turn (:data:`SURFACE_FEATURES`) and answers the
    majority label of that feature value in the training turns (the overall majority for unseen values).
    Returns {"chance": majority-class accuracy on test, "right_share_by_turn": {k: share right in train},
    "predictors": {feature: test accuracy}}. On a task without shortcuts every predictor stays near chance.
    """
    train_turns, test_turns = judged_turns(train), judged_turns(test)
    overall = sum(right for *_, right in train_turns) * 2 >= len(train_turns)
    predictors = {}
    for name, feature in SURFACE_FEATURES.items():
        votes = collections.defaultdict(lambda: [0, 0])
        for turn, r, right in train_turns:
            votes[feature(turn, r)][right] += 1
        rule = {value: v[1] > v[0] if v[0] != v[1] else overall for value, v in votes.items()}
        hits = [rule.get(feature(turn, r), overall) == right for turn, r, right in test_turns]
        predictors[name] = sum(hits) / len(hits)
    by_turn = collections.defaultdict(list)
    for turn, _, right in train_turns:
        by_turn[turn].append(right)
    majority = sum(right for *_, right in test_turns) / len(test_turns)
    return {"chance": max(majority, 1 - majority), "turns": {"train": len(train_turns), "test": len(test_turns)},
            "right_share_by_turn": {k: sum(v) / len(v) for k, v in sorted(by_turn.items())},
            "turns_by_position": {k: len(v) for k, v in sorted(by_turn.items())},
            "predictors": predictors}


# ---------------------------------------------------------------------------- the rule that wrote the feedback

def parse_answer(sentence: str) -> tuple[str, int] | None:
    """(task name, 0-based value) of an answer sentence of :func:`generate`'s tasks, or None."""
    text = sentence.strip().rstrip(".").strip().lower()
    for name, pattern in (("count", r"there are (\d+)"), ("bars", r"bar (\d+) is the tallest")):
        match = re.fullmatch(pattern, text)
        if match:
            return name, int(match.group(1)) - 1
    match = re.fullmatch(r"it is (\w+)", text)
    if match and match.group(1) in RAINBOW:
        return "color", RAINBOW.index(match.group(1))
    return None


def exact_feedback(groundtruth: str, answer: str) -> tuple[str, int]:
    """The feedback f_k (text, score) the generator's own rule gives ``answer`` (the text after "Answer:").

    The synthetic set's feedback is a function of (groundtruth, answer): 10 when right, else
    ``WRONG_SCORES[distance]`` and the hint that points towards the groundtruth. An answer that is not a
    sentence of the groundtruth's task scores 1 with a request for one. Used as the *exact teacher* in free
    dialogues, to measure the student's refinement apart from a trained teacher's mistakes.
    """
    truth, given = parse_answer(groundtruth), parse_answer(answer)
    if truth is None:
        raise ValueError(f"not a synthetic groundtruth: {groundtruth!r}")
    if given is None or given[0] != truth[0]:
        return feedback(1, "Answer with one sentence like the examples of this question."), 1
    if given[1] == truth[1]:
        return feedback(RIGHT_SCORE, "Correct! Your answer is right."), RIGHT_SCORE
    task = TASKS[truth[0]]()  # hints name nothing of the drawing, so an undrawn task writes them
    distance = min(abs(given[1] - truth[1]), MAX_OFFSET)
    return feedback(WRONG_SCORES[distance], task.hint(truth[1] > given[1])), WRONG_SCORES[distance]


def blind_feedback(turns: Sequence[Mapping]) -> dict[tuple[str, int], tuple[str, int]]:
    """The feedback of a *blind teacher*, fitted on teacher training turns (:func:`turn_records`): one that reads
    the question's task and the answer it judges, never the image nor the groundtruth. For each (task, 0-based
    value) answered wrong in ``turns``: the hint the rule gave that answer most often, and the score it gave it
    most often (ties: the first in sorted order), as {(task, value): (feedback text, score)}.

    This is the floor a trained teacher's direction and distance score (:func:`fire_jax.eval.judge.rule_check`)
    must clear before they show that it compares the answer with the groundtruth its prompt states. It is far
    above 1/2 and 1/4: with the sides and distances drawn uniformly where the scale allows, an answer near one
    end of its scale is mostly wrong towards the other (an answer of 1 is always too low), and distance 1 is
    possible from every value, so it is the commonest distance and score 6 the commonest score of a wrong
    answer.
    """
    hints, scores = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for record in turns:
        key = parse_answer(_answer(record["conversations"][-2]["value"]))
        score = record["score"][-1]
        if key is None or score == RIGHT_SCORE:
            continue
        hints[key][record["conversations"][-1]["value"].split("Feedback:", 1)[-1].strip()] += 1
        scores[key][score] += 1

    def most(counter):
        return max(sorted(counter.items()), key=lambda item: item[1])[0]

    return {key: (feedback(most(scores[key]), most(hints[key])), most(scores[key])) for key in sorted(hints)}
