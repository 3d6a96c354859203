"""Input pipeline: batch contract, exact resume, sharding, mixing, length policy, TFDS round trip."""

import json
import os
import tempfile

import numpy as np
import pytest

from fire_jax.core.config import ASSETS_DIR, DATA_DEFAULTS, load_config
from fire_jax.core.config import data_config as make_data_config
from fire_jax.data import tfds_fire
from fire_jax.data import pipeline as pipeline_lib
from fire_jax.data.records import Conversation, Instruction, load_records
from fire_jax.data.sources import open_source
from fire_jax.data.sources import geometry_from_model_config
from fire_jax.data.synthetic import synthesize
from fire_jax.core.geometry import ImageGeometry, unpadded_size

ROOT = os.path.dirname(os.path.dirname(__file__))
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "fire")
FIXTURE_FILES = [os.path.join(FIXTURES, f) for f in ("fire_100k_demo.json", "fire_1m_demo.json")]
TINY = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)))
SYNTHETIC = dict(json="assets:synthetic_fire/train.json", image_root="assets:synthetic_fire/images", weight=1.0)
KEYS = {"input_ids": np.int32, "attention_mask": np.int32, "loss_mask": np.float32, "turn_ids": np.int32,
        "pixel_values": np.float32, "image_index": np.int32, "image_sizes": np.int32}


def InputPipeline(config, geometry, **kwargs):
    """The pipeline with r_1 labelled unless a test says otherwise: the shipped set's one-round dialogues
    (first answer right) keep a label (loss.student_first_turn, passed by the trainer)."""
    return pipeline_lib.InputPipeline(config, geometry, **{"student_first_turn": True, **kwargs})


def data_config(**changes):
    config = dict(tokenizer="assets:tiny_tokenizer.json", image_token="<image>", pad_token="<pad>", role="student",
                  teacher_history="full", sources=dict(synthetic=SYNTHETIC),
                  on_bad_record="skip", max_len=768, buckets=(256, 384, 512, 640, 768), batch_size=8, shuffle=True,
                  seed=0, num_epochs=0, num_threads=0, num_workers=0)
    config.update(changes)
    return config


def take(pipeline, n):
    return [next(pipeline) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_batch_contract():
    pipeline = InputPipeline(data_config(role="teacher"), TINY, image_token_id=511)
    for batch in take(pipeline, 3):
        assert set(batch) == set(KEYS) | {"example_id"}
        for key, dtype in KEYS.items():
            assert batch[key].dtype == dtype, key
        b, s = batch["input_ids"].shape
        assert b == 8 and s in (256, 384, 512, 640, 768)
        assert batch["pixel_values"].shape == (8, 5, 3, 32, 32) and batch["image_sizes"].shape == (8, 2)
        assert batch["example_id"].shape == (8,) and batch["example_id"].dtype.kind == "U"
        mask = batch["attention_mask"].astype(bool)
        assert (batch["input_ids"][~mask] == pipeline.pad_id).all() and pipeline.pad_id == 5
        assert (batch["loss_mask"] == (batch["turn_ids"] > 0)).all() and (batch["loss_mask"][~mask] == 0).all()
        assert s - mask.sum(1).max() < 128  # the smallest bucket that fits
        for row in range(b):
            size = tuple(batch["image_sizes"][row])
            index = batch["image_index"][row]
            image_tokens = batch["input_ids"][row] == 511
            assert ((index >= 0) == image_tokens).all() and image_tokens.sum() == TINY.num_tokens(size)
            newline = 5 * 16  # the slot after max_tiles * tokens_per_tile features
            assert (index == newline).sum() == unpadded_size(size, *TINY.grid_shape(size), TINY.grid)[0]
            tiles = TINY.num_tiles(size)
            assert index[image_tokens & (index != newline)].max() < tiles * 16
            assert (batch["pixel_values"][row, tiles:] == 0).all() and (batch["pixel_values"][row, :tiles] != 0).any()
    assert pipeline.num_examples == 720


@pytest.mark.parametrize("threads", [0, 2])
def test_resume_gives_the_same_batches(threads):
    config = data_config(batch_size=4, num_threads=threads)
    first = InputPipeline(config, TINY)
    take(first, 2)
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    expected = take(first, 3)
    resumed = InputPipeline(config, TINY)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 3), expected)


