"""VLRMBench with a fire_jax model: generate, judge, resume, score (docs/vlrmbench.md).

The model-dependent half of the benchmark, one task at a time (:func:`run_task`) and its scoring
(:func:`score`); prompts, parsers and metrics are :mod:`fire_jax.vlrmbench`. A whole run, the tasks then the
paper's analyses, is :func:`fire_jax.vlrmbench.suite.evaluate` (``python -m fire_jax.evaluate_vlrm``).

**Several images per sample.** A VLRMBench record holds a list of images. The
user turn is ``"<image>\\n" * k + prompt`` (one placeholder per image, in
order, each followed by a newline, as LLaVA-NeXT's processor writes several
images), rendered with the Llama-3 template of :mod:`fire_jax.data.chat`;
placeholder i expands to ``geometry.num_tokens(size_i)`` image token ids.
Each image is tiled by :func:`fire_jax.data.images.preprocess` and the
sample's tiles are concatenated in image order (the in-process backend,
:class:`fire_jax.infer.backends.InProcess`), so one example needs
``sum_i num_tiles(size_i)`` tiles; the model lays the features out with
:func:`fire_jax.core.geometry.place_images` (image i reads the tiles after images
< i). With ``generate.max_tiles`` set, a sample needing more tiles stops the
run before any generation, naming it.

**API models.** ``config.checkpoint`` (the evaluated model) and
``config.judge.checkpoint`` (the ERA/EC judge) may be ``api:<base_url>#<model>``:
any OpenAI-compatible endpoint, e.g. GPT-4o or ``python -m fire_jax.serve``
(the :class:`Responder` over an endpoint's backend; a served fire_jax model answers exactly as in process).

**Generation.** Greedy (sampled for voting), on the in-process backend's engine
(:class:`fire_jax.infer.backends.InProcess`), which has ``batch_size`` slots for
every call (no recompiles). MJ is generated in both orders. ERA and
EC: the model writes a critique (the candidate), then the judge (the same
model unless ``config.judge`` names another) scores (reference, candidate)
in both orders with the release's judge prompts. Every candidate that came
back is judged, an empty one too (the release judges it); one whose
generation raised is not (``no_candidate``).

**Failures.** A generation that raises, or yields empty text, is recorded
with its reason (``exception``, ``empty``, ``input`` for an unreadable image,
``no_candidate``). Scoring then follows ``config.vlrm.accounting``
(:func:`fire_jax.vlrmbench.score_task`): "ours" counts a failed or
unreadable sample wrong (an empty answer or candidate is a failed one);
"official" scores as the release's scorers, which read an empty answer as
written and leave out only a sample with no output (:func:`task_outputs`);
"vlmevalkit" as VLMEvalKit's, which scores a failed or empty generation as its
failure message. Every figure is in results.json (``by_accounting``) and in
the table, with the failed samples by reason (generation_failed, judge_failed,
unparsable).

**Missing images.** ``config.vlrm.missing_images``: "skip" drops a record
whose image file does not exist (a bad record, ``missing_image``, counted);
"send_without" keeps it and sends its request without that image, as the
release's clients do (they log the error and go on), counted as a kept odd
record (``missing_image``); "auto" (default) is "send_without" under
``accounting="official"``, else "skip". An image file that exists but cannot
be read fails its request (``input``; the release's client stops there).

**Resuming.** Each sample's raw outputs are appended, as one JSON line, to
``workdir/outputs/<task>.jsonl`` once all its generations are done (a batch
of samples at a time); a rerun skips the ids found there (the last line of
an id wins; a partial last line left by a kill is cut off). The settings that
change a task's outputs (model, render, decode length; the judge for ERA/EC)
are kept per task in ``workdir/settings.json``; a rerun with other settings
stops instead of mixing outputs. Scores are always recomputed from the
JSONL, so another ``parser`` (or row name) needs no new generation.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from fire_jax.core.config import load_config
from fire_jax.data.chat import Message
from fire_jax.data.images import load_image
from fire_jax.infer import factory
from fire_jax.infer.api import ApiError
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.loading import display_name
from fire_jax.core.results import ResultStore, write_json
from fire_jax.core.files import write_text
from fire_jax.vlrmbench.data import MISSING_IMAGES, TaskData
from fire_jax.vlrmbench.score import (ACCOUNTINGS, TaskResult, pooled_step_f1, results_table, score_accountings,
                                      theme_average)
from fire_jax.vlrmbench.tasks import (TASKS, Sample, build_judge_prompt, build_prompt, check_choice, num_orders,
                                      task_info)

# ----------------------------------------------------------------------------
# Prompts with several images
# ----------------------------------------------------------------------------


def image_size(path: str) -> tuple[int, int]:
    """(height, width) from the file header, without decoding the pixels."""
    from PIL import Image

    with Image.open(path) as image:
        return image.height, image.width


def tiles_needed(sample: Sample, geometry) -> int:
    """Tiles of all the sample's images together (their tiles are concatenated)."""
    return sum(geometry.num_tiles(image_size(path)) for path in sample.images)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One generation: a task or judge prompt (without placeholders) and the sample's images."""

    prompt: str
    images: tuple[str, ...]


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------

