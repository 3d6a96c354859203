"""The feedback chat in a browser: the student answers, you or the teacher give feedback, the student refines.

    python -m fire_jax.demo                                   # the main job's student + teacher, else a random tiny model
    python -m fire_jax.demo --port 7860 --student WORKDIR_OR_ADAPTER_OR_HF_DIR --teacher api:http://127.0.0.1:8000/v1#teacher

Open http://127.0.0.1:7860/. Pick one of the shipped example images (its
question and groundtruth come with it) or upload one, ask a question, and
read the student's answer. Type feedback yourself, or press "Ask the
teacher": the teacher compares the answer with the groundtruth and writes a
scored feedback (you may edit it). "Refine" sends the feedback to the
student, which answers again. Each turn shows its response, feedback and
score; "Download record" saves the conversation as a FIRE record (the released
raw schema, checked with :func:`fire_jax.data.records.parse_record`).

Student and teacher are model specs: a Hugging Face directory, a PEFT
adapter (its base: --init, else the config's), a train workdir, ``random``
(the config's random model), or ``api:<base_url>#<model>`` (any
OpenAI-compatible endpoint, e.g. ``fire_jax.serve``). Prompts are rendered by
the agents of :mod:`fire_jax.infer` from :mod:`fire_jax.data.chat`, exactly as
in training and in the free dialogues: the student sees the feedback without
its score line, the teacher sees the question, the groundtruth and the
latest answer.

The page is one static, self-contained HTML file (``fire_jax/assets/demo/index.html``)
served by FastAPI, the stack of :mod:`fire_jax.serving.server`: nothing is fetched from the internet, and its JSON
routes (``/api/respond``, ``/api/feedback``, ``/api/record``) are the same
calls a script would make. With ``"stream": true`` the generating routes
answer with server-sent events, so the page shows the text as it grows and
the tokens generated so far (:class:`Streaming`: the backend's ``stream``; an in-process model runs on
a started continuous-batching engine, an ``api:`` model streams from its endpoint).
Errors (a bad image, a failed model) come back as JSON and are shown in the
page. Bad input is a 4xx with one clear message, checked before any work, with
the limits and flags of :mod:`fire_jax.serving.server` (:mod:`fire_jax.serving.limits`): the
body's size, read time and nesting, the image's size, format and declared
pixels (read from its header before decoding), the text's length in
characters (before tokenising), the prompt against the engine's context.
"""

from __future__ import annotations

import sys

import argparse
import asyncio
import itertools
import json
import os
import threading
import time
from typing import Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse

from fire_jax.core.cli import require_model_config
from fire_jax.core.config import (DEFAULT_CONFIG, FREE_DIALOGUE_NEW_TOKENS, apply_overrides, load_config,
                                  split_overrides)
from fire_jax.data.bad_records import BadRecordError
from fire_jax.data.records import Turn, parse_record, to_raw
from fire_jax.data.scores import parse_score
from fire_jax.dialogue.agents import from_specs
from fire_jax.infer.api import ApiError
from fire_jax.infer.backends import Refused
from fire_jax.infer.sampling import SamplingParams
from fire_jax.serving.limits import (BadRequest, Limits, OneLineLog, add_arguments, boolean, check_text, json_body,
                                     limits_of, longest_token_chars, open_data_uri, run_server, text_chars_bound)
from fire_jax.serving.defaults import default_models

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "synthetic_fire")
#: The page: one static HTML file (no template); it reads the models, sampling and examples from /api/settings.
PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo", "index.html")
NUM_EXAMPLES = 24


def examples(directory: str = EXAMPLES_DIR, limit: int = NUM_EXAMPLES) -> list[dict]:
    """The shipped test items as {"image", "question", "groundtruth"} (image: a file name under images/)."""
    with open(os.path.join(directory, "test.json"), encoding="utf-8") as f:
        records = json.load(f)
    return [{"image": r["image"], "question": r["question"]["value"], "groundtruth": r["groundtruth"]["value"]}
            for r in records[:limit]]


def load_agents(config, student_spec: str | None, teacher_spec: str | None, init: str | None,
                sampling: SamplingParams, *, seed: int = 0, context: int = 2048):
    """(student, teacher, {role: description}): :func:`fire_jax.dialogue.agents.from_spec`, one request at a time,
    an in-process model streaming with ``context`` columns; the teacher sees the latest answer."""
    agents, descriptions = from_specs(config, {"student": student_spec, "teacher": teacher_spec}, sampling,
                                      init=init, concurrency=1, seed=seed, context=context)
    return agents["student"], agents["teacher"], descriptions


