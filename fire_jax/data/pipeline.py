"""The host input pipeline: records -> fixed-shape numpy batches for the trainer.

Per example (:class:`Preprocessor`): decode the image, any-resolution tiles,
chat rendering for the model's role, tokenisation with the image placeholder
expanded, loss mask and turn ids, cut to ``max_len``. Per batch
(:func:`collate`): pad sequences to the smallest length bucket that fits,
tiles to ``geometry.max_tiles``, and lay out the image features with
:func:`fire_jax.core.geometry.place_images`.

:class:`InputPipeline` runs this with grain over the configured sources:
shuffled by seed (differently each epoch), sharded by process, mixed by
weight, optionally in worker threads / processes, with a checkpointable
position (:meth:`InputPipeline.get_state` / :meth:`InputPipeline.set_state`).

Batch (per process, ``B = batch_size // process_count``, ``S`` a bucket length)::

    input_ids       int32   [B, S]   pad_id after the sequence
    attention_mask  int32   [B, S]   1 on real tokens
    loss_mask       float32 [B, S]   1 on labelled tokens (token t is predicted from position t-1)
    turn_ids        int32   [B, S]   i on tokens of r_i / f_i, -1 elsewhere
    pixel_values    float32 [B, max_tiles, 3, tile, tile]   zeros for padding tiles / no image
    image_index     int32   [B, S]   place_images(...): feature-bank index per image token, -1 for text
    image_sizes     int32   [B, 2]   (height, width), (0, 0) without image
    example_id      str     [B]      "" for rows that pad the last batch of a finite run
                                     (such a row: one attended BOS, no label)
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import zlib
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from PIL import Image

from fire_jax.core.config import DATA_DEFAULTS, resolve_path
from fire_jax.data import chat as chat_lib
from fire_jax.data.images import load_image, normalise, pad_tiles, tiles
from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.data.records import Conversation, Record, field_caps
from fire_jax.data.sources import open_source
from fire_jax.core.geometry import ImageGeometry, place_images

# Reasons the pipeline drops an example that parsed fine: image_cut, no_labelled_token, unreadable_image, and
# no_score (a teacher reading a built split, which keeps unscoreable conversations for the student).


@dataclasses.dataclass
class Preprocessor:
    """One record -> one example (dict of per-example arrays), or a ``{"dropped": reason}`` marker.

    The example holds input_ids, loss_mask, turn_ids, uint8 ``tiles`` [n, tile, tile, 3],
    image_size and example_id; :func:`collate` turns tiles into normalised pixel_values.
    """

    tokenizer_path: str
    geometry: ImageGeometry
    role: str = "student"
    first_turn_labelled: bool = False
    teacher_history: str = "full"
    short_teacher_share: float = 0.0  # data.short_teacher_share (fire_jax.data.chat.training_messages)
    max_len: int = 3072
    image_token: str = "<image>"
    pad_token: str = "<pad>"
    on_bad_record: str = "skip"
    template: str = ""  # a shipped template name or .jinja file; "": the tokenizer_config.json's

    def __post_init__(self):
        if self.role not in chat_lib.ROLES:
            raise ValueError(f"data.role must be one of {chat_lib.ROLES}, got {self.role!r}")
        self.chat = chat_lib.ChatTokenizer.from_file(resolve_path(self.tokenizer_path), self.geometry,
                                                     template=self.template or None,
                                                     image_token=self.image_token, pad_token=self.pad_token)

    def __getstate__(self):  # worker processes rebuild the tokenizer from its file
        return {k: v for k, v in self.__dict__.items() if k != "chat"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__post_init__()

    def messages(self, record: Record) -> list[chat_lib.Message]:
        return chat_lib.training_messages(record, self.role, first_turn_labelled=self.first_turn_labelled,
                                          teacher_history=self.teacher_history,
                                          short_teacher_share=self.short_teacher_share)

    def __call__(self, item: tuple[Record, str | bytes | None]) -> dict[str, Any]:
        record, image_source = item
        if image_source is None:
            return self._example(record, None)
        try:
            image = Image.open(image_source if isinstance(image_source, str) else io.BytesIO(image_source))
        except Exception as e:  # PIL raises many types for broken files
            return self._drop(BadRecordError("unreadable_image", record.id, "image", str(e)))
        with image:
            return self._example(record, image)

    def _example(self, record: Record, image: Image.Image | None) -> dict[str, Any]:
        if self.role == "teacher" and isinstance(record, Conversation) and any(t.score is None for t in record.turns):
            return {"dropped": "no_score", "example_id": record.id}  # the teacher learns every f_i's score
        # Token counts need only the image size (header), so length checks come before decoding.
        size = None if image is None else (image.height, image.width)
        encoded = self.chat.encode(self.messages(record), size)
        if len(encoded) > self.max_len:
            if encoded.image_start >= 0 and encoded.image_start + encoded.image_tokens > self.max_len:
                return {"dropped": "image_cut", "example_id": record.id}
            encoded = dataclasses.replace(encoded, **{k: getattr(encoded, k)[:self.max_len]
                                                      for k in ("input_ids", "loss_mask", "turn_ids")})
        if not encoded.loss_mask.any():
            return {"dropped": "no_labelled_token", "example_id": record.id}
        t = self.geometry.tile_size
        image_tiles, image_size = np.zeros((0, t, t, 3), np.uint8), (0, 0)
        if image is not None:
            try:
                image_tiles, image_size = tiles(load_image(image, alpha="keep"), self.geometry)
            except Exception as e:  # truncated or corrupt image data
                return self._drop(BadRecordError("unreadable_image", record.id, "image", str(e)))
        # Tiles travel as uint8 (4x less to copy between processes); collate normalises them.
        return {"input_ids": encoded.input_ids, "loss_mask": encoded.loss_mask, "turn_ids": encoded.turn_ids,
                "tiles": image_tiles, "image_size": np.asarray(image_size, np.int32), "example_id": record.id}

    def _drop(self, error: BadRecordError) -> dict[str, Any]:
        """A record dropped while training: raised under on_bad_record="error", else counted downstream
        (the worker processes cannot share a :class:`BadRecords`; the pipeline counts the "dropped" reasons)."""
        if self.on_bad_record == "error":
            raise error
        return {"dropped": error.reason, "example_id": error.where}


def text_length(item: tuple[Record, Any]) -> int:
    """Characters of a record's text: the cheap length estimate :class:`LengthGrouped` sorts by, read before
    tokenising (LLaVA's ``modality_lengths`` count the words of a record's turns for the same purpose)."""
    record = item[0]
    if isinstance(record, Conversation):
        return len(record.question) + len(record.groundtruth) + sum(len(t.response) + len(t.feedback)
                                                                     for t in record.turns)
    return sum(len(text) for _, text in record.messages)


class LengthGrouped:
    """Batches of similar length from a shuffled order: each window of ``n`` batches of ``B`` consecutive positions
    is sorted by :func:`text_length`, cut into batches of ``B``, and its full batches are taken in an order drawn
    from the seed and the window; a window's partial batch stays last.

    ``epoch=(records, offset, stride)`` says that position ``j`` of this stream is item ``offset + j * stride`` of
    a repeated order whose epochs hold ``records`` items each (a process's share of ``ds.repeat()[p::count]``):
    windows then start again at each epoch's first position, so no window holds the end of one epoch and the start
    of the next (which would put one record twice in a window, and, sorted, side by side), and every epoch reads
    each record once. Without it (sources mixed by weight) windows are cut every ``n * B`` positions.

    As transformers' ``group_by_length`` (``LengthGroupedSampler``: megabatches of 50 batches, sorted) and LLaVA's
    ``--group_by_modality_length``, it cuts padding when sequence lengths vary: the main job's student batches
    (dialogues of one to five turns, 110-368 tokens) fill 80% of their padded columns with windows of 8 batches,
    56% without. A pure function of the position, so a restored iterator continues the same order.

    Limits: examples the pipeline drops after this (``image_cut``, ``no_labelled_token``) shift every later batch
    boundary off the windows' (each batch then joins two runs); and a window's lengths are read from its records,
    each read once more (per worker process) than without grouping.
    """

    def __init__(self, parent, batch_size: int, window: int, seed: int,
                 epoch: tuple[int, int, int] | None = None):
        import grain

        if batch_size < 1 or window < 1:
            raise ValueError(f"LengthGrouped: batch_size and window must be >= 1, got {batch_size}, {window}")
        if epoch is not None and (epoch[0] < 1 or epoch[2] < 1):
            raise ValueError(f"LengthGrouped: epoch=(records, offset, stride) needs records, stride >= 1, got {epoch}")
        self.parent, self.batch_size, self.size, self.seed = parent, batch_size, batch_size * window, seed
        self.epoch = epoch
        self._orders: dict[int, list[int]] = {}  # a few windows' orders (a pure function: races only recompute)
        self.dataset = grain.MapDataset.source(self)

    def __len__(self) -> int:
        return len(self.parent)

    def _epoch_start(self, e: int) -> int:
        """The first position of this stream in epoch ``e``."""
        records, offset, stride = self.epoch
        return max(0, -(-(e * records - offset) // stride))

    def window(self, index: int) -> tuple[int, int]:
        """The ``[start, end)`` positions of the window holding position ``index``."""
        if self.epoch is None:
            start = index // self.size * self.size
            end = start + self.size
        else:
            records, offset, stride = self.epoch
            e = (offset + index * stride) // records
            first = self._epoch_start(e)
            start = first + (index - first) // self.size * self.size
            end = min(start + self.size, self._epoch_start(e + 1))
        return start, min(end, len(self.parent))

    def order(self, start: int, end: int) -> list[int]:
        """The window ``[start, end)``'s positions, relative to its start, in the order they are read."""
        order = self._orders.get(start)
        if order is None:
            n = end - start
            lengths = [text_length(self.parent[start + i]) for i in range(n)]
            ranked = sorted(range(n), key=lambda i: (lengths[i], i))
            batches = [ranked[j:j + self.batch_size] for j in range(0, n, self.batch_size)]
            full = [b for b in batches if len(b) == self.batch_size]
            # the batch order's key: (seed, w) for the w-th window of n * B, the start's remainder after an epoch's
            key = [self.seed, start // self.size] + ([start % self.size] if start % self.size else [])
            rng = np.random.default_rng(key)
            order = [i for k in rng.permutation(len(full)) for i in full[k]] + [i for b in batches[len(full):]
                                                                                for i in b]
            if len(self._orders) >= 8:
                self._orders.clear()
            self._orders[start] = order
        return order

    def __getitem__(self, index: int):
        start, end = self.window(index)
        return self.parent[start + self.order(start, end)[index - start]]


def batch_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"sequence of {length} tokens is longer than the largest bucket {max(buckets)}")


def collate(examples: Sequence[Mapping[str, Any]], *, batch_size: int, buckets: Sequence[int], pad_id: int,
            image_token_id: int, geometry: ImageGeometry) -> dict[str, np.ndarray]:
    """Fixed-shape batch of ``batch_size`` rows (missing rows are padding) from per-example dicts."""
    length = batch_length(max(len(e["input_ids"]) for e in examples), buckets)
    max_tiles, t = geometry.max_tiles, geometry.tile_size
    batch = {
        "input_ids": np.full((batch_size, length), pad_id, np.int32),
        "attention_mask": np.zeros((batch_size, length), np.int32),
        "loss_mask": np.zeros((batch_size, length), np.float32),
        "turn_ids": np.full((batch_size, length), -1, np.int32),
        "pixel_values": pad_tiles([e["tiles"] for e in examples], tiles=max_tiles, batch=batch_size, tile_size=t,
                                  fill=normalise),
        "image_sizes": np.zeros((batch_size, 2), np.int32),
    }
    ids = np.full(batch_size, "", dtype=object)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        batch["input_ids"][row, :n] = example["input_ids"]
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, :n] = example["loss_mask"]
        batch["turn_ids"][row, :n] = example["turn_ids"]
        batch["image_sizes"][row] = example["image_size"]
        ids[row] = example["example_id"]
    # Rows padding a short last batch hold one attended BOS (and no label), so no attention row is empty.
    bos = examples[0]["input_ids"][0]
    batch["input_ids"][len(examples):, 0] = bos
    batch["attention_mask"][len(examples):, 0] = 1
    sizes = [[tuple(s)] if s[0] > 0 else [] for s in batch["image_sizes"]]
    batch["image_index"] = place_images(batch["input_ids"], image_token_id, sizes, geometry, max_tiles)
    batch["example_id"] = ids.astype(str)
    return batch


