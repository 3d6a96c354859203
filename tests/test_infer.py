"""Decoding against transformers' generate and against our own full forward."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from PIL import Image

from fire_jax.core.config import ASSETS_DIR
from fire_jax.convert import hf as convert
from fire_jax.data.chat import ChatTokenizer
from fire_jax.data.images import preprocess
from fire_jax.data.records import Turn
from fire_jax.data.scores import parse_score
from fire_jax.dialogue.agents import Student, Teacher
from fire_jax.infer.backends import InProcess
from fire_jax.infer.buckets import Buckets
from fire_jax.infer.decode import generate
from fire_jax.infer.engine import left_pad
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.kernels import TRACE_COUNTS
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.forward import image_inputs, normalise_sizes
from hf_reference import hf_logits, jit_call, load_tool, make_batch, rel_err, tiny_hf_model

# Mixed batch: three aspect ratios (different tile counts and token counts) and two text-only prompts.
SIZES = [(40, 70), (30, 90), None, (64, 64), None]
TEXT = [(3, 5), (9, 2), (7, 0), (1, 1), (20, 0)]
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, stop_ids=())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, our model from its checkpoint, checkpoint dir)."""
    directory = str(tmp_path_factory.mktemp("hf_decode"))
    hf = tiny_hf_model(directory)
    # Larger embeddings make greedy outputs vary; unscaled, the random model repeats one token.
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(8.0)
    hf.save_pretrained(directory)
    return hf, convert.load_hf_checkpoint(directory), directory


@pytest.fixture(scope="module")
def batch(pair):
    """(prompts as unpadded token lists, pixel_values [B, max_tiles, 3, H, W])."""
    ids, _, pixel_values, _, lengths = make_batch(pair[1].cfg.geometry, SIZES, TEXT)
    return [ids[b, :n].tolist() for b, n in enumerate(lengths)], pixel_values


@pytest.fixture(scope="module")
def free_run(pair, batch):
    """Greedy, no stop ids: every row runs NEW tokens."""
    prompts, pixel_values = batch
    return generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES, sampling=GREEDY)


@pytest.fixture(scope="module")
def stop(free_run):
    """A stop id greedy emits mid-sequence in some row (first occurrence at step >= 3), and the expected cut tokens."""
    tokens = free_run.tokens
    stop_id = next(int(row[k]) for row in tokens for k in range(3, NEW - 3) if row[k] not in row[:k])
    expected = np.full_like(tokens, -1)
    for b, row in enumerate(tokens):
        hits = np.flatnonzero(row == stop_id)
        end = hits[0] + 1 if len(hits) else NEW
        expected[b, :end] = row[:end]
    assert (expected == -1).any()
    return stop_id, expected


def _hf_generate(hf, prompts, pixel_values, sizes, stop_id):
    """HF greedy generate on a left-padded batch; new tokens with -1 after the first stop, NEW columns."""
    length = max(map(len, prompts))
    ids, mask, _ = left_pad(prompts, length, 0)
    kwargs = dict(input_ids=torch.as_tensor(ids, dtype=torch.long),
                  attention_mask=torch.as_tensor(mask, dtype=torch.long))
    if sizes is not None:
        kwargs.update(pixel_values=torch.as_tensor(pixel_values), image_sizes=torch.as_tensor(sizes))
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=stop_id)
    new = out[:, length:].numpy()
    result = np.full((len(prompts), NEW), -1, np.int64)
    for b, row in enumerate(new):
        hits = np.flatnonzero(row == stop_id)
        end = hits[0] + 1 if len(hits) else len(row)
        result[b, :end] = row[:end]
    return result


def test_greedy_matches_hf_generate(pair, batch, stop):
    hf, model, _ = pair
    prompts, pixel_values = batch
    stop_id, _ = stop
    ours = generate(model, prompts, pixel_values=pixel_values, image_sizes=SIZES,
                    sampling=SamplingParams(max_tokens=NEW, stop_ids=(stop_id,)))
    # HF cannot mix text-only and image examples in one batch: one batched call for each kind.
    with_image = [b for b, s in enumerate(SIZES) if s is not None]
    text_only = [b for b, s in enumerate(SIZES) if s is None]
    ref = np.zeros_like(ours.tokens)
    ref[with_image] = _hf_generate(hf, [prompts[b] for b in with_image], pixel_values[with_image],
                                   [SIZES[b] for b in with_image], stop_id)
    ref[text_only] = _hf_generate(hf, [prompts[b] for b in text_only], None, None, stop_id)
    print("ours:\n", ours.tokens, "\nHF:\n", ref)
    np.testing.assert_array_equal(ours.tokens, ref)
    assert len({len(p) for p in prompts}) == len(prompts)  # all prompt lengths differ: left padding is exercised