class Streaming:
    """A student or teacher whose reply reaches the page while it is generated: the agent's prompt
    (``agent.prompts``, as in the free dialogues) streamed by its backend
    (:meth:`fire_jax.infer.backends.Backend.stream`). An in-process model streams from a started
    continuous-batching engine (its greedy tokens are those of the agent's own ``generate``; several people can
    use the demo at once), an ``api:`` endpoint through its streamed completions.
    """

    def __init__(self, agent, sampling: SamplingParams, max_text_chars: int = 0):
        self.agent, self.sampling = agent, sampling
        self.seeds = itertools.count(sampling.seed)  # a sampled request's seed: --seed, then one more per call
        # characters of text a request may hold: the context at the tokenizer's longest token (0: any)
        backend = agent.backend
        self.max_text_chars = max_text_chars or (text_chars_bound(
            backend.context, longest_token_chars(backend.tokenizer)) if backend.context else 0)

    def start(self, image, prompt_args: tuple, push: Callable[[dict], None]) -> Callable[[], None]:
        """Generate for one image and ``agent.prompts(*prompt_args)`` in a thread of its own; ``push`` gets
        ``{"delta", "tokens"}`` as the text grows, then ``{"text"}``, ``{"error"}`` or, for a request the
        backend refused before generating, ``{"refused": BadRequest}``. Returns a cancel function."""
        (messages,) = self.agent.prompts(*prompt_args)
        sampling = self.sampling.replace(seed=next(self.seeds) % 2 ** 32)
        cancelled = threading.Event()

        def on_delta(delta: str, tokens: int) -> None:
            if cancelled.is_set():
                raise _Cancelled  # ends the generation
            push({"delta": delta, "tokens": tokens})

        def work():
            try:
                push({"text": self.agent.backend.stream(image, messages, on_delta, sampling)})
            except _Cancelled:
                pass
            except Refused as e:
                push({"refused": refusal(e)})
            except Exception as e:  # shown in the page
                push({"error": failure_message(e)})

        threading.Thread(target=work, daemon=True).start()
        return cancelled.set


class _Cancelled(Exception):
    pass


def refusal(error: Refused) -> BadRequest:
    """The 4xx of a request the model refused before generating: over the context, or the demo is stopping."""
    if error.kind == "stopping":
        return BadRequest(503, str(error), "shutting_down")
    if error.kind == "context":
        return BadRequest(400, f"{error}; start the demo with a larger --cache_len", "context_length_exceeded")
    return BadRequest(400, str(error), "invalid_request_error")


def failure_message(error: BaseException, *, log: bool = True) -> str:
    """What the page shows of a failed generation: an endpoint's own account (:class:`ApiError`: which endpoint,
    why, after how many tries), else a plain sentence, the details (class and message) going to the demo's log
    on stderr, never to the page."""
    if isinstance(error, ApiError):
        return str(error)
    if log:  # else the request's one line says it (OneLineLog)
        print(f"fire_jax.demo: generation failed: {type(error).__name__}: {' '.join(str(error).split())}",
              file=sys.stderr, flush=True)
    return "the model failed to generate; the demo's log says why"


