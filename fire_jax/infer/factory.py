"""The one factory of backends: a model spec to the backend that generates for it (:func:`generator`), or that a
server serves it on (:func:`serving`).

A spec is a checkpoint run in process (:class:`fire_jax.infer.backends.InProcess` over
:func:`fire_jax.infer.loading.load`; a server's :class:`fire_jax.infer.backends.Serving`) or, with a prefix of
:data:`SPEC_PREFIXES`, an endpoint (:class:`fire_jax.infer.api.ApiBackend`). The agents over a backend (the student, the teacher, and the exact
teacher, an agent with no backend) are built by :func:`fire_jax.dialogue.agents.from_spec`.

A server may also serve kinds of its own that a plugin registers (:func:`register_serving`): the tests' scripted
endpoints (``tests/scripted_model.py``) stand for a slow or flaky model behind the same backend protocol.
"""

from __future__ import annotations

from typing import Callable

from fire_jax.infer.api import ApiBackend
from fire_jax.infer.backends import Backend, InProcess, ServedBackend, Serving, StreamingEngines
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams

#: The spec prefixes of backends that are no checkpoint, each its class's own ``prefix``: an endpoint's. Any other
#: spec is a checkpoint run in process.
SPEC_PREFIXES = (ApiBackend.prefix,)


def backend_of(spec) -> str | None:
    """The prefix of :data:`SPEC_PREFIXES` that ``spec`` begins with, or None (a checkpoint, or the config's own
    model)."""
    return _prefix_of(spec, SPEC_PREFIXES)


def _prefix_of(spec, prefixes) -> str | None:
    """The first of ``prefixes`` that ``spec`` (a string, else None) begins with, or None."""
    return next((p for p in prefixes if isinstance(spec, str) and spec.startswith(p)), None)


def generator(spec: str | None, sampling: SamplingParams = SamplingParams(), *,
              engine: EngineConfig = EngineConfig(), config=None, init: str | None = None, batch_size: int = 0,
              mesh=None, concurrency: int = 32, seed: int = 0, models: dict | None = None, context: int = 2048, **endpoint) -> Backend:
    """The backend of a model spec, before any role: the one way a backend is built.

    ``spec``:
      - ``api:<base_url>#<model>``: an OpenAI-compatible endpoint (:class:`fire_jax.infer.api.ApiBackend`,
        ``concurrency`` requests at a time, ``endpoint``: its other options, such as ``retries`` and
        ``timeout``);
      - a checkpoint (an HF folder, a PEFT adapter whose base is ``init``, a ``fire_jax.train`` workdir:
        :func:`fire_jax.infer.loading.load`), or None / "" / "random": the model of ``config`` (its
        ``init.hf_checkpoint``, else random weights), :class:`InProcess` on an engine of ``batch_size`` slots,
        streaming on one of ``context`` columns.

    ``sampling``: the settings of a call that names none (sampled requests seeded from ``seed``); ``engine``: the
    shape of an in-process backend's engine (sized for each call). ``models``: a
    dict shared between calls, so backends of the same checkpoint share one loaded model and one streaming
    engine. The backend's ``description`` says where it came from.
    """
    spec = None if spec in (None, "", "random") else spec
    sampling = sampling.replace(seed=seed)
    if backend_of(spec) == ApiBackend.prefix:
        return ApiBackend(spec, sampling, concurrency=concurrency, **endpoint)
    if endpoint:
        raise TypeError(f"{sorted(endpoint)}: options of an endpoint, not of an in-process model ({spec!r})")
    models = {} if models is None else models
    if (spec, init) not in models:
        models[(spec, init)] = (_load(spec, config, init), StreamingEngines())
    loaded, streaming = models[(spec, init)]
    return InProcess(loaded.model, loaded.chat, sampling, engine=engine, mesh=mesh, batch_size=batch_size,
                     description=loaded.description, context=context, streaming=streaming)


#: Served kinds that are no checkpoint, by spec prefix: ``build(rest_of_spec)`` gives a
#: :class:`fire_jax.infer.backends.ServedBackend` (:func:`register_serving`).
SERVING_KINDS: dict[str, Callable[[str], ServedBackend]] = {}


def register_serving(prefix: str, build: Callable[[str], ServedBackend]) -> None:
    """Serve specs beginning with ``prefix`` on ``build(the rest of the spec)`` (a ``fire_jax.serve --plugin``
    module calls this when imported)."""
    SERVING_KINDS[prefix] = build


def serving(spec: str | None, shape: EngineConfig, *, config, init: str | None = None,
            context: Callable | None = None) -> ServedBackend:
    """The backend a server serves a spec on: a registered kind's (:func:`register_serving`), else a checkpoint's
    (None: the model of ``config``, as :func:`generator`), its model on one engine of ``shape`` (not started),
    with ``context(chat)`` cache columns a slot when given (a function of the model's
    :class:`fire_jax.data.chat.ChatTokenizer`: its tokenizer and tile geometry), else ``shape.cache_len``."""
    kind = _prefix_of(spec, SERVING_KINDS)
    if kind is not None:
        return SERVING_KINDS[kind](spec[len(kind):])
    loaded = _load(spec, config, init)
    if context is not None:
        shape = shape.replace(cache_len=context(loaded.chat))
    return Serving(loaded.model, loaded.chat, shape, description=loaded.description)


def _load(spec: str | None, config, init: str | None):
    """The loaded model of a checkpoint spec (:func:`fire_jax.infer.loading.load`), a PEFT adapter's base
    ``init`` when given."""
    import copy

    from fire_jax.infer.loading import load

    model_config = copy.deepcopy(config)
    if init:
        model_config.init = dict(hf_checkpoint=init)
    return load(model_config, spec)
