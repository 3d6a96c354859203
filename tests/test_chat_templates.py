"""Chat templates (Llama-3 as LLaVA-NeXT trains it and as llava-hf publishes it, ChatML, Vicuna v1): rendered as transformers' apply_chat_template renders them, loss
masks from the rendered text, stop ids from the template, images placed by the caller."""

import os

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken

from fire_jax.core.config import ASSETS_DIR
from fire_jax.data import chat
from fire_jax.data.records import Conversation, Turn
from fire_jax.data.templates import ChatTemplate, template_source
from fire_jax.core.geometry import ImageGeometry

TINY = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)))
TOKENIZER = os.path.join(ASSETS_DIR, "tiny_tokenizer.json")
#: Each template's special tokens (added to the tiny BPE, so every template tokenises here) and BOS / EOS.
FAMILIES = {
    "llama3": (chat.LLAMA3_SPECIAL_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
    "llava_hf_llama3": (chat.LLAMA3_SPECIAL_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
    "chatml": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_start|>", "<|im_end|>", "<|im_end|>"),
    "vicuna_v1": (("<s>", "</s>"), "<s>", "</s>", "</s>"),
}

CONVERSATION = Conversation(
    id="c", image="a.png", question="How many red circles? Type <image> if unsure.", groundtruth="There are 4.",
    turns=(Turn("Thought: I count them.\nAnswer: There are 3.", "Score: 6.\nFeedback: Too low. Count again.", 6.0),
           Turn("Thought: I count again.\nAnswer: There are 4.", "Score: 10.\nFeedback: Correct!", 10.0)),
    source="synthetic_count", split="test")


def _tokenizer(family: str) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer.from_file(TOKENIZER)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FAMILIES[family][0]])
    return tokenizer


def _chat(family: str) -> chat.ChatTokenizer:
    specials, bos, eos, _ = FAMILIES[family]
    return chat.ChatTokenizer(_tokenizer(family), TINY, template=family, bos_token=bos, eos_token=eos)


def _sequences():
    return {"student": chat.student_messages(CONVERSATION, first_turn_labelled=True),
            "teacher (full)": chat.teacher_messages(CONVERSATION, history="full"),
            "teacher prompt (latest)": chat.teacher_messages(CONVERSATION, history="latest", until_turn=2),
            "student prompt": chat.student_messages(CONVERSATION, until_turn=2)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_render_as_transformers_apply_chat_template(family):
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, _ = FAMILIES[family]
    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(family), bos_token=bos, eos_token=eos)
    ours = _chat(family)
    for name, messages in _sequences().items():
        prompt = "prompt" in name
        conversation = ours.template.conversation(messages, chat.SYSTEM)
        expected = hf.apply_chat_template(conversation, chat_template=template_source(family), tokenize=False,
                                          add_generation_prompt=prompt)
        assert ours.render(messages, add_generation_prompt=prompt) == expected, (family, name)
        assert chat.SYSTEM in expected and (name.startswith("student") or chat.TEACHER_INSTRUCTION in expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_labelled_spans_are_the_turn_text_and_the_end_token(family):
    ours = _chat(family)
    end = FAMILIES[family][3]
    assert ours.template.end_token == end and ours.stop_ids == tuple(dict.fromkeys(
        (ours.tokenizer.token_to_id(end), ours.tokenizer.token_to_id(FAMILIES[family][2]))))
    for name, messages in _sequences().items():
        encoded = ours.encode(messages, (64, 64), add_generation_prompt="prompt" in name)
        spans = {}
        for turn in sorted(set(encoded.turn_ids.tolist()) - {-1}):
            ids = encoded.input_ids[encoded.turn_ids == turn]
            spans[turn] = ours.decode(ids)
            assert np.all(np.diff(np.flatnonzero(encoded.turn_ids == turn)) == 1)  # one contiguous span
        labelled = [m for m in messages if m.turn > 0]
        assert spans == {m.turn: m.text + end for m in labelled}, (family, name)
        # one image block, where the template puts it; the typed "<image>" in the question stays text
        assert (encoded.input_ids == ours.image_token_id).sum() == TINY.num_tokens((64, 64)) == encoded.image_tokens
        assert "Type <image> if unsure." in ours.decode(encoded.input_ids)


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_pieces_tokenise_as_the_whole_rendered_string(family):
    """Where the template writes every token (Llama-3, ChatML), tokenising piece by piece is tokenising the
    rendered string whole (the image block collapsed to one placeholder)."""
    ours = _chat(family)
    for messages in _sequences().values():
        messages = [chat.Message(m.role, m.text.replace("<image>", "picture"), m.turn, m.images) for m in messages]
        encoded = ours.encode(messages, (64, 64))
        ids = encoded.input_ids
        collapsed = np.concatenate([ids[:encoded.image_start + 1], ids[encoded.image_start + encoded.image_tokens:]])
        whole = ours.tokenizer.encode(ours.render(messages), add_special_tokens=False).ids
        assert collapsed.tolist() == whole


def test_vicuna_trains_eos_after_each_answer_although_the_template_writes_none():
    ours = _chat("vicuna_v1")
    messages = chat.student_messages(CONVERSATION, first_turn_labelled=True)
    rendered = ours.render(messages)
    assert "</s>" not in rendered and rendered.startswith(chat.SYSTEM + " USER: <image>\n")
    encoded = ours.encode(messages, (64, 64))
    eos = ours.tokenizer.token_to_id("</s>")
    assert [int(encoded.turn_ids[i]) for i in np.flatnonzero(encoded.input_ids == eos)] == [1, 2]


def test_a_template_file_beside_the_tokenizer_is_read(tmp_path):
    """``tokenizer_config.json`` next to tokenizer.json names the template (as a fetched GGUF model's folder)."""
    import json

    _tokenizer("chatml").save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": template_source("chatml"), "bos_token": "<|im_start|>",
                   "eos_token": "<|im_end|>"}, f)
    ours = chat.ChatTokenizer.from_file(str(tmp_path / "tokenizer.json"), TINY)
    assert ours.render([chat.Message("user", "Hi")]) == (f"<|im_start|>system\n{chat.SYSTEM}<|im_end|>\n"
                                                         "<|im_start|>user\nHi<|im_end|>\n")
    assert ours.stop_ids == (ours.tokenizer.token_to_id("<|im_end|>"),)