async def _events(streaming: Streaming, image, prompt_args: tuple):
    """The events of one generation as they come (an async iterator); leaving early (the client went away)
    cancels it. The generation starts here and its first event is awaited, so a prompt the model refuses is a
    BadRequest before any reply."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = streaming.start(image, prompt_args, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    try:
        first = await queue.get()
    except BaseException:
        cancel()
        raise
    if "refused" in first:
        raise first["refused"]

    async def events():
        event = first
        try:
            while True:
                yield event
                if "text" in event or "error" in event:
                    return
                event = await queue.get()
        finally:
            cancel()

    return events()


class ModelFailure(RuntimeError):
    pass


async def _reply(body: dict, events, finish: Callable[[str], dict]):
    """``stream: true``: server-sent events ``{"delta", "tokens"}`` ..., then ``{"done": true, **finish(text)}``
    or ``{"error": {"message"}}``; else the JSON of ``finish(text)`` once generated."""
    if body.get("stream") is True:
        async def sse():
            async for event in events:
                if "text" in event:
                    event = {"done": True, **finish(event["text"])}
                elif "error" in event:
                    event = {"error": {"message": event["error"], "code": "model_failure"}}
                yield f"data: {json.dumps(event)}\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")
    async for event in events:
        if "error" in event:
            raise ModelFailure(event["error"])
        if "text" in event:
            return finish(event["text"])


def _text(body: dict, field: str, *, required: bool = True) -> str:
    value = body.get(field, "")
    if not isinstance(value, str):
        raise BadRequest(400, f"'{field}' must be a string")
    if required and not value.strip():
        raise BadRequest(400, f"'{field}' is empty")
    return value.strip()


def _turns(body: dict) -> list[Turn]:
    """The conversation so far: [{"response", "feedback"}] with scores parsed from the feedback (``scores.parse_score``)."""
    turns = body.get("turns", [])
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("response"), str) and isinstance(t.get("feedback", ""), str)
            for t in turns):
        raise BadRequest(400, "'turns' must be a list of {'response': str, 'feedback': str}")
    return [Turn(t["response"].strip(), t.get("feedback", "").strip(), parse_score(t.get("feedback", "")))
            for t in turns]


def _turn_json(turn: Turn) -> dict:
    return {"response": turn.response, "feedback": turn.feedback, "score": turn.score}


def conversation_record(body: dict) -> dict:
    """The conversation as a raw FIRE record (the released schema); a trailing answer without feedback is left out."""
    turns = _turns(body)
    while turns and not turns[-1].feedback:
        turns.pop()
    if not turns:
        raise BadRequest(400, "no answer has feedback yet: give feedback (or ask the teacher) before downloading")
    missing = [k for k, t in enumerate(turns, 1) if not t.feedback]
    if missing:
        raise BadRequest(400, f"turn {missing[0]} has no feedback")
    image_name = _text(body, "image_name")
    if os.path.basename(image_name) != image_name or image_name in (".", "..") or any(c in image_name for c in "\\\0"):
        raise BadRequest(400, "'image_name' must be a file name, without folders")  # refused: not echoed
    record = to_raw(f"demo-{int(time.time() * 1000)}", image_name, _text(body, "question"),
                    _text(body, "groundtruth", required=False) or "(none given)", turns, source="demo", split="demo")
    try:  # the demo's users may give feedback without a score line: the student's data keeps such records
        parse_record(record, default_id=record["id"], require_scores=False)
    except BadRecordError as e:
        raise BadRequest(400, f"the conversation is not a valid FIRE record: {e}", e.reason)
    return record


def create_app(student: Streaming, teacher: Streaming, descriptions: dict, sampling: SamplingParams, *,
               limits: Limits | None = None, example_dir: str = EXAMPLES_DIR, api_docs: bool = False,
               debug: bool = False):
    """The demo's app; ``limits`` (:class:`fire_jax.serving.limits.Limits`) on every request before it reaches a model.
    ``api_docs``: serve FastAPI's ``/docs`` and ``/openapi.json`` (off by default: the page is the demo's one
    interface, and Swagger's page loads its scripts from a CDN). Each failed request is one line of the log
    (:class:`fire_jax.serving.limits.OneLineLog`; ``debug``: with the traceback of an unexpected failure)."""
    limits = limits or Limits()
    docs = dict(docs_url="/docs", redoc_url=None, openapi_url="/openapi.json") if api_docs else dict(
        docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="fire_jax demo", **docs)

    async def body_of(http) -> dict:
        body = await json_body(http, limits)
        boolean(body, "stream", False)  # 400 unless a boolean
        return body

    def checked(streaming: Streaming, body: dict, turns: list[Turn], *texts: str):
        """The request's image, once its text is measured against the model's bound (before tokenising) and its
        image checked (before decoding)."""
        check_text([*texts, *(t.response for t in turns), *(t.feedback for t in turns)],
                   streaming.max_text_chars or limits.max_text_chars)
        return open_data_uri(body.get("image"), limits.max_image_bytes, limits.max_pixels)

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        return JSONResponse({"error": {"message": e.message, "code": e.code}}, status_code=e.status)

    app.add_middleware(OneLineLog, prog="fire_jax.demo", failed=_failure_response, debug=debug)
    _add_pages(app, descriptions, sampling, examples(example_dir), example_dir)

    @app.post("/api/respond")
    async def respond(http: HttpRequest):
        """The student's next answer r_k, k = len(turns) + 1; every earlier turn needs feedback.
        ``stream: true``: server-sent events as the answer grows (see :func:`_reply`)."""
        body = await body_of(http)
        question, turns = _text(body, "question"), _turns(body)
        image = checked(student, body, turns, question)
        if any(not t.feedback for t in turns):
            raise BadRequest(400, "give feedback on the last answer (or ask the teacher) before refining")
        events = await _events(student, image, ([question], [tuple(turns)]))
        return await _reply(body, events, lambda text: {"response": text, "turns": [_turn_json(t) for t in turns]})

    @app.post("/api/feedback")
    async def feedback(http: HttpRequest):
        """The teacher's feedback f_k with its score on the last answer r_k (``stream: true`` as /api/respond)."""
        body = await body_of(http)
        question, turns, groundtruth = _text(body, "question"), _turns(body), _text(body, "groundtruth")
        image = checked(teacher, body, turns, question, groundtruth)
        if not turns:
            raise BadRequest(400, "ask the student first: there is no answer to give feedback on")
        events = await _events(teacher, image, ([question], [groundtruth], [turns[-1].response],
                                                [tuple(turns[:-1])]))
        return await _reply(body, events, lambda text: {"feedback": text, "score": parse_score(text)})

    @app.post("/api/record")
    async def record(http: HttpRequest):
        return conversation_record(await body_of(http))

    return app