def _absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; outside an absl app nothing has parsed them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class InputPipeline:
    """Training batches from ``config.data`` (see ``configs/tiny.py``).

    Args:
      config: the ``config.data`` ConfigDict (or a dict).
      geometry: the model's :class:`ImageGeometry` (``LlavaNextConfig.geometry``).
      image_token_id: the model's image token id; checked against the tokenizer's.
      process_index, process_count: this host's shard (``jax.process_index()``, ``jax.process_count()``).
      sources: key of ``config`` holding the sources ("sources"; e.g. "eval_sources").
      student_first_turn: also label the student's r_1 (the trainer passes ``loss.student_first_turn``).
      overrides: values replacing fields of ``config`` (batch_size, seed, num_epochs, role, ...).
    """

    def __init__(self, config: Mapping[str, Any], geometry: ImageGeometry, *, image_token_id: int | None = None,
                 process_index: int = 0, process_count: int = 1, sources: str = "sources",
                 student_first_turn: bool = False, **overrides):
        import grain

        given = dict(config.to_dict() if hasattr(config, "to_dict") else config)
        if "student_first_turn" in given or "student_first_turn" in overrides:
            raise ValueError("data.student_first_turn is now loss.student_first_turn (FIRE Eq. 5); the trainer passes "
                             "it to InputPipeline(student_first_turn=...)")
        unknown = (set(given) | set(overrides)) - set(DATA_DEFAULTS) - {"tokenizer", "sources", "field_caps"}
        missing = {"tokenizer", "sources"} - set(given) - set(overrides)
        if unknown or missing:
            raise ValueError(f"data config: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}; "
                             f"see fire_jax.core.config.DATA_DEFAULTS")
        cfg = {**DATA_DEFAULTS, **given, **overrides}
        self.config, self.geometry = cfg, geometry
        if cfg["batch_size"] % process_count:
            raise ValueError(f"data.batch_size={cfg['batch_size']} is not divisible by process_count={process_count}")
        self.batch_size = cfg["batch_size"] // process_count
        self.buckets = tuple(sorted(set(cfg.get("buckets") or ()) | {cfg["max_len"]}))
        self.buckets = tuple(b for b in self.buckets if b <= cfg["max_len"])
        self.preprocessor = Preprocessor(
            tokenizer_path=cfg["tokenizer"], geometry=geometry, role=cfg["role"],
            first_turn_labelled=student_first_turn, teacher_history=cfg["teacher_history"],
            short_teacher_share=float(cfg.get("short_teacher_share") or 0.0), max_len=cfg["max_len"], image_token=cfg["image_token"], pad_token=cfg["pad_token"],
            on_bad_record=cfg["on_bad_record"], template=cfg["template"])
        chat = self.preprocessor.chat
        if image_token_id is not None and image_token_id != chat.image_token_id:
            raise ValueError(f"tokenizer {cfg['tokenizer']} gives {cfg['image_token']!r} id {chat.image_token_id}, "
                             f"the model's image_token_id is {image_token_id}")
        self.pad_id, self.image_token_id = chat.pad_id, chat.image_token_id
        self.bad_records = BadRecords()  # skipped while parsing JSON sources
        self.dropped: collections.Counter = collections.Counter()  # dropped by the pipeline

        require_scores = cfg["role"] == "teacher"  # the student needs no scores: keep unscoreable feedback
        caps = field_caps(cfg.get("field_caps"))  # the most characters per field of a record
        opened = {name: (open_source(source, on_bad_record=cfg["on_bad_record"], bad=self.bad_records,
                                     require_scores=require_scores, caps=caps),
                         float(source.get("weight", 1.0))) for name, source in sorted(cfg[sources].items())}
        self.source_sizes = {name: len(records) for name, (records, _) in opened.items()}  # after bad records
        self.stated_sizes = {name: source.get("num_examples") for name, source in cfg[sources].items()}
        self.num_examples = sum(self.source_sizes.values())  # one epoch, all processes
        self.process_count = process_count
        ds = self._order(opened, cfg, process_index, process_count)
        if cfg["group_by_length"]:
            # Epoch boundaries are known where one stream repeats: a finite run (sources concatenated) or one source.
            epoch = ((self.num_examples, process_index, process_count)
                     if cfg["num_epochs"] or len(opened) == 1 else None)
            ds = LengthGrouped(ds, self.batch_size, int(cfg["group_by_length"]), cfg["seed"], epoch).dataset
        ds = ds.map(self.preprocessor).to_iter_dataset(grain.ReadOptions(
            num_threads=cfg["num_threads"], prefetch_buffer_size=2 * self.batch_size if cfg["num_threads"] else 0))
        if cfg["num_workers"]:
            _absl_flags_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg["num_workers"],
                                                             per_worker_buffer_size=2))
        ds = ds.filter(self._keep).batch(self.batch_size, drop_remainder=False, batch_fn=self._collate)
        self._dataset = ds
        self._iterator = iter(ds)

    @staticmethod
    def _order(opened, cfg, process_index, process_count):
        """Which record comes next on this process: shuffled, repeated, sharded, mixed.

        Forever (``num_epochs=0``): every source shuffled (differently each
        epoch) and repeated on its own, then mixed by ``weight``. A finite
        number of epochs: the sources concatenated, so each epoch sees every
        record of every source exactly once (weights are not used).
        """
        import grain

        def order(ds, name, epochs):
            if cfg["shuffle"]:
                ds = ds.shuffle(seed=(cfg["seed"] + zlib.crc32(name.encode())) % 2**32)
            return ds.repeat(epochs)[process_index::process_count]

        datasets = {name: grain.MapDataset.source(records) for name, (records, _) in opened.items()}
        if cfg["num_epochs"]:
            return order(grain.MapDataset.concatenate(list(datasets.values())), "+".join(datasets), cfg["num_epochs"])
        parts = [order(ds, name, None) for name, ds in datasets.items()]
        weights = [weight for _, weight in opened.values()]
        return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)

    def examples_per_process(self, epochs: float) -> int:
        """Usable examples each process reads in ``epochs`` passes (the smallest share, so every process
        plans the same number of steps; the others leave at most one example unread)."""
        return int(self.num_examples * epochs) // self.process_count

    def steps(self, epochs: float) -> int:
        """Steps that read ``epochs`` passes over the usable examples: the last batch may be partial
        (its missing rows are label-free padding), so the end of the data is trained on."""
        return max(1, math.ceil(self.examples_per_process(epochs) / self.batch_size))

    def _keep(self, example: Mapping[str, Any]) -> bool:
        if "dropped" in example:
            self.dropped[example["dropped"]] += 1
            return False
        return True

    def _collate(self, examples):
        return collate(examples, batch_size=self.batch_size, buckets=self.buckets, pad_id=self.pad_id,
                       image_token_id=self.image_token_id, geometry=self.geometry)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch returned (JSON-serialisable)."""
        return {"iterator": self._iterator.get_state(), "dropped": dict(self.dropped)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a position saved by :meth:`get_state`."""
        self._iterator.set_state(state["iterator"])
        self.dropped = collections.Counter(state.get("dropped", {}))

    def close(self) -> None:
        """Stop worker processes, if any."""
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def report(self) -> str:
        """Bad records skipped while parsing and examples dropped so far, by reason."""
        dropped = BadRecords(self.dropped)
        return "\n".join([self.bad_records.report("bad records skipped"), dropped.report("examples dropped")])
