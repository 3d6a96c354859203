"""Any OpenAI-compatible endpoint as a student or teacher: ``api:<base_url>#<model>`` model specs.

    api:http://127.0.0.1:8000/v1#student          # a fire_jax.serve model
    api:https://api.openai.com/v1#gpt-4o          # key from $OPENAI_API_KEY (or $FIRE_JAX_API_KEY)

The prompts are the agents' own (:mod:`fire_jax.dialogue.agents`, rendered by
:mod:`fire_jax.data.chat`), sent as chat messages: fire_jax's system prompt,
then each message, the ``<image>\\n`` placeholder becoming a PNG ``image_url``
part (a ``data:`` URI) followed by the rest of the text, which is how
:mod:`fire_jax.serving.server` renders them back, so a served fire_jax model answers
exactly as in process. Rows go out concurrently (``concurrency`` threads),
each retried up to ``retries`` times with exponential backoff on 429, 5xx,
timeouts and connection errors; every failure is counted by reason in
``failures``, and a row that still fails raises :class:`ApiError` (the batch
runners resume from their outputs). :meth:`ApiBackend.stream` passes a reply's
text on as it arrives (the demo shows it growing).

A spec is accepted wherever a model is loaded: FIRE-Bench fixed and free
dialogues and FIRE-1M-style generation (``student.init`` / ``teacher.init``,
:func:`fire_jax.eval.fire_bench.build_agents`), the VLRMBench model and
ERA/EC judge (:class:`fire_jax.vlrmbench.runner.Responder`),
``python -m fire_jax.chat`` / ``.batch_infer`` / ``.demo`` and ``python -m fire_jax.make_fire100k``, all
through :func:`fire_jax.infer.factory.generator`.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import io
import os
import threading
import time
from typing import Callable, Sequence

from fire_jax.data.chat import SYSTEM, Message
from fire_jax.data.images import load_image
from fire_jax.infer.backends import images_of
from fire_jax.infer.sampling import SamplingParams

API_PREFIX = "api:"
KEY_VARIABLES = ("FIRE_JAX_API_KEY", "OPENAI_API_KEY")


class ApiError(RuntimeError):
    """A request that failed for good; ``reason`` as counted in ``failures`` (``http_429``, ``timeout``, ...)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


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
    load_image(image, alpha="keep").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(messages: Sequence[Message], image, system: str | None = None) -> list[dict]:
    """OpenAI chat messages of a prompt: the system prompt (None: fire_jax's :data:`fire_jax.data.chat.SYSTEM`),
    then each message, its images (``image``: one, or a sequence taken in order) as ``image_url`` parts before
    its text."""
    images = iter(images_of(image))
    out = [{"role": "system", "content": SYSTEM if system is None else system}]
    for message in messages:
        if message.images:
            parts = [{"type": "image_url", "image_url": {"url": image_url(next(images))}}
                     for _ in range(message.images)]
            out.append({"role": message.role, "content": parts + [{"type": "text", "text": message.text}]})
        else:
            out.append({"role": message.role, "content": message.text})
    return out


