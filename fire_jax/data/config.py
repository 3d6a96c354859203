"""Reading the data parts of an experiment config: paths, config files, geometry, sources.

A source (one entry of ``config.data.sources``) is either raw JSON::

    dict(json="assets:synthetic_fire/train.json", image_root="assets:synthetic_fire/images", weight=1.0)

or a split built by ``tools/build_dataset.py``::

    dict(tfds="/data/tfds", split="fire_100k", weight=1.0)

plus, optionally, ``max_examples`` (a fixed random subset of that many
records) and ``num_examples`` (the size the source is expected to have: the trainer
plans its steps from the records that actually load and prints both).
Paths starting with ``assets:`` are inside ``fire_jax/assets`` (the shipped
tiny tokenizer and synthetic demo data).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence as SequenceABC
from typing import Any, Mapping

from fire_jax.geometry import ImageGeometry
from fire_jax.data.records import BadRecords, Record, iter_records

#: Fields of ``config.data`` besides the required ``tokenizer`` and ``sources``, with their defaults.
DATA_DEFAULTS = dict(
    image_token="<image>",  # placeholder token; its id must equal model.image_token_id
    pad_token="<pad>",  # falls back to <|end_of_text|> if the tokenizer has none
    role="student",  # "student" (FIRE-LLaVA, Eq. 5) or "teacher" (FD-LLaVA, Eq. 6)
    teacher_history="full",  # "full" (training) or "latest" (the teacher of free dialogues)
    eval_sources={},
    on_bad_record="skip",  # or "error"
    max_len=3072,  # tokens, image features included
    buckets=(),  # sequence lengths batches are padded to (max_len is always one)
    batch_size=64,  # global; each process gets batch_size // process_count
    shuffle=True,
    seed=0,
    num_epochs=0,  # 0: repeat forever, sources mixed by weight; n: n passes over all sources
    num_threads=0,  # grain read threads (0: in the calling thread)
    num_workers=0,  # grain worker processes (0: none)
)


def data_config(tokenizer: str, sources: Mapping[str, Mapping[str, Any]], **fields):
    """A ``config.data`` ConfigDict: the defaults above, the tokenizer.json path, the sources, overrides."""
    import ml_collections

    unknown = set(fields) - set(DATA_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown data config field(s) {sorted(unknown)}; known: {sorted(DATA_DEFAULTS)}")
    return ml_collections.ConfigDict({**DATA_DEFAULTS, "tokenizer": tokenizer, "sources": dict(sources), **fields})


ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def resolve_path(path: str) -> str:
    """``assets:x`` -> ``fire_jax/assets/x``; other paths with ``~`` expanded."""
    if path.startswith("assets:"):
        return os.path.join(ASSETS_DIR, path[len("assets:"):])
    return os.path.expanduser(path)


def load_config(spec: str):
    """``configs/tiny.py`` or ``configs/tiny.py:arg`` -> the file's ``get_config(arg)``."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("fire_jax_config", path)
    if module_spec is None:
        raise FileNotFoundError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg)


def geometry_from_model_config(model: Mapping[str, Any]) -> ImageGeometry:
    """The image geometry named by ``config.model`` (what ``LlavaNextConfig.geometry`` builds)."""
    return ImageGeometry(tile_size=model["vision"]["image_size"], patch_size=model["vision"]["patch_size"],
                         pinpoints=tuple(tuple(p) for p in model["image_grid_pinpoints"]),
                         mode=model.get("image_mode", "anyres"), pad_newline=model.get("pad_newline", False))


class _TfdsRecords(SequenceABC):
    """Random access to (record, encoded image) of a built TFDS split."""

    def __init__(self, source):
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index):
        from fire_jax.data.tfds_fire import to_record
        return to_record(self._source[index])


#: Fields of one source: where the data is, its mixing weight, an optional subset size, and its expected size.
SOURCE_FIELDS = ("json", "image_root", "tfds", "split", "weight", "max_examples", "num_examples")


class _Subset(SequenceABC):
    """``max_examples`` records of a source, a fixed random subset (smaller subsets nest in larger ones)."""

    def __init__(self, records, size: int):
        import numpy as np

        self._records = records
        order = np.random.default_rng(0).permutation(len(records))
        self._indices = np.sort(order[:size])

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index):
        return self._records[int(self._indices[index])]


def open_source(source: Mapping[str, Any], *, on_bad_record: str = "skip", bad: BadRecords | None = None,
                require_scores: bool = True) -> SequenceABC[tuple[Record, str | bytes | None]]:
    """A random-access sequence of (record, image path / encoded bytes / None) for one source config.

    JSON sources are parsed (and their images checked) here; bad records are
    added to ``bad`` (or raise under ``on_bad_record="error"``); ``require_scores=False``
    keeps conversations with an unscoreable feedback (the student's data). With
    ``max_examples``, a fixed random subset of that size (the FIRE-1M
    data-size ablation: the 200K subset is part of the 400K one, ...).
    """
    unknown = set(source) - set(SOURCE_FIELDS)
    if unknown:
        raise ValueError(f"data source: unknown field(s) {sorted(unknown)}; known: {SOURCE_FIELDS}")
    if "tfds" in source:
        from fire_jax.data.tfds_fire import data_source
        records = _TfdsRecords(data_source(resolve_path(source["tfds"]), source.get("split")))
    elif "json" in source:
        paths = source["json"]
        paths = [resolve_path(p) for p in ([paths] if isinstance(paths, str) else paths)]
        records = list(iter_records(paths, resolve_path(source.get("image_root", "")), on_bad_record=on_bad_record,
                                    split=source.get("split", ""), bad=bad, require_scores=require_scores))
    else:
        raise ValueError(f"a data source needs 'json' (+ 'image_root') or 'tfds' (+ 'split'), got {dict(source)}")
    size = source.get("max_examples")
    if size and size < len(records):
        records = _Subset(records, size)
    return records
