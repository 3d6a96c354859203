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

Both stop on the chat template's end-of-turn token and EOS (``ChatTokenizer.stop_ids``). They are prompt
builders over a backend (:mod:`fire_jax.infer.backends`), which :func:`fire_jax.infer.factory.generator` builds
of a model spec; :func:`from_spec` makes the agent of a spec and a role, ``exact:`` the synthetic set's
:class:`ExactTeacher` (its feedback a rule, no backend).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fire_jax.data.chat import (RELEASE_TEACHER_TEMPLATES, Message, answer_of, check_teacher_history,
                                check_teacher_prompt, release_teacher_messages, student_messages, teacher_messages)
from fire_jax.data.records import Conversation, Turn
from fire_jax.data.scores import parse_score
from fire_jax.infer import factory
from fire_jax.infer.backends import Backend
from fire_jax.infer.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Feedback:
    text: str  # the whole feedback f_k, score line included
    score: float | None  # a_k parsed from it (fire_jax.data.scores.parse_score), None if it has none


def _conversation(question: str, groundtruth: str, turns: Sequence[Turn]) -> Conversation:
    return Conversation(id="", image=None, question=question, groundtruth=groundtruth, turns=tuple(turns),
                        source="", split="")


def student_prompt(question: str, history: Sequence[Turn]) -> list:
    """The messages of the prompt for r_k, k = len(history) + 1 (in-process and endpoint students alike)."""
    return student_messages(_conversation(question, "", history), until_turn=len(history) + 1)


def teacher_prompt(question: str, groundtruth: str, answer: str, history: Sequence[Turn], mode: str, *,
                   image_inline: bool = False, prompt: str = "paper", request: bool = False) -> list:
    """The messages of the prompt for f_k on answer r_k, k = len(history) + 1, with teacher history ``mode``
    (``image_inline``: the image after "Question: ", as the release's teacher prompt has it); ``prompt="release"``:
    as the release's fixed-dialogue evaluation feeds its teacher (:func:`release_teacher_messages`, ``request``)."""
    conv = _conversation(question, groundtruth, [*history, Turn(answer, "", None)])
    if check_teacher_prompt(prompt) == "release":
        return release_teacher_messages(conv, until_turn=len(history) + 1, history=mode, request=request)
    return teacher_messages(conv, history=mode, until_turn=len(history) + 1, image_inline=image_inline)


class _Role:
    """A prompt builder over a backend (:class:`fire_jax.infer.backends.Backend`:
    :class:`fire_jax.infer.backends.InProcess`, an endpoint's :class:`fire_jax.infer.api.ApiBackend`, or any
    object with its ``generate``)."""

    role = ""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.description = getattr(backend, "description", "")


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
        return self.backend.generate(images, self.prompts(questions, histories), rng=rng)


class Teacher(_Role):
    """Scores a student answer against the groundtruth and writes feedback, seeing the teacher history
    ``history`` ("latest" or "full": the one place it is checked)."""

    role = "teacher"

    def __init__(self, backend: Backend, history: str = "latest", prompt: str = "paper"):
        super().__init__(backend)
        self.history = check_teacher_history(history)
        self.prompt = check_teacher_prompt(prompt)
        # A model run as the release runs it (its checkpoint in the original format) gets the release's prompt:
        # the image after "Question: " (fire_jax.core.geometry, conventions "release").
        chat = getattr(backend, "chat", None)
        self.image_inline = bool(chat is not None and chat.geometry.release)
        # prompt "release": eval_feedback.py's prompt() appends its request under any template but the release's
        # teacher templates (an endpoint's template is unknown here: it gets the request too)
        self.request = getattr(chat, "template_name", None) not in RELEASE_TEACHER_TEMPLATES

    def prompts(self, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                histories: Sequence[Sequence[Turn]]) -> list[list[Message]]:
        """The prompt messages for f_k on answer r_k, k = len(history) + 1, per example."""
        return [teacher_prompt(q, gt, a, h, self.history, image_inline=self.image_inline, prompt=self.prompt,
                               request=self.request)
                for q, gt, a, h in zip(questions, groundtruths, answers, histories)]

    def feedback(self, images, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                 histories: Sequence[Sequence[Turn]] | None = None, *, rng=None) -> list[Feedback]:
        """Feedback f_k with its parsed score on each answer r_k."""
        histories = [()] * len(images) if histories is None else histories
        texts = self.backend.generate(images, self.prompts(questions, groundtruths, answers, histories), rng=rng)
        return [Feedback(text, parse_score(text)) for text in texts]