def test_a_template_that_drops_a_message_text_is_refused():
    template = ChatTemplate("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
                            "{% endfor %}", special_tokens=["</s>"], eos_token="</s>", name="lossy")
    with pytest.raises(ValueError, match="lossy: rendered 1 of 2 message texts"):
        template.pieces([chat.Message("user", "a"), chat.Message("assistant", "b", 1)], system=None)


def test_llava_hf_llama3_differs_from_llama3_only_before_text_only_messages():
    """llava-hf's template writes "\n" before every text part: equal to ``llama3`` where a message has an image,
    one newline more after the header of a text-only message, and no BOS (the tokenizer adds it)."""
    ours, hf = _chat("llama3"), _chat("llava_hf_llama3")
    messages = chat.student_messages(CONVERSATION, until_turn=2)
    a, b = ours.render(messages), hf.render(messages)
    assert a.startswith("<|begin_of_text|>") and not b.startswith("<|begin_of_text|>")
    image_message = "<|start_header_id|>user<|end_header_id|>\n\n<image>\nHow many red circles?"
    assert image_message in a and image_message in b
    assert a.count("<|end_header_id|>\n\n\n") == 0
    assert b.count("<|end_header_id|>\n\n\n") == 1 + len(messages) - 1  # the system message, all but the image's
    assert b.replace("<|end_header_id|>\n\n\n", "<|end_header_id|>\n\n") == a[len("<|begin_of_text|>"):]


def test_the_data_config_names_the_template(tmp_path):
    """``data.template`` picks a shipped template over the tokenizer_config.json beside the tokenizer."""
    import json

    from fire_jax.data.pipeline import Preprocessor

    path = str(tmp_path / "tokenizer.json")
    _tokenizer("vicuna_v1").save(path)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": template_source("chatml"), "bos_token": "<s>", "eos_token": "</s>"}, f)
    messages = chat.student_messages(CONVERSATION)
    from_file = Preprocessor(tokenizer_path=path, geometry=TINY).chat
    assert from_file.render(messages).startswith("<|im_start|>system\n")
    vicuna = Preprocessor(tokenizer_path=path, geometry=TINY, template="vicuna_v1").chat
    assert vicuna.render(messages) == _chat("vicuna_v1").render(messages)
    assert vicuna.render(messages).startswith(chat.SYSTEM) and "USER: <image>\n" in vicuna.render(messages)
