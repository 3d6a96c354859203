"""The FIRE release's conversation templates (MM-FIRE/FIRE ``llava/conversation.py``) as shipped chat templates.

tests/fixtures/release_templates.json holds what the release's own ``Conversation.get_prompt()`` rendered for a
3-turn student dialogue and a teacher dialogue with an image, messages appended as its
``llava/eval/feedback_chat.py`` appends them (``"<image>\\n"`` before the first text; the assistant header as
the generation prompt); the strings were produced by running the release's file, not written by hand.
"""

import json
import os

import numpy as np
import pytest
from tokenizers import AddedToken

from fire_jax.data.chat import SYSTEM, ChatTokenizer, Message
from fire_jax.data.templates import ChatTemplate, template_source
from fire_jax.data.tokenizer import train_tokenizer
from fire_jax.core.geometry import ImageGeometry

FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "release_templates.json"),
                         encoding="utf-8"))
TEMPLATES = sorted(FIXTURE["renderings"])
GEOMETRY = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64)))
VICUNA_EOS = "</s>"


def _messages(kind: str, *, prompt: bool = False) -> list[Message]:
    """The fixture's dialogue as labelled messages: the k-th assistant message is turn k."""
    rows = FIXTURE["dialogues"][kind][:-1] if prompt else FIXTURE["dialogues"][kind]
    out, k = [], 0
    for role, text, images in rows:
        k += role == "assistant"
        out.append(Message(role, text, k if role == "assistant" else -1, images))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny Llama-3-style tokenizer with Vicuna's ``</s>`` added as a special token."""
    corpus = [text for rows in FIXTURE["dialogues"].values() for _, text, _ in rows]
    tok = train_tokenizer(corpus, vocab_size=512)
    tok.add_special_tokens([AddedToken(VICUNA_EOS, special=True, normalized=False)])
    return tok


def _chat(tokenizer, name: str) -> ChatTokenizer:
    eos = {} if name.startswith("llama_v3") else dict(eos_token=VICUNA_EOS)
    return ChatTokenizer(tokenizer, GEOMETRY, template=name, **eos)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("kind", ["student", "teacher"])
def test_rendering_equals_the_release(tokenizer, name, kind):
    chat = _chat(tokenizer, name)
    expected = FIXTURE["renderings"][name]
    assert chat.render(_messages(kind)) == expected[kind]  # the system message given is the template's own
    assert chat.render(_messages(kind, prompt=True), add_generation_prompt=True) == expected[f"{kind}_prompt"]
    pieces = chat.template.pieces(_messages(kind), system=SYSTEM)
    assert "".join(p.text for p in pieces) == expected[kind]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("kind", ["student", "teacher"])
def test_loss_mask_labels_exactly_the_assistant_turns(tokenizer, name, kind):
    chat = _chat(tokenizer, name)
    messages = _messages(kind)
    encoded = chat.encode(messages, (40, 70))
    end = "<|eot_id|>" if name.startswith("llama_v3") else VICUNA_EOS
    answers = [m for m in messages if m.role == "assistant"]
    for m in answers:
        span = encoded.input_ids[encoded.turn_ids == m.turn]
        assert chat.decode(span) == m.text + end, (m.turn, chat.decode(span))
    assert set(encoded.turn_ids[encoded.loss_mask > 0]) == {m.turn for m in answers}
    assert ((encoded.turn_ids > 0) == (encoded.loss_mask > 0)).all()
    # Everything else is the rendered prompt: unlabelled, and with the labelled spans it decodes to the release's.
    assert chat.decode(encoded.input_ids).replace("<image>" * encoded.image_tokens, "<image>") == \
        FIXTURE["renderings"][name][kind]
    assert np.count_nonzero(encoded.input_ids == chat.image_token_id) == GEOMETRY.num_tokens((40, 70))


def test_student_and_teacher_llama_v3_are_one_template():
    assert template_source("llama_v3_student") == template_source("llama_v3_teacher")
    own = ChatTemplate(template_source("llama_v3_teacher"), special_tokens=["<|eot_id|>"])
    assert own.own_system and not ChatTemplate(template_source("llama3"), special_tokens=["<|eot_id|>"]).own_system
