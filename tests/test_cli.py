"""Command-line tools on the tiny default: chat, batch generation, checkpoint loading."""

import json
import os

import jax
from flax import nnx
import numpy as np
import pytest
from PIL import Image

from fire_jax import batch_infer, chat
from fire_jax.core.config import DEFAULT_CONFIG, load_config
from fire_jax.convert.hf import save_hf_checkpoint, save_peft_adapter
from fire_jax.data.bad_records import BadRecordError
from fire_jax.data.records import Turn
from fire_jax.infer import loading
from fire_jax.dialogue.agents import Feedback, Student, Teacher

FAST = ["--max_new_tokens", "4"]


def _scripted(lines):
    """An input() that returns ``lines`` in order, then raises EOFError."""
    lines = list(lines)

    def input_fn(prompt=""):
        if not lines:
            raise EOFError
        return lines.pop(0)

    return input_fn


def _record_calls(monkeypatch, cls, name):
    """Wrap ``cls.name`` so each call's arguments are recorded; the real method still runs."""
    calls, real = [], getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.fixture(scope="module")
def config():
    return load_config(DEFAULT_CONFIG)


# ------------------------------------------------------------------------------------------------ chat


def test_chat_two_turns_of_user_feedback(monkeypatch):
    responds = _record_calls(monkeypatch, Student, "respond")
    out = []
    turns = chat.main(FAST, input_fn=_scripted(["Count the squares again.", "quit"]), print_fn=out.append)
    text = "\n".join(out)
    assert len(turns) == 2 and len(responds) == 2
    assert turns[0].feedback == "Count the squares again." and turns[1].feedback == ""
    assert responds[0][1] == [chat.DEMO_QUESTION] and list(responds[0][2][0]) == []
    assert list(responds[1][2][0]) == [Turn(turns[0].response, "Count the squares again.", None)]
    assert "[turn 2] student:" in text and "stopped" in text and "score" not in text
    # End of input stops as "quit" does.
    assert len(chat.main(FAST, input_fn=_scripted([]), print_fn=out.append)) == 1


def test_chat_auto_scores_every_turn():
    out = []
    turns = chat.main(["--auto", "--max_turns", "2", *FAST], input_fn=_scripted([]), print_fn=out.append)
    text = "\n".join(out)
    assert len(turns) == 2 and text.count("teacher: score ") == 2 and "stopped after 2 turns" in text
    assert "groundtruth: There are 3 red squares." in text


def test_chat_auto_stops_when_the_teacher_is_satisfied(monkeypatch):
    replies = iter([Feedback("Score: 3.\nFeedback: Look at the top row.", 3),
                    Feedback("Score: 9.\nFeedback: Correct.", 9)])
    teacher_calls = []

    def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None):
        teacher_calls.append((groundtruths, answers))
        return [next(replies)]

    monkeypatch.setattr(Teacher, "feedback", feedback)
    responds = _record_calls(monkeypatch, Student, "respond")
    out = []
    turns = chat.main(["--auto", *FAST], input_fn=_scripted([]), print_fn=out.append)
    text = "\n".join(out)
    assert [t.score for t in turns] == [3, 9] and "solved at turn 2 (score 9 >= 8)" in text
    assert "teacher: score 3\n" in text and "teacher: score 9\n" in text
    assert teacher_calls[1] == ([chat.DEMO_GROUNDTRUTH], [turns[1].response])
    assert responds[1][2][0][0].feedback_text == "Look at the top row."  # the student never sees the score line


# -------------------------------------------------------------------------------------------- generate


