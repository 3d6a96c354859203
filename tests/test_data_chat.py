"""Chat rendering: exact template strings, labelled spans, image token counts against Hugging Face."""

import json
import os

import numpy as np
import pytest
import tokenizers
from PIL import Image

from fire_jax.core.config import ASSETS_DIR
from fire_jax.data import chat
from fire_jax.data.records import Instruction, load_records
from fire_jax.data.synthetic import corpus
from fire_jax.data.tokenizer import train_tokenizer
from fire_jax.core.geometry import DEFAULT_PINPOINTS, ImageGeometry

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "fire")
TOKENIZER = os.path.join(ASSETS_DIR, "tiny_tokenizer.json")
TINY = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)))
LLAVA_NEXT_8B = ImageGeometry(tile_size=336, patch_size=14, pinpoints=DEFAULT_PINPOINTS)

SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content that the "
          "user provides, and assist the user with a variety of tasks using natural language.")
HEAD = f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
INSTRUCTION = """Please compare my answer with the groundtruth answer and provide helpful, detailed, and polite feedback to help me improve my answer.
Formulate the feedback as:
'''
Score: <compare my answer with the groundtruth answer in terms of accuracy, relevance, helpfulness, and level of detail, and provide an overall score on a scale of 1 to 10, where a higher score indicates better overall performance.>
Feedback: <provide feedback on my answer. Do NOT directly tell the groundtruth answer. The feedback should identify which parts of my answer are incorrect, what is missing in my answer, and how to improve my answer.>
'''"""  # noqa: E501
R1 = ("Thought: The container is on the counter near the sink. It looks like it could be made of plastic or some "
      "other material.\nAnswer: No, the container is not made of wicker.")
F1 = ("Score: 3.\nFeedback: Your observation about the container's location is correct, but the material assessment "
      "is incorrect. Look closely at the texture and pattern of the container. Wicker typically has a woven "
      "appearance. Try to reassess the material based on these characteristics.")
R2 = ("Thought: The container does have a woven texture, which is a characteristic of wicker. \nAnswer: Yes, the "
      "container is made of wicker.")
F2 = ("Score: 10.\nFeedback: Great job! You correctly identified the woven texture of the container, which "
      "indicates that it is made of wicker.")


def user(text):
    return f"<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"


def assistant(text):
    return f"<|start_header_id|>assistant<|end_header_id|>\n\n{text}<|eot_id|>"


@pytest.fixture(scope="module")
def records():
    records, bad = load_records([os.path.join(FIXTURES, f) for f in ("fire_100k_demo.json", "fire_1m_demo.json")],
                                os.path.join(FIXTURES, "images"))
    assert len(records) == 188 and dict(bad) == {"missing_image": 1}
    return records


@pytest.fixture(scope="module")
def tiny():
    return chat.ChatTokenizer.from_file(TOKENIZER, TINY)


def test_prompt_strings_are_the_spec_strings():
    assert chat.SYSTEM == SYSTEM and chat.TEACHER_INSTRUCTION == INSTRUCTION


def test_student_rendering_exact(records):
    expected = (HEAD + user("<image>\nIs the container made of wicker?") + assistant(R1)
                + user(F1.split("Feedback: ")[1]) + assistant(R2))
    assert chat.render(chat.student_messages(records[0])) == expected
    prompt = chat.render(chat.student_messages(records[0], until_turn=2), add_generation_prompt=True)
    assert prompt == expected[:-len(R2 + "<|eot_id|>")]


def test_teacher_rendering_exact(records):
    question = "<image>\nQuestion: Is the container made of wicker?\nGroundtruth: Yes, the container is made of wicker."
    expected = HEAD + user(question) + user(INSTRUCTION) + user(R1) + assistant(F1) + user(R2) + assistant(F2)
    assert chat.render(chat.teacher_messages(records[0])) == expected
    latest = HEAD + user(question) + user(INSTRUCTION) + user(R2) + assistant(F2)
    assert chat.render(chat.teacher_messages(records[0], history="latest")) == latest
    prompt = chat.render(chat.teacher_messages(records[0], history="latest", until_turn=2), add_generation_prompt=True)
    assert prompt == latest[:-len(F2 + "<|eot_id|>")]


def labelled_spans(chat_tokenizer, encoded):
    """{turn: decoded text} of every maximal run of labelled tokens."""
    spans, turns = {}, encoded.turn_ids
    for turn in np.unique(turns[turns > 0]):
        positions = np.flatnonzero(turns == turn)
        assert np.array_equal(positions, np.arange(positions[0], positions[-1] + 1)), "a turn's span is contiguous"
        spans[int(turn)] = chat_tokenizer.decode(encoded.input_ids[positions])
    return spans