def test_threads_give_the_same_batches():
    assert_batches_equal(take(InputPipeline(data_config(num_threads=2), TINY), 3),
                         take(InputPipeline(data_config(), TINY), 3))
    grouped = data_config(batch_size=4, group_by_length=4)  # read threads share the windows' cached orders
    assert_batches_equal(take(InputPipeline(dict(grouped, num_threads=2), TINY), 5),
                         take(InputPipeline(grouped, TINY), 5))


def test_worker_processes_give_the_same_batches():
    pipeline = InputPipeline(data_config(num_workers=2, batch_size=4), TINY)
    try:
        batches = take(pipeline, 3)
    finally:
        pipeline.close()
    assert_batches_equal(batches, take(InputPipeline(data_config(batch_size=4), TINY), 3))


def epoch_ids(config, **kwargs):
    pipeline = InputPipeline(config, TINY, **kwargs)
    return [i for batch in pipeline for i in batch["example_id"]]


def test_two_processes_cover_every_example_once():
    config = data_config(num_epochs=1, batch_size=14)
    ids = [epoch_ids(config, process_index=p, process_count=2) for p in range(2)]
    real = [[i for i in shard if i] for shard in ids]
    assert len(ids[0]) == len(ids[1])  # both processes see the same number of (padded) batches
    assert sorted(real[0] + real[1]) == [f"synthetic_train_{i:05d}" for i in range(720)]
    last = list(InputPipeline(config, TINY, process_index=1, process_count=2))[-1]
    padding = last["example_id"] == ""
    assert padding.sum() == 4  # 360 examples in batches of 7
    assert (last["attention_mask"][padding].sum(1) == 1).all() and (last["input_ids"][padding, 0] == 0).all()
    assert (last["loss_mask"][padding] == 0).all()


def test_shuffle_is_deterministic_by_seed_and_differs_per_epoch():
    one = epoch_ids(data_config(num_epochs=2, batch_size=40))
    assert one == epoch_ids(data_config(num_epochs=2, batch_size=40))
    assert one[:720] != epoch_ids(data_config(num_epochs=1, batch_size=40, seed=1))
    assert sorted(one[:720]) == sorted(one[720:]) and one[:720] != one[720:]