def test_stop_pads_with_minus_one_and_does_not_extend(pair, batch, stop, free_run):
    prompts, pixel_values = batch
    stop_id, expected = stop
    out = generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES,
                   sampling=SamplingParams(max_tokens=NEW, stop_ids=(stop_id,)))
    np.testing.assert_array_equal(out.tokens, expected)
    cut = out.tokens == -1
    assert cut.any() and (out.logprobs[cut] == 0).all()
    np.testing.assert_allclose(out.logprobs[~cut], free_run.logprobs[~cut], rtol=1e-6)
    np.testing.assert_array_equal(out.lengths, (expected >= 0).sum(axis=1))


def test_inactive_padding_rows_change_nothing(pair, batch, stop):
    prompts, pixel_values = batch
    stop_id, expected = stop
    out = generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES,
                   sampling=SamplingParams(max_tokens=NEW, stop_ids=(stop_id,)), pad_rows=len(prompts) + 3)
    np.testing.assert_array_equal(out.tokens, expected)  # only the real rows come back, unchanged


def test_cached_decode_equals_full_forward_every_step(pair, batch, free_run):
    """The log-prob of every generated token equals a cache-free forward over prompt + generated tokens."""
    model = pair[1]
    prompts, pixel_values = batch
    tokens = free_run.tokens
    full = [p + row.tolist() for p, row in zip(prompts, tokens)]
    length = max(map(len, full))
    ids, mask, positions = left_pad(full, length, 0)
    # Images are laid out from the prompt alone: a generated id may equal the image token (it is text there).
    prompt_only = np.where(np.arange(length) < length - NEW, ids, 0)
    pixels, image_index = image_inputs(model, prompt_only, pixel_values, normalise_sizes(SIZES, len(SIZES)))
    logits = np.asarray(jit_call(model, *map(jnp.asarray, (ids, pixels, image_index, mask, positions))))
    # Left padding: every row ends at the last slot; generated token k is predicted at length - NEW - 1 + k.
    predicting = logits[:, length - NEW - 1:length - 1].astype(np.float64)
    top = predicting.max(-1, keepdims=True)
    logprobs = predicting - top - np.log(np.exp(predicting - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(predicting.argmax(-1), tokens)
    assert np.abs(picked - free_run.logprobs).max() < 1e-4
    assert len({tuple(r) for r in tokens}) == len(tokens) and all(len(set(r)) > 3 for r in tokens)


def test_decode_chunks_and_windows_change_no_token(pair, batch, free_run, stop):
    """A decode chunk attends over a window of the cache that grows between chunks: chunks of one step (a
    window per 16 columns) and of all the steps (one window, the whole cache), with a stop mid-chunk, write
    the same tokens and log-probs."""
    prompts, pixel_values = batch
    for chunk in (1, NEW):
        out = generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES,
                       sampling=GREEDY, engine=EngineConfig(chunk=chunk, bucket_min=16))
        np.testing.assert_array_equal(out.tokens, free_run.tokens)
        np.testing.assert_allclose(out.logprobs, free_run.logprobs, rtol=1e-5, atol=1e-6)
    stop_id, expected = stop
    stopped = generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES,
                       sampling=SamplingParams(max_tokens=NEW, stop_ids=(stop_id,)), engine=EngineConfig(chunk=1))
    np.testing.assert_array_equal(stopped.tokens, expected)


