"""GGUF files (llama.cpp's format) in: a Llama LLM's config, weights and tokenizer.

:func:`read_gguf` opens a file (memory-mapped) and checks it whole before anything is loaded: the
architecture (``llama`` only), every tensor's name, quantization type and shape against the config
in the metadata, and that no tensor is missing. :meth:`GGUFFile.tensors` then yields one tensor at
a time, dequantized to float32 and renamed to transformers' ``LlamaForCausalLM`` keys and layout
(``[out, in]``, llama.cpp's rotary row order of q / k undone as transformers undoes it), which
:func:`load_gguf_llm` maps into a fire_jax model with :mod:`fire_jax.convert.hf`'s key rules.

:meth:`GGUFFile.tokenizer` rebuilds the byte-level BPE tokenizer from the vocabulary and merges in
the metadata, splitting text the way llama.cpp does for the file's ``tokenizer.ggml.pre``.

Every failure is a :class:`GGUFError`, one line naming the file and the tensor or metadata key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import numpy as np

from fire_jax.core.files import output_file, write_text
from fire_jax.models.config import LlamaConfig, LoraConfig, LlavaNextConfig, VisionConfig
from fire_jax.models.llava_next import LlavaNext


class GGUFError(ValueError):
    """A GGUF file fire_jax cannot read: ``"{path}: tensor {name}: {reason}"`` or ``"{path}: {reason}"``."""

    def __init__(self, path: str, reason: str, tensor: str | None = None):
        self.path, self.reason, self.tensor = path, reason, tensor
        where = f"{path}: tensor {tensor}: " if tensor else f"{path}: "
        super().__init__(where + " ".join(str(reason).split()))  # one line whatever the reason holds

    def __reduce__(self):  # pickled with its fields (a worker process's error reaches the parent whole)
        return GGUFError, (self.path, self.reason, self.tensor)


#: Quantization types read (dequantized by ``gguf.quants``). K-quants and i-quants are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# llama.cpp's per-layer tensor names ("blk.N.*") -> transformers' LlamaForCausalLM ("model.layers.N.*").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied in turn: each splits the pieces the
# previous one left, matches and the text between them alike (tokenizers' Split "isolated").
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` family."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is taken as is
    add_bos: bool = False  # unless the file's tokenizer.ggml.add_bos_token says otherwise


_PRE_FAMILIES = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT (also a file without tokenizer.ggml.pre)
    ("default",): PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
        PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum"): PreTokenizer((_GPT2_SPLIT,)),
    # digits one by one, then GPT-2's split (SmolLM2's tokenizer.json: Digits(individual_digits) + ByteLevel)
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
        PreTokenizer((r"\p{N}", _GPT2_SPLIT)),
}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _PRE_FAMILIES.items() for name in names}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of tokens matched whole in the text


def expected_tensors(llm: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp tensor name -> (transformers ``LlamaForCausalLM`` key, ``[out, in]`` shape) of every tensor
    a Llama with this config has (``output.weight`` only when untied)."""
    q, kv, d, f = llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim, llm.dim, llm.mlp_dim
    shapes = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
              "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_gate.weight": (f, d),
              "ffn_up.weight": (f, d), "ffn_down.weight": (d, f)}
    tensors = {"token_embd.weight": ("model.embed_tokens.weight", (llm.vocab_size, d))}
    for i in range(llm.layers):
        tensors.update({f"blk.{i}.{name}": (f"model.layers.{i}.{key}", shapes[name])
                        for name, key in _LAYER_TENSORS.items()})
    tensors["output_norm.weight"] = ("model.norm.weight", (d,))
    if not llm.tie_word_embeddings:
        tensors["output.weight"] = ("lm_head.weight", (llm.vocab_size, d))
    return tensors


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q / k row permutation (``convert_hf_to_gguf.py``'s ``permute``), as transformers'
    ``reverse_permute_weights``: per head, rows [pair, half] -> [half, pair] (interleaved RoPE pairs back
    to HF's rotate-half order). ``heads``: the query heads for q, the KV heads for k."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass
class GGUFFile:
    """A checked GGUF file: its LLM config and tokenizer settings; tensors read on demand."""

    path: str
    llm: LlamaConfig
    chat_template: str | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    reader: Any = dataclasses.field(repr=False)  # gguf.GGUFReader (memory-mapped)
    names: dict[str, str] = dataclasses.field(repr=False)  # HF key -> llama.cpp tensor name

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings decoded, arrays as lists), or ``default`` when absent."""
        return _field(self.reader, key, default)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(``LlamaForCausalLM`` key, float32 ``[out, in]`` array), one tensor in memory at a time."""
        from gguf.quants import dequantize

        by_name = {t.name: t for t in self.reader.tensors}
        for key, name in self.names.items():
            tensor = by_name[name]
            try:
                value = dequantize(tensor.data, tensor.tensor_type)
            except Exception as e:  # the package's own failure, in one line naming the tensor
                raise GGUFError(self.path, f"cannot dequantize {tensor.tensor_type.name}: {e}", name) from e
            value = np.asarray(value, np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
            if name.endswith("attn_q.weight"):
                value = unpermute_rotary(value, self.llm.heads)
            elif name.endswith("attn_k.weight"):
                value = unpermute_rotary(value, self.llm.kv_heads)
            yield key, value

    def tokenizer(self):
        """The file's tokenizer as a ``tokenizers.Tokenizer``: byte-level BPE from tokens and merges, every
        CONTROL / USER_DEFINED token a special added token at its own id, llama.cpp's split for
        ``tokenizer.ggml.pre``, a ByteLevel decoder, BOS / EOS added as llama.cpp adds them."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        model = self.field("tokenizer.ggml.model")
        if model != "gpt2":
            raise GGUFError(self.path, f"metadata tokenizer.ggml.model: {model!r} is not supported "
                                       "(only 'gpt2', byte-level BPE)")
        pre_name = self.field("tokenizer.ggml.pre") or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise GGUFError(self.path, f"metadata tokenizer.ggml.pre: {pre_name!r} is not supported "
                                       f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        pre = PRE_TOKENIZERS[pre_name]
        tokens = self.field("tokenizer.ggml.tokens")
        merges = self.field("tokenizer.ggml.merges")
        if tokens is None or merges is None:
            raise GGUFError(self.path, "metadata tokenizer.ggml.tokens / tokenizer.ggml.merges: missing")
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        special = [i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        # Tokens as the file spells them (byte-level characters), as llama.cpp looks them up.
        try:
            bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                             merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre.ignore_merges)
        except Exception as e:  # tokenizers' own message: a merge of tokens the vocabulary lacks
            raise GGUFError(self.path, f"metadata tokenizer.ggml.merges: {e}") from e
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        post_processor = self._post_processor(tokens, pre)
        if post_processor is not None:
            tokenizer.post_processor = post_processor
        if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):  # a token listed twice, say
            raise GGUFError(self.path, f"metadata tokenizer.ggml.tokens: {len(tokens)} tokens make a tokenizer "
                                       f"of {tokenizer.get_vocab_size(with_added_tokens=True)}")
        return tokenizer

    def _post_processor(self, tokens: list[str], pre: PreTokenizer):
        """The post-processor adding BOS / EOS, or None: the file's add_bos / add_eos flags, else the pre-type's."""
        from tokenizers import processors

        add_bos = self.field("tokenizer.ggml.add_bos_token", pre.add_bos) and self.bos_id is not None
        add_eos = self.field("tokenizer.ggml.add_eos_token", False) and self.eos_id is not None
        if not (add_bos or add_eos):
            return None
        ids = ([self.bos_id] if add_bos else []), ([self.eos_id] if add_eos else [])
        wrap = lambda seq: " ".join([*(tokens[i] for i in ids[0]), seq, *(tokens[i] for i in ids[1])])  # noqa: E731
        return processors.TemplateProcessing(
            single=wrap("$A"), pair=wrap("$A") + " " + wrap("$B:1"),
            special_tokens=sorted({(tokens[i], i) for i in ids[0] + ids[1]}))

    def save_tokenizer(self, folder: str) -> str:
        """Write ``folder/tokenizer.json`` and a ``tokenizer_config.json`` (chat template, BOS, EOS, PAD);
        returns the tokenizer.json path."""
        tokenizer = self.tokenizer()
        path = os.path.join(folder, "tokenizer.json")
        with output_file(path) as temporary:
            tokenizer.save(temporary)
        token = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
        config = dict(chat_template=self.chat_template, bos_token=token(self.bos_id), eos_token=token(self.eos_id),
                      pad_token=token(self.pad_id), source=os.path.basename(self.path))
        write_text(os.path.join(folder, "tokenizer_config.json"), json.dumps(config, indent=2))
        return path


# --------------------------------------------------------------------------- reading and checking

def read_gguf(path: str) -> GGUFFile:
    """Open and check a llama GGUF file (nothing dequantized yet); raises :class:`GGUFError`."""
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(path, "no such file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the package fails deep inside on a truncated or foreign file
        raise GGUFError(path, f"not a readable GGUF file (truncated or corrupt? {os.path.getsize(path)} bytes): "
                              f"{type(e).__name__}: {e}") from e
    get = lambda key, default=None: _field(reader, key, default)  # noqa: E731
    arch = get("general.architecture")
    if arch != "llama":
        raise GGUFError(path, f"architecture {arch!r} is not supported (only 'llama')")
    heads = _number(path, reader, "llama.attention.head_count")
    dim = _number(path, reader, "llama.embedding_length")
    head_dim = get("llama.attention.key_length", dim // heads)
    if get("llama.attention.value_length", head_dim) != head_dim:
        raise GGUFError(path, "metadata llama.attention.value_length: differs from key_length (not supported)")
    if get("llama.rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(path, f"metadata llama.rope.dimension_count: {get('llama.rope.dimension_count')}, "
                              f"partial rotary embeddings (head_dim {head_dim}) are not supported")
    if get("llama.rope.scaling.type", "none") != "none":
        raise GGUFError(path, f"metadata llama.rope.scaling.type: {get('llama.rope.scaling.type')!r} is not "
                              "supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = get("llama.vocab_size") or (len(tokens.data) if tokens is not None else None) or (
        int(embed.shape[1]) if embed is not None else None)
    if vocab is None:
        raise GGUFError(path, "metadata llama.vocab_size: missing (and no tokens or token_embd.weight to count)")
    llm = LlamaConfig(
        vocab_size=int(vocab), dim=dim, layers=_number(path, reader, "llama.block_count"), heads=heads,
        kv_heads=get("llama.attention.head_count_kv", heads), head_dim=head_dim,
        mlp_dim=_number(path, reader, "llama.feed_forward_length"),
        norm_eps=_float32(_number(path, reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32(get("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors))
    names = _check_tensors(path, reader, llm)
    return GGUFFile(path=path, llm=llm, chat_template=get("tokenizer.chat_template"),
                    bos_id=get("tokenizer.ggml.bos_token_id"), eos_id=get("tokenizer.ggml.eos_token_id"),
                    pad_id=get("tokenizer.ggml.padding_token_id"), reader=reader, names=names)


def _float32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.999999747378752e-06):
    the value a config file writes, equal to the file's in float32."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _field(reader, key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (numpy scalars unwrapped, strings decoded), or ``default`` when absent."""
    found = reader.fields.get(key)
    if found is None:
        return default
    value = found.contents()
    return value.item() if isinstance(value, np.generic) else value


def _number(path: str, reader, key: str) -> int | float:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(path, f"metadata {key}: missing")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise GGUFError(path, f"metadata {key}: {value!r} is not a number")
    return value


def _check_tensors(path: str, reader, llm: LlamaConfig) -> dict[str, str]:
    """HF key -> tensor name, after checking every tensor's name, type and shape against ``llm`` (the
    reader already failed on a file too short for its tensors)."""
    from gguf import GGMLQuantizationType

    expected = expected_tensors(llm)
    for tensor in reader.tensors:
        if tensor.name not in expected:
            reason = ("RoPE frequency factors (Llama-3.1 rope scaling) are not supported"
                      if tensor.name == "rope_freqs.weight" else
                      f"not a tensor of a {llm.layers}-layer llama (attention biases, extra layers and others "
                      "are not read)")
            raise GGUFError(path, reason, tensor.name)
        kind = GGMLQuantizationType(tensor.tensor_type).name
        if kind not in SUPPORTED_TYPES:
            raise GGUFError(path, f"quantization type {kind} is not supported (supported: "
                                  f"{', '.join(SUPPORTED_TYPES)})", tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dimensions innermost first
        if shape != expected[tensor.name][1]:
            raise GGUFError(path, f"shape {shape} ([out, in]), expected {expected[tensor.name][1]} from the "
                                  f"metadata (dim {llm.dim}, heads {llm.heads}/{llm.kv_heads} x {llm.head_dim}, "
                                  f"mlp {llm.mlp_dim}, vocab {llm.vocab_size})", tensor.name)
    present = {t.name for t in reader.tensors}
    missing = [name for name in expected if name not in present]
    if missing:
        raise GGUFError(path, f"missing ({len(missing)} tensor(s) missing in all)", missing[0])
    return {key: name for name, (key, _) in expected.items()}


# --------------------------------------------------------------------------- into a fire_jax model

def load_gguf_llm(model: LlavaNext, gguf: GGUFFile | str) -> LlavaNext:
    """Set ``model``'s LLM weights (embedding, layers, final norm, lm_head when untied) from a GGUF file, in
    place; returns the model. Vision tower, connector, image_newline and LoRA factors are untouched.

    ``model.cfg.llm`` must be the file's LLM config, but for a vocabulary at least as large: rows past the
    file's (tokens appended, e.g. ``<image>``) keep their current values. One tensor at a time passes
    through the host, mapped by :mod:`fire_jax.convert.hf`'s rules (the hub's ``language_model.*`` keys).
    """
    from flax import nnx

    from fire_jax.convert.hf import _flat_params, load_tensors

    gguf = gguf if isinstance(gguf, GGUFFile) else read_gguf(gguf)
    ours_cfg, theirs = model.cfg.llm, gguf.llm
    differ = [f"{f.name}={getattr(ours_cfg, f.name)!r} (file: {getattr(theirs, f.name)!r})"
              for f in dataclasses.fields(LlamaConfig)
              if f.name != "vocab_size" and getattr(ours_cfg, f.name) != getattr(theirs, f.name)]
    if ours_cfg.vocab_size < theirs.vocab_size:
        differ.append(f"vocab_size={ours_cfg.vocab_size} (file: {theirs.vocab_size}, more rows)")
    if differ:
        raise GGUFError(gguf.path, f"the model's LLM config differs from the file's: {', '.join(differ)}")
    frozen = nnx.state(model.language_model, nnx.Param)
    ours = {f"language_model.{k}": v for k, v in _flat_params(frozen).items()}
    extra = ours_cfg.vocab_size - theirs.vocab_size

    def hub_tensors():
        for key, tensor in gguf.tensors():
            if extra and key in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor = _with_rows(tensor, model, key)
            yield "language_model." + key, tensor

    loaded = load_tensors(hub_tensors(), ours, gguf.path, sharding=lambda _, target: target[...].sharding)
    missing = sorted(set(ours) - set(loaded))
    if missing:
        raise GGUFError(gguf.path, f"the model has LLM weights the file does not fill: {missing[:5]}")
    for path, variable in nnx.to_flat_state(frozen):
        variable[...] = loaded["language_model." + ".".join(str(p) for p in path)]
    return model


def _with_rows(tensor: np.ndarray, model: LlavaNext, key: str) -> np.ndarray:
    """The file's ``[file_vocab, dim]`` rows over the model's current ``[vocab, dim]`` (HF layout)."""
    import jax

    current = (model.language_model.model.embed_tokens.embedding[...] if key == "model.embed_tokens.weight"
               else model.language_model.lm_head.kernel[...].T)
    rows = np.array(jax.device_get(current), np.float32)
    rows[:tensor.shape[0]] = tensor
    return rows


def llava_from_gguf(path: str, vision: VisionConfig, lora: LoraConfig | None, extra_vocab: int = 0,
                    seed: int = 0, **overrides) -> LlavaNext:
    """A LLaVA-NeXT with the GGUF file's LLM: vision tower, connector and image_newline random (``seed``).

    ``extra_vocab`` rows are appended to the vocabulary with the model's init (the first is the default
    ``image_token_id``); ``overrides`` set other LlavaNextConfig fields (``dtype``, ``param_dtype``, ...).
    """
    from flax import nnx

    gguf = read_gguf(path)
    llm = dataclasses.replace(gguf.llm, vocab_size=gguf.llm.vocab_size + extra_vocab)
    if extra_vocab:
        overrides.setdefault("image_token_id", gguf.llm.vocab_size)
    cfg = LlavaNextConfig(vision=vision, llm=llm, lora=lora, **overrides)
    return load_gguf_llm(LlavaNext(cfg, rngs=nnx.Rngs(seed)), gguf)


#: The vision tower of a LLaVA built around a GGUF file's LLM for text-only inputs: the smallest CLIP.
TEXT_ONLY_VISION = VisionConfig(image_size=14, patch_size=14, width=16, layers=1, heads=1, mlp_dim=16)


__all__ = ["GGUFError", "GGUFFile", "PreTokenizer", "PRE_TOKENIZERS", "SUPPORTED_TYPES", "read_gguf",
           "expected_tensors", "unpermute_rotary", "load_gguf_llm", "llava_from_gguf", "TEXT_ONLY_VISION"]
