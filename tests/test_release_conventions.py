"""A checkpoint in the original LLaVA format runs as the FIRE release runs it: its anyres grid (pinpoints read as
(width, height), the first of tied pinpoints), its unpadding, its tiles, its image conversion (alpha dropped), its
BOS, its prompt cut and its teacher prompt; a llava-hf checkpoint keeps transformers' ways.

tests/fixtures/release_conventions.json holds what the release's own functions gave, run in a scratch folder on
MM-FIRE/FIRE @ 4aba1c8 (``llava/mm_utils.py``: ``select_best_resolution``, ``process_anyres_image``,
``tokenizer_image_token``; ``llava/model/llava_arch.py``: ``unpad_image`` and the feature layout of
``prepare_inputs_labels_for_multimodal``; ``llava/eval/model_fire_chat_loader.py``'s teacher prompt).
"""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from fire_jax.core.geometry import DEFAULT_PINPOINTS, ImageGeometry, select_best_resolution
from fire_jax.data.chat import ChatTokenizer, Message
from fire_jax.data.images import load_image, preprocess, tiles

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURE = json.load(open(os.path.join(ROOT, "tests", "fixtures", "release_conventions.json")))


def _release_geometry(pinpoints, tile=336, patch=14, **kwargs) -> ImageGeometry:
    return ImageGeometry(tile_size=tile, patch_size=patch, pinpoints=tuple(map(tuple, pinpoints)),
                         conventions="release", **kwargs)


@pytest.mark.parametrize("case", FIXTURE["grids"]["sizes"], ids=lambda c: "x".join(map(str, c["image_size_wh"])))
def test_grids_and_image_token_counts_equal_the_release(case):
    """The FIRE checkpoints' pinpoints as their config.json lists them ([[336, 672], [672, 336], ...], read as
    (width, height)): the chosen canvas, grid, unpadded map and feature count of every size, ties included."""
    geometry = _release_geometry(FIXTURE["grids"]["pinpoints_wh"])
    (w, h), (best_w, best_h), (cols, rows) = case["image_size_wh"], case["best_resolution_wh"], case["grid_wh"]
    assert select_best_resolution((h, w), geometry.pinpoints_hw) == (best_h, best_w)
    assert geometry.grid_shape((h, w)) == (rows, cols)
    assert list(geometry.unpadded((h, w))) == case["unpadded_map_hw"]
    assert geometry.num_tokens((h, w)) == case["image_feature_tokens"]
    assert len(geometry.feature_index((h, w))) == case["image_feature_tokens"]


def test_transformers_conventions_read_the_same_list_the_other_way():
    """The difference the release's reading makes: a 300x200 image ties on every pinpoint it fits; the release
    keeps the first, 336 wide and 672 tall (976 features), transformers' reading 672 wide and 336 tall (1,464)."""
    pinpoints = FIXTURE["grids"]["pinpoints_wh"]
    hf = ImageGeometry(pinpoints=tuple(map(tuple, pinpoints)))
    release = _release_geometry(pinpoints)
    assert (release.num_tokens((200, 300)), hf.num_tokens((200, 300))) == (976, 1464)
    assert (release.num_tokens((300, 200)), hf.num_tokens((300, 200))) == (1476, 984)
    assert hf.pinpoints_hw == DEFAULT_PINPOINTS == tuple(map(tuple, pinpoints))


def test_pad_mode_is_576_features_without_a_newline():
    """The release's free dialogues set image_aspect_ratio="pad": one tile, 576 features."""
    geometry = _release_geometry(FIXTURE["grids"]["pinpoints_wh"], mode="pad")
    assert geometry.num_tokens((200, 300)) == FIXTURE["grids"]["pad_mode_tokens"] == 576