def _write_prompts(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def image_root(tmp_path):
    Image.new("RGB", (70, 40), "red").save(tmp_path / "red.png")
    return tmp_path


def test_generate_skips_bad_lines_and_resumes(image_root, monkeypatch):
    good = [dict(id=f"p{i}", image="red.png", question=f"Question {i}?") for i in range(3)]
    good[1]["history"] = [dict(response="Answer: blue", feedback="Score: 2.\nFeedback: Look again.")]
    outside = image_root.parent / f"{image_root.name}-outside.png"  # a link out of the root: refused unread
    Image.new("RGB", (70, 40), "blue").save(outside)
    os.symlink(outside, image_root / "link.png")
    bad = ["{not json", json.dumps(dict(id="nq", image="red.png")), json.dumps(dict(id="ni", image="no.png",
                                                                                    question="Q?")),
           json.dumps(dict(id="ln", image="link.png", question="Q?"))]
    source, output = image_root / "in.jsonl", image_root / "out.jsonl"
    _write_prompts(source, [good[0], bad[0], good[1], bad[1], bad[2], bad[3], good[2]])
    args = ["--input", str(source), "--output", str(output), "--image_root", str(image_root), "--batch_size", "2",
            *FAST]
    out = []
    summary = batch_infer.main(args, print_fn=out.append)
    assert summary == {"written": 3, "already_done": 0,
                       "bad": {"invalid_json": 1, "missing_field": 1, "missing_image": 1, "image_outside_root": 1}}
    assert [r["id"] for r in _read(output)] == ["p0", "p1", "p2"]
    assert all(isinstance(r["output"], str) and "score" not in r for r in _read(output))
    assert "invalid_json" in out[-1] and f"{source}:4 (id 'nq'): field 'question'" in out[-1]

    _write_prompts(source, [*good, dict(id="p3", image="red.png", question="Question 3?"),
                            dict(id="p4", image="red.png", question="Question 4?")])
    calls = _record_calls(monkeypatch, Student, "respond")
    summary = batch_infer.main(args, print_fn=out.append)
    assert summary == {"written": 2, "already_done": 3, "bad": {}}
    assert [q for call in calls for q in call[1]] == ["Question 3?", "Question 4?"]
    assert [r["id"] for r in _read(output)] == ["p0", "p1", "p2", "p3", "p4"]

    _write_prompts(source, [good[0], json.dumps(dict(id="x", image="red.png", question=""))])
    with pytest.raises(BadRecordError, match=r"in.jsonl:2 \(id 'x'\): field 'question'"):
        batch_infer.main([*args, "--on_bad_record", "error"], print_fn=out.append)


def test_generate_teacher_writes_scores(image_root, monkeypatch):
    feedback = _record_calls(monkeypatch, Teacher, "feedback")
    source, output = image_root / "in.jsonl", image_root / "feedback.jsonl"
    _write_prompts(source, [dict(id=7, image="red.png", question="What colour is it?", groundtruth="Red.",
                                 answer="Answer: blue"),
                            dict(id=8, image="red.png", question="What colour is it?", answer="Answer: red")])
    summary = batch_infer.main(["--input", str(source), "--output", str(output), "--image_root", str(image_root),
                             "--role", "teacher", "--batch_size", "1", *FAST], print_fn=lambda *_: None)
    assert summary["written"] == 1 and summary["bad"] == {"missing_field": 1}
    (record,) = _read(output)
    assert record["id"] == "7" and set(record) == {"id", "output", "score"}
    assert feedback[0][1:4] == (["What colour is it?"], ["Red."], ["Answer: blue"])


# ---------------------------------------------------------------------------------------------- loading


def _randomise_lora(model, seed):
    rng = np.random.default_rng(seed)
    for layer in model.language_model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            for factor in (linear.lora_a, linear.lora_b):
                factor[...] = rng.standard_normal(factor[...].shape).astype(np.float32)


def _lora_values(model):
    return [np.asarray(f[...]) for layer in model.language_model.model.layers
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj) for f in (linear.lora_a, linear.lora_b)]


def test_peft_adapter_round_trip(config, tmp_path):
    model = loading.load(config).model
    _randomise_lora(model, 1)
    save_peft_adapter(model, str(tmp_path / "adapter"))
    assert loading.checkpoint_kind(str(tmp_path / "adapter")) == "peft"
    loaded = loading.load(config, str(tmp_path / "adapter"))
    assert loaded.description.startswith("PEFT adapter") and "random init (seed 0)" in loaded.description
    for ours, theirs in zip(_lora_values(model), _lora_values(loaded.model), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(model.language_model.lm_head.kernel[...],
                                  loaded.model.language_model.lm_head.kernel[...])  # the same random base

    # An HF checkpoint loads too; a directory of neither kind names all three.
    save_hf_checkpoint(model, str(tmp_path / "hf"))
    from_hf = loading.load(config, str(tmp_path / "hf"))
    assert from_hf.description == f"HF checkpoint {tmp_path / 'hf'}"
    np.testing.assert_array_equal(model.language_model.lm_head.kernel[...],
                                  from_hf.model.language_model.lm_head.kernel[...])
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="Hugging Face checkpoint.*PEFT adapter.*train workdir"):
        loading.load(config, str(tmp_path / "other"))