def model_name(config) -> str:
    """The evaluated model's row name: :func:`fire_jax.infer.loading.display_name` of ``config.name`` /
    ``config.checkpoint`` / ``config.init.hf_checkpoint``."""
    return display_name(name=config.get("name") or "", checkpoint=config.get("checkpoint") or "",
                        init=config.get("init", {}).get("hf_checkpoint") or "", fallback="fire_jax (random init)")


def _sampling_variant(sampling: SamplingParams, max_new_tokens: int | None,
                      temperature: float | None) -> SamplingParams:
    """``sampling`` with the settings a variant (the judge, the voting sampler) gives; None keeps one."""
    changes = dict(max_tokens=max_new_tokens, temperature=temperature)
    return sampling.replace(**{k: v for k, v in changes.items() if v is not None})


def prompt_messages(request: Prompt) -> list[Message]:
    """A request's prompt: one user message, the sample's images (one placeholder each, in order, as
    LLaVA-NeXT's processor writes several images) before the prompt text. A ``<image>`` inside the text stays
    text. Served to an endpoint, it is fire_jax's system prompt and one user message of ``image_url`` parts then
    the text, the shape the official VLRMBench scripts send GPT-4o."""
    return [Message("user", request.prompt, images=len(request.images))]


def failure_of(error: Exception) -> str:
    """A failed generation's record: ``api_<reason>: ...`` for an endpoint's (``api_http_503``, ``api_timeout``,
    ...), else ``exception: <class>: ...``."""
    if isinstance(error, ApiError):
        return f"api_{error.reason}: {error}"
    return f"exception: {type(error).__name__}: {error}"