def test_greedy_token_is_argmax_and_logprob_is_log_softmax():
    from fire_jax.infer.sampling import greedy_token, token_logprob

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1000)), jnp.float32)
    logits = logits.at[1, 7].set(9.0).at[1, 500].set(9.0)  # a tie: the first index wins, as argmax
    np.testing.assert_array_equal(greedy_token(logits), jnp.argmax(logits, axis=-1))
    assert int(greedy_token(logits)[1]) == 7
    token = jnp.asarray([3, 7, 999, 0])
    np.testing.assert_allclose(token_logprob(logits, token),
                               jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0],
                               rtol=1e-6, atol=1e-6)


def test_sampling_reproducible_and_greedy_limits(pair, batch, free_run):
    model = pair[1]
    prompts, pixel_values = batch
    kw = dict(pixel_values=pixel_values, image_sizes=SIZES)
    sampling = SamplingParams(max_tokens=NEW, stop_ids=(), temperature=1.5, top_k=100, top_p=0.95)
    first = generate(model, prompts, sampling=sampling, rng=jax.random.key(1), **kw).tokens
    again = generate(model, prompts, sampling=sampling, rng=jax.random.key(1), **kw).tokens
    other = generate(model, prompts, sampling=sampling, rng=jax.random.key(2), **kw).tokens
    np.testing.assert_array_equal(first, again)
    assert (first != other).mean() > 0.3
    assert (first != free_run.tokens).mean() > 0.3
    top_p_zero = SamplingParams(max_tokens=NEW, stop_ids=(), temperature=1.0, top_p=0.0)
    np.testing.assert_array_equal(generate(model, prompts, sampling=top_p_zero, rng=jax.random.key(3), **kw).tokens,
                                  free_run.tokens)
    with pytest.raises(ValueError, match="rng"):
        generate(model, prompts, sampling=sampling, **kw)


def test_sampler_filters_per_row():
    """Top-k and top-p keep exactly the tokens they should, in HF's proportions, each row with its own
    settings; a greedy row beside sampled ones takes its argmax."""
    from fire_jax.infer.sampling import Nucleus, RowSettings, pick

    probs = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = jnp.asarray(np.tile(np.log(probs), (n, 1)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), n)

    def freq(temperature=1.0, top_k=0, top_p=1.0):
        full = lambda v, dtype: jnp.full((n,), v, dtype)
        drawn = np.asarray(Nucleus(full(temperature, jnp.float32), full(top_k, jnp.int32),
                                   full(top_p, jnp.float32))(logits, keys))
        return np.bincount(drawn, minlength=4) / len(drawn)

    top_p = freq(top_p=0.7)  # 0.5 + 0.3 reaches 0.7: tokens 0 and 1
    assert top_p[2:].sum() == 0 and abs(top_p[0] - 0.5 / 0.8) < 0.03
    top_k = freq(top_k=3)
    assert top_k[3] == 0 and abs(top_k[2] - 0.15 / 0.95) < 0.03
    assert abs(freq()[3] - 0.05) < 0.015
    assert freq(temperature=0.7, top_k=1)[0] == 1.0
    skewed = np.log([0.1, 0.6, 0.3, 1e-9])
    mixed = RowSettings(temperature=jnp.asarray([0.0, 1.0, 1.0, 0.0]), top_k=jnp.asarray([0, 0, 1, 0]),
                        top_p=jnp.ones(4), seeds=jnp.arange(4, dtype=jnp.uint32))
    token, logprob = pick(jnp.asarray(np.tile(skewed, (4, 1)), jnp.float32), mixed, jnp.zeros(4, jnp.int32))
    token = np.asarray(token)
    assert token[0] == 1 and token[2] == 1 and token[3] == 1  # greedy rows, and a top-1 row
    np.testing.assert_allclose(logprob, skewed[token], rtol=1e-4)
    # the filters run only when a row asks (lax.cond): rows that filter nothing draw the same tokens either way
    wide = jax.random.normal(jax.random.key(1), (6, 3000)) * 3
    wide_keys = jax.random.split(jax.random.key(2), 6)
    plain = Nucleus(jnp.ones(6), jnp.zeros(6, jnp.int32), jnp.ones(6))
    beside_filters = Nucleus(jnp.ones(6), jnp.asarray([0, 0, 0, 0, 5, 0]), jnp.asarray([1, 1, 1, 1, 1, 0.5]))
    unfiltered, filtered = np.asarray(plain(wide, wide_keys)), np.asarray(beside_filters(wide, wide_keys))
    assert (unfiltered[:4] == filtered[:4]).all() and len(set(unfiltered.tolist())) > 3
    np.testing.assert_array_equal(plain.scores(wide), wide)
    assert filtered[4] in np.argsort(np.asarray(wide[4]))[-5:]


