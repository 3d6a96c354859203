"""A terminal dialogue: the student answers, you (or the teacher, with --auto) give feedback, turn after turn.

    python -m fire_jax.chat                                  # tiny default: a drawn image, a default question
    python -m fire_jax.chat --auto                           # the teacher gives the feedback and the score
    python -m fire_jax.chat --config configs/fire_student.py --image cat.jpg --question "..." \\
        --student WORKDIR_OR_ADAPTER --teacher FD_ADAPTER --groundtruth "..." [--auto]

--student / --teacher take a Hugging Face checkpoint, a PEFT adapter or a
fire_jax train workdir (detected; see fire_jax.infer.loading), or
api:<base_url>#<model> (any OpenAI-compatible endpoint, e.g. fire_jax.serve;
key from $FIRE_JAX_API_KEY or $OPENAI_API_KEY); without one the config's
model is used. With a teacher, each answer is scored (the teacher
sees the question, the groundtruth and the latest answer, FIRE Fig. A14); in
--auto mode its feedback goes to the student, else you type the feedback
(an empty line takes the teacher's). Stops on "quit" / end of input, when the
teacher's score reaches --solved (8) in --auto mode, or after --max_turns (5).
The student sees the feedback without its score line (the text after "Feedback:").
"""

from __future__ import annotations

import sys

import argparse

import jax
from PIL import Image, ImageDraw

from fire_jax.core.cli import run_command, require_model_config
from fire_jax.core.config import (DEFAULT_CONFIG, FREE_DIALOGUE_NEW_TOKENS, apply_overrides, load_config,
                                  split_overrides)
from fire_jax.data.records import Turn
from fire_jax.data.scores import parse_score
from fire_jax.dialogue.agents import from_specs
from fire_jax.infer.api import is_api_spec
from fire_jax.dialogue.stop import FREE_DIALOGUE, StopRule
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.loading import check_checkpoint_arg

DEMO_QUESTION = "How many red squares are in the image?"
DEMO_GROUNDTRUTH = "There are 3 red squares."
QUIT = ("quit", "exit", "q")


def demo_image() -> Image.Image:
    """A 64x96 white image with three red squares and a blue circle (the default when --image is omitted)."""
    image = Image.new("RGB", (96, 64), "white")
    draw = ImageDraw.Draw(image)
    for x in (6, 36, 66):
        draw.rectangle((x, 8, x + 20, 28), fill="red")
    draw.ellipse((38, 38, 58, 58), fill="blue")
    return image


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="config file[:arg] (default: configs/tiny.py); --config.<field>=<value> sets a field")
    parser.add_argument("--image", help="image file (default: a drawn demo image)")
    parser.add_argument("--question", help="asked for when --image is given without it")
    parser.add_argument("--groundtruth", help="what the teacher compares against; asked for when needed")
    parser.add_argument("--student", help="checkpoint (HF dir, PEFT adapter dir or train workdir) or "
                                          "api:<base_url>#<model>")
    parser.add_argument("--teacher", help="the teacher, as --student (implied by --auto: the config's model)")
    parser.add_argument("--auto", action="store_true", help="the teacher gives the feedback")
    parser.add_argument("--max_turns", type=int, default=FREE_DIALOGUE.max_turns)
    parser.add_argument("--solved", type=float, default=FREE_DIALOGUE.threshold,
                        help="--auto stops at this score (default: the free dialogues' threshold)")
    parser.add_argument("--max_new_tokens", type=int, default=FREE_DIALOGUE_NEW_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for flag, spec in (("--student", args.student), ("--teacher", args.teacher)):
        if not is_api_spec(spec):
            check_checkpoint_arg(parser, spec, flag)
    return args


def _ask(input_fn, prompt: str) -> str | None:
    """One line of input, stripped; None at end of input."""
    try:
        return input_fn(prompt).strip()
    except EOFError:
        return None


def main(argv=None, input_fn=input, print_fn=print) -> list[Turn]:
    """Run one dialogue; returns its turns (the last one's feedback is empty if the dialogue stopped there)."""
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    config = require_model_config(apply_overrides(load_config(args.config), overrides), args.config)
    image = demo_image() if args.image is None else args.image
    question = args.question or (DEMO_QUESTION if args.image is None else _ask(input_fn, "question> "))
    use_teacher = args.auto or args.teacher is not None
    groundtruth = args.groundtruth or (DEMO_GROUNDTRUTH if args.image is None else None)
    if use_teacher and not groundtruth:
        groundtruth = _ask(input_fn, "groundtruth> ")
    if not question or (use_teacher and not groundtruth):
        print_fn("no question" if not question else "no groundtruth for the teacher")
        return []

    sampling = SamplingParams.from_config(args, source="the command line")
    specs = {"student": args.student, **({"teacher": args.teacher} if use_teacher else {})}
    agents, descriptions = from_specs(config, specs, sampling, concurrency=1)  # the teacher sees the latest answer
    student, teacher = agents["student"], agents.get("teacher")
    for role, description in descriptions.items():
        print_fn(f"{role}: {description}")
    print_fn(f"image: {args.image or 'demo (3 red squares, 1 blue circle)'}\nquestion: {question}"
             + (f"\ngroundtruth: {groundtruth}" if use_teacher else ""))
    if not args.auto:
        print_fn(f"type feedback after each answer ({' / '.join(QUIT)} or end of input stops"
                 + (", an empty line takes the teacher's)" if teacher else ")"))

    key = jax.random.key(args.seed)
    history: list[Turn] = []
    for k in range(1, args.max_turns + 1):
        response = student.respond([image], [question], [tuple(history)], rng=jax.random.fold_in(key, 2 * k))[0]
        print_fn(f"\n[turn {k}] student: {response}")
        suggestion = None
        if teacher is not None:
            suggestion = teacher.feedback([image], [question], [groundtruth], [response], [tuple(history)],
                                          rng=jax.random.fold_in(key, 2 * k + 1))[0]
            score = "none (no 'Score:' line)" if suggestion.score is None else f"{suggestion.score:g}"
            print_fn(f"[turn {k}] teacher: score {score}\n{suggestion.text}")
        if args.auto:
            feedback = suggestion.text
        else:
            feedback = _ask(input_fn, "feedback> ")
            while feedback == "" and suggestion is None:
                feedback = _ask(input_fn, "feedback> ")
            if feedback is None or feedback.lower() in QUIT:
                history.append(Turn(response, "", None))
                print_fn("stopped")
                return history
            feedback = feedback or suggestion.text
        history.append(Turn(response, feedback, parse_score(feedback)))
        if args.auto and StopRule(threshold=args.solved).solves(suggestion.score):
            print_fn(f"solved at turn {k} (score {suggestion.score:g} >= {args.solved:g})")
            return history
    print_fn(f"stopped after {args.max_turns} turns")
    return history


if __name__ == "__main__":
    run_command(main, "fire_jax.chat")