def _failure_response(e: Exception) -> tuple[int, dict]:
    """A model failure's 500: shown in the page (its details in the log), the demo goes on."""
    message = str(e) if isinstance(e, ModelFailure) else failure_message(e, log=False)
    return 500, {"error": {"message": message, "code": "model_failure"}}


def _add_pages(app, descriptions: dict, sampling: SamplingParams, items: list[dict], example_dir: str) -> None:
    """The page, its settings (the models, the sampling, the examples) and the examples' images."""

    @app.get("/", response_class=HTMLResponse)
    def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/api/settings")
    def get_settings():
        return {"student": descriptions["student"], "teacher": descriptions["teacher"],
                "sampling": {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed},
                "examples": items}

    @app.get("/examples/{name}")
    def example_image(name: str):
        if name not in {item["image"] for item in items}:
            raise BadRequest(404, "no such example image", "not_found")
        return FileResponse(os.path.join(example_dir, "images", name), media_type="image/png")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860, help="0: a free port (the line 'demo on ...' says which)")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="config file[:arg] (default: configs/tiny.py); --config.<field>=<value> sets a field")
    parser.add_argument("--student", help="HF dir, PEFT adapter, train workdir, 'random' or api:<base_url>#<model> "
                                          "(default: the main job's student, runs/smollm2 or runs/tiny, if present, "
                                          "else random)")
    parser.add_argument("--teacher", help="as --student (default: the main job's teacher if present, else random)")
    parser.add_argument("--init", help="base HF checkpoint for PEFT adapters (default: the main job's base, or the "
                                       "config's)")
    parser.add_argument("--max_new_tokens", type=int, default=FREE_DIALOGUE_NEW_TOKENS, help="as in the free dialogues")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache_len", type=int, default=2048,
                        help="context of an in-process model's engine: prompt (bucketed) + --max_new_tokens")
    parser.add_argument("--api_docs", action="store_true",
                        help="also serve FastAPI's /docs and /openapi.json (Swagger's page needs its CDN)")
    add_arguments(parser, max_images=False)  # one image per request
    return parser.parse_args(argv)


def main(argv=None):
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    student_spec, teacher_spec, init = args.student, args.teacher, args.init
    if student_spec is None or teacher_spec is None:
        found, base, why = default_models()
        student_spec = student_spec or found.get("student", "random")
        teacher_spec = teacher_spec or found.get("teacher", "random")
        init = init or base
        print(f"default models: {why}", flush=True)
    sampling = SamplingParams.from_config(args, source="the command line", seed=args.seed)
    config = require_model_config(apply_overrides(load_config(args.config), overrides), args.config)
    student, teacher, descriptions = load_agents(config, student_spec, teacher_spec, init, sampling, seed=args.seed,
                                                 context=args.cache_len)
    for role, description in descriptions.items():
        print(f"{role}: {description}", flush=True)
    student, teacher = (Streaming(agent, sampling, args.max_text_chars) for agent in (student, teacher))
    app = create_app(student, teacher, descriptions, sampling, limits=limits_of(args, max_images=1),
                     api_docs=args.api_docs, debug=args.debug)
    run_server(app, args, "demo on http://{host}:{port}/")