def test_compilations_bounded_by_buckets(pair):
    model = pair[1]
    config = SamplingParams(max_tokens=3, stop_ids=())  # a config no other test compiles
    step = Buckets(64, 1024).prompt
    assert [step(n) for n in (1, 64, 65, 1000, 1025, 3000)] == [64, 64, 128, 1024, 2048, 3072]
    fine = Buckets(64).prompt
    assert [fine(n) for n in (1, 64, 65, 400, 512, 513, 1025, 3000)] == [64, 64, 128, 448, 512, 640, 1280, 3072]
    # a bucket past the room a cache row leaves falls back to the length rounded up to bucket_min
    assert step(600, room=1024) == 1024 and step(600, room=700) == 640

    def traces_for(lengths):
        before = dict(TRACE_COUNTS)
        generate(model, [list(range(1, n + 1)) for n in lengths], sampling=config)
        return {k: TRACE_COUNTS[k] - before.get(k, 0) for k in ("engine_admit", "engine_decode")}

    assert traces_for([5, 9]) == {"engine_admit": 1, "engine_decode": 1}
    assert traces_for([17, 40]) == {"engine_admit": 0, "engine_decode": 0}
    assert traces_for([64, 2]) == {"engine_admit": 0, "engine_decode": 0}
    assert traces_for([3, 70]) == {"engine_admit": 2, "engine_decode": 1}  # a row in the next bucket


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
def test_mesh_data_tensor_matches_single_device(pair, batch, free_run):
    prompts, pixel_values = batch
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    out = generate(pair[1], prompts, pixel_values=pixel_values, image_sizes=SIZES, sampling=GREEDY, mesh=mesh)
    np.testing.assert_array_equal(out.tokens, free_run.tokens)
    np.testing.assert_allclose(out.logprobs, free_run.logprobs, atol=1e-5)


def test_hf_logits_tool(pair, tmp_path):
    hf, model, directory = pair
    sizes = [(40, 70), None, (30, 90)]
    ids, mask, pixel_values, _, lengths = make_batch(model.cfg.geometry, sizes, [(3, 5), (30, 0), (2, 2)])
    image_sizes = np.array([s or (0, 0) for s in sizes])
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=mask, pixel_values=pixel_values,
             image_sizes=image_sizes)
    load_tool("hf_logits").main(["--model", directory, "--inputs", str(tmp_path / "in.npz"),
                                  "--out", str(tmp_path / "out.npz")])
    logits = np.load(tmp_path / "out.npz")["logits"]
    assert logits.shape == (*ids.shape, model.cfg.llm.vocab_size) and logits.dtype == np.float32
    for b, size in enumerate(sizes):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        ref = hf_logits(hf, ids[b, :lengths[b]], pixel_values[b, :tiles], size)
        assert rel_err(logits[b, :lengths[b]], ref) < 1e-4


def test_hf_generate_tool(pair, batch, stop, tmp_path):
    _, _, directory = pair
    prompts, pixel_values = batch
    stop_id, expected = stop
    ids, mask, _ = left_pad(prompts, max(map(len, prompts)) + 3, 0)  # HF-style left padding, extra pad columns
    image_sizes = np.array([s or (0, 0) for s in SIZES])
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=mask, pixel_values=pixel_values,
             image_sizes=image_sizes)
    load_tool("hf_generate").main(["--model", directory, "--inputs", str(tmp_path / "in.npz"), "--max_new_tokens",
                                    str(NEW), "--stop_ids", str(stop_id), "--out", str(tmp_path / "out.npz")])
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["generated_ids"], expected)


# ---------------------------------------------------------------------------------------------- agents

SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content that the "
          "user provides, and assist the user with a variety of tasks using natural language.")
