"""Rollouts of the reinforcement stage: groups of sampled dialogues per item with the student's current weights,
each turn's reward from the teacher's score, and the training batch they make.

- :class:`ScoringTeacher`: any teacher :func:`fire_jax.dialogue.agents.from_spec` builds (FD, the exact teacher,
  an endpoint), its replies read as rewards, every reward that cannot be read counted by reason;
- :func:`items_at`: the items of one rollout (a seeded order over the training items, epoch after epoch);
- :func:`rollout`: ``group_size`` dialogues per item through the one dialogue loop
  (:func:`fire_jax.dialogue.loop.run_dialogues`), the student an in-process backend over the trained model itself;
- :func:`dialogue_rewards`: per-turn rewards (:func:`fire_jax.train.policy.turn_rewards`), None for a dialogue
  with a reward that could not be read, which then never enters the update;
- :func:`rollout_batch`: a row per dialogue (:func:`dialogue_rows`), every turn's prompt as the engine read it and
  the token ids it sampled (the only labelled ones), each turn's with its advantage (turn-level credit).

Rows are what was sampled, not the dialogue's text encoded again: a text's canonical tokens need not be the ones
sampled (a leading space, a byte token that decodes to U+FFFD), and the ratio and the KL term compare
log-probabilities of the sampled tokens under the prompt the student actually saw.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import numpy as np

from fire_jax.core.geometry import place_images
from fire_jax.data.images import pad_tiles
from fire_jax.data.items import Item
from fire_jax.data.pipeline import batch_length
from fire_jax.data.scores import parse_score
from fire_jax.dialogue.agents import Feedback, Student
from fire_jax.dialogue.loop import Dialogue, run_dialogues
from fire_jax.dialogue.stop import StopRule
from fire_jax.infer.backends import InProcess
from fire_jax.train.policy import turn_rewards

#: Why a reward could not be read: the teacher's reply has no score, or (``teacher_<reason>``) the teacher failed:
#: an endpoint's failure reason once its retries are spent (``teacher_timeout``, ``teacher_http_503``, ...;
#: :class:`fire_jax.infer.api.ApiError`), else the exception's type.
NO_SCORE = "no_score"


class ScoringTeacher:
    """A teacher whose replies are rewards: :meth:`feedback` as the teacher's, but a reply the teacher could not give
    (an endpoint down or timing out) is a reply without a score, so its dialogue stops there (``no_score``) and
    leaves the update; ``failures`` counts both by reason, ``errors`` keeps the first message of each."""

    def __init__(self, teacher, rule: StopRule):
        self.teacher, self.rule = teacher, rule
        self.description = getattr(teacher, "description", "")
        self.failures: collections.Counter = collections.Counter()
        self.errors: dict[str, str] = {}

    def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None) -> list[Feedback]:
        backend = getattr(self.teacher, "backend", None)
        if backend is None:  # a rule (the exact teacher): nothing to fail but its score
            replies = self.teacher.feedback(images, questions, groundtruths, answers, histories, rng=rng)
        else:
            histories = [()] * len(images) if histories is None else histories
            texts = backend.generate(images, self.teacher.prompts(questions, groundtruths, answers, histories),
                                     rng=rng, errors=True)
            replies = [self._failed(t) if isinstance(t, BaseException) else Feedback(t, parse_score(t))
                       for t in texts]
        for reply in replies:
            if reply.text and self.rule.score(reply) is None:
                self.failures[NO_SCORE] += 1
        return replies

    def _failed(self, error: BaseException) -> Feedback:
        reason = f"teacher_{getattr(error, 'reason', type(error).__name__)}"
        self.failures[reason] += 1
        self.errors.setdefault(reason, str(error).splitlines()[0] if str(error) else reason)
        return Feedback("", None)


def items_at(items: Sequence[Item], iteration: int, per_step: int, seed: int) -> list[Item]:
    """The ``per_step`` items of rollout ``iteration``: positions ``iteration * per_step ...`` of a stream of epochs,
    each a permutation of ``items`` seeded by (``seed``, epoch), so a resumed stage draws the same items."""
    out = []
    for position in range(iteration * per_step, (iteration + 1) * per_step):
        epoch, index = divmod(position, len(items))
        out.append(items[np.random.default_rng((seed, epoch)).permutation(len(items))[index]])
    return out


class SampledStudent(Student):
    """The student over an in-process backend that keeps what it sampled: per (image, question, earlier turns,
    response) the engine's requests and results (:meth:`fire_jax.infer.backends.InProcess.results`), in order."""

    def __init__(self, backend: InProcess):
        super().__init__(backend)
        self.samples: dict[tuple, list] = collections.defaultdict(list)

    def respond(self, images, questions, histories=None, *, rng=None) -> list[str]:
        histories = [()] * len(images) if histories is None else histories
        results = self.backend.results(images, self.prompts(questions, histories), rng=rng)
        texts = [result.text.strip() for _, result in results]
        for image, question, history, text, sample in zip(images, questions, histories, texts, results):
            self.samples[_turn_key(image, question, history, text)].append(sample)
        return texts


def _turn_key(image, question: str, history, response: str) -> tuple:
    return image, question, tuple((t.response, t.feedback) for t in history), response


@dataclasses.dataclass
class Rollout:
    """One rollout's dialogues in item order, ``group_size`` per item (``groups[i]``: dialogue i's item), and per
    dialogue per turn the engine's (request, result) of its r_k."""

    dialogues: list[Dialogue]
    groups: list[int]
    samples: list[list[tuple]]