def test_length_grouped_windows_hand_checked():
    """Windows of 3 batches of 2 over 14 records of known lengths: each window keeps its records, its batches are
    pairs of neighbours in length order, their order is the seed's, the last window's partial batch stays last."""
    lengths = [9, 1, 7, 3, 12, 5, 2, 8, 4, 11, 6, 10, 13, 0]
    records = [(Conversation(f"r{i}", None, "q" * n, "", (), "s", "train"), None) for i, n in enumerate(lengths)]
    grouped = pipeline_lib.LengthGrouped(records, batch_size=2, window=3, seed=0)
    order = [grouped[i][0].id for i in range(len(records))]
    by_length = lambda ids: sorted(ids, key=lambda i: lengths[int(i[1:])])
    windows = [order[0:6], order[6:12], order[12:14]]
    assert [sorted(w) for w in windows] == [sorted(f"r{i}" for i in range(a, b))
                                            for a, b in ((0, 6), (6, 12), (12, 14))]
    # window 0 by length: r1 (1), r3 (3), r5 (5), r2 (7), r0 (9), r4 (12) -> batches [r1 r3] [r5 r2] [r0 r4]
    assert {tuple(windows[0][j:j + 2]) for j in (0, 2, 4)} == {("r1", "r3"), ("r5", "r2"), ("r0", "r4")}
    assert {tuple(windows[1][j:j + 2]) for j in (0, 2, 4)} == {("r6", "r8"), ("r10", "r7"), ("r11", "r9")}
    assert windows[2] == ["r13", "r12"]  # the end of a finite run: one batch, sorted
    for w in windows[:2]:
        assert [by_length(w[j:j + 2]) for j in (0, 2, 4)] == [w[j:j + 2] for j in (0, 2, 4)]
    again = pipeline_lib.LengthGrouped(records, batch_size=2, window=3, seed=0)
    assert [again[i][0].id for i in reversed(range(14))] == order[::-1]  # a pure function of the position
    seeds = {tuple(pipeline_lib.LengthGrouped(records, 2, 3, seed)[i][0].id for i in range(12)) for seed in range(8)}
    assert len(seeds) > 1  # the batch order within a window is drawn
    assert pipeline_lib.text_length(records[4]) == 12
    instruction = Instruction("i", None, (("user", "What is it?"), ("assistant", "A cat.")), "s", "train")
    assert pipeline_lib.text_length((instruction, None)) == 17
    # The same 14 positions as two epochs of 7 (one process): windows start again at position 7.
    epochs = pipeline_lib.LengthGrouped(records, batch_size=2, window=3, seed=0, epoch=(7, 0, 1))
    assert [epochs.window(i) for i in (0, 5, 6, 7, 12, 13)] == [(0, 6), (0, 6), (6, 7), (7, 13), (7, 13), (13, 14)]
    assert sorted(epochs[i][0].id for i in range(7)) == [f"r{i}" for i in range(7)]
    # Process 1 of 2 over epochs of 7: its positions 0-2 are items 1, 3, 5 (epoch 0), 3-6 are 7, 9, 11, 13.
    shard = pipeline_lib.LengthGrouped(records, batch_size=2, window=3, seed=0, epoch=(7, 1, 2))
    assert [shard.window(i) for i in (0, 2, 3, 6)] == [(0, 3), (0, 3), (3, 7), (3, 7)]


def test_group_by_length_pads_less_and_reads_every_record_once():
    """The shipped training dialogues (one to five turns) as the student reads them: windows of 8 batches keep
    one epoch's records, resume exactly, and fill 0.71 of the padded columns where the shuffled order fills 0.55."""
    def epoch(**changes):
        config = data_config(num_epochs=1, batch_size=8, buckets=(128, 192, 256, 384, 512, 640, 768), **changes)
        batches = list(InputPipeline(config, TINY))
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        padded = sum(b["attention_mask"].size for b in batches)
        return [i for b in batches for i in b["example_id"] if i], real / padded

    plain_ids, plain_fill = epoch()
    grouped_ids, grouped_fill = epoch(group_by_length=8)
    assert sorted(grouped_ids) == sorted(plain_ids) == [f"synthetic_train_{i:05d}" for i in range(720)]
    assert grouped_ids != plain_ids
    assert 0.5 < plain_fill < 0.6 and grouped_fill > 0.68, (plain_fill, grouped_fill)
    # Two epochs of 720 in windows of 64: the windows start again at each epoch, so neither epoch reads a record
    # twice and no batch holds one twice (one window across the boundary put 3-4 batches of an epoch so).
    for process in range(2):
        config = data_config(num_epochs=2, batch_size=8, group_by_length=8, buckets=(768,))
        batches = list(InputPipeline(config, TINY, process_index=process, process_count=2))
        ids = [i for b in batches for i in b["example_id"] if i]
        assert len(ids) == 720 and len(set(ids[:360])) == len(set(ids[360:])) == 360
        assert all(len(set(b["example_id"])) == len(b["example_id"]) for b in batches)
    config = data_config(batch_size=4, group_by_length=4)
    first = InputPipeline(config, TINY)
    take(first, 3)
    state = json.loads(json.dumps(first.get_state()))
    expected = take(first, 5)  # across a window's end
    resumed = InputPipeline(config, TINY)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 5), expected)


