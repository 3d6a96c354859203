"""Batch generation: student responses or teacher feedback for a JSONL file of prompts.

    python -m fire_jax.batch_infer --input prompts.jsonl --output out.jsonl            # tiny default, student
    python -m fire_jax.batch_infer --config configs/fire_teacher.py --checkpoint WORKDIR --role teacher \\
        --input prompts.jsonl --image_root /data/fire/images --output feedback.jsonl --batch_size 16

Input, one JSON object a line: ``id``, ``image`` (path under --image_root),
``question``, optional ``history`` ([{"response", "feedback"}, ...], the earlier
turns); for the teacher also ``groundtruth`` and ``answer`` (the response r_k
to judge). Output, one line per prompt: ``{"id", "output"}``, plus ``"score"``
(parsed from the feedback, null if none) for the teacher. The student
generates r_k and the teacher f_k, k = len(history) + 1, on the prompts of
:mod:`fire_jax.dialogue.agents`.

--checkpoint may be api:<base_url>#<model>, any OpenAI-compatible endpoint
(e.g. python -m fire_jax.serve, or GPT-4o with $OPENAI_API_KEY): rows go out
--concurrency at a time, with bounded retries and backoff on 429/5xx; a
batch whose rows still fail stops the job, which a rerun resumes.

Resumable: ids already in --output are skipped, results are appended batch by
batch. Bad input lines (invalid_json, missing_field, missing_image,
unreadable_image, duplicate_id) are skipped and counted by reason, or raise
naming file, line and field with --on_bad_record error.
"""

from __future__ import annotations

import sys

import argparse
import dataclasses
import os
from typing import Sequence

import jax

from fire_jax.core.cli import existing_dir, run_command, require_model_config
from fire_jax.core.config import DEFAULT_CONFIG, apply_overrides, load_config, resolve_path, split_overrides
from fire_jax.data.images import load_image
from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.image_files import image_path
from fire_jax.data.jsonl import jsonl_lines
from fire_jax.data.records import Turn
from fire_jax.data.scores import parse_score
from fire_jax.dialogue.agents import from_specs
from fire_jax.infer.api import is_api_spec
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.loading import check_checkpoint_arg
from fire_jax.core.results import ResultStore

ROLES = ("student", "teacher")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    image: str  # resolved path
    question: str
    history: tuple[Turn, ...]
    groundtruth: str = ""  # teacher only
    answer: str = ""  # teacher only: the response r_k to judge
    where: str = ""  # "FILE:LINE" for error messages


def _text(raw: dict, field: str, where: str, *, location: str | None = None) -> str:
    value = raw.get(field)
    if not isinstance(value, str) or not value.strip():
        raise BadRecordError("missing_field", where, location or field,
                             "absent" if value is None else f"expected a non-empty string, got {value!r}")
    return value.strip()


def parse_prompt(raw, where: str, role: str, image_root: str) -> Prompt:
    """One input line's JSON value as a :class:`Prompt`; raises :class:`BadRecordError` (image existence
    checked)."""
    if not isinstance(raw, dict):
        raise BadRecordError("missing_field", where, "<line>", f"expected a JSON object, got {type(raw).__name__}")
    if not isinstance(raw.get("id"), (str, int)) or raw["id"] == "":
        raise BadRecordError("missing_field", where, "id", f"expected a string or integer, got {raw.get('id')!r}")
    where = f"{where} (id {raw['id']!r})"
    image = image_path(image_root, _text(raw, "image", where), where)
    question = _text(raw, "question", where)
    history = raw.get("history") or []
    if not isinstance(history, list):
        raise BadRecordError("missing_field", where, "history", f"expected a list, got {history!r}")
    turns = []
    for i, turn in enumerate(history):
        if not isinstance(turn, dict):
            raise BadRecordError("missing_field", where, f"history[{i}]", "expected {\"response\", \"feedback\"}")
        response = _text(turn, "response", where, location=f"history[{i}].response")
        feedback = _text(turn, "feedback", where, location=f"history[{i}].feedback")
        turns.append(Turn(response, feedback, parse_score(feedback)))
    extra = {}
    if role == "teacher":
        extra = dict(groundtruth=_text(raw, "groundtruth", where), answer=_text(raw, "answer", where))
    if not os.path.isfile(image):
        raise BadRecordError("missing_image", where, "image", f"{image} does not exist")
    return Prompt(str(raw["id"]), image, question, tuple(turns), where=where, **extra)