class ExactTeacher:
    """A teacher that never errs on the synthetic set: the generator's own feedback rule
    (:func:`fire_jax.data.synthetic.exact_feedback`) on the answer after "Answer:" (:func:`answer_of`); no
    backend, no prompt. Spec ``exact:`` (any name after it: ``exact:synthetic``), teacher only.

    Same interface as :class:`Teacher`. In free dialogues it measures what a student does with
    informative, always-right feedback, apart from the mistakes of a trained teacher (FD).
    """

    prefix = "exact:"
    role = "teacher"
    name = "exact teacher (the generator's rule)"

    def __init__(self, spec: str = prefix):
        self.description = spec

    def feedback(self, images, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                 histories=None, *, rng=None) -> list[Feedback]:
        from fire_jax.data.synthetic import exact_feedback

        out = []
        for groundtruth, answer in zip(groundtruths, answers):
            text, score = exact_feedback(groundtruth, answer_of(answer))
            out.append(Feedback(text.strip(), float(score)))
        return out


def role_agent(role: str, backend: Backend, *, teacher_history: str = "latest",
               teacher_prompt: str = "paper") -> Student | Teacher:
    """``backend`` as the student or the teacher (``role``; the teacher's history and prompt, :class:`Teacher`)."""
    if role == "student":
        return Student(backend)
    if role == "teacher":
        return Teacher(backend, teacher_history, teacher_prompt)
    raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")


#: The spec prefixes that name no checkpoint: an endpoint's backend (:data:`fire_jax.infer.factory.SPEC_PREFIXES`)
#: and the exact teacher (an agent with no backend), each its class's own ``prefix``. Any other spec is a
#: checkpoint run in process.
SPEC_PREFIXES = (*factory.SPEC_PREFIXES, ExactTeacher.prefix)


def spec_prefix(spec) -> str | None:
    """The prefix of :data:`SPEC_PREFIXES` that ``spec`` begins with, or None (a checkpoint, or the config's own
    model)."""
    return next((p for p in SPEC_PREFIXES if isinstance(spec, str) and spec.startswith(p)), None)


def from_spec(spec: str | None, role: str, sampling: SamplingParams = SamplingParams(), *, config=None,
              init: str | None = None, teacher_history: str = "latest", teacher_prompt: str = "paper", **options):
    """The student or teacher (``role``) of a model spec: the one way every CLI and runner builds an agent.

    ``exact:`` is the synthetic set's :class:`ExactTeacher`; any other spec is a prompt builder
    (:class:`Student`, :class:`Teacher`) over the backend :func:`fire_jax.infer.factory.generator` builds of it,
    with ``options``
    (``engine``, ``batch_size``, ``mesh``, ``concurrency``, ``seed``, ``models``, ``context``). The agent's
    ``description`` says where it came from.
    """
    if role not in ("student", "teacher"):
        raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")
    if spec_prefix(spec) == ExactTeacher.prefix:
        if role != "teacher":
            raise ValueError(f"{spec!r} is the exact teacher (the synthetic set's rule), not a {role}")
        return ExactTeacher(spec)
    backend = factory.generator(spec, sampling, config=config, init=init, **options)
    return role_agent(role, backend, teacher_history=teacher_history, teacher_prompt=teacher_prompt)


def from_specs(config, specs: dict, sampling: SamplingParams = SamplingParams(), **options) -> tuple[dict, dict]:
    """({role: agent}, {role: description}) of :func:`from_spec` for each role's spec in ``specs``; roles naming
    the same checkpoint share one loaded model."""
    models = options.pop("models", {})
    agents = {role: from_spec(spec, role, sampling, config=config, models=models, **options)
              for role, spec in specs.items()}
    return agents, {role: agent.description for role, agent in agents.items()}
