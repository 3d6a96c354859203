"""Any OpenAI-compatible endpoint as a student or teacher: ``api:<base_url>#<model>`` model specs (issue 16.3).

    api:http://127.0.0.1:8000/v1#student          # a fire_jax.serve model
    api:https://api.openai.com/v1#gpt-4o          # key from $OPENAI_API_KEY (or $FIRE_JAX_API_KEY)

The prompts are the agents' own (:mod:`fire_jax.infer.agents`, rendered by
:mod:`fire_jax.data.chat`), sent as chat messages: fire_jax's system prompt,
then each message, the ``<image>\\n`` placeholder becoming a PNG ``image_url``
part (a ``data:`` URI) followed by the rest of the text, which is how
:mod:`fire_jax.serve` renders them back, so a served fire_jax model answers
exactly as in process. Rows go out concurrently (``concurrency`` threads),
each retried up to ``retries`` times with exponential backoff on 429, 5xx,
timeouts and connection errors; every failure is counted by reason in
``failures``, and a row that still fails raises :class:`ApiError` (the batch
runners resume from their outputs).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import io
import os
import threading
import time
from typing import Sequence

from fire_jax.data.chat import SYSTEM, TEACHER_HISTORIES, Message, student_messages, teacher_messages
from fire_jax.data.images import load_image
from fire_jax.data.records import IMAGE_PLACEHOLDER, Turn, parse_score
from fire_jax.infer.agents import Feedback, _conversation
from fire_jax.infer.decode import DecodeConfig

API_PREFIX = "api:"
KEY_VARIABLES = ("FIRE_JAX_API_KEY", "OPENAI_API_KEY")


class ApiError(RuntimeError):
    pass


def is_api_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(API_PREFIX)


def parse_spec(spec: str) -> tuple[str, str]:
    """(base_url, model) of ``api:<base_url>#<model>``."""
    base_url, _, model = spec[len(API_PREFIX):].partition("#")
    if not is_api_spec(spec) or not base_url or not model:
        raise ValueError(f"model spec {spec!r}: expected api:<base_url>#<model>, e.g. api:http://127.0.0.1:8000/v1#tiny")
    return base_url, model


def image_url(image) -> str:
    buffer = io.BytesIO()
    load_image(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(messages: Sequence[Message], image) -> list[dict]:
    """OpenAI chat messages of a rendered prompt; ``<image>\\n`` becomes an image part."""
    out = [{"role": "system", "content": SYSTEM}]
    for message in messages:
        if IMAGE_PLACEHOLDER in message.text:
            before, _, after = message.text.partition(IMAGE_PLACEHOLDER)
            after = after[1:] if after.startswith("\n") else after
            parts = ([{"type": "text", "text": before}] if before else []) + [
                {"type": "image_url", "image_url": {"url": image_url(image)}}] + (
                [{"type": "text", "text": after}] if after else [])
            out.append({"role": message.role, "content": parts})
        else:
            out.append({"role": message.role, "content": message.text})
    return out


class ApiAgent:
    """Chat completions from one endpoint's model, rows in parallel, retried, failures counted."""

    def __init__(self, spec: str, config: DecodeConfig = DecodeConfig(), *, concurrency: int = 32, retries: int = 4,
                 backoff: float = 0.5, timeout: float = 600.0, seed: int = 0):
        import openai

        self.spec = spec
        self.base_url, self.model_name = parse_spec(spec)
        key = next((os.environ[v] for v in KEY_VARIABLES if os.environ.get(v)), "EMPTY")
        self.client = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout)
        self.config, self.concurrency, self.retries, self.backoff, self.seed = config, concurrency, retries, backoff, seed
        self.failures: collections.Counter = collections.Counter()  # reason -> count, retried ones included
        self._lock = threading.Lock()
        self.model = None  # no in-process model

    def _one(self, messages: list[dict]) -> str:
        import openai

        c = self.config
        extra = {"top_k": c.top_k} if c.top_k else {}
        for attempt in range(self.retries + 1):
            try:
                reply = self.client.chat.completions.create(
                    model=self.model_name, messages=messages, max_tokens=c.max_new_tokens, temperature=c.temperature,
                    top_p=c.top_p, seed=self.seed, extra_body=extra or None)
                return (reply.choices[0].message.content or "").strip()
            except openai.APIStatusError as e:
                reason, retry = f"http_{e.status_code}", e.status_code == 429 or e.status_code >= 500
            except openai.APITimeoutError:
                reason, retry = "timeout", True
            except openai.APIConnectionError:
                reason, retry = "connection", True
            with self._lock:
                self.failures[reason] += 1
            if not retry or attempt == self.retries:
                raise ApiError(f"{self.spec}: request failed ({reason}) after {attempt + 1} tries; "
                               f"failures so far: {dict(self.failures)}")
            time.sleep(self.backoff * 2 ** attempt)

    def _generate(self, images, prompts: Sequence[Sequence[Message]]) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(self._one, [chat_messages(p, image) for p, image in zip(prompts, images)]))


class ApiStudent(ApiAgent):
    def respond(self, images, questions: Sequence[str], histories: Sequence[Sequence[Turn]] | None = None, *,
                rng=None) -> list[str]:
        histories = [()] * len(images) if histories is None else histories
        prompts = [student_messages(_conversation(q, "", h), until_turn=len(h) + 1) for q, h in zip(questions, histories)]
        return self._generate(images, prompts)


class ApiTeacher(ApiAgent):
    def __init__(self, spec: str, config: DecodeConfig = DecodeConfig(), *, history: str = "latest", **kwargs):
        if history not in TEACHER_HISTORIES:
            raise ValueError(f"teacher history must be one of {TEACHER_HISTORIES}, got {history!r}")
        super().__init__(spec, config, **kwargs)
        self.history = history

    def feedback(self, images, questions: Sequence[str], groundtruths: Sequence[str], answers: Sequence[str],
                 histories: Sequence[Sequence[Turn]] | None = None, *, rng=None) -> list[Feedback]:
        histories = [()] * len(images) if histories is None else histories
        prompts = [teacher_messages(_conversation(q, gt, [*h, Turn(a, "", None)]), history=self.history,
                                    until_turn=len(h) + 1)
                   for q, gt, a, h in zip(questions, groundtruths, answers, histories)]
        return [Feedback(text, parse_score(text)) for text in self._generate(images, prompts)]


def api_agent(spec: str, role: str, decode: DecodeConfig = DecodeConfig(), *, teacher_history: str = "latest",
              **kwargs) -> ApiStudent | ApiTeacher:
    """The endpoint model of ``spec`` as a student or a teacher (the batch runners' interface)."""
    if role == "student":
        return ApiStudent(spec, decode, **kwargs)
    if role == "teacher":
        return ApiTeacher(spec, decode, history=teacher_history, **kwargs)
    raise ValueError(f"role must be 'student' or 'teacher', got {role!r}")