INSTRUCTION = """Please compare my answer with the groundtruth answer and provide helpful, detailed, and polite feedback to help me improve my answer.
Formulate the feedback as:
'''
Score: <compare my answer with the groundtruth answer in terms of accuracy, relevance, helpfulness, and level of detail, and provide an overall score on a scale of 1 to 10, where a higher score indicates better overall performance.>
Feedback: <provide feedback on my answer. Do NOT directly tell the groundtruth answer. The feedback should identify which parts of my answer are incorrect, what is missing in my answer, and how to improve my answer.>
'''"""
HEAD = f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
IMAGES = [(40, 70), (64, 64)]
HISTORY = [Turn("Thought: two red shapes.\nAnswer: 2", "Score: 3.\nFeedback: Count the squares too.", 3),
           Turn("Thought: and one square.\nAnswer: 3", "Score: 6\nFeedback: Look at the right edge.", 6)]


def _user(text):
    return f"<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"


def _assistant(text):
    return f"<|start_header_id|>assistant<|end_header_id|>\n\n{text}<|eot_id|>"


GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def chat(pair):
    return ChatTokenizer.from_file(os.path.join(ASSETS_DIR, "tiny_tokenizer.json"), pair[1].cfg.geometry)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGES]


def _shown(chat, encoded, size):
    """Decoded prompt with its block of image tokens collapsed back to one "<image>"."""
    ids = encoded.input_ids.tolist()
    assert ids.count(chat.image_token_id) == chat.geometry.num_tokens(size)
    start = ids.index(chat.image_token_id)
    return chat.decode(ids[:start + 1] + [i for i in ids[start:] if i != chat.image_token_id])


def _encoded(chat, prompts, sizes):
    """The token ids an in-process backend generates from: each prompt's messages rendered with the assistant
    header, its image expanded for its size."""
    return [chat.encode(messages, size, add_generation_prompt=True) for messages, size in zip(prompts, sizes)]


def test_agents_render_spec_prompts(pair, chat):
    student = Student(InProcess(pair[1], chat))
    first, third = _encoded(chat, student.prompts(["How many shapes?", "How many shapes?"], [[], HISTORY]), IMAGES)
    assert _shown(chat, first, IMAGES[0]) == HEAD + _user("<image>\nHow many shapes?") + GEN
    assert _shown(chat, third, IMAGES[1]) == (
        HEAD + _user("<image>\nHow many shapes?") + _assistant("Thought: two red shapes.\nAnswer: 2")
        + _user("Count the squares too.") + _assistant("Thought: and one square.\nAnswer: 3")
        + _user("Look at the right edge.") + GEN)
    question = _user("<image>\nQuestion: How many shapes?\nGroundtruth: 4") + _user(INSTRUCTION)
    backend = InProcess(pair[1], chat)
    (latest,) = _encoded(chat, Teacher(backend).prompts(["How many shapes?"], ["4"], ["Answer: 4"], [HISTORY]),
                         IMAGES[1:])
    assert _shown(chat, latest, IMAGES[1]) == HEAD + question + _user("Answer: 4") + GEN
    (full,) = _encoded(chat, Teacher(backend, history="full").prompts(["How many shapes?"], ["4"], ["Answer: 4"],
                                                                      [HISTORY]), IMAGES[1:])
    assert _shown(chat, full, IMAGES[1]) == (
        HEAD + question + _user(HISTORY[0].response) + _assistant(HISTORY[0].feedback)
        + _user(HISTORY[1].response) + _assistant(HISTORY[1].feedback) + _user("Answer: 4") + GEN)
    with pytest.raises(ValueError, match="history"):
        Teacher(backend, history="all")


def _hf_greedy_text(hf, model, chat, image, prompt, max_new_tokens):
    """transformers' greedy generate on one rendered prompt (same ids, same processed pixels), decoded."""
    tiles, size = preprocess(image, model.cfg.geometry)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.as_tensor(prompt.input_ids, dtype=torch.long)[None],
                          pixel_values=torch.as_tensor(tiles)[None], image_sizes=torch.as_tensor([size]),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=chat.pad_id,
                          eos_token_id=[chat.eot_id, chat.eos_id])
    new = out[0, len(prompt.input_ids):].tolist()
    new = [i for i in new if i not in (chat.eot_id, chat.eos_id, chat.pad_id)]
    return chat.tokenizer.decode(new, skip_special_tokens=True).strip()


