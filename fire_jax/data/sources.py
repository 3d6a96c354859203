"""The data sources of an experiment config (``config.data.sources``) and the image geometry of ``config.model``.

A source (one entry of ``config.data.sources``) is either raw JSON::

    dict(json="assets:synthetic_fire/train.json", image_root="assets:synthetic_fire/images", weight=1.0)

or a split built by ``tools/build_dataset.py``::

    dict(tfds="/data/tfds", split="fire_100k", weight=1.0)

or ``generate`` fresh drawings of the shipped synthetic set (:mod:`fire_jax.data.synthetic`), each with its
question and the right answer in the first turn's words, as single-turn instruction records::

    dict(generate=1600, seed=1, split="align_generated")

(``split`` names the drawings' random stream, ``f"{seed}/{split}"``, one of its own: never the shipped test images)

plus, optionally, ``max_examples`` (a fixed random subset of that many
records) and ``num_examples`` (the size the source is expected to have: the trainer
plans its steps from the records that actually load and prints both).
Paths starting with ``assets:`` are inside ``fire_jax/assets`` (the shipped
tiny tokenizer and synthetic demo data).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any, Mapping

from fire_jax.core.config import resolve_path
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.records import Record, iter_records
from fire_jax.core.geometry import ImageGeometry

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
SOURCE_FIELDS = ("json", "image_root", "tfds", "generate", "seed", "split", "weight", "max_examples",
                 "num_examples")


def subset_indices(total: int, size: int) -> list[int]:
    """A fixed random subset of ``size`` of ``range(total)``, in order (all when size is 0 or >= total);
    smaller subsets nest in larger ones (one permutation, seed 0)."""
    import numpy as np

    if not size or size >= total:
        return list(range(total))
    return sorted(int(i) for i in np.random.default_rng(0).permutation(total)[:size])


class _Subset(SequenceABC):
    """``max_examples`` records of a source: the :func:`subset_indices` of that size."""

    def __init__(self, records, size: int):
        self._records = records
        self._indices = subset_indices(len(records), size)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index):
        return self._records[self._indices[index]]


def open_source(source: Mapping[str, Any], *, on_bad_record: str = "skip", bad: BadRecords | None = None,
                require_scores: bool = True,
                caps: Mapping[str, int] | None = None) -> SequenceABC[tuple[Record, str | bytes | None]]:
    """A random-access sequence of (record, image path / encoded bytes / None) for one source config.

    JSON sources are parsed (and their images checked) here; bad records are
    added to ``bad`` (or raise under ``on_bad_record="error"``); ``require_scores=False``
    keeps conversations with an unscoreable feedback (the student's data); ``caps``: the most characters per
    field (``config.data.field_caps``, :func:`fire_jax.data.records.field_caps`). With
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
                                    split=source.get("split", ""), bad=bad, require_scores=require_scores,
                                    caps=caps))
    elif "generate" in source:
        records = generated_instructions(int(source["generate"]), int(source.get("seed", 0)),
                                         source.get("split") or "generated")
    else:
        raise ValueError(f"a data source needs 'json' (+ 'image_root'), 'tfds' (+ 'split') or 'generate' (+ 'seed'), "
                         f"got {dict(source)}")
    size = source.get("max_examples")
    if size and size < len(records):
        records = _Subset(records, size)
    return records


def generated_instructions(num: int, seed: int, split: str) -> list[tuple[Record, bytes]]:
    """``num`` fresh drawings of the synthetic set (:func:`fire_jax.data.synthetic.synthesize` under ``split``),
    each as a single-turn instruction record with the right answer
    (:func:`fire_jax.data.synthetic.instruction_records`, ``right=True``) and its PNG bytes: as many images as a
    stage needs to learn to read the tower rather than the 720 training images by heart."""
    import io

    from fire_jax.data.records import parse_record
    from fire_jax.data.synthetic import instruction_records, synthesize

    if split in ("train", "test"):
        raise ValueError(f"a generated source's split must not be the shipped set's {split!r}: its drawings would be "
                         f"the shipped images")
    raws, images, _ = synthesize(num, seed, split)
    out = []
    for raw in instruction_records(raws, right=True):
        buffer = io.BytesIO()
        images[raw["image"]].save(buffer, format="PNG")
        out.append((parse_record(raw, default_id=raw["id"], default_split=split), buffer.getvalue()))
    return out
