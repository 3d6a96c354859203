"""Experiment configs: loading a config file, its argument, paths, and the default sub-configs (FIRE Sec. 5.1).

The lowest layer of the package: every config file, the trainer and the
inference tools import it, and it imports nothing but ml_collections (no
jax), so reading a config is cheap and never drags in model code.

- :func:`load_config` ``("configs/fire.py:fire_student,released=true")`` runs
  the file's ``get_config(arg)``; relative paths are tried against the current
  directory, then the repository root.
- :func:`parse_arg` is the one syntax of that argument: an optional leading
  name, then ``key=value`` options typed like their defaults.
- :func:`resolve_path`: ``assets:x`` is ``fire_jax/assets/x``.
- :func:`data_config`, :func:`train_config`, :func:`loss_config`,
  :func:`mesh_config`: the sub-configs with the paper's defaults (FIRE Sec. 5.1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
from typing import Any, Mapping

import ml_collections

from fire_jax.core import axes as ax

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")
REPO_DIR = os.path.dirname(PACKAGE_DIR)


def _configs_dir() -> str:
    """The config files: ``configs/`` of the source tree (a clone, an editable install), else the copy an installed
    wheel carries as ``fire_jax/configs/`` (``pyproject.toml`` maps one onto the other)."""
    in_repo = os.path.join(REPO_DIR, "configs")
    if os.path.exists(os.path.join(REPO_DIR, "pyproject.toml")) and os.path.isdir(in_repo):
        return in_repo
    return os.path.join(PACKAGE_DIR, "configs")


CONFIGS_DIR = _configs_dir()
#: The built-in tiny config every CLI falls back to.
DEFAULT_CONFIG = os.path.join(CONFIGS_DIR, "tiny.py")


class InputError(ValueError):
    """Input the user can fix (a config field, a flag, a file, a record), as opposed to a bug; its message
    names what and where. CLIs end on it with one line (:mod:`fire_jax.core.cli`)."""


def json_error_at(message: str, where: str) -> str:
    """``json.JSONDecodeError.msg`` placed at ``where`` ("byte 12", "line 3 column 4"): "Unterminated string starting
    at" becomes "Unterminated string starting at byte 12", not "... starting at at byte 12"."""
    return f"{message.removesuffix(' at')} at {where}"


class WriteFailed(OSError):
    """An output that could not be written (a full disk, a quota, a read-only or failing filesystem), as opposed
    to a bug: the message names the path and the space left on its filesystem (:func:`write_failed`). CLIs end
    on it with that one line, exit 1 (:mod:`fire_jax.core.cli`)."""

    def __str__(self) -> str:
        return self.args[0]


#: An errno as libraries quote it in their messages: Python's "[Errno 28]", tensorstore's "[os_error_code='28']",
#: safetensors' (Rust's std::io::Error) "No space left on device (os error 28)" or "Os { code: 28, ... }".
_QUOTED_ERRNO = re.compile(r"\[Errno (\d+)\]|os_error_code='(\d+)'|\(os error (\d+)\)|Os \{ code: (\d+)")


def error_number(error: BaseException | None) -> int | None:
    """The errno of an OSError, or the one a library's error quotes (orbax's tensorstore writes raise ValueError),
    along the error's causes; None when there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno
        quoted = _QUOTED_ERRNO.search(str(error))
        if quoted:
            return int(next(g for g in quoted.groups() if g))
        error = error.__cause__ or error.__context__
    return None


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def free_space(path: str) -> str:
    """"<free> free of <total>" on the filesystem that holds ``path`` (or its nearest existing folder)."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return "free space unknown"
    return f"{_bytes(usage.free)} free of {_bytes(usage.total)}"


def write_failed(path: str, error: BaseException) -> WriteFailed:
    """The :class:`WriteFailed` of ``error``, raised while writing ``path``: the reason (the errno's text when the
    error carries one) and the space left there, in one line."""
    number = error_number(error)
    reason = os.strerror(number) if number else " ".join(str(error).split())[:300] or type(error).__name__
    failed = WriteFailed(f"could not write {path}: {reason} ({free_space(path)} on its filesystem)")
    failed.errno, failed.filename = number, path
    return failed