def test_mixing_ratio():
    test_source = dict(SYNTHETIC, json="assets:synthetic_fire/test.json", weight=1.0)
    config = data_config(sources=dict(train=dict(SYNTHETIC, weight=3.0), test=test_source), batch_size=40)
    ids = [i for batch in take(InputPipeline(config, TINY), 4) for i in batch["example_id"]]
    assert sum(i.startswith("synthetic_test") for i in ids) == 40


def test_length_policy(tmp_path):
    one_turn, images, _ = synthesize(3, seed=1, split="x")
    for record in one_turn:
        record["conversations"] = record["conversations"][:2]
    for name, image in images.items():
        image.save(tmp_path / name)
    path = tmp_path / "one_turn.json"
    path.write_text(json.dumps(one_turn))
    sources = dict(synthetic=SYNTHETIC, one_turn=dict(json=str(path), image_root=str(tmp_path)))
    # Student examples with one turn have no label (r_1 is not a target) and are dropped: the 3 cut here and
    # the shipped dialogues whose first answer is already right.
    shipped, _ = load_records(os.path.join(ASSETS_DIR, "synthetic_fire", "train.json"),
                              os.path.join(ASSETS_DIR, "synthetic_fire", "images"))
    one_round = 3 + sum(len(r.turns) == 1 for r in shipped)
    assert 3 < one_round < 723
    pipeline = InputPipeline(data_config(sources=sources, num_epochs=1, shuffle=False, batch_size=723), TINY,
                             student_first_turn=False)
    batch = next(pipeline)
    assert dict(pipeline.dropped) == {"no_labelled_token": one_round}
    assert (batch["example_id"] != "").sum() == 723 - one_round
    # Labelling r_1 keeps them.
    pipeline = InputPipeline(data_config(sources=sources, num_epochs=1, shuffle=False, batch_size=723), TINY)
    kept = (next(pipeline)["example_id"] != "").sum()
    assert kept == 723 and not pipeline.dropped, (kept, pipeline.dropped)
    # Teacher sequences (520-640 tokens) cut to 560: kept while a label is left, the image block is never cut.
    pipeline = InputPipeline(data_config(role="teacher", max_len=560, buckets=(), num_epochs=1, batch_size=720), TINY)
    batch = next(pipeline)
    assert batch["input_ids"].shape == (720, 560) and not pipeline.dropped
    assert (batch["attention_mask"].sum(1) == 560).any() and (batch["loss_mask"].sum(1) > 0).all()
    pipeline = InputPipeline(data_config(max_len=40, buckets=(), num_epochs=1, batch_size=8), TINY)
    with pytest.raises(StopIteration):
        next(pipeline)
    assert dict(pipeline.dropped) == {"image_cut": 720}
    assert "image_cut" in pipeline.report()