def read_prompts(path: str, role: str, image_root: str, *, skip_ids=frozenset(), on_bad_record: str = "skip",
                 bad: BadRecords | None = None) -> list[Prompt]:
    """The valid prompts of a JSONL file whose ids are not in ``skip_ids``; bad lines counted in ``bad``."""
    bad = BadRecords() if bad is None else bad
    prompts, seen = [], set()
    for record in jsonl_lines(path):
        where = f"{path}:{record.line}"
        try:
            if record.error is not None:
                raise BadRecordError("invalid_json", where, "<line>", record.error)
            prompt = parse_prompt(record.value, where, role, image_root)
            if prompt.id in seen:
                raise BadRecordError("duplicate_id", prompt.where, "id", "the id appeared on an earlier line")
        except BadRecordError as e:
            bad.handle(e, on_bad_record)
            continue
        seen.add(prompt.id)
        if prompt.id not in skip_ids:
            prompts.append(prompt)
    return prompts


def infer_batch(agent, role: str, prompts: Sequence[Prompt], images, rng) -> list[dict]:
    questions, histories = [p.question for p in prompts], [p.history for p in prompts]
    if role == "student":
        return [{"output": text} for text in agent.respond(images, questions, histories, rng=rng)]
    feedback = agent.feedback(images, questions, [p.groundtruth for p in prompts], [p.answer for p in prompts],
                              histories, rng=rng)
    return [{"output": f.text, "score": f.score} for f in feedback]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="config file[:arg] (default: configs/tiny.py); --config.<field>=<value> sets a field")
    parser.add_argument("--checkpoint", help="HF checkpoint dir, PEFT adapter dir, train workdir or "
                                             "api:<base_url>#<model>")
    parser.add_argument("--adapter", type=existing_dir, default=None,
                        help="a LoRA folder of the original LLaVA format (the FIRE release's teacher) merged into "
                             "--checkpoint (or, without it, into the base its adapter_config.json names)")
    parser.add_argument("--input", required=True, help="JSONL of prompts")
    parser.add_argument("--output", required=True, help="JSONL of results (appended; existing ids are skipped)")
    parser.add_argument("--image_root", default="", help="image paths in --input are relative to it")
    parser.add_argument("--role", choices=ROLES, default="student")
    parser.add_argument("--teacher_history", choices=("full", "latest"), default=None,
                        help="what earlier turns the teacher sees (default: config.data.teacher_history)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on_bad_record", choices=("skip", "error"), default="skip")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight to an api: endpoint")
    args = parser.parse_args(argv)
    if not is_api_spec(args.checkpoint):
        check_checkpoint_arg(parser, args.checkpoint, "--checkpoint")
    return args


def main(argv=None, print_fn=print) -> dict:
    """Run the job; returns {"written", "already_done", "bad": {reason: count}}."""
    from tqdm.auto import tqdm

    argv, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    config = require_model_config(apply_overrides(load_config(args.config), overrides), args.config)
    if args.adapter:
        config.init = dict(config.get("init") or {}, adapter=args.adapter)
    store = ResultStore(args.output, key_field="id")  # resume: ids already written are skipped
    done = {str(record["id"]) for record in store}
    bad = BadRecords()
    prompts = read_prompts(args.input, args.role, resolve_path(args.image_root), skip_ids=done,
                           on_bad_record=args.on_bad_record, bad=bad)
    print_fn(f"{args.input}: {len(prompts)} prompts to generate, {len(done)} already in {args.output}")
    written = 0
    if not prompts:
        store.close()
    else:
        history = args.teacher_history or config.data.get("teacher_history", "full")
        sampling = SamplingParams.from_config(args, source="the command line")
        agents, descriptions = from_specs(config, {args.role: args.checkpoint}, sampling, teacher_history=history,
                                           concurrency=args.concurrency, batch_size=args.batch_size)
        agent = agents[args.role]
        print_fn(f"{args.role}: {descriptions[args.role]}")
        key = jax.random.key(args.seed)
        with store, tqdm(total=len(prompts), desc=args.role, dynamic_ncols=True) as bar:
            for start in range(0, len(prompts), args.batch_size):
                chunk, batch, images = prompts[start:start + args.batch_size], [], []
                for prompt in chunk:
                    try:
                        images.append(load_image(prompt.image, alpha="keep"))
                    except Exception as e:  # an unreadable file fails its line, not the job
                        error = BadRecordError("unreadable_image", prompt.where, "image", f"{type(e).__name__}: {e}")
                        bad.handle(error, args.on_bad_record)
                        continue
                    batch.append(prompt)
                if batch:
                    # The agent's engine has batch_size slots for every batch, a short last one too.
                    results = infer_batch(agent, args.role, batch, images, jax.random.fold_in(key, start))
                    for prompt, result in zip(batch, results):
                        store.add({"id": prompt.id, **result})
                    written += len(batch)
                bar.update(len(chunk))
    print_fn(f"wrote {written} to {args.output}")
    print_fn(bad.report("bad input lines"))
    return {"written": written, "already_done": len(done), "bad": dict(bad)}


if __name__ == "__main__":
    run_command(main, "fire_jax.batch_infer")