@pytest.mark.parametrize("case", FIXTURE["tiles"]["images"], ids=lambda c: "x".join(map(str, c["image_size_wh"])))
def test_tiles_equal_the_release_s(case):
    """The release's process_anyres_image on a 16-px processor: the base tile (the whole image squashed), then
    the grid tiles of the resized, black-padded canvas, row-major; normalised."""
    geometry = _release_geometry(FIXTURE["tiles"]["pinpoints_wh"], tile=16, patch=4)
    image = Image.fromarray(np.asarray(case["pixels_hwc_uint8"], np.uint8))
    pixels, size = preprocess(image, geometry)
    w, h = case["image_size_wh"]
    assert size == (h, w) and geometry.grid_shape(size) == tuple(reversed(case["grid_wh"]))
    np.testing.assert_allclose(pixels, np.asarray(case["tiles_nchw"], np.float32), atol=2e-5)


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_transparency_is_dropped_as_the_release_opens_images():
    """``Image.open(...).convert('RGB')``: a transparent pixel keeps its colour under the release's conventions;
    transformers' image processors composite it on white."""
    rgba = np.asarray(FIXTURE["rgba"]["rgba_hwc_uint8"], np.uint8)
    expected = np.asarray(FIXTURE["rgba"]["rgb_after_convert_hwc_uint8"], np.uint8)
    np.testing.assert_array_equal(np.asarray(load_image(_png(rgba), alpha="drop")), expected)
    white = np.asarray(load_image(_png(rgba)))
    assert tuple(white[0, 2]) == (255, 255, 255) and tuple(expected[0, 2]) == (0, 0, 255)  # blue at alpha 0
    # through the tiles, by each model's conventions: an image kept with its alpha until it is tiled
    kept = load_image(_png(rgba), alpha="keep")
    assert kept.mode == "RGBA"
    release, hf = (ImageGeometry(tile_size=4, patch_size=2, pinpoints=((4, 4),), mode="pad", conventions=c)
                   for c in ("release", "transformers"))
    np.testing.assert_array_equal(tiles(kept, release)[0], tiles(Image.fromarray(expected), release)[0])
    np.testing.assert_array_equal(tiles(kept, hf)[0], tiles(Image.fromarray(white), hf)[0])