def test_instruction_source_with_text_only_records(tmp_path):
    synthesize(1, seed=0, split="i")[1]["i_00000.png"].save(tmp_path / "a.png")
    (tmp_path / "llava.json").write_text(json.dumps([
        {"id": "img", "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                          {"from": "gpt", "value": "Shapes."}]},
        {"id": "txt", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]))
    config = data_config(sources=dict(llava=dict(json=str(tmp_path / "llava.json"), image_root=str(tmp_path))),
                         num_epochs=1, shuffle=False, batch_size=2)
    batch = next(InputPipeline(config, TINY))
    assert batch["example_id"].tolist() == ["img", "txt"]
    assert (batch["image_index"][1] == -1).all() and (batch["pixel_values"][1] == 0).all()
    assert batch["image_sizes"][1].tolist() == [0, 0] and batch["image_sizes"][0].tolist() != [0, 0]
    assert (batch["turn_ids"] == 1).sum(1).min() > 0 and (batch["turn_ids"] > 1).sum() == 0


def test_a_generated_source_draws_fresh_images_with_their_right_answers():
    """``generate``: fresh drawings (never a shipped image) as single-turn records whose answer is the groundtruth
    in the first turn's words; the same (seed, split) draws the same images."""
    from fire_jax.data.images import load_image
    from fire_jax.data.sources import generated_instructions
    from fire_jax.data.synthetic import parse_answer

    source = dict(generate=6, seed=1, split="align_generated")
    records = open_source(source)
    raws, images, _ = synthesize(6, 1, "align_generated")
    assert len(records) == 6 and [r.id for r, _ in records] == [f"{r['id']}_instruct" for r in raws]
    for (record, png), raw in zip(records, raws):
        question, answer = record.messages[0][1], record.messages[1][1]
        assert question == raw["question"]["value"] and answer.startswith("Thought: ")
        assert parse_answer(answer.split("Answer: ")[1]) == parse_answer(raw["groundtruth"]["value"])
        assert (np.asarray(load_image(png)) == np.asarray(images[record.image].convert("RGB"))).all()
    root = os.path.join(ASSETS_DIR, "synthetic_fire")
    shipped = [np.asarray(load_image(os.path.join(root, "images", r["image"])))
               for r in json.load(open(os.path.join(root, "test.json")))]
    drawn = [np.asarray(load_image(png)) for _, png in records]
    assert not any(a.shape == b.shape and (a == b).all() for a in drawn for b in shipped)
    assert [r.id for r, _ in generated_instructions(6, 1, "align_generated")] == [r.id for r, _ in records]
    with pytest.raises(ValueError, match="must not be the shipped set's 'test'"):
        open_source(dict(generate=2, seed=0, split="test"))
    batch = next(InputPipeline(data_config(sources=dict(generated=source), num_epochs=1, shuffle=False,
                                           batch_size=2), TINY))
    assert batch["example_id"].tolist() == [r.id for r, _ in records[:2]] and (batch["image_sizes"] > 0).all()


def test_max_examples_takes_nested_subsets():
    def ids(n):
        config = data_config(sources=dict(synthetic=dict(SYNTHETIC, max_examples=n)), num_epochs=1, batch_size=8)
        pipeline = InputPipeline(config, TINY)
        assert pipeline.num_examples == n
        return {i for batch in pipeline for i in batch["example_id"] if i}

    small, large = ids(40), ids(120)
    assert len(small) == 40 and len(large) == 120 and small < large
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_example'\]"):
        InputPipeline(data_config(sources=dict(synthetic=dict(SYNTHETIC, max_example=3))), TINY)


def test_tiny_config_builds():
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    geometry = geometry_from_model_config(config.model)
    pipeline = InputPipeline(config.data, geometry, image_token_id=config.model.image_token_id)
    batch = next(pipeline)
    assert batch["input_ids"].shape[0] == config.data.batch_size and batch["input_ids"].max() < 512
    with pytest.raises(ValueError, match="image_token_id"):
        InputPipeline(config.data, geometry, image_token_id=128256)


def test_data_config_defaults_and_unknown_fields():
    config = make_data_config("assets:tiny_tokenizer.json", dict(synthetic=SYNTHETIC), max_len=768, batch_size=4)
    assert set(config) == set(DATA_DEFAULTS) | {"tokenizer", "sources"}
    assert next(InputPipeline(config, TINY))["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_length'\]"):
        InputPipeline(dict(config.to_dict(), max_length=10), TINY)
    with pytest.raises(ValueError, match="unknown data config field"):
        make_data_config("x", {}, batchsize=3)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    out, scratch = str(tmp_path_factory.mktemp("tfds")), str(tmp_path_factory.mktemp("scratch"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", scratch)
        builder = tfds_fire.build(FIXTURE_FILES, os.path.join(FIXTURES, "images"), "fire_bench", out)
    assert dict(builder.bad) == {"missing_image": 1}
    # nothing left in the temporary directory (tensorflow-datasets' bucket lookup, skipped, left a folder a build)
    assert os.listdir(scratch) == []
    return out


def test_tfds_round_trip(tfds_dir):
    records, _ = load_records(FIXTURE_FILES, os.path.join(FIXTURES, "images"))
    by_id = {r.id: r for r in records}
    source = tfds_fire.data_source(tfds_dir, "fire_bench")
    assert len(source) == 188
    for i in range(len(source)):
        record, image = tfds_fire.to_record(source[i])
        assert isinstance(record, Conversation) and record == by_id[record.id]
        with open(os.path.join(FIXTURES, "images", record.image), "rb") as f:
            assert image == f.read()
    saved = tfds_fire.metadata(tfds_dir, "fire_bench")
    assert saved["bad_records"] == {"missing_image": 1} and sum(saved["source_counts"].values()) == 188
    assert saved["source_counts"]["gqa"] == sum(r.source == "gqa" for r in records)


def test_pipeline_reads_tfds_like_json(tfds_dir):
    def examples(source):
        config = data_config(sources=dict(fire=source), num_epochs=1, shuffle=False, batch_size=188, role="teacher",
                             max_len=2048, buckets=())
        batch = next(InputPipeline(config, TINY))
        return {i: (batch["input_ids"][r], batch["pixel_values"][r]) for r, i in enumerate(batch["example_id"])}

    from_json = examples(dict(json=FIXTURE_FILES, image_root=os.path.join(FIXTURES, "images")))
    from_tfds = examples(dict(tfds=tfds_dir, split="fire_bench"))
    assert from_json.keys() == from_tfds.keys() and len(from_json) == 188
    for key in from_json:
        np.testing.assert_array_equal(from_json[key][0], from_tfds[key][0])
        np.testing.assert_array_equal(from_json[key][1], from_tfds[key][1])


def test_build_tool(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "build_dataset.py"), "--json", FIXTURE_FILES[1],
         "--image_root", os.path.join(FIXTURES, "images"), "--split", "fire_1m", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "split fire_1m: 94 examples" in out and "missing_image             1" in out
    assert "gqa                      19" in out


def test_synthetic_data():
    records, images, _ = synthesize(12, seed=3, split="train")
    again, images_again, _ = synthesize(12, seed=3, split="train")
    assert records == again and all(images[k].tobytes() == images_again[k].tobytes() for k in images)
    assert records != synthesize(12, seed=4, split="train")[0]
    shipped, bad = load_records(os.path.join(ASSETS_DIR, "synthetic_fire", "train.json"),
                                os.path.join(ASSETS_DIR, "synthetic_fire", "images"), on_bad_record="error")
    assert len(shipped) == 720 and not bad
    for record in shipped:
        answer = record.groundtruth
        assert [t.response.split("Answer: ")[1] == answer for t in record.turns] == \
            [False] * (len(record.turns) - 1) + [True]
        assert [t.score for t in record.turns][-1] == 10 and all(t.score < 10 for t in record.turns[:-1])


def test_teacher_stage_mixes_comparisons_as_instructions():
    """Text-only comparisons ("Groundtruth: ...\\nAnswer: ..." -> the rule's feedback) are instruction records: a
    teacher's pipeline reads them as a second source beside the teacher turns, the same tokens under either
    role, the reply alone labelled."""
    comparisons = dict(json="assets:synthetic_fire/comparisons.json", weight=1.0)
    turns = dict(json="assets:synthetic_fire/teacher_turns.json", image_root="assets:synthetic_fire/images")
    pipeline = InputPipeline(data_config(role="teacher", teacher_history="latest", max_len=3072, buckets=(),
                                         sources=dict(comparisons=comparisons, synthetic=turns)), TINY)
    assert pipeline.source_sizes == {"comparisons": 1440, "synthetic": 1307}
    ids = [i for batch in take(pipeline, 4) for i in batch["example_id"]]
    assert {i.rsplit("_", 1)[1].rstrip("0123456789") for i in ids} == {"compare", "t"} and not pipeline.dropped
    record, image = open_source(comparisons, on_bad_record="error")[0]
    teacher, student = (pipeline_lib.Preprocessor("assets:tiny_tokenizer.json", TINY, role=role)
                        for role in ("teacher", "student"))
    a, b = teacher((record, image)), student((record, image))
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    assert image is None and teacher.chat.decode(a["input_ids"][a["loss_mask"] > 0]).startswith(
        "Score: 2.\nFeedback: Your count is too high. Count them again.")
