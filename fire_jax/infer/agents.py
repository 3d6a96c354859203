"""The student and the teacher as batched generators: the student answers and refines, the teacher scores
and writes feedback.

Prompts are the training sequences cut before the turn to generate, rendered
by :mod:`fire_jax.data.chat` (the same code that renders training data), so
an agent sees exactly what its model was trained on:

- student, for r_k: user [image] q, assistant r_1, user f_1 (feedback text
  only), ..., user f_{k-1}, then the assistant header;
- teacher, for f_k: user [image] "Question: {q}\\nGroundtruth: {gt}", user
  TEACHER_INSTRUCTION, [user r_j, assistant f_j for earlier turns when
  ``history="full"``], user r_k, then the assistant header. In free dialogues
  the teacher sees only the latest answer (``"latest"``, the default; Fig. A14).

Both stop on the chat template's end-of-turn token and EOS (``ChatTokenizer.stop_ids``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fire_jax.data.chat import ChatTokenizer, Message, check_teacher_history, student_messages, teacher_messages
from fire_jax.data.images import TileCache
from fire_jax.data.records import Conversation, Turn, parse_score
from fire_jax.infer.api import ApiAgent, is_api_spec
from fire_jax.infer.decode import requests_for
from fire_jax.infer.engine import Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Feedback:
    text: str  # the whole feedback f_k, score line included
    score: float | None  # a_k parsed from it (fire_jax.data.records.parse_score), None if it has none


def _conversation(question: str, groundtruth: str, turns: Sequence[Turn]) -> Conversation:
    return Conversation(id="", image=None, question=question, groundtruth=groundtruth, turns=tuple(turns),
                        source="", split="")


def student_prompt(question: str, history: Sequence[Turn]) -> list:
    """The messages of the prompt for r_k, k = len(history) + 1 (in-process and endpoint students alike)."""
    return student_messages(_conversation(question, "", history), until_turn=len(history) + 1)


def teacher_prompt(question: str, groundtruth: str, answer: str, history: Sequence[Turn], mode: str) -> list:
    """The messages of the prompt for f_k on answer r_k, k = len(history) + 1, with teacher history ``mode``."""
    conv = _conversation(question, groundtruth, [*history, Turn(answer, "", None)])
    return teacher_messages(conv, history=mode, until_turn=len(history) + 1)


#: Every in-process agent's decoded and tiled images: a dialogue's image is tiled once, not at every turn by
#: the student and again by the teacher.
TILES = TileCache()


class InProcess:
    """The in-process backend: a model, its chat tokenizer and decode settings, generating on the model's
    :class:`fire_jax.infer.engine.Engine`. Every in-process generation goes through :meth:`generate_ids` (the
    student's, the teacher's and VLRMBench's prompts alike).

    Each prompt is prefilled in its own length bucket, short prompts several to a prefill, and a step attends
    over the columns its rows have filled. ``batch_size`` > 0 gives the engine at least that many slots (one set
    of compiled shapes for a whole run); a sampled call draws with seeds from its ``rng`` key, so the same key
    draws the same texts (bit for bit with ``prefix_cache=False``; a reused prefix's keys and values may differ
    in the last bits).

    The engine keeps each call's keys and values for the next (``engine.prefix_cache``, on by default): a
    dialogue's prompt at turn k begins with its prompt at turn k - 1 (the student's: then r_{k-1} and f_{k-1};
    the teacher's: the question, groundtruth and instruction again), so only what follows is prefilled.
    An engine rebuilt larger takes over the old one's cached prefixes.
    """

    def __init__(self, model, chat: ChatTokenizer, sampling: SamplingParams = SamplingParams(), *,
                 engine: EngineConfig = EngineConfig(), mesh=None, batch_size: int = 0, description: str = ""):
        if chat.image_token_id != model.cfg.image_token_id:
            raise ValueError(f"tokenizer image id {chat.image_token_id} != model image_token_id "
                             f"{model.cfg.image_token_id}")
        self.model, self.chat, self.mesh, self.batch_size = model, chat, mesh, batch_size
        self.description = description  # where the model came from (fire_jax.infer.loading.Loaded.description)
        self.sampling = sampling
        self.engine_config = engine.replace(stop_ids=chat.stop_ids, pad_id=chat.pad_id, logprobs=False)  # texts
        self._engine: Engine | None = None

    def generate(self, images, prompts: Sequence[Sequence[Message]], rng=None) -> list[str]:
        """The backend call of :class:`Student` and :class:`Teacher`: one image per prompt (messages), each
        rendered by the chat template with the assistant header; the texts, stripped. Each request carries its
        own image's tiles (decoded and tiled once for all agents, :data:`TILES`), and the engine pads them once,
        where it forms a prefill's batch."""
        tiled = self.tiled(images)
        ids = [self.encode(messages, size) for messages, (_, size) in zip(prompts, tiled)]
        texts = self.generate_ids(ids, [tiles for tiles, _ in tiled], [size for _, size in tiled], rng)
        return [text.strip() for text in texts]

    def encode(self, messages: Sequence[Message], image_size) -> list[int]:
        """A prompt's token ids: its messages rendered by the chat template with the assistant header, the image
        expanded for its (height, width)."""
        return self.chat.encode(messages, image_size, add_generation_prompt=True).input_ids.tolist()

    def generate_ids(self, prompts: Sequence[Sequence[int]], pixel_values, image_sizes, rng=None) -> list[str]:
        """The texts generated for token-id prompts (images expanded), each row's tiles (a list of
        ``[tiles, 3, T, T]`` arrays, None for a row without images, or one padded ``[batch, tiles, 3, T, T]``
        array) and each row's image size(s)."""
        requests = requests_for(prompts, pixel_values, image_sizes, self.sampling, rng)
        try:
            engine = self.engine(prompts, max(len(r.image_sizes) for r in requests))
            return [result.text for result in engine.generate(requests)]
        except BaseException:  # an interrupted or failed call leaves requests in the engine: start afresh
            self._engine = None
            raise

    def engine(self, prompts: Sequence[Sequence[int]], images: int = 0) -> Engine:
        """The backend's engine: ``max(batch_size, rows)`` slots, cache rows long enough for every prompt's
        bucket + max_new_tokens (a power of two), at least ``images`` images per request; built anew, larger,
        when a call needs more."""
        c = self.engine_config.sized_for([len(p) for p in prompts], self.sampling.max_tokens,
                                         slots=self.batch_size, images=images, doubling=True)
        old = self._engine
        if old is None or old.cache_len < c.cache_len or old.slots < c.slots or old.max_images < images:
            if old is not None:
                c = c.replace(slots=max(c.slots, old.slots), cache_len=max(c.cache_len, old.cache_len),
                              max_images=max(c.max_images, old.max_images))
            self._engine = Engine(self.model, c.replace(min_width=c.slots), tokenizer=self.chat.tokenizer,
                                  mesh=self.mesh)
            if old is not None:
                self._engine.stats.update(old.stats)  # counts over the backend's calls
                if c.prefix_cache:
                    self._engine.adopt(old)
        return self._engine

    def tiled(self, images) -> list[tuple[np.ndarray, tuple[int, int]]]:
        """Each image's tiles and (height, width), decoded and tiled once for all agents (:data:`TILES`)."""
        return [TILES.get(image, self.model.cfg.geometry) for image in images]


class _Role:
    """A prompt builder over a backend: :class:`InProcess`, an endpoint's :class:`fire_jax.infer.api.ApiAgent`,
    or any object with ``generate(images, prompts, rng) -> texts`` (``prompts``: one message list per image)."""

    role = ""

    def __init__(self, backend):
        self.backend = backend
        self.description = getattr(backend, "description", "")

    @property
    def model(self):
        """The in-process model (None for an endpoint)."""
        return getattr(self.backend, "model", None)


class Student(_Role):
    """Answers a question about an image, refining earlier answers from feedback."""

    role = "student"

    def prompts(self, questions: Sequence[str], histories: Sequence[Sequence[Turn]]) -> list[list[Message]]:
        """The prompt messages for r_k, k = len(history) + 1, per example."""
        return [student_prompt(q, h) for q, h in zip(questions, histories)]

    def respond(self, images, questions: Sequence[str], histories: Sequence[Sequence[Turn]] | None = None, *,
                rng=None) -> list[str]:
        """Responses ("Thought: ...\\nAnswer: ...") r_k, one per example.

        images: PIL images, paths or encoded bytes; histories: per example the
        earlier turns (r_j, f_j) as :class:`Turn` (default: none, so k = 1).
        """
        histories = [()] * len(images) if histories is None else histories
        return self.backend.generate(images, self.prompts(questions, histories), rng)


class Teacher(_Role):
    """Scores a student answer against the groundtruth and writes feedback, seeing the teacher history
    ``history`` ("latest" or "full": the one place it is checked)."""

    role = "teacher"

    def __init__(self, backend, history: str = "latest"):
        super().__init__(backend)
        self.history = check_teacher_history(history)

    def prompts(self, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                histories: Sequence[Sequence[Turn]]) -> list[list[Message]]:
        """The prompt messages for f_k on answer r_k, k = len(history) + 1, per example."""
        return [teacher_prompt(q, gt, a, h, self.history)
                for q, gt, a, h in zip(questions, groundtruths, answers, histories)]

    def feedback(self, images, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                 histories: Sequence[Sequence[Turn]] | None = None, *, rng=None) -> list[Feedback]:
        """Feedback f_k with its parsed score on each answer r_k."""
        histories = [()] * len(images) if histories is None else histories
        texts = self.backend.generate(images, self.prompts(questions, groundtruths, answers, histories), rng)
        return [Feedback(text, parse_score(text)) for text in texts]


def role_agent(role: str, backend, *, teacher_history: str = "latest") -> Student | Teacher:
    """``backend`` as the student or the teacher (``role``)."""
    if role == "student":
        return Student(backend)
    if role == "teacher":
        return Teacher(backend, teacher_history)
    raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")


# ----------------------------------------------------------------------------
# The one agent factory
# ----------------------------------------------------------------------------

#: Agent factories by spec prefix, for specs that are not an in-process checkpoint: ``factory(spec, role, sampling,
#: *, teacher_history, concurrency, seed)`` -> a student or teacher. ``api:`` (an endpoint) is registered here;
#: ``exact:`` (:class:`fire_jax.eval.judge.ExactTeacher`, a teacher with no generator) by its module, which the
#: FIRE-Bench runners import (so ``exact:`` is a FIRE-Bench teacher spec); a new backend registers its own prefix.
BACKENDS: dict = {}


def register_backend(prefix: str, factory) -> None:
    """Make ``from_spec`` build the agents of specs that begin with ``prefix`` with ``factory``."""
    BACKENDS[prefix] = factory


def backend_of(spec) -> str | None:
    """The registered prefix ``spec`` begins with, or None (a checkpoint, or the config's own model)."""
    return next((p for p in BACKENDS if isinstance(spec, str) and spec.startswith(p)), None)


def _endpoint(spec, role, sampling, *, teacher_history="latest", concurrency=32, seed=0):
    return role_agent(role, generator(spec, sampling, concurrency=concurrency, seed=seed),
                      teacher_history=teacher_history)


register_backend("api:", _endpoint)


def generator(spec: str | None, sampling: SamplingParams = SamplingParams(), *, engine: EngineConfig = EngineConfig(),
              config=None, init: str | None = None, batch_size: int = 0, mesh=None, concurrency: int = 32,
              seed: int = 0, models: dict | None = None, **endpoint):
    """The text generator behind an agent, before any role: the backend of a model spec.

    ``spec``:
      - ``api:<base_url>#<model>``: an OpenAI-compatible endpoint (:class:`fire_jax.infer.api.ApiAgent`,
        ``concurrency`` requests at a time, sampled requests seeded from ``seed``, ``endpoint``: its other
        options, such as ``retries`` and ``timeout``);
      - a checkpoint (an HF folder, a PEFT adapter whose base is ``init``, a ``fire_jax.train`` workdir:
        :func:`fire_jax.infer.loading.load`), or None / "" / "random": the model of ``config`` (its
        ``init.hf_checkpoint``, else random weights), :class:`InProcess` on an engine of ``batch_size`` slots.

    ``models``: a dict shared between calls, so generators of the same checkpoint share one loaded model. The
    generator's ``description`` says where it came from.
    """
    spec = None if spec in (None, "", "random") else spec
    if is_api_spec(spec):
        return ApiAgent(spec, sampling, concurrency=concurrency, seed=seed, **endpoint)
    if endpoint:
        raise TypeError(f"{sorted(endpoint)}: options of an endpoint, not of an in-process model ({spec!r})")
    import copy

    from fire_jax.infer.loading import load

    models = {} if models is None else models
    if (spec, init) not in models:
        model_config = copy.deepcopy(config)
        if init:
            model_config.init = dict(hf_checkpoint=init)
        models[(spec, init)] = load(model_config, spec)
    return models[(spec, init)].backend(sampling, engine=engine, mesh=mesh, batch_size=batch_size)


def from_spec(spec: str | None, role: str, sampling: SamplingParams = SamplingParams(), *,
              engine: EngineConfig = EngineConfig(), config=None, init: str | None = None,
              teacher_history: str = "latest", batch_size: int = 0, mesh=None, concurrency: int = 32, seed: int = 0,
              models: dict | None = None):
    """The student or teacher (``role``) of a model spec: the one way every CLI and runner builds an agent.

    A spec with a registered prefix (:data:`BACKENDS`: ``api:``; ``exact:`` for the synthetic set's exact
    teacher once :mod:`fire_jax.eval.judge` is imported, as the FIRE-Bench runners do) is built by its
    factory; any other is a checkpoint or the config's own model, run in process (:func:`generator`). The
    agent's ``description`` says where it came from.
    """
    if role not in ("student", "teacher"):
        raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")
    if role == "teacher":
        check_teacher_history(teacher_history)
    prefix = backend_of(spec)
    if prefix is not None:
        made = BACKENDS[prefix](spec, role, sampling, teacher_history=teacher_history, concurrency=concurrency,
                                seed=seed)
        if not getattr(made, "description", ""):
            made.description = spec
        return made
    backend = generator(spec, sampling, engine=engine, config=config, init=init, batch_size=batch_size, mesh=mesh,
                        models=models)
    return role_agent(role, backend, teacher_history=teacher_history)


def from_specs(config, specs: dict, sampling: SamplingParams = SamplingParams(), **options) -> tuple[dict, dict]:
    """({role: agent}, {role: description}) of :func:`from_spec` for each role's spec in ``specs``; roles naming
    the same checkpoint share one loaded model."""
    models = options.pop("models", {})
    agents = {role: from_spec(spec, role, sampling, config=config, models=models, **options)
              for role, spec in specs.items()}
    return agents, {role: agent.description for role, agent in agents.items()}