@contextlib.contextmanager
def writing(path: str):
    """Turn an OSError raised inside the block into the :class:`WriteFailed` of ``path``."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as e:
        raise write_failed(path, e) from e


def cache_dir() -> str:
    """Where fetched models live: ``$FIRE_JAX_CACHE``, else ``~/.cache/fire_jax``."""
    return os.environ.get("FIRE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fire_jax")


def resolve_path(path: str) -> str:
    """``assets:x`` -> ``fire_jax/assets/x``; ``cache:x`` -> ``<cache_dir()>/x`` (a fetched model's files, see
    ``fire_jax.convert.fetch``); other paths with ``~`` expanded."""
    if path.startswith("assets:"):
        return os.path.join(ASSETS_DIR, path[len("assets:"):])
    if path.startswith("cache:"):
        return os.path.join(cache_dir(), path[len("cache:"):])
    return os.path.expanduser(path)


def config_path(path: str) -> str:
    """A config file's path: as given if it exists, else ``configs/x.py`` in :data:`CONFIGS_DIR` (so it works
    from any directory, and from an installed wheel); raises FileNotFoundError naming both places."""
    path = resolve_path(path)
    if os.path.exists(path) or os.path.isabs(path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"config file {path!r} not found")
        return path
    parts = os.path.normpath(path).split(os.sep)
    shipped = os.path.join(CONFIGS_DIR, *parts[1:]) if parts[0] == "configs" else os.path.join(REPO_DIR, path)
    if os.path.exists(shipped):
        return shipped
    raise FileNotFoundError(f"config file {path!r} not found (nor {shipped!r})")


def load_config(spec: str):
    """``configs/tiny.py`` or ``configs/fire.py:ARG`` -> the file's ``get_config(ARG)`` (ARG "" when absent)."""
    path, _, arg = spec.partition(":")
    path = config_path(path)
    module_spec = importlib.util.spec_from_file_location("fire_jax_config_file", path)
    if module_spec is None:
        raise FileNotFoundError(f"config file {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg)


def parse_arg(arg: str, *, where: str, names: tuple[str, ...] = (), **defaults) -> tuple[str | None, dict[str, Any]]:
    """A config file's argument, ``[name][,key=value...]``: (name, options).

    ``names``: the allowed leading names (the first is the default; none: no name is taken).
    ``defaults``: the options, each value typed like its default (bools: 1/true/yes, 0/false/no).
    ``where`` names the config file in errors: ``configs/fire.py: option 'x' unknown; known: [...]``.
    """
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    name = names[0] if names else None
    if parts and "=" not in parts[0]:
        if not names:
            raise InputError(f"{where}: takes only key=value options, got {parts[0]!r}; known: {sorted(defaults)}")
        name = parts.pop(0)
        if name not in names:
            raise InputError(f"{where}: {name!r} unknown; choose from {list(names)}")
    options = dict(defaults)
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            raise InputError(f"{where}: expected key=value, got {part!r}")
        if key not in defaults:
            raise InputError(f"{where}: option {key!r} unknown; known: {sorted(defaults)}")
        kind = type(defaults[key])
        if kind is bool:
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise InputError(f"{where}: option {key}={value!r}: expected true or false")
            options[key] = value.lower() in ("1", "true", "yes")
        else:
            try:
                options[key] = kind(value)
            except ValueError:
                raise InputError(f"{where}: option {key}={value!r}: expected {kind.__name__}") from None
    return name, options


def override_target(config, path: str, *, source: str = ""):
    """(the ConfigDict holding field ``path`` = "a.b.c", the field's name); :class:`InputError` when a part of the
    path names no field: ``no field 'c' in a.b{source} (known: ...)``."""
    *parents, name = path.split(".")
    node = config
    for depth, key in enumerate([*parents, name]):
        if not hasattr(node, "keys") or key not in node:
            known = f" (known: {', '.join(sorted(node.keys()))})" if hasattr(node, "keys") else ""
            raise InputError(f"no field {key!r} in {'.'.join(parents[:depth]) or 'the config'}{source}{known}")
        if depth < len(parents):
            node = node[key]
    return node, name


def apply_overrides(config, overrides, *, where: str = "--config"):
    """Set ``--config.a.b=value`` overrides (as ``config_flags`` does for the absl CLIs) on a loaded config.

    ``overrides``: "a.b=value" strings. A value is read as a Python literal when it parses as one (``8``,
    ``0.5``, ``True``, ``(1, 2)``, ``'x'``), else taken as a string; the field must exist, and ml_collections
    refuses a value of another type. Errors name the override: ``--config.train.lrr=1: no field 'lrr' in
    train (known: ...)``.
    """
    import ast

    for override in overrides:
        path, eq, text = override.partition("=")
        if not eq or not path:
            raise InputError(f"{where}.{override}: expected --config.<field>=<value>")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        try:
            node, name = override_target(config, path)
        except InputError as e:
            raise InputError(f"{where}.{override}: {e}") from None
        current = node[name]
        if isinstance(current, bool) and text.lower() in ("1", "true", "yes", "0", "false", "no"):
            value = text.lower() in ("1", "true", "yes")
        if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(current, str) and not isinstance(value, str):
            value = text
        try:
            node[name] = value
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}.{override}: {e}") from None
    return config