def test_agents_generate_as_hf_on_their_prompts(pair, chat, images):
    """Student.respond and Teacher.feedback = HF greedy generate on the same prompt ids and processed pixels."""
    hf, model, _ = pair
    config = SamplingParams(max_tokens=NEW)
    questions = ["How many shapes?", "What colour is the square?"]
    histories = [[], HISTORY[:1]]
    backend = InProcess(model, chat, config)
    student = Student(backend)
    responses = student.respond(images, questions, histories)
    prompts = _encoded(chat, student.prompts(questions, histories), IMAGES)
    for image, prompt, response in zip(images, prompts, responses):
        assert response == _hf_greedy_text(hf, model, chat, image, prompt, NEW)
    assert any(responses)
    groundtruths, answers = ["3", "red"], ["Thought: I see three.\nAnswer: 3", responses[1]]
    for history in ("latest", "full"):  # the teacher's prompt for f_k with and without the earlier turns
        teacher = Teacher(backend, history=history)
        feedback = teacher.feedback(images, questions, groundtruths, answers, histories)
        prompts = _encoded(chat, teacher.prompts(questions, groundtruths, answers, histories), IMAGES)
        assert len(feedback) == 2 and any(f.text for f in feedback)
        for image, prompt, f in zip(images, prompts, feedback):
            assert f.text == _hf_greedy_text(hf, model, chat, image, prompt, NEW)
            assert f.score == parse_score(f.text)


def test_teacher_feedback_carries_the_parsed_score(pair, chat, images, monkeypatch):
    """Feedback.score is the score of the generated text (fire_jax.data.scores.parse_score); no score line gives None."""
    teacher = Teacher(InProcess(pair[1], chat))
    texts = ["Score: 7.\nFeedback: Count the squares too.", "Feedback: Look again.", "Score: 10/10\nFeedback: Yes."]
    monkeypatch.setattr(teacher.backend, "generate", lambda images_, prompts, sampling=None, rng=None: texts[:len(prompts)])
    feedback = teacher.feedback(images + images[:1], ["q"] * 3, ["gt"] * 3, ["Answer: 1"] * 3)
    assert [(f.text, f.score) for f in feedback] == list(zip(texts, [7, None, 10]))