class ApiBackend:
    """The endpoint backend (:class:`fire_jax.infer.backends.Backend`): chat completions from one endpoint's
    model, rows in parallel, retried, failures counted. ``sampling``: the settings of a call that names none."""

    prefix = API_PREFIX  # the specs it serves (fire_jax.infer.factory.generator)
    context, tokenizer, geometry = 0, None, None  # the endpoint's own

    def __init__(self, spec: str, sampling: SamplingParams = SamplingParams(), *, concurrency: int = 32,
                 retries: int = 4, backoff: float = 0.5, timeout: float = 600.0):
        import openai

        self.spec = spec
        self.base_url, self.model_name = parse_spec(spec)
        key = next((os.environ[v] for v in KEY_VARIABLES if os.environ.get(v)), "EMPTY")
        self.client = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout)
        self.sampling, self.concurrency, self.retries, self.backoff = sampling, concurrency, retries, backoff
        self.failures: collections.Counter = collections.Counter()  # reason -> count, retried ones included
        self._lock = threading.Lock()
        self.description = f"endpoint {spec}"

    def _create(self, messages: list[dict], sampling: SamplingParams | None = None, seed: int | None = None,
                **kwargs):
        s = sampling or self.sampling
        return self.client.chat.completions.create(
            model=self.model_name, messages=messages, max_tokens=s.max_tokens, temperature=s.temperature,
            top_p=s.top_p, seed=s.seed if seed is None else seed,
            extra_body={"top_k": s.top_k} if s.top_k else None, **kwargs)

    def _retried(self, attempt: Callable, may_retry: Callable[[], bool] = lambda: True):
        """``attempt()``, tried again with exponential backoff on 429, 5xx, timeouts and connection errors
        (while ``may_retry()``); every failure counted by reason; :class:`ApiError` once retries are spent."""
        import openai

        for tries in range(1, self.retries + 2):
            try:
                return attempt()
            except openai.APIStatusError as e:
                reason, retry = f"http_{e.status_code}", e.status_code == 429 or e.status_code >= 500
            except openai.APITimeoutError:
                reason, retry = "timeout", True
            except openai.APIConnectionError:
                reason, retry = "connection", True
            with self._lock:
                self.failures[reason] += 1
            if not retry or tries > self.retries or not may_retry():
                so_far = ", ".join(f"{why} x{count}" for why, count in self.failures.items())
                raise ApiError(f"{self.spec}: request failed ({reason}) after {tries} tries; failures so far: "
                               f"{so_far}", reason)
            time.sleep(self.backoff * 2 ** (tries - 1))

    def complete(self, messages: list[dict], sampling: SamplingParams | None = None, seed: int | None = None) -> str:
        """One chat completion's text (stripped), retried; raises :class:`ApiError` once retries are spent."""
        return self._retried(lambda: (self._create(messages, sampling, seed).choices[0].message.content or "").strip())

    def stream(self, image, messages: Sequence[Message], on_delta: Callable[[str, int], None],
               sampling: SamplingParams | None = None) -> str:
        """:meth:`fire_jax.infer.backends.Backend.stream` from the endpoint's streamed completion (an endpoint's
        pieces are about a token each: ``tokens`` counts them). Retried as :meth:`complete` until the first piece
        has arrived."""
        pieces: list[str] = []
        request = chat_messages(messages, image)

        def attempt():
            for chunk in self._create(request, sampling, stream=True):
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    pieces.append(delta)
                    on_delta(delta, len(pieces))
            return "".join(pieces).strip()

        return self._retried(attempt, may_retry=lambda: not pieces)

    def complete_many(self, messages: Sequence[list[dict]], sampling: SamplingParams | None = None,
                      seeds: Sequence[int] | None = None) -> list[str | ApiError]:
        """:meth:`complete` of every message list, ``concurrency`` at a time; a failed one's ApiError in its place."""
        def one(k):
            try:
                return self.complete(messages[k], sampling, None if seeds is None else seeds[k])
            except ApiError as e:
                return e

        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.concurrency, len(messages)))) as pool:
            return list(pool.map(one, range(len(messages))))

    def generate(self, images, prompts: Sequence[Sequence[Message]], sampling: SamplingParams | None = None,
                 rng=None, *, system: str | None = None, errors: bool = False) -> list:
        """:meth:`fire_jax.infer.backends.Backend.generate`: every row's text, or the first failure raised (the
        runners resume), or with ``errors`` each failed row's :class:`ApiError` in its place. Row k is seeded
        with b + k, b drawn from ``rng`` (without one: every row the settings' ``seed``), so repeated prompts
        of one call draw apart."""
        seeds = None
        if rng is not None:
            import jax

            base = int(jax.random.randint(rng, (), 0, 2 ** 30))
            seeds = [base + k for k in range(len(prompts))]
        out = self.complete_many([chat_messages(p, image, system) for p, image in zip(prompts, images)], sampling,
                                 seeds)
        failed = next((o for o in out if isinstance(o, ApiError)), None)
        if failed is not None and not errors:
            raise failed
        return out