def split_overrides(argv) -> tuple[list[str], list[str]]:
    """(the other arguments, the ``--config.x=y`` overrides without their ``--config.`` prefix)."""
    rest, overrides = [], []
    for arg in argv:
        if arg.startswith("--config.") and "=" in arg:
            overrides.append(arg[len("--config."):])
        else:
            rest.append(arg)
    return rest, overrides


#: New tokens a turn of a free dialogue may generate (docs/spec.md): configs/eval_free.py's ``decode.max_new_tokens``
#: beyond the tiny models, and the default of the interactive dialogues (``fire_jax.chat``, ``fire_jax.demo``).
FREE_DIALOGUE_NEW_TOKENS = 160


#: Fields of ``config.data`` besides the required ``tokenizer`` and ``sources``, with their defaults.
DATA_DEFAULTS = dict(
    image_token="<image>",  # placeholder token; its id must equal model.image_token_id
    pad_token="<pad>",  # falls back to <|end_of_text|> if the tokenizer has none
    template="",  # chat template: a shipped name (llama3, llava_hf_llama3, chatml, vicuna_v1, the FIRE release's
                  # llama_v3_student, llama_v3_teacher, llava_v1_student_feedback, llava_v1_teacher_feedback) or a
                  # .jinja file; "": the tokenizer_config.json's beside the tokenizer, else llama3
    field_caps={},  # the most characters per record field, over fire_jax.data.records.FIELD_CAPS
    role="student",  # "student" (FIRE-LLaVA, Eq. 5) or "teacher" (FD-LLaVA, Eq. 6)
    teacher_history="full",  # "full" (training) or "latest" (the teacher of free dialogues)
    short_teacher_share=0.0,  # a share of teacher sequences, drawn per record id, rendered short: no instruction
                              # message, each judged response cut to its "Answer:" line (fire_jax.data.chat)
    eval_sources={},
    on_bad_record="skip",  # or "error"
    max_len=3072,  # tokens, image features included
    buckets=(),  # sequence lengths batches are padded to (max_len is always one)
    group_by_length=0,  # n > 0: each window of n batches of the shuffled order sorted by text length, cut into
                        # batches taken in random order (transformers' group_by_length); 0: the shuffled order
    batch_size=64,  # global; each process gets batch_size // process_count
    shuffle=True,
    seed=0,
    num_epochs=0,  # 0: repeat forever, sources mixed by weight; n: n passes over all sources
    num_threads=0,  # grain read threads (0: in the calling thread)
    num_workers=0,  # grain worker processes (0: none)
)