def test_loaded_models_decode_from_the_layer_list():
    """A config that trains with stacked layers (scan_layers=True, the 8B configs) loads for generation as the
    per-layer list, with the same weights: greedy tokens equal those of the list-layout model of the same seed."""
    from fire_jax.core.config import load_config
    from fire_jax.infer.loading import load

    config = load_config(os.path.join(os.path.dirname(ASSETS_DIR), "..", "configs", "tiny.py"))
    stacked = load_config(os.path.join(os.path.dirname(ASSETS_DIR), "..", "configs", "tiny.py"))
    stacked.model.scan_layers = True
    plain, loaded = load(config), load(stacked)
    assert loaded.model.cfg.scan_layers is False
    prompts = [[1, 5, 9, 200, 17], [3, 4]]
    sampling, shape = SamplingParams(max_tokens=6), EngineConfig(pad_id=plain.chat.pad_id)
    want = generate(plain.model, prompts, sampling=sampling, engine=shape).tokens
    got = generate(loaded.model, prompts, sampling=sampling, engine=shape).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_agent_writes_what_generate_writes_and_samples_by_its_key():
    """An agent's engine (slots for batch_size or the call's rows, prefixes reused across calls, a longer cache
    built when a call needs one) writes the texts of generate's one fixed batch for image prompts of several
    lengths and for text prompts; a sampled call draws by its rng key: the same key the same texts, and those
    of generate with that key."""
    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.data.images import pad_tiles
    from fire_jax.infer.loading import load

    loaded = load(load_config(DEFAULT_CONFIG))
    embed = loaded.model.language_model.model.embed_tokens.embedding
    embed.set_value(embed.get_value() * 50)  # unit-scale embeddings: greedy outputs vary instead of repeating
    student = Student(InProcess(loaded.model, loaded.chat, SamplingParams(max_tokens=12), batch_size=4))
    backend = student.backend
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)) for h, w in
              [(40, 70), (64, 64), (30, 90), (50, 50), (70, 40), (32, 32)]]
    questions = ["What colour?", "How many shapes are there, and which one is the largest of them all?",
                 "Which shape?", "Where is it?", "Count them.", "What is this?"]
    turn = Turn("Thought: I count them.\nAnswer: 3", "Look again at the left side.\nScore: 4", 4.0)
    histories = [(), (turn,), (), (turn, turn), (), (turn, turn, turn)]

    def reference(images, questions, histories):
        sizes = [(i.height, i.width) for i in images]
        prompts = _encoded(loaded.chat, student.prompts(questions, histories), sizes)
        pixel_values = pad_tiles([preprocess(i, loaded.model.cfg.geometry)[0] for i in images])
        out = generate(loaded.model, [p.input_ids for p in prompts], pixel_values=pixel_values, image_sizes=sizes,
                       sampling=backend.sampling, engine=backend.engine_config, tokenizer=loaded.chat.tokenizer)
        return [t.strip() for t in out.texts]

    texts = student.respond(images, questions, histories)
    assert texts == reference(images, questions, histories)
    engine = backend._engine
    assert engine.slots == 6 and engine.stats["requests"] == 6
    again = student.respond(images, questions, histories)  # the same prompts: prefixes reused
    assert again == texts and backend._engine.stats["reused_tokens"] > 0
    # Chat prompts end alike, so this random model answers them alike; random token prompts vary.
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 70, 130, 20, 250, 9)]
    texts = backend.generate_ids(prompts, None, None)
    ref = generate(loaded.model, prompts, sampling=backend.sampling, engine=backend.engine_config,
                   tokenizer=loaded.chat.tokenizer).texts
    assert texts == ref and len(set(texts)) > 4
    long = student.respond(images[:1], questions[:1], [(turn,) * 12])
    assert backend._engine.cache_len > engine.cache_len
    assert long == reference(images[:1], questions[:1], [(turn,) * 12])
    sampler = InProcess(loaded.model, loaded.chat, SamplingParams(max_tokens=12, temperature=1.0), engine=EngineConfig(prefix_cache=False),
                             batch_size=4)
    drawn = sampler.generate_ids(prompts, None, None, rng=jax.random.key(5))
    assert drawn == sampler.generate_ids(prompts, None, None, rng=jax.random.key(5))
    assert drawn != sampler.generate_ids(prompts, None, None, rng=jax.random.key(6)) and drawn != texts
    assert drawn == generate(loaded.model, prompts, sampling=sampler.sampling, engine=sampler.engine_config,
                             tokenizer=loaded.chat.tokenizer, rng=jax.random.key(5)).texts


def test_agent_keeps_one_engine_of_batch_size_slots_for_short_calls():
    """An agent built with batch_size keeps one engine of that many slots (one set of compiled shapes) for
    calls of fewer rows, and returns the real rows' texts only."""
    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.infer.loading import load

    loaded = load(load_config(DEFAULT_CONFIG))
    student = Student(InProcess(loaded.model, loaded.chat, SamplingParams(max_tokens=3), batch_size=4))
    image = Image.new("RGB", (40, 30), "red")
    one = student.respond([image], ["What colour?"])
    engine = student.backend._engine
    three = student.respond([image] * 3, ["What colour?", "Which shape?", "How many?"])
    assert student.backend._engine is engine and engine.slots == 4 and len(one) == 1 and len(three) == 3
    assert three[0] == one[0]  # the same prompt, greedy: the rows beside it change nothing
    unpadded = Student(InProcess(loaded.model, loaded.chat, SamplingParams(max_tokens=3)))
    assert unpadded.respond([image], ["What colour?"]) == one and unpadded.backend._engine.slots == 1


