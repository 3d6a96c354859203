"""FIRE-100K-style generation (FIRE Fig. 3a, Sec. 3.2): one API-model call writes a whole student-teacher
conversation (the job: ``python -m fire_jax.make_fire100k``, docs/fire100k.md).

For each (image, instruction, groundtruth, source) triplet the model gets :data:`SYSTEM_PROMPT` and a user message
with the image and :data:`USER_PROMPT` (ours: the paper shows its prompts only as pictures, Figs. A11-A12) and
answers with the whole conversation as JSON, ``{"turns": [{"thought", "answer", "score", "feedback"}, ...]}``.
:func:`parse_conversation` reads it strictly into FIRE turns: the student's response
``"Thought: ...\\nAnswer: ..."``, the teacher's feedback ``"Score: N.\\nFeedback: ..."``; the record
(:func:`fire_jax.dialogue.fire1m.fire_record`) is then checked with :func:`fire_jax.data.records.parse_record`.
Kept: conversations that parse, have at most ``max_turns`` (:data:`MAX_TURNS`, 6) turns and whose last score is
higher than the first (the paper's two filters: :func:`fire_jax.data.filters.drop_reason`, the keep/drop rule of
FIRE-1M-style generation too). Every drop is counted by reason (:data:`DROP_REASONS`).

:func:`make_records` sends the requests concurrently with the retries of :class:`fire_jax.infer.api.ApiBackend`
and appends each result as it comes, so a killed run loses only the requests in flight and a rerun skips every
id already kept or dropped (a request that still failed, ``api_error``, is retried by the next run).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import re

from fire_jax.core.results import ResultStore
from fire_jax.data.chat import Message
from fire_jax.data.filters import FILTER_REASONS, drop_reason
from fire_jax.data.items import Item
from fire_jax.data.records import Turn
from fire_jax.dialogue.fire1m import fire_record
from fire_jax.dialogue.loop import Dialogue
from fire_jax.infer.api import ApiBackend, ApiError

MAX_TURNS = 6  # the paper drops conversations with more turns
#: Why a conversation is not kept: malformed output (not_json, bad_structure, bad_score, empty_text), the
#: generated-conversation filter (:data:`fire_jax.data.filters.FILTER_REASONS`, then a parse_record reason), or a
#: request that failed.
DROP_REASONS = ("not_json", "bad_structure", "bad_score", "empty_text", *FILTER_REASONS, "api_error")

SYSTEM_PROMPT = """You write training conversations for FIRE, a dataset that teaches a vision-language model to \
refine its answers from feedback. You are given an image, a question about it and its groundtruth answer. Write a \
whole conversation between a student (a vision-language model) and a teacher:

1. The student answers the question. Its first answer is plausible but imperfect, the way a real model errs: a \
wrong detail, a miscount, an incomplete or too vague answer. Each student response has a "thought" (its short \
reasoning about the image) and an "answer".
2. The teacher compares the student's answer with the groundtruth in terms of accuracy, relevance, helpfulness \
and level of detail, gives an overall integer "score" from 0 to 10 (higher is better), and writes "feedback": \
polite and specific, saying which parts of the answer are wrong, what is missing and how to improve it. The \
feedback must NOT state the groundtruth answer.
3. The student refines its answer using the feedback, and the teacher scores and comments again. Scores rise as \
the answer improves. Stop when the answer is correct (score 8 or more), after at most {max_turns} student turns.