def _tokenizer(name: str):
    """The tiny word-level tokenizer the fixture's ids were made with (its vocabulary and special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    spec = FIXTURE["bos"]["tokenizers"][name]
    tokenizer = Tokenizer(models.WordLevel(spec["vocab"], unk_token=spec["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s+"), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special_tokens_added"]])
    return tokenizer


@pytest.mark.parametrize("template", ["llama_v3_student", "llava_v1_student_feedback"])
def test_token_ids_equal_the_release_s_bos_included(template):
    """Llama-3: the tokenizer's BOS before the template's (two); Vicuna: the tokenizer's <s> (one). The rest of
    the ids equal tokenizer_image_token's, the image's placeholder expanded to its features."""
    case = FIXTURE["bos"]["cases"][template]
    geometry = _release_geometry(DEFAULT_PINPOINTS)
    size = (672, 336)
    chat = ChatTokenizer(_tokenizer(case["tokenizer"]), geometry, template=template)
    encoded = chat.encode([Message("user", "What is shown in the picture?", images=1)], size,
                          add_generation_prompt=True)
    n = geometry.num_tokens(size)
    expected = [i for x in case["tokenizer_image_token"] for i in ([chat.image_token_id] * n if x == -200 else [x])]
    assert encoded.input_ids.tolist() == expected
    bos = FIXTURE["bos"]["tokenizers"][case["tokenizer"]]["bos_id"]
    assert expected[:case["total_bos"]] == [bos] * case["total_bos"] and expected[case["total_bos"]] != bos
    plain = ChatTokenizer(_tokenizer(case["tokenizer"]), ImageGeometry(), template=template).encode(
        [Message("user", "What is shown in the picture?", images=1)], size, add_generation_prompt=True)
    assert plain.input_ids[0] == (bos if template.startswith("llama") else expected[1])  # transformers: one fewer


def test_inputs_are_cut_at_tokenizer_model_max_length():
    """The release cuts each input after the image's features are placed, keeping the first tokens (its
    llava_arch.py): a long question loses its end and the assistant header; a cut in the image is refused."""
    geometry = _release_geometry(((32, 16),), tile=16, patch=4)
    chat = ChatTokenizer(_tokenizer("llama3_bos_postprocessor"), geometry, template="llama_v3_student")
    messages = [Message("user", "What is shown in the picture? " * 20, images=1)]
    whole = chat.encode(messages, (16, 16), add_generation_prompt=True)
    cut = len(whole.input_ids) - 30
    chat.input_cut = cut
    short = chat.encode(messages, (16, 16), add_generation_prompt=True)
    assert short.input_ids.tolist() == whole.input_ids[:cut].tolist() and len(short.turn_ids) == cut
    chat.input_cut = whole.image_start + 3
    with pytest.raises(ValueError, match="inside its image features"):
        chat.encode(messages, (16, 16), add_generation_prompt=True)


def test_the_teacher_prompt_of_free_dialogues_is_the_release_s():
    """model_fire_chat_loader.py: three user messages, the image after "Question: ", the latest answer alone."""
    from fire_jax.dialogue.agents import teacher_prompt

    case = FIXTURE["teacher_prompts"]["free_dialogue_teacher_llama_v3"]
    chat = ChatTokenizer(_tokenizer("llama3_bos_postprocessor"), _release_geometry(DEFAULT_PINPOINTS),
                         template="llama_v3_teacher")
    messages = teacher_prompt("What colour is the bus?", "The bus is red.", "The bus is blue.", (), "latest",
                              image_inline=True)
    assert chat.render(messages, add_generation_prompt=True) == case["prompt"]
    encoded = chat.encode(messages, (336, 672), add_generation_prompt=True)
    before = encoded.input_ids[encoded.image_start - 2:encoded.image_start]
    assert [chat.tokenizer.id_to_token(int(i)) for i in before] == [":", " "]  # "Question: " then the image
    assert encoded.image_tokens == chat.geometry.num_tokens((336, 672))


@pytest.mark.parametrize("template,tokenizer", [("llama_v3_teacher", "llama3_bos_postprocessor"),
                                                ("llava_v1_teacher_feedback", "vicuna_bos_postprocessor"),
                                                ("llava_v1_student_feedback", "vicuna_bos_postprocessor")])
def test_the_teacher_prompt_of_fixed_dialogues_is_the_release_s(template, tokenizer):
    """``fixed.teacher_prompt="release"``: a real FIRE record's turns as eval_feedback.py feeds them, turn 1 and
    turn 2 (the first answer's feedback as written). No instruction message; under a template that is not one
    of the release's teacher templates its prompt() appends its request to the first turn (the third case)."""
    import types

    from fire_jax.data.records import Turn
    from fire_jax.dialogue.agents import Teacher

    case = FIXTURE["teacher_prompts"]["fixed_dialogue_teacher"]
    chat = ChatTokenizer(_tokenizer(tokenizer), _release_geometry(DEFAULT_PINPOINTS), template=template)
    teacher = Teacher(types.SimpleNamespace(chat=chat), history="full", prompt="release")
    assert teacher.request == (template == "llava_v1_student_feedback")
    responses, feedbacks = case["responses"], case["feedbacks"]
    for k, expected in enumerate(case["prompts"][template], 1):
        history = [Turn(r, f, None) for r, f in zip(responses[:k - 1], feedbacks)]
        [messages] = teacher.prompts([case["question"]], [case["groundtruth"]], [responses[k - 1]], [history])
        assert chat.render(messages, add_generation_prompt=True) == expected
        assert sum(m.images for m in messages) == 1 and messages[0].images == 1  # the image first, once
    # the paper's prompt keeps its instruction message under the same template
    paper = Teacher(types.SimpleNamespace(chat=chat), history="full").prompts(
        [case["question"]], [case["groundtruth"]], [responses[0]], [()])[0]
    assert [m.role for m in paper] == ["user", "user", "user"] and paper[1].text.startswith("Please compare")
    with pytest.raises(ValueError, match="teacher prompt must be one of"):
        Teacher(types.SimpleNamespace(chat=chat), prompt="releases")


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A tiny model exported in the original LLaVA format with a prompt cut (tokenizer_model_max_length)."""
    import dataclasses

    from fire_jax.convert import llava
    from fire_jax.core.config import load_config
    from fire_jax.models import merge_lora
    from fire_jax.weights.build import build_model

    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    model = merge_lora(build_model(config))
    model.cfg = dataclasses.replace(model.cfg, max_input_tokens=3072)
    folder = str(tmp_path_factory.mktemp("original") / "llava")
    llava.save_llava_checkpoint(model, folder)
    # the release's vocabulary has no <image> (its prompts carry -200): the tiny one with its <image> renamed, so
    # that the appended <image> takes the id after the checkpoint's vocabulary, as the loader gives the model
    from fire_jax.core.config import resolve_path

    text = open(resolve_path(config.data.tokenizer)).read().replace('"<image>"', '"<unused>"')
    open(os.path.join(folder, "tokenizer.json"), "w").write(text)
    return folder, model


def test_an_original_format_checkpoint_carries_the_release_s_conventions(original):
    from fire_jax.convert.load import load_checkpoint
    from fire_jax.weights.build import conventions_of

    folder, model = original
    written = json.load(open(os.path.join(folder, "config.json")))
    # written as the release reads them, (width, height): the same grids as the model that wrote them
    assert written["image_grid_pinpoints"] == [[w, h] for h, w in model.cfg.image_grid_pinpoints]
    assert written["tokenizer_model_max_length"] == 3072
    loaded = load_checkpoint(folder, None)
    assert (loaded.cfg.conventions, loaded.cfg.max_input_tokens) == ("release", 3072)
    for size in ((200, 300), (300, 200), (50, 50), (90, 20)):
        assert loaded.cfg.geometry.grid_shape(size) == model.cfg.geometry.grid_shape(size)
    assert load_checkpoint(folder, None, conventions="transformers").cfg.conventions == "transformers"
    assert conventions_of(folder) == "release" and conventions_of("") == "transformers"
    assert conventions_of(folder, override="transformers") == "transformers"


def test_checkpoint_info_reads_the_image_id_and_the_grids_from_the_checkpoint(original, capsys):
    from hf_reference import load_tool

    folder, model = original
    info = load_tool("checkpoint_info").main([folder])
    assert info["conventions"] == "release" and info["max_input_tokens"] == 3072
    assert info["image_token_id"] == info["vocab_size"] == model.cfg.llm.vocab_size  # the next id after it
    assert info["grids"]["300x200"]["image_tokens"] == model.cfg.geometry.num_tokens((200, 300))
    out = capsys.readouterr().out
    assert f"<image>: id {info['image_token_id']:,}" in out and "inputs cut at: 3,072 tokens" in out


def test_evaluate_runs_an_original_format_checkpoint_with_the_release_switch(original, tmp_path):
    """A tiny original-format checkpoint through the fixed and the free dialogues with ``release=True``: the
    release's settings, its conventions recorded in the run's settings (a rerun with others is refused)."""
    from fire_jax.core.config import load_config
    from fire_jax.eval.fire_bench import evaluate

    folder, _ = original
    for setting in ("fixed", "free"):
        config = load_config(os.path.join(ROOT, "configs", f"eval_{setting}.py") + ":tiny,release=True")
        assert config.release and config.data.template == "llama_v3_student"
        config.student.init = config.teacher.init = folder
        config.data.tokenizer = os.path.join(folder, "tokenizer.json")
        config.test.max_examples = 2
        config.decode.max_new_tokens = 6
        workdir = tmp_path / setting
        results = evaluate(config, str(workdir))
        settings = json.load(open(workdir / "settings.json"))
        assert settings["student"]["conventions"] == settings["teacher"]["conventions"] == "release"
        assert results["student"]["conventions"] == "release"
        if setting == "free":
            assert settings["model"]["image_mode"] == "pad" and settings["free"]["score_parser"] == "official"
        else:
            assert settings["fixed"]["student_first_turn"] and settings["decode"]["max_new_tokens"] == 6
            assert settings["fixed"]["teacher_prompt"] == "release"
            teachers = [json.loads(line) for line in open(workdir / "fixed_outputs.jsonl")]
            assert sum(r["role"] == "teacher" for r in teachers) >= 2
        config.model.conventions = "transformers"
        with pytest.raises(ValueError, match="conventions"):
            evaluate(config, str(workdir))