def test_in_process_streams_what_it_generates_refuses_over_its_context_and_stops_when_asked():
    """InProcess.stream passes the text on as it grows (pieces adding up to generate's greedy text, the token
    count rising), refuses a prompt over its streaming context before any work, and ends (cancelling the
    request) when on_delta raises; the engine goes on serving. Backends of one loaded model share it."""
    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.infer.factory import generator
    from fire_jax.infer.backends import Refused

    models = {}
    backend, other = (generator(None, SamplingParams(max_tokens=8), config=load_config(DEFAULT_CONFIG), context=256,
                                models=models) for _ in range(2))
    student = Student(backend)
    image = Image.new("RGB", (40, 30), "red")
    (messages,) = student.prompts(["What colour?"], [()])
    pieces = []
    text = backend.stream(image, messages, lambda piece, tokens: pieces.append((piece, tokens)))
    assert text == student.respond([image], ["What colour?"])[0] and text
    tokens = [t for _, t in pieces]
    assert "".join(p for p, _ in pieces).strip() == text and tokens[0] == 1 and tokens == sorted(set(tokens))
    with pytest.raises(Refused, match="context"):
        backend.stream(image, student.prompts(["word " * 300], [()])[0], lambda *_: None)

    class Enough(Exception):
        pass

    def enough(piece, tokens):
        raise Enough

    with pytest.raises(Enough):
        backend.stream(image, messages, enough)
    assert backend.stream(image, messages, lambda *_: None) == text
    assert other.streaming_engine() is backend.streaming_engine() and other.model is backend.model


def test_serving_backend_updates_count_tokens_refuse_and_cancel():
    """Serving, the server's backend: a submitted request's updates carry pieces adding up to its text, the
    prompt's tokens and the tokens generated so far, then the finish reason ("length" at max_tokens, no stop ids);
    its greedy text is generate's. A prompt over the context is refused before any work ("context"), a waiting
    request cancelled ends at once ("cancelled", nothing generated), a stopped backend refuses ("stopping"), and
    stats count what it served."""
    import queue

    from fire_jax.core.config import DEFAULT_CONFIG, load_config
    from fire_jax.data.chat import Message
    from fire_jax.infer.backends import Refused, Serving
    from fire_jax.infer.loading import load

    loaded = load(load_config(DEFAULT_CONFIG))
    backend = Serving(loaded.model, loaded.chat, EngineConfig(bucket_step=None, slots=2, cache_len=256, chunk=2))
    llm = loaded.model.cfg.llm
    assert (backend.context, backend.slots, backend.max_images) == (256, 2, 4)
    assert backend.kv_cache_bytes == 2 * llm.layers * 2 * llm.kv_heads * 256 * llm.head_dim * 4  # float32
    with pytest.raises(Refused, match="exceeds the context of 256 tokens") as refused:
        backend.request([Message("user", "word " * 300)], [], SamplingParams(max_tokens=8))
    assert refused.value.kind == "context"

    heard = []  # not started: the request waits, and a cancel ends it at once
    waiting = backend.request([Message("user", "Hello there")], [], SamplingParams(max_tokens=50, stop_ids=()))
    ticket = backend.submit(waiting, heard.append)
    assert backend.in_flight == 1 and backend.cancel(ticket) and not backend.cancel(ticket)
    assert [(u.reason, u.prompt_tokens, u.completion_tokens) for u in heard] == [("cancelled", len(waiting.prompt), 0)]
    assert backend.in_flight == 0 and backend.stats["cancelled"] == 1

    image, messages = Image.new("RGB", (40, 30), "red"), [Message("user", "What colour?", images=1)]
    sampling = SamplingParams(max_tokens=6, stop_ids=())
    request = backend.request(messages, [image], sampling)
    updates: queue.SimpleQueue = queue.SimpleQueue()
    backend.start()
    try:
        backend.submit(request, updates.put)
        heard = [updates.get(timeout=300)]
        while heard[-1].reason is None:
            heard.append(updates.get(timeout=300))
    finally:
        backend.stop()
    last = heard[-1]
    assert (last.reason, last.completion_tokens, last.prompt_tokens, last.error) == ("length", 6, len(request.prompt),
                                                                                     None)
    assert "".join(u.delta for u in heard) == last.text and last.text.strip()
    counts = [u.completion_tokens for u in heard]
    assert counts == sorted(counts) and counts[0] >= 1
    assert last.text.strip() == InProcess(loaded.model, loaded.chat, sampling).generate([image], [messages])[0]
    assert backend.stats["requests"] == 1 and backend.stats["prompt_tokens"] == len(request.prompt)
    with pytest.raises(Refused) as refused:
        backend.submit(request, updates.put)
    assert refused.value.kind == "stopping"