class Responder:
    """A model answering VLRMBench requests: ``responder(requests)`` -> [(text, failure)].

    A thin adapter over the backend of ``config.checkpoint`` (:func:`fire_jax.infer.factory.generator`: in
    process, on an engine of ``batch_size`` slots for every call, or an ``api:<base_url>#<model>`` endpoint,
    ``concurrency`` requests at a time with its retries): what is VLRMBench's own is the multi-image prompt
    (:func:`prompt_messages`) and the per-request failures. A request may have no image (its files were
    missing: ``missing_images="send_without"``); an unreadable image fails its request (``input: ...``), a
    failed generation its requests (:func:`failure_of`).
    """

    def __init__(self, backend, sampling: SamplingParams, *, name: str, batch_size: int, max_tiles: int = 0,
                 build: Callable | None = None):
        self.backend, self.sampling, self.name, self.batch_size, self.max_tiles = (backend, sampling, name,
                                                                                  batch_size, max_tiles)
        self._build = build  # (sampling, batch_size) -> a backend of the same model (variants)

    @classmethod
    def from_config(cls, config, generate_config, *, name: str, max_new_tokens: int) -> "Responder":
        """The model of ``config`` (:func:`fire_jax.infer.factory.generator` of ``config.checkpoint``): an
        ``api:<base_url>#<model>`` endpoint, an HF / PEFT adapter / train workdir checkpoint
        (:func:`fire_jax.infer.loading.load`), else ``config.init.hf_checkpoint``, else random weights."""
        spec, models = config.get("checkpoint") or None, {}
        sampling = SamplingParams.from_config(generate_config, source="config.generate", max_tokens=max_new_tokens)
        engine = EngineConfig.from_config(generate_config)

        def build(sampling: SamplingParams, batch_size: int):
            return factory.generator(spec, sampling, engine=engine, config=config, batch_size=batch_size,
                                     seed=config.seed, models=models)

        backend = build(sampling, generate_config.batch_size)
        print(f"{name}: {backend.description}")
        return cls(backend, sampling, name=name, batch_size=generate_config.batch_size,
                   max_tiles=generate_config.max_tiles if backend.geometry else 0, build=build)

    def variant(self, *, name: str | None = None, batch_size: int | None = None, max_new_tokens: int | None = None,
                temperature: float | None = None) -> "Responder":
        """The same model with other decode settings (the judge, the voting sampler), on a backend of its own."""
        batch_size = batch_size or self.batch_size
        sampling = _sampling_variant(self.sampling, max_new_tokens, temperature)
        return Responder(self._build(sampling, batch_size), sampling, name=name or self.name, batch_size=batch_size,
                         max_tiles=self.max_tiles, build=self._build)

    @property
    def geometry(self):
        """How the model tiles images (None: an endpoint's own)."""
        return self.backend.geometry

    @property
    def failures(self):
        """An endpoint's failed tries by reason, retried ones included (None in process)."""
        return getattr(self.backend, "failures", None)

    def __call__(self, requests: Sequence[Prompt], rng=None) -> list[tuple[str | None, str | None]]:
        """(text, failure) per request: failure None, "input: ...", "empty" or :func:`failure_of`'s.

        rng: a JAX key when sampling; batch i of the call samples with ``fold_in(rng, i)``.
        """
        results: list[tuple[str | None, str | None]] = [(None, None)] * len(requests)
        ready, images = [], {}
        for i, request in enumerate(requests):
            try:
                for path in request.images:
                    if path not in images:
                        images[path] = load_image(path, alpha="keep")
            except Exception as e:  # an unreadable image fails its request, not the run
                results[i] = (None, f"input: {type(e).__name__}: {e}")
                continue
            ready.append(i)
        for start in range(0, len(ready), self.batch_size):
            chunk = ready[start:start + self.batch_size]
            key = None if rng is None else jax.random.fold_in(rng, start // self.batch_size)
            outs = self.backend.generate([tuple(images[path] for path in requests[i].images) for i in chunk],
                                         [prompt_messages(requests[i]) for i in chunk], rng=key, errors=True)
            failed = [out for out in outs if isinstance(out, Exception) and not isinstance(out, ApiError)]
            if failed:  # recorded per prompt and counted; the run goes on
                _warn(f"{self.name}: generation failed for {len(failed)} prompts: {type(failed[0]).__name__}: "
                      f"{failed[0]}")
            for i, out in zip(chunk, outs):
                results[i] = (None, failure_of(out)) if isinstance(out, Exception) else (out, None if out else "empty")
        return results


def _warn(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"WARNING: {message}")


# ----------------------------------------------------------------------------
# One task: generate what is missing, append records
# ----------------------------------------------------------------------------


def read_records(path: Path) -> tuple[dict[str, dict], int]:
    """{sample id: its last record} of an outputs JSONL, and how many lines could not be read."""
    if not Path(path).exists():
        return {}, 0
    store = ResultStore(path, "id", unreadable="skip", repair=False)
    return store.records, store.unreadable


def record_failures(record: dict) -> list[str]:
    """The failure reasons of one record, ERA/EC's candidate first (empty when every generation succeeded)."""
    return [f for f in [record.get("candidate_failure")] + record["failures"] if f]


def _reason(failure: str) -> str:
    return failure.split(":", 1)[0]


def run_task(data: TaskData, generator: Responder, judge: Responder | None, path: Path,
             *, render: str, retry_failed: bool = False, prompt: PromptFn | None = None) -> int:
    """Generate every sample of ``data`` not yet in ``path``; returns the number of samples generated now.

    A record: ``{"id", "outputs": [text | null, ...], "failures": [null | reason, ...]}``
    (outputs as score_task reads them: one text, MJ's two orders, or the judge's
    two orders), plus ERA/EC's ``"candidate"`` and ``"candidate_failure"``, and
    ``"missing_images"`` when the request went without some of the sample's
    image files (a sample's record is generated again once its images differ).
    ``prompt(sample, order)`` replaces the release's prompt (the k-shot analysis).
    """
    from tqdm.auto import tqdm

    info = task_info(data.task)
    with ResultStore(path, "id", unreadable="skip") as store, \
            tqdm(total=len(data), desc=f"{info.short:>3}", dynamic_ncols=True) as bar:
        if store.cut:
            _warn(f"{path}: cut a partial last line (an interrupted write); that sample is generated again")

        def done(sample: Sample) -> bool:  # generated, not to retry, with the images it has now
            record = store.records.get(sample.id)
            return (record is not None and not (retry_failed and record_failures(record))
                    and record.get("missing_images", []) == list(sample.missing_images))

        pending = [s for s in data if not done(s)]
        bar.update(len(data) - len(pending))
        for start in range(0, len(pending), generator.batch_size):
            group = pending[start:start + generator.batch_size]
            store.add_many(_generate_group(group, data.task, generator, judge, render, prompt))
            bar.update(len(group))
    return len(pending)


PromptFn = Callable[[Sample, int], str]


def _generate_group(samples: Sequence[Sample], task: str, generator: Responder, judge: Responder | None,
                    render: str, prompt: PromptFn | None = None) -> list[dict]:
    info = task_info(task)
    orders = num_orders(task)
    prompt = prompt or (lambda sample, order: build_prompt(sample, task, render, order))
    requests = [Prompt(prompt(s, order), s.images) for s in samples for order in range(orders)]
    outs = generator(requests)
    missing = lambda s: {"missing_images": list(s.missing_images)} if s.missing_images else {}
    if info.theme != "criticism":
        return [{"id": s.id, "outputs": [t for t, _ in outs[k * orders:(k + 1) * orders]],
                 "failures": [e for _, e in outs[k * orders:(k + 1) * orders]], **missing(s)}
                for k, s in enumerate(samples)]
    judged = [k for k, (_, failure) in enumerate(outs) if failure in (None, "empty")]
    verdicts = judge([Prompt(build_judge_prompt(samples[k], task, outs[k][0] or "", render, order),
                              samples[k].images) for k in judged for order in (0, 1)])
    by_sample = {k: verdicts[2 * j:2 * j + 2] for j, k in enumerate(judged)}
    records = []
    for k, s in enumerate(samples):
        pair = by_sample.get(k, [(None, "no_candidate")] * 2)
        records.append({"id": s.id, "candidate": outs[k][0], "candidate_failure": outs[k][1],
                        "outputs": [t for t, _ in pair], "failures": [e for _, e in pair], **missing(s)})
    return records


def task_outputs(samples: Sequence[Sample], records: dict[str, dict], accounting: str = "ours") -> dict[str, Any]:
    """What score_task reads under ``accounting``: per id one text (step tasks, FF) or a pair (MJ's orders,
    ERA/EC's judge outputs); None where there is no output.

    ours and vlmevalkit: every failed generation is None, an empty answer too, and both judge outputs of an
    ERA/EC sample whose candidate failed or came back empty (VLMEvalKit's API models return their failure
    message for an empty answer, ``vlmeval/api/base.py`` ``BaseAPI.generate``, and score_task reads None as
    that message). official: what the release's output files hold: a request that raised (or whose image
    could not be read) is None, as the release's client writes no line for it; an empty answer is ""
    (written, then scored); ERA/EC: the judge's outputs for every candidate that came back, an empty one
    included.
    """
    check_choice(accounting, ACCOUNTINGS, "accounting")
    official = accounting == "official"

    def text(output: str | None, failure: str | None) -> str | None:
        if failure is None:
            return output
        return (output or "") if official and failure == "empty" else None

    outputs = {}
    for sample in samples:
        record = records.get(sample.id)
        if record is None:
            continue
        candidate = record.get("candidate_failure")
        no_candidate = candidate is not None and not (official and candidate == "empty")
        texts = [None if no_candidate else text(t, e) for t, e in zip(record["outputs"], record["failures"])]
        outputs[sample.id] = texts[0] if len(texts) == 1 else tuple(texts)
    return outputs


def failure_counts(samples: Sequence[Sample], records: dict[str, dict]) -> collections.Counter:
    """Failed generations of a task by reason (ERA/EC candidates included); ``missing`` = samples never run."""
    counts: collections.Counter = collections.Counter()
    for sample in samples:
        record = records.get(sample.id)
        if record is None:
            counts["missing"] += 1
            continue
        for failure in record_failures(record):
            counts[_reason(failure)] += 1
    return counts


# ----------------------------------------------------------------------------
# The whole benchmark
# ----------------------------------------------------------------------------


def select_tasks(tasks: str | Sequence[str]) -> list[str]:
    """Task file names, in Table 3's order, from "all", "SC,IC", or a list of short or file names."""
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if list(tasks) in ([], ["all"]):
        return [t.file for t in TASKS]
    chosen = {task_info(t).file for t in tasks}
    return [t.file for t in TASKS if t.file in chosen]


def missing_images(config) -> str:
    """``config.vlrm.missing_images`` with "auto" resolved: the release's "send_without" under
    ``accounting="official"``, else "skip" (see the module's "Missing images")."""
    choice = config.vlrm.get("missing_images", "auto")
    if choice == "auto":
        return "send_without" if config.vlrm.accounting == "official" else "skip"
    check_choice(choice, MISSING_IMAGES, "vlrm.missing_images")
    return choice


def judge_config(config):
    """The judge's config: None when the evaluated model judges, else a config to load it from.

    ``config.judge.config`` names a config file (default: the evaluated
    model's config) and ``config.judge.checkpoint`` its weights (any kind
    :func:`fire_jax.infer.loading.load` reads; default: that config's).
    """
    judge = config.judge
    if not (judge.config or judge.checkpoint):
        return None
    out = load_config(judge.config) if judge.config else copy.deepcopy(config)
    if judge.checkpoint or not judge.config:
        out.checkpoint = judge.checkpoint
    out.name = judge.name
    return out


def judge_name(config) -> str:
    other = judge_config(config)
    return config.judge.name or (model_name(config) + " (self)" if other is None else model_name(other))


def _build_judge(config, generator: Responder) -> Responder:
    other = judge_config(config)
    if other is None:
        return generator.variant(name=judge_name(config), max_new_tokens=config.judge.max_new_tokens)
    return Responder.from_config(other, config.generate, name=judge_name(config),
                                 max_new_tokens=config.judge.max_new_tokens)


def task_settings(config, task: str) -> dict:
    """What a task's outputs depend on: model, render, decode length (+ the judge for ERA/EC)."""
    settings = dict(checkpoint=config.get("checkpoint", ""),
                    hf_checkpoint=config.get("init", {}).get("hf_checkpoint", ""), seed=config.seed,
                    render=config.vlrm.render, max_new_tokens=config.generate.max_new_tokens)
    if task_info(task).theme == "criticism":
        judge = config.judge
        settings.update(judge_config=judge.config, judge_checkpoint=judge.checkpoint,
                        judge_max_new_tokens=judge.max_new_tokens)
    return settings


ACCOUNTING_ROWS = {"ours": "failures count wrong", "official": "the release's scorers",
                   "vlmevalkit": "VLMEvalKit's scorer"}


def score(datasets: dict[str, TaskData], workdir: Path, *, model: str, judge: str, parser: str, render: str,
          accounting: str = "ours", missing_images: str = "skip") -> dict:
    """Score the tasks from their outputs JSONL; write and print results.json / results.md.

    Every task is scored under every accounting; ``accounting`` picks the
    one in ``scores`` and the W-Avgs, ``by_accounting`` holds them all, and the
    table has a row for each. Beside each Step W-Avg (the paper's) is the
    pooled step F1 (VLMEvalKit's, :func:`fire_jax.vlrmbench.pooled_step_f1`). ``missing_images``: how ``datasets`` were
    loaded, named in results.json and the table.
    """
    from fire_jax.vlrmbench.audit import audit_table

    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {list(ACCOUNTINGS)}, got {accounting!r}")
    results: dict[str, dict[str, TaskResult]] = {a: {} for a in ACCOUNTINGS}
    tasks = {}
    for f, data in datasets.items():
        records, unreadable = read_records(workdir / "outputs" / f"{f}.jsonl")
        failures = failure_counts(data.samples, records)
        entry = dict(bad_records=dict(data.skipped), kept_records=dict(data.kept),
                     generation_failures=dict(failures), unreadable_output_lines=unreadable)
        if data.samples:
            both = score_accountings(f, data.samples, task_outputs(data.samples, records), parser,
                                     official_outputs=task_outputs(data.samples, records, "official"))
            for a, result in both.items():
                results[a][f] = result
            entry.update(both[accounting].to_json())
            entry["by_accounting"] = {a: dict(scores=r.scores, num_scored=r.num_scored) for a, r in both.items()}
        else:
            entry.update(task=f, num_samples=0, error="no usable samples")
        tasks[task_info(f).short] = entry
    rows_accounting = (accounting,) + tuple(a for a in ACCOUNTINGS if a != accounting)
    rows = {f"{model} ({a}: {ACCOUNTING_ROWS[a]})": results[a] for a in rows_accounting}
    table = (results_table(rows, judge=judge, render=render) + _counts_table(datasets, tasks, missing_images)
             + audit_table(datasets, {name: {f: r.scores["f1"] for f, r in results[a].items() if "f1" in r.scores}
                                      for name, a in zip(rows, rows_accounting)}))
    summary = dict(model=model, judge=judge, parser=parser, render=render, accounting=accounting,
                   missing_images=missing_images, tasks=tasks)
    for theme in ("step", "outcome"):
        summary[f"{theme}_w_avg"] = theme_average(results[accounting], theme)
        summary[f"{theme}_w_avg_by_accounting"] = {a: theme_average(results[a], theme) for a in ACCOUNTINGS}
    summary["step_pooled_f1"] = pooled_step_f1(results[accounting])  # VLMEvalKit's Overall_F1_weighted
    summary["step_pooled_f1_by_accounting"] = {a: pooled_step_f1(results[a]) for a in ACCOUNTINGS}
    write_json(workdir / "results.json", summary)
    write_text(workdir / "results.md", table)
    print(table)
    print(f"wrote {workdir / 'results.json'} and {workdir / 'results.md'}")
    return {**summary, "table": table}


def _counts_table(datasets: dict[str, TaskData], tasks: dict[str, dict], missing_images: str = "skip") -> str:
    """Per task: samples, records skipped and kept odd, failed generations, failed samples, by reason."""
    def reasons(counts: dict) -> str:
        return ", ".join(f"{r} {n}" for r, n in sorted(counts.items())) or "0"

    lines = ["", "Samples; bad records skipped and odd records kept; failed generations (exception, empty "
             "output, unreadable input, ERA/EC judge skipped for lack of a candidate); failed samples (counted "
             "wrong by ours, left out by official), by reason. A record whose image file is missing: "
             + {"skip": "skipped (bad record missing_image)",
                "send_without": "sent without it, as the release (kept record missing_image)"}[missing_images]
             + f" (missing_images={missing_images}).", "",
             "| Task | samples | bad records | kept records | failed generations | failed samples |",
             "| --- | ---: | --- | --- | --- | --- |"]
    for f in datasets:
        entry = tasks[task_info(f).short]
        lines.append(f"| {task_info(f).short} | {entry['num_samples']} | {reasons(entry['bad_records'])} | "
                     f"{reasons(entry['kept_records'])} | {reasons(entry['generation_failures'])} | "
                     f"{reasons(entry.get('failed_samples', {}))} |")
    return "\n".join(lines) + "\n"