def data_config(tokenizer: str, sources: Mapping[str, Mapping[str, Any]], **fields) -> ml_collections.ConfigDict:
    """A ``config.data`` ConfigDict: the defaults above, the tokenizer.json path, the sources, overrides."""
    unknown = set(fields) - set(DATA_DEFAULTS)
    if unknown:
        raise InputError(f"unknown data config field(s) {sorted(unknown)}; known: {sorted(DATA_DEFAULTS)}")
    return ml_collections.ConfigDict({**DATA_DEFAULTS, "tokenizer": tokenizer, "sources": dict(sources), **fields})


def train_config(**overrides) -> ml_collections.ConfigDict:
    """AdamW lr 2e-4, wd 0, betas (0.9, 0.999), eps 1e-8; 3% warm-up then cosine; clip 1.0; batch 64; 1 epoch."""
    config = ml_collections.ConfigDict(dict(
        lr=2e-4, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, warmup_frac=0.03, clip_norm=1.0,
        lr_schedule="cosine",  # after the warm-up: "cosine" to 0 (the release's) or "constant" (the peak lr)
        batch_size=64,  # global; must equal data.batch_size
        accum_steps=1,  # micro-batches per step (the global batch is split, gradients summed)
        epochs=1.0,
        total_steps=0,  # 0: epochs * examples / batch_size
        train_connector=False,  # True reproduces the released checkpoints (connector trained too)
        trainable=(),  # regexes over frozen-weight paths to train as well (the tiny demo: (".*",))
        loss_chunk=512,  # tokens of the flattened micro-batch per logits chunk in the loss (labelled ones only)
        checkpoint_every=500,
        keep_checkpoints=3,
        export=True,  # PEFT adapter at the end
        export_merged=False,  # and merged HF weights
        shard_init=False,  # random weights made straight onto the mesh, each device its shard (jit: not
                           # bit-identical to eager init; the 8B configs set it)
        xla_options=(),  # (name, value) pairs of XLA debug options for the step program alone, over XLA_FLAGS,
                         # e.g. (("xla_backend_optimization_level", 2),)
    ))
    config.update(overrides)
    return config


def loss_config(**overrides) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(dict(
        normalize="token",  # mean over the global batch's labelled tokens; "turn": mean of per-turn means
        max_turns=8,  # turn indices reported separately in the metrics (higher ones pooled as "> max_turns")
        student_first_turn=False,  # also label the student's r_1 (the release did; the paper, Eq. 5, not)
    ))
    config.update(overrides)
    return config