@pytest.mark.parametrize("role", ["student", "student_first_turn", "teacher"])
def test_labelled_spans_decode_to_turn_texts(records, tiny, role):
    for record in records:
        if role == "teacher":
            messages, expected = chat.teacher_messages(record), {i: t.feedback for i, t in enumerate(record.turns, 1)}
        else:
            first = role == "student_first_turn"
            messages = chat.student_messages(record, first_turn_labelled=first)
            expected = {i: t.response for i, t in enumerate(record.turns, 1) if i >= 2 or first}
        encoded = tiny.encode(messages, (100, 120))
        assert labelled_spans(tiny, encoded) == {i: text + "<|eot_id|>" for i, text in expected.items()}
        assert np.array_equal(encoded.loss_mask, (encoded.turn_ids > 0).astype(np.float32))
        assert encoded.loss_mask.dtype == np.float32 and encoded.input_ids.dtype == np.int32
        assert (encoded.input_ids == tiny.bos_id).sum() == 1 and encoded.input_ids[0] == tiny.bos_id


def test_pieces_tokenise_like_the_whole_string(records, tiny):
    """Tokenising template pieces separately gives the ids of the whole rendered string."""
    for record in records:
        for messages in (chat.student_messages(record), chat.teacher_messages(record)):
            encoded = tiny.encode(messages, (100, 120))
            whole = tiny.tokenizer.encode(chat.render(messages), add_special_tokens=False).ids
            start, n = encoded.image_start, encoded.image_tokens
            collapsed = np.concatenate([encoded.input_ids[:start + 1], encoded.input_ids[start + n:]])
            assert collapsed.tolist() == whole


def test_image_block(tiny):
    messages = [chat.Message("user", "What?", images=1), chat.Message("assistant", "This.", 1)]
    encoded = tiny.encode(messages, (48, 96))
    assert encoded.image_tokens == TINY.num_tokens((48, 96)) == 52
    block = encoded.input_ids[encoded.image_start:encoded.image_start + encoded.image_tokens]
    assert (block == 511).all() and (encoded.input_ids == 511).sum() == 52
    assert (encoded.turn_ids[encoded.image_start:encoded.image_start + 52] == -1).all()
    assert tiny.image_summary((48, 96)) == "<image x 52: base 16 + grid 1x2 unpadded 4x8 + 4 newlines>"
    assert "<image x 52: base 16 + grid 1x2 unpadded 4x8 + 4 newlines>\nWhat?" in tiny.show(encoded, (48, 96))
    assert "[[1|This.<|eot_id|>]]" in tiny.show(encoded, (48, 96))
    big = chat.ChatTokenizer.from_file(TOKENIZER, LLAVA_NEXT_8B)
    assert big.image_summary((480, 720)) == "<image x 2144: base 576 + grid 2x2 unpadded 32x48 + 32 newlines>"
    with pytest.raises(ValueError, match="hold 1 image"):
        tiny.encode(messages)
    # A "<image>" typed in a text is text: tokenised as characters, never as the image token.
    typed = tiny.encode([chat.Message("user", "What is <image> here?")])
    assert (typed.input_ids == 511).sum() == 0 and "What is <image> here?" in tiny.decode(typed.input_ids)


def test_instruction_rendering(tiny):
    record = Instruction(id="1", image="a.png", messages=(("user", "What is this?"), ("assistant", "A square."),
                                                          ("user", "Colour?"), ("assistant", "Green.")),
                         source="llava", split="instruct")
    messages = chat.training_messages(record, "student")
    assert chat.render(messages) == (HEAD + user("<image>\nWhat is this?") + assistant("A square.") + user("Colour?")
                                     + assistant("Green."))
    encoded = tiny.encode(messages, (64, 64))
    assert labelled_spans(tiny, encoded) == {1: "A square.<|eot_id|>", 2: "Green.<|eot_id|>"}
    text_only = Instruction(id="2", image=None, messages=(("user", "Hi"), ("assistant", "Hello")), source="s", split="")
    encoded = tiny.encode(chat.training_messages(text_only, "teacher"))
    assert encoded.image_start == -1 and labelled_spans(tiny, encoded) == {1: "Hello<|eot_id|>"}


