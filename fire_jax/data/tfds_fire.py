"""A tensorflow-datasets builder for FIRE (array_record files; no TensorFlow needed).

One builder config per split (``fire_100k``, ``fire_1m``, ``fire_bench``, and
``instruct`` for LLaVA-665K-style data), each holding one split of the same
name, so splits are built independently::

    <out>/fire/fire_100k/1.0.0/fire-fire_100k.array_record-00000-of-00001 ...

An example stores the encoded image bytes (as downloaded; b"" for a
text-only record), its (height, width), the conversation (question,
groundtruth, turns of response/feedback/score) or the instruction messages,
the source and the record's own split field. Per-source counts and the bad
records skipped while building are kept in the dataset's metadata.
Read with :func:`data_source` (``tfds.builder_from_directory``, no builder
class needed) and turn examples back into records with :func:`to_record`.
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from fire_jax.core.config import InputError
from fire_jax.data.bad_records import BadRecords
from fire_jax.data.image_files import image_size_of
from fire_jax.data.records import Conversation, Instruction, Record, Turn, iter_records

SPLITS = ("fire_100k", "fire_1m", "fire_bench", "instruct")
VERSION = "1.0.0"


def features() -> tfds.features.FeaturesDict:
    text = tfds.features.Text()
    return tfds.features.FeaturesDict({
        "id": text,
        "kind": text,  # "fire" or "instruction"
        "image": tfds.features.Tensor(shape=(), dtype=np.object_),  # encoded bytes, b"" without image
        "image_path": text,  # as in the raw record, relative to the image root
        "image_size": tfds.features.Tensor(shape=(2,), dtype=np.int32),  # (height, width); (0, 0) without image
        "question": text,
        "groundtruth": text,
        "turns": tfds.features.Sequence({"response": text, "feedback": text, "score": np.float32}),  # NaN: none
        "messages": tfds.features.Sequence({"role": text, "text": text}),
        "source": text,
        "split": text,
    })


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """A FIRE build's info: built here, never looked up in tensorflow-datasets' gs://tfds-data bucket (its lookup
    makes a temporary folder that it leaves behind, one per new build, even with the bucket disabled)."""

    def initialize_from_bucket(self) -> None:
        pass


class Fire(tfds.core.GeneratorBasedBuilder):
    """FIRE conversations and instruction data with their encoded images."""

    VERSION = tfds.core.Version(VERSION)
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=name) for name in SPLITS]
    # tfds locates builder code through importlib_resources, which is not a dependency here.
    code_path = epath.Path(__file__)

    def __init__(self, *, json_files=(), image_root: str = "", on_bad_record: str = "skip", **kwargs):
        kwargs.setdefault("file_format", "array_record")
        self._json_files, self._image_root, self._on_bad_record = list(json_files), image_root, on_bad_record
        self.source_counts: collections.Counter = collections.Counter()
        self.bad = BadRecords()
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalDatasetInfo(builder=self, description=__doc__, features=features(),
                                     metadata=tfds.core.MetadataDict())

    def _split_generators(self, dl_manager):
        del dl_manager
        if not self._json_files:
            raise ValueError("Fire builder: no json_files given to build from")
        return {self.builder_config.name: self._generate_examples()}

    def _generate_examples(self):
        key = 0
        for record, image_path in iter_records(self._json_files, self._image_root, on_bad_record=self._on_bad_record,
                                               split=self.builder_config.name, decode_images=True, bad=self.bad,
                                               require_scores=False):  # the teacher's pipeline drops no_score
            image = b""
            if image_path is not None:
                with open(image_path, "rb") as f:
                    image = f.read()
            self.source_counts[record.source] += 1
            yield key, to_example(record, image)
            key += 1
        if not key:  # tensorflow-datasets would stop with "No examples were yielded"
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad.items()))
            example = next(iter(self.bad.first.values()), "")
            raise InputError(f"no usable record in split {self.builder_config.name!r} of {self._json_files}: "
                             f"{sum(self.bad.values())} bad records dropped"
                             + (f" ({reasons}; e.g. {example})" if reasons else " (the files hold no records)"))
        self.info.metadata["source_counts"] = dict(self.source_counts)
        self.info.metadata["bad_records"] = dict(self.bad)


def to_example(record: Record, image: bytes) -> dict:
    """The TFDS example of a record and its encoded image."""
    example = {"id": record.id, "image": image, "image_path": record.image or "",
               "image_size": np.asarray(image_size_of(image) if image else (0, 0), np.int32),
               "question": "", "groundtruth": "", "turns": {"response": [], "feedback": [], "score": []},
               "messages": {"role": [], "text": []}, "source": record.source, "split": record.split}
    if isinstance(record, Conversation):
        example.update(kind="fire", question=record.question, groundtruth=record.groundtruth, turns={
            "response": [t.response for t in record.turns], "feedback": [t.feedback for t in record.turns],
            "score": [math.nan if t.score is None else float(t.score) for t in record.turns]})
    else:
        example.update(kind="instruction", messages={"role": [r for r, _ in record.messages],
                                                      "text": [t for _, t in record.messages]})
    return example


def _str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def to_record(example: dict) -> tuple[Record, bytes | None]:
    """(record, encoded image or None) from an example read from the data source."""
    image = example["image"] or None
    common = dict(id=_str(example["id"]), image=_str(example["image_path"]) or None, source=_str(example["source"]),
                  split=_str(example["split"]))
    if _str(example["kind"]) == "instruction":
        messages = example["messages"]
        return Instruction(messages=tuple((_str(r), _str(t)) for r, t in zip(messages["role"], messages["text"])),
                           **common), image
    turns = example["turns"]
    return Conversation(
        question=_str(example["question"]), groundtruth=_str(example["groundtruth"]),
        turns=tuple(Turn(response=_str(r), feedback=_str(f), score=None if math.isnan(s) else
                         (int(s) if float(s).is_integer() else float(s)))
                    for r, f, s in zip(turns["response"], turns["feedback"], turns["score"])),
        **common), image


def build(json_files, image_root: str, split: str, out_dir: str, *, on_bad_record: str = "skip") -> Fire:
    """Build one split into ``out_dir``; returns the builder (source_counts, bad, info)."""
    config = split if split in SPLITS else tfds.core.BuilderConfig(name=split)
    builder = Fire(json_files=json_files, image_root=image_root, on_bad_record=on_bad_record, config=config,
                   data_dir=out_dir)
    builder.download_and_prepare()
    return builder


def dataset_dir(path: str, split: str | None = None) -> str:
    """The version directory of a built split: ``path`` itself, or ``path/fire/<split>/<latest version>``."""
    if os.path.exists(os.path.join(path, "dataset_info.json")):
        return path
    base = os.path.join(path, "fire", split or "")
    versions = sorted((d for d in os.listdir(base) if d[0].isdigit()),
                      key=lambda v: tuple(int(x) for x in v.split("."))) if os.path.isdir(base) else []
    if not versions:
        raise FileNotFoundError(f"no built FIRE split {split!r} under {path} (expected {base}/<version>/)")
    return os.path.join(base, versions[-1])


def data_source(path: str, split: str | None = None):
    """A random-access source (``len``, ``[i]``) of the examples of one built split."""
    directory = dataset_dir(path, split)
    builder = tfds.builder_from_directory(directory)
    return builder.as_data_source(split=split or builder.builder_config.name)


def metadata(path: str, split: str | None = None) -> dict:
    """Per-source counts and bad-record counts saved with a built split."""
    builder = tfds.builder_from_directory(dataset_dir(path, split))
    return dict(builder.info.metadata or {})