def _number(low: float | None = None, high: float | None = None, *, integer: bool = False, low_open: bool = False,
            high_open: bool = False):
    """A check of one config value: a number (an integer when ``integer``; never a bool) within the bounds."""
    kind = "an integer" if integer else "a number"
    if low is not None and high is not None:
        want = f"{kind} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        want = f"{kind} {'>' if low_open else '>='} {low:g}"
    else:
        want = kind

    def check(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            return want
        if isinstance(value, float) and not math.isfinite(value):
            return want
        if low is not None and (value < low or (low_open and value == low)):
            return want
        if high is not None and (value > high or (high_open and value == high)):
            return want
        return None

    return check


def _one_of(*choices):
    def check(value) -> str | None:
        return None if value in choices else f"one of {list(choices)}"

    return check


#: What each field of the train / loss / data sub-configs may hold, checked wherever such a sub-config appears
#: (a training config's ``train``, a main job's ``base_train.train``, ...): :func:`check_config`.
FIELD_CHECKS = {
    "train": dict(
        lr=_number(0, 1e3, low_open=True), weight_decay=_number(0), b1=_number(0, 1, high_open=True),
        b2=_number(0, 1, high_open=True), eps=_number(0, low_open=True), warmup_frac=_number(0, 1, high_open=True),
        clip_norm=_number(0), lr_schedule=_one_of("cosine", "constant"), batch_size=_number(1, integer=True),
        accum_steps=_number(1, integer=True), epochs=_number(0, low_open=True), total_steps=_number(0, integer=True),
        loss_chunk=_number(1, integer=True), checkpoint_every=_number(1, integer=True),
        keep_checkpoints=_number(1, integer=True)),
    "loss": dict(normalize=_one_of("token", "turn"), max_turns=_number(1, integer=True)),
    # a reinforcement stage's (configs/fire_rl.py, fire_jax.train.policy)
    "rl": dict(items_per_step=_number(1, integer=True), group_size=_number(2, integer=True),
               iterations=_number(1, integer=True), updates=_number(1, integer=True), temperature=_number(0, 2),
               top_p=_number(0, 1), gamma=_number(0, 1), advantage=_one_of("grpo", "rloo"),
               normalize=_one_of("token", "sequence"), clip=_number(0, low_open=True), kl_coef=_number(0),
               max_failed_rollouts=_number(1, integer=True)),
    "reward": dict(score=_number(), improvement=_number()),
    "data": dict(max_len=_number(1, integer=True), batch_size=_number(1, integer=True),
                 group_by_length=_number(0, integer=True), num_epochs=_number(0, integer=True),
                 num_threads=_number(0, integer=True), num_workers=_number(0, integer=True),
                 seed=_number(integer=True), on_bad_record=_one_of("skip", "error"),
                 role=_one_of("student", "teacher"), teacher_history=_one_of("full", "latest"),
                 short_teacher_share=_number(0, 1, high_open=True)),
}


def check_config(config, where: str = "config") -> None:
    """Raise :class:`InputError` naming the first field of ``config`` (at any depth) whose value its
    :data:`FIELD_CHECKS` refuses, in one line: ``config field base_train.train.checkpoint_every = 0: expected an
    integer >= 1``. Called where a job takes its config (the trainer, the main job), after overrides."""
    def walk(node, path: tuple[str, ...]) -> None:
        items = node.items() if isinstance(node, (Mapping, ml_collections.ConfigDict)) else ()
        for key, value in items:
            key = str(key)
            checks = FIELD_CHECKS.get(path[-1]) if path else None
            if checks and key in checks:
                want = checks[key](value)
                if want:
                    raise InputError(f"{where} field {'.'.join(path + (key,))} = {value!r}: expected {want}")
            elif key in ("sources", "eval_sources"):  # a data source's fields are its loader's to check
                continue
            elif isinstance(value, (Mapping, ml_collections.ConfigDict)):
                walk(value, path + (key,))

    walk(config, ())


#: Default sharding rules, (logical axis name, mesh axes): batch over data x fsdp, weights' model dimension
#: over fsdp, heads / mlp / vocab over tensor (Megatron-style), the vision tower the same way; an inference
#: engine's decode slots (its KV cache's rows, fire_jax.infer.kernels.CACHE_AXES) over data.
DEFAULT_RULES = (
    (ax.BATCH, (ax.DATA, ax.FSDP)),
    (ax.SLOTS, (ax.DATA,)),
    (ax.EMBED, (ax.FSDP,)),
    (ax.HEADS, (ax.TENSOR,)),
    (ax.KV_HEADS, (ax.TENSOR,)),
    (ax.MLP, (ax.TENSOR,)),
    (ax.VOCAB, (ax.TENSOR,)),
    (ax.VISION_EMBED, (ax.FSDP,)),
    (ax.VISION_HEADS, (ax.TENSOR,)),
    (ax.VISION_MLP, (ax.TENSOR,)),
)


def mesh_config(shape=(-1, 1, 1)) -> ml_collections.ConfigDict:
    """(data, fsdp, tensor) sizes, -1 = the rest; rules map logical axis names to mesh axes."""
    return ml_collections.ConfigDict(dict(shape=tuple(shape), rules=tuple((k, tuple(v)) for k, v in DEFAULT_RULES)))