def test_shipped_tokenizer():
    tokenizer = tokenizers.Tokenizer.from_file(TOKENIZER)
    assert tokenizer.get_vocab_size() == 512 and tokenizer.token_to_id("<image>") == 511
    assert [tokenizer.token_to_id(t) for t in (*chat.LLAMA3_SPECIAL_TOKENS, "<pad>")] == [0, 1, 2, 3, 4, 5]
    with open(os.path.join(ASSETS_DIR, "synthetic_fire", "train.json")) as f:
        retrained = train_tokenizer(corpus(json.load(f)))
    assert retrained.to_str() == tokenizer.to_str(), "tools/make_synthetic_fire.py reproduces the shipped tokenizer"


#: (height, width) per geometry: five aspect ratios, every grid shape of the pinpoints.
SIZES = {"tiny": ((96, 128), (50, 128), (128, 50), (30, 60), (60, 30)),
         "8b": ((480, 640), (300, 1000), (1000, 300), (300, 600), (600, 300))}


@pytest.mark.parametrize("name, geometry, patch", [("tiny", TINY, 8), ("8b", LLAVA_NEXT_8B, 14)])
def test_token_ids_equal_hf_llava_next_processor(records, name, geometry, patch):
    """Same ids as LlavaNextProcessor (PIL image processor + our tokenizer.json) on the rendered text."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor, PreTrainedTokenizerFast

    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": geometry.tile_size},
        crop_size={"height": geometry.tile_size, "width": geometry.tile_size},
        image_grid_pinpoints=[list(p) for p in geometry.pinpoints])
    processor = LlavaNextProcessor(image_processor=image_processor,
                                   tokenizer=PreTrainedTokenizerFast(tokenizer_file=TOKENIZER), patch_size=patch,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    ours = chat.ChatTokenizer.from_file(TOKENIZER, geometry)
    assert len({geometry.grid_shape(size) for size in SIZES[name]}) == 5
    for record, size in zip(records[::40], SIZES[name]):
        image = Image.open(os.path.join(FIXTURES, "images", record.image)).convert("RGB").resize(size[::-1])
        messages = chat.teacher_messages(record)
        encoded = ours.encode(messages, size)
        hf = processor(images=image, text=chat.render(messages), add_special_tokens=False, return_tensors="np")
        assert encoded.image_tokens == geometry.num_tokens(size)
        # HF counts the CLS feature and then drops it ("default" feature selection).
        assert encoded.image_tokens + 1 == processor._get_number_of_features(*size, geometry.tile_size,
                                                                             geometry.tile_size)
        assert hf["input_ids"][0].tolist() == encoded.input_ids.tolist()
        assert hf["image_sizes"][0].tolist() == list(size)


def test_encode_several_images_expands_each_placeholder_for_its_size(tiny):
    """ChatTokenizer.encode(image_sizes=...): placeholder i becomes num_tokens(sizes[i]) image ids, in order; one
    image through image_sizes is the same sequence as through image_size; a system override replaces the text."""
    sizes = [(40, 70), (90, 30)]
    messages = [chat.Message("user", "Which is red?", images=2)]
    encoded = tiny.encode(messages, image_sizes=sizes, add_generation_prompt=True)
    ids = encoded.input_ids
    is_image = ids == tiny.image_token_id
    starts = np.flatnonzero(is_image & ~np.roll(is_image, 1))
    ends = np.flatnonzero(is_image & ~np.roll(is_image, -1)) + 1
    assert (ends - starts).tolist() == [TINY.num_tokens(s) for s in sizes]
    assert encoded.image_start == starts[0] and encoded.image_tokens == sum(TINY.num_tokens(s) for s in sizes)
    collapsed = np.concatenate([ids[:starts[0] + 1], ids[ends[0]:starts[1] + 1], ids[ends[1]:]])
    assert tiny.decode(collapsed) == chat.render(messages, add_generation_prompt=True)
    one = [chat.Message("user", "Which is red?", images=1)]
    np.testing.assert_array_equal(tiny.encode(one, image_sizes=[sizes[0]]).input_ids,
                                  tiny.encode(one, sizes[0]).input_ids)
    with pytest.raises(ValueError, match="hold 2 image.*but 1 image size"):
        tiny.encode(messages, image_sizes=sizes[:1])
    custom = tiny.encode(one, image_sizes=[sizes[0]], system="Answer briefly.")
    assert "Answer briefly." in tiny.decode(custom.input_ids) and chat.SYSTEM not in tiny.decode(custom.input_ids)