def rollout(model, chat, items: Sequence[Item], teacher, rule: StopRule, *, group_size: int, sampling, engine,
            rng, mesh=None) -> Rollout:
    """``group_size`` dialogues per item, all in flight at once, the student sampled with ``sampling`` from the
    in-process backend over ``model`` (the trainer's current weights, no copy: a new backend each rollout, so no
    cached key or value of older weights is reused) and the teacher's replies its rewards."""
    student = SampledStudent(InProcess(model, chat, sampling, engine=engine, mesh=mesh,
                                       batch_size=len(items) * group_size))
    originals = [item for item in items for _ in range(group_size)]
    copies = [dataclasses.replace(item, id=str(row)) for row, item in enumerate(originals)]  # one id a dialogue
    finished: dict[str, Dialogue] = {}
    run_dialogues(copies, student, teacher, rule, batch_size=len(copies), rng=rng,
                  on_finish=lambda d: finished.__setitem__(d.item.id, d))
    dialogues = [dataclasses.replace(finished[copy.id], item=item) for copy, item in zip(copies, originals)]
    samples = [[student.samples[_turn_key(d.item.image, d.item.question, d.turns[:k], turn.response)].pop(0)
                for k, turn in enumerate(d.turns)] for d in dialogues]
    return Rollout(dialogues, [g for g in range(len(items)) for _ in range(group_size)], samples)


def dialogue_rewards(dialogues: Sequence[Dialogue], reward) -> list[list[float] | None]:
    """Per-turn rewards of each dialogue (``reward``: ``score`` and ``improvement`` weights), None where a turn's
    score could not be read (never a silent zero)."""
    out = []
    for dialogue in dialogues:
        scores = dialogue.scores
        out.append(None if any(s is None for s in scores) else
                   turn_rewards(scores, score=reward.score, improvement=reward.improvement))
    return out


def dialogue_rows(rollout_: Rollout, per_turn: Sequence[Sequence[float] | None], limit: int) -> list[tuple]:
    """The rows of a rollout's readable dialogues, as few as the prompts allow: turn k's prompt is the dialogue so
    far, so when it begins with turn k-1's row (its prompt and sampled ids, token for token) turn k extends that
    row, and one forward pass scores every turn of the dialogue. A turn starts a row of its own where the prompt
    does not extend it (a sampled reply whose text encodes to other ids, the template's cut) or the row would pass
    ``limit`` tokens. Each row: (ids, [(start, stop, turn k, advantage)] its labelled spans, its first request)."""
    out = []
    for samples, values in zip(rollout_.samples, per_turn):
        if values is None:
            continue
        row = None
        for k, ((request, result), value) in enumerate(zip(samples, values)):
            prompt, sampled = list(request.prompt), list(result.tokens)
            extends = row is not None and prompt[:len(row[0])] == row[0] and len(prompt) + len(sampled) <= limit
            if not extends:
                row = ([], [], request)
                out.append(row)
            ids = (prompt + sampled)[:limit]
            row[0][:] = ids
            if len(ids) > len(prompt):
                row[1].append((len(prompt), len(ids), k + 1, value))
    return out


def rollout_batch(rollout_: Rollout, per_turn: Sequence[Sequence[float] | None], *, rows: int, buckets: Sequence[int],
                  pad_id: int, image_token_id: int, geometry) -> dict[str, np.ndarray]:
    """The training batch of a rollout: the dialogues whose rewards were read (the others leave the batch), a row
    per dialogue where its prompts extend each other (:func:`dialogue_rows`; a row is cut at the largest bucket),
    labelled on the sampled ids, each turn's with ``turn_ids`` k and ``advantages`` the turn's (turn-level
    credit); padded to ``rows`` times a power of two rows (few compiled shapes: each new one compiles the step and
    the log-probs again)."""
    built = dialogue_rows(rollout_, per_turn, max(buckets))
    if not built:
        raise ValueError("a rollout with no readable reward has no batch")
    length = batch_length(max(len(ids) for ids, _, _ in built), buckets)
    count = rows * 2 ** math.ceil(math.log2(-(-len(built) // rows)))  # rows x a power of two: few shapes
    batch = {"input_ids": np.full((count, length), pad_id, np.int32),
             "attention_mask": np.zeros((count, length), np.int32),
             "loss_mask": np.zeros((count, length), np.float32), "turn_ids": np.full((count, length), -1, np.int32),
             "advantages": np.zeros((count, length), np.float32)}
    for row, (ids, spans, _) in enumerate(built):
        batch["input_ids"][row, :len(ids)] = ids
        batch["attention_mask"][row, :len(ids)] = 1
        for start, stop, turn, advantage in spans:
            batch["loss_mask"][row, start:stop], batch["turn_ids"][row, start:stop] = 1.0, turn
            batch["advantages"][row, start:stop] = advantage
    batch["input_ids"][len(built):, 0] = batch["input_ids"][0, 0]  # padding rows: one attended token, no label
    batch["attention_mask"][len(built):, 0] = 1
    batch["pixel_values"] = pad_tiles([request.pixel_values for _, _, request in built], tiles=geometry.max_tiles,
                                      batch=count, tile_size=geometry.tile_size)
    sizes = [[tuple(s) for s in request.image_sizes] for _, _, request in built] + [[]] * (count - len(built))
    # the prompts' image placeholders only: a sampled id equal to the image token's is text, as the engine read it
    prompts_only = np.where(batch["loss_mask"] > 0, pad_id, batch["input_ids"])
    batch["image_index"] = place_images(prompts_only, image_token_id, sizes, geometry, geometry.max_tiles)
    batch["rows_used"] = np.asarray(len(built))
    return batch