Reply with JSON only, no other text, in exactly this form (one object per student turn, in order):
{{"turns": [{{"thought": "...", "answer": "...", "score": 4, "feedback": "..."}}, ...]}}"""

USER_PROMPT = "Question: {question}\nGroundtruth: {groundtruth}\n\nWrite the conversation as JSON."

_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.DOTALL)
_TURN_KEYS = {"thought", "answer", "score", "feedback"}


class Malformed(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def parse_conversation(text: str) -> list[Turn]:
    """The FIRE turns of a model's JSON conversation; raises :class:`Malformed` naming the reason.

    Strict: one JSON object (optionally in a single ```json fence) with a non-empty
    ``turns`` list of objects with exactly the keys thought, answer, score (a number
    in 0..10) and feedback (non-empty strings).
    """
    text = text.strip()
    fenced = _FENCE.match(text)
    try:
        data = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as e:
        raise Malformed("not_json", f"{e}; output starts {text[:60]!r}") from None
    turns = data.get("turns") if isinstance(data, dict) else None
    if not isinstance(turns, list) or not turns:
        raise Malformed("bad_structure", "expected an object with a non-empty 'turns' list")
    out = []
    for k, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or set(turn) != _TURN_KEYS:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise Malformed("bad_structure", f"turn {k}: expected keys {sorted(_TURN_KEYS)}, got {keys}")
        score = turn["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 10 \
                or not math.isfinite(score):
            raise Malformed("bad_score", f"turn {k}: score {score!r} is not a number in 0..10")
        texts = [turn[key] for key in ("thought", "answer", "feedback")]
        if not all(isinstance(t, str) for t in texts):
            raise Malformed("bad_structure", f"turn {k}: thought, answer and feedback must be strings")
        if not all(t.strip() for t in texts):
            raise Malformed("empty_text", f"turn {k}: an empty thought, answer or feedback")
        thought, answer, feedback = (" ".join(t.split()) for t in texts)  # one line each: "Score:" stays first
        score = int(score) if float(score).is_integer() else float(score)
        out.append(Turn(f"Thought: {thought}\nAnswer: {answer}", f"Score: {score}.\nFeedback: {feedback}", score))
    return out


def prompt(item: Item) -> list[Message]:
    """The prompt for one triplet, after :data:`SYSTEM_PROMPT`: the image, then the question and groundtruth."""
    return [Message("user", USER_PROMPT.format(question=item.question, groundtruth=item.groundtruth), images=1)]


def to_record(item: Item, output: str, *, image_root: str, split: str, max_turns: int) -> tuple[dict | None, dict | None]:
    """(kept record, None) or (None, drop entry) for one model output."""
    drop = lambda reason, detail: (None, {"id": item.id, "source": item.source, "reason": reason, "detail": detail,
                                          "output": output[:4000]})
    try:
        turns = parse_conversation(output)
    except Malformed as e:
        return drop(e.reason, e.detail)
    record = fire_record(Dialogue(item, turns), split=split, image_root=image_root)
    reason = drop_reason(record, max_turns=max_turns)
    return drop(reason.reason, str(reason)) if reason else (record, None)


def make_records(items, backend: ApiBackend, out: str, *, image_root: str, split: str = "fire_100k",
                 max_turns: int = MAX_TURNS, concurrency: int = 16) -> collections.Counter:
    """Ask ``backend`` for a conversation per triplet not yet done, ``concurrency`` at a time, each written as it
    comes; returns this run's api_error count (as a Counter)."""
    from tqdm.auto import tqdm

    failed = collections.Counter()
    with ResultStore(out, key_field="id") as kept, ResultStore(out + ".dropped.jsonl", key_field="id") as dropped:
        todo = [item for item in items if item.id not in kept and item.id not in dropped]
        print(f"FIRE-100K-style generation with {backend.spec}: {len(items)} triplets, {len(items) - len(todo)} "
              f"already done ({len(kept)} kept), {len(todo)} to run", flush=True)
        system = SYSTEM_PROMPT.format(max_turns=max_turns)
        ask = lambda item: backend.generate([item.image], [prompt(item)], system=system)[0]  # retried, counted
        with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool, \
                tqdm(total=len(items), initial=len(items) - len(todo), desc="generate", unit="conversation",
                     dynamic_ncols=True) as progress:
            futures = {pool.submit(ask, item): item for item in todo}
            for future in concurrent.futures.as_completed(futures):
                item = futures[future]
                try:
                    output = future.result()
                except ApiError as e:
                    failed["api_error"] += 1
                    print(f"{item.id}: {e}", flush=True)
                    continue
                record, drop = to_record(item, output, image_root=image_root, split=split, max_turns=max_turns)
                if record:  # written and flushed at once
                    kept.add(record)
                else:
                    dropped.add(drop)
                progress.update(1)
                progress.set_postfix(kept=len(kept))
    return failed
