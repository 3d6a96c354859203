"""The paper's recipes as configs (LLaVA-665K mixed in, released=True), steps from the usable data, the end of
the data, and turn normalisation for turn ids above loss.max_turns."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fire_jax.core.config import load_config
from fire_jax.data.pipeline import InputPipeline
from fire_jax.data.synthetic import synthesize
from fire_jax.models import LlavaNext, LlavaNextConfig
from fire_jax.weights.sharding import make_mesh
from fire_jax.train import loop
from fire_jax.train.loss import token_weights
from fire_jax.train.step import Trainer

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = os.path.join(ROOT, "configs")


def _recipe(name, arg=""):
    return load_config(os.path.join(CONFIGS, name) + (f":{arg}" if arg else ""))


# ---------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("name, role, fire", [("fire100k_student.py", "student", {"fire_100k": 100_000}),
                                              ("fire_student.py", "student", {"fire_100k": 100_000,
                                                                              "fire_1m": 1_000_000}),
                                              ("fire_teacher.py", "teacher", {"fire_100k": 100_000})])
def test_recipes_mix_all_of_llava_665k_by_default(name, role, fire):
    config = _recipe(name)
    sources = config.data.sources
    assert config.data.role == role
    assert {k: v.num_examples for k, v in sources.items()} == {**fire, "llava_665k": 665_298}
    assert sources.llava_665k.split == "instruct" and "max_examples" not in sources.llava_665k  # all of it
    assert config.loss.student_first_turn is False and tuple(config.model.lora.targets) == ("q", "k")


def test_instruction_count_and_ratio_options():
    assert _recipe("fire_teacher.py", "llava_n=1000").data.sources.llava_665k.max_examples == 1000
    assert "llava_665k" not in _recipe("fire_student.py", "llava_n=0").data.sources
    # A ratio counts the FIRE examples the recipe sees: (100K + 200K of FIRE-1M) x 0.5.
    mixed = _recipe("fire.py", "fire_student,fire_1m=200000,llava_ratio=0.5").data.sources
    assert mixed.llava_665k.num_examples == mixed.llava_665k.max_examples == 150_000
    assert mixed.fire_1m.max_examples == 200_000
    raw = _recipe("fire.py", "fire_teacher,llava=/d/mix665k.json,images=/d/img").data.sources.llava_665k
    assert (raw.json, raw.image_root) == ("/d/mix665k.json", "/d/img")
    with pytest.raises(ValueError, match="not both"):
        _recipe("fire.py", "fire_student,llava_n=5,llava_ratio=0.5")


def test_pipeline_8b_and_the_ablation_source():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fire_recipes", os.path.join(CONFIGS, "fire.py"))
    fire = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fire)
    ABLATION_SOURCE = fire.ABLATION_SOURCE
    config = _recipe("main_job.py", "8b")
    for stage in (config.teacher_train, config.student_train):
        assert stage.data.sources.llava_665k.num_examples == 665_298
    # The Fig. 6 ablation subsamples FIRE-1M, named by key (sorted order would pick the instruction data).
    assert ABLATION_SOURCE == "fire_1m" and config.student_train.data.sources[ABLATION_SOURCE].split == "fire_1m"
    assert sorted(config.student_train.data.sources)[-1] == "llava_665k"
    options = _recipe("main_job.py", "8b,llava_n=7,released=True")
    assert options.student_train.data.sources.llava_665k.max_examples == 7
    assert options.teacher_train.data.sources.llava_665k.max_examples == 7
    assert options.student_train.loss.student_first_turn and not options.teacher_train.loss.student_first_turn
    with pytest.raises(ValueError):
        _recipe("main_job.py", "tiny,llava_n=7")


def test_released_reproduces_the_release():
    config = _recipe("fire_student.py", "released=True")
    assert tuple(config.model.lora.targets) == ("q", "k", "v") and config.train.train_connector
    assert config.loss.student_first_turn  # the release labelled r_1 too (FIRE Eq. 5 does not)
    assert "student_first_turn" not in config.data  # one name: loss.student_first_turn
    with pytest.raises(ValueError, match="loss.student_first_turn"):
        InputPipeline(dict(_recipe("tiny.py").data.to_dict(), student_first_turn=True),
                      LlavaNextConfig.from_dict(_recipe("tiny.py").model).geometry)


# ---------------------------------------------------------------------------- steps from the usable data


@pytest.fixture(scope="module")
def dirty_data(tmp_path_factory):
    """45 synthetic dialogues (all with >= 2 turns) and 6 injected bad records, as one JSON file."""
    directory = tmp_path_factory.mktemp("dirty")
    records, images, _ = synthesize(160, seed=3, split="dirty")
    for name, image in images.items():
        image.save(directory / name)
    good = [r for r in records if len(r["conversations"]) >= 4][:45]
    assert len(good) == 45
    bad = [dict(good[0], id="missing_image", image="nowhere.png"),
           dict(good[1], id="bad_order", conversations=good[1]["conversations"][::-1]),
           dict(good[2], id="empty", question={"role": "user", "value": " "}),
           dict(good[3], id="no_question", question=None),
           "not an object",
           dict(good[4], id="odd_turns", conversations=good[4]["conversations"][:3])]
    path = directory / "dirty.json"
    path.write_text(json.dumps(good[:20] + bad + good[20:]))
    # 12 one-round dialogues: valid records, but a student without r_1 labelled has nothing to learn from them.
    (directory / "one_round.json").write_text(json.dumps([dict(r, conversations=r["conversations"][:2])
                                                          for r in records[-12:]]))
    return str(path), str(directory)


def _dirty_config(dirty_data, **data):
    path, images = dirty_data
    config = _recipe("tiny.py")
    config.data.sources = dict(dirty=dict(json=path, image_root=images, num_examples=51))
    config.mesh.shape = (1, 1, 1)
    config.data.update({**dict(num_epochs=1, batch_size=8, max_len=768, buckets=()), **data})  # one compile
    config.train.update(dict(total_steps=0, batch_size=8, checkpoint_every=100, warmup_frac=0.0))
    return config


def test_steps_count_usable_examples_per_process(dirty_data):
    config = _dirty_config(dirty_data)
    geometry = LlavaNextConfig.from_dict(config.model).geometry
    for process_count, batch, steps in ((1, 8, 6), (2, 4, 6), (4, 2, 6)):
        pipelines = [InputPipeline(config.data, geometry, process_index=p, process_count=process_count)
                     for p in range(process_count)]
        assert pipelines[0].num_examples == 45 and sum(pipelines[0].bad_records.values()) == 6
        # 45 usable over the processes: each plans ceil(floor(45 / processes) / its batch) steps.
        assert loop.total_steps(config, pipelines[0]) == steps == math.ceil(45 // process_count / batch)
        for pipeline in pipelines:  # every process has at least that many batches: no StopIteration inside
            assert sum(1 for _ in pipeline) >= steps


def test_training_runs_to_the_true_end_and_exports(dirty_data, tmp_path, capsys):
    # 45 usable of 51 records, batch 8: 6 steps (the last batch 5 examples + 3 label-free padding rows).
    config = _dirty_config(dirty_data)
    config.loss.student_first_turn = True  # the trainer passes it to the pipeline: r_1 is labelled
    summary = loop.train(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "steps: 6 = ceil(45 usable examples per process / 8 per process)" in out, out
    assert "source dirty: 45 usable (stated 51)" in out
    assert summary["step"] == summary["total_steps"] == 6 and not summary["data_ended"]
    assert summary["metrics"]["turn_tokens"][1] > 0
    assert os.path.exists(tmp_path / "run" / "export" / "peft_adapter" / "adapter_model.safetensors")
    # Examples dropped while training (one-round dialogues keep no label without r_1) end the data before the
    # planned steps: 57 usable records plan 8 steps, 45 are trained on in 6; the run stops there and exports.
    config = _dirty_config(dirty_data)
    config.data.sources.one_round = dict(json=os.path.join(dirty_data[1], "one_round.json"),
                                         image_root=dirty_data[1])
    summary = loop.train(config, str(tmp_path / "short"))
    out = capsys.readouterr().out
    assert summary["data_ended"] and summary["step"] == 6 and summary["total_steps"] == 8, (summary["step"], out)
    assert "the data ended after step 6 of 8" in out and "no_labelled_token        12" in out
    assert os.path.exists(tmp_path / "short" / "export" / "peft_adapter" / "adapter_model.safetensors")


# ---------------------------------------------------------------------------- turn normalisation


def test_turn_weights_sum_to_one_above_max_turns():
    mask = jnp.ones((1, 6), jnp.float32)
    turns = jnp.array([[1, 1, 9, 9, 10, 10]])
    weights = token_weights(mask, turns, "turn", 8)
    np.testing.assert_allclose(weights, [[1 / 6] * 6], rtol=1e-6)  # three turns, two tokens each
    mask = jnp.array([[0, 1, 1, 1, 1, 1, 1, 0]], jnp.float32)
    turns = jnp.array([[-1, 2, 12, 12, 12, 40, 2, -1]])
    weights = token_weights(mask, turns, "turn", 4)
    np.testing.assert_allclose(weights, [[0, 1 / 6, 1 / 9, 1 / 9, 1 / 9, 1 / 3, 1 / 6, 0]], rtol=1e-6)
    assert abs(float(weights.sum()) - 1.0) < 1e-6


def test_step_reports_turns_above_max_turns():
    config = _recipe("tiny.py")
    config.loss.update(dict(normalize="turn", max_turns=2))
    config.train.update(dict(batch_size=2, lr=0.0))
    config.model.lora.dropout = 0.0
    model = LlavaNext(LlavaNextConfig.from_dict(config.model), rngs=nnx.Rngs(0))
    seq = 16
    ids = np.random.default_rng(0).integers(1, 500, (2, seq)).astype(np.int32)
    turns = np.full((2, seq), -1, np.int32)
    turns[0, 3:6], turns[0, 8:10], turns[1, 4:12] = 1, 2, 7  # turn 7 > max_turns
    batch = {"input_ids": ids, "attention_mask": np.ones((2, seq), np.int32),
             "loss_mask": (turns > 0).astype(np.float32), "turn_ids": turns,
             "pixel_values": np.zeros((2, model.cfg.geometry.max_tiles, 3, 32, 32), np.float32),
             "image_index": np.full((2, seq), -1, np.int32)}
    logits = np.asarray(model(jnp.asarray(ids)), np.float64)[:, :-1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0]
    t = turns[:, 1:]
    expected = np.mean([nll[t == k].mean() for k in (1, 2, 7)])  # mean of per-turn means, turn 7 included
    trainer = Trainer(model, config.train, config.loss, 4, make_mesh((1, 1, 1), jax.devices()[:1]))
    _, metrics = trainer.step(trainer.initial_state, batch, jax.random.key(0))
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["turn_tokens"], [0, 3, 2])
    assert metrics["turn_tokens_above_max"] == 8 == (t == 7).sum()
    np.testing.assert_allclose(metrics["turn_loss_above_max"], nll[t == 7].mean(), rtol=1e-5)
    assert metrics["turn_tokens"].sum() + metrics["turn_tokens_above_max"] == metrics["labelled_tokens"]