def test_train_workdir_restores_the_latest_checkpoint(config, tmp_path):
    """A workdir's latest checkpoint restores its LoRA weights through fire_jax.weights.checkpoint, without a
    trainer."""
    from fire_jax.weights.checkpoint import Checkpointer
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    trainer = Trainer(loading.load(config).model, config.train, config.loss, 10, mesh)
    state = trainer.initial_state
    trained = type(state)(state.step + 7, jax.tree.map(lambda x: x + 0.25, state.params), state.opt_state)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    config_json = json.loads(config.to_json())
    checkpointer.save(7, trained, {"iterator": 0}, config_json, metrics={"loss": 1.0}, force=True)
    checkpointer.wait()
    checkpointer.close()
    with pytest.raises(ValueError, match="train workdir"):
        loading.checkpoint_kind(str(tmp_path))  # no config.json yet: not a workdir
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    assert loading.checkpoint_kind(str(tmp_path)) == "workdir"
    loaded = loading.load(config, str(tmp_path))
    assert loaded.description == f"train workdir {tmp_path}, step 7"
    expected = trainer.model(trained)
    for ours, theirs in zip(_lora_values(expected), _lora_values(loaded.model), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert np.abs(_lora_values(loaded.model)[1]).min() == 0.25  # B was zero before "training"
    # Placed as the untrained model's weights, not by the training mesh saved with them: an engine's programs
    # compiled for one model serve the other (a NamedSharding leaf would be a new program's key).
    placed = lambda model: [x.sharding for x in jax.tree.leaves(nnx.state(model))]
    assert placed(loaded.model) == placed(loading.load(config).model)
    assert {type(s).__name__ for s in placed(loaded.model)} == {"SingleDeviceSharding"}
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 3; it has steps \\[7\\]"):
        loading.load(config, str(tmp_path), step=3)
    # The trained weights are an item of their own: inference reads only it, the optimizer state stays on disk.
    items = {"config", "data", "optimizer", "params", "state"} & set(os.listdir(tmp_path / "checkpoints" / "7"))
    assert items == {"config", "data", "optimizer", "params"}


def test_workdir_written_before_the_params_item_still_loads(config, tmp_path):
    """A workdir whose checkpoints hold the whole train state in one ``state`` item (the layout before the
    ``params`` item) restores its LoRA weights without a trainer; the trainer resumes from it too."""
    import orbax.checkpoint as ocp

    from fire_jax.weights.checkpoint import Checkpointer
    from fire_jax.weights.sharding import make_mesh
    from fire_jax.train.step import Trainer

    trainer = Trainer(loading.load(config).model, config.train, config.loss, 10, make_mesh((1, 1, 1), jax.devices()[:1]))
    state = trainer.initial_state
    trained = type(state)(state.step + 5, jax.tree.map(lambda x: x - 0.5, state.params), state.opt_state)
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), options=ocp.CheckpointManagerOptions(create=True),
                                    item_names=("state", "data", "config"))
    config_json = json.loads(config.to_json())
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(trained), data=ocp.args.JsonSave({"i": 3}),
                                            config=ocp.args.JsonSave(config_json)))
    manager.wait_until_finished()
    manager.close()
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    loaded = loading.load(config, str(tmp_path))
    assert loaded.description == f"train workdir {tmp_path}, step 5"
    for ours, theirs in zip(_lora_values(trainer.model(trained)), _lora_values(loaded.model), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    resumed, data_state, step = Checkpointer(str(tmp_path / "checkpoints")).restore(trainer.initial_state)
    assert (step, int(resumed.step), data_state) == (5, 5, {"i": 3})


def test_display_name_is_the_one_naming_rule():
    """fire_bench's agent names and VLRMBench's row names come from loading.display_name."""
    from fire_jax.eval.fire_bench import agent_name

    assert loading.display_name(name="ours", checkpoint="/runs/x/export/peft_adapter") == "ours"
    assert loading.display_name(checkpoint="/runs/fd_run/export/peft_adapter/") == "fd_run"
    assert loading.display_name(checkpoint="/ckpt/llava-hf") == "llava-hf"
    assert loading.display_name(init="/data/llama3-llava-next-8b-hf") == "llama3-llava-next-8b-hf"
    assert loading.display_name(checkpoint="api:http://127.0.0.1:8000/v1#gpt-x") == "gpt-x (http://127.0.0.1:8000/v1)"
    assert loading.display_name() == "random init"
    assert agent_name({"adapter": "/runs/fire/export/peft_adapter", "init": "/base"}) == "fire"
    assert agent_name({"init": "/base/hf", "adapter": ""}) == "hf" and agent_name({}) == "random init"
