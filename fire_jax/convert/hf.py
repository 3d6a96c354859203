"""Hugging Face LLaVA-NeXT and LLaVA-1.5 checkpoints <-> fire_jax NNX models, and PEFT adapters out.

Two architectures: transformers' ``LlavaNextForConditionalGeneration`` (``model_type`` "llava_next": llava-hf's
llama3-llava-next-8b-hf and llava-v1.6-vicuna-7b-hf) and ``LlavaForConditionalGeneration`` ("llava":
llava-1.5-7b-hf; no image_newline, one padded-to-square tile per image: ``architecture="llava"``,
``image_mode="pad"``). Both store the same keys apart from image_newline.

One function per tensor family (MaxText's layout): a rule maps each HF key to a
path in our state and a transform of the tensor. Loading streams one tensor at
a time from the safetensors files into an abstract model, so the 8B weights
never exist twice in host memory.

Key layouts read: the hub's (``language_model.model.*``, ``language_model.lm_head``,
``vision_tower.vision_model.*`` or ``vision_tower.*``, ``multi_modal_projector.*``,
``image_newline``) and transformers' in-memory one (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head.*``). Written: the hub's.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.core.config import InputError
from fire_jax.core.results import read_json_object
from fire_jax.core.geometry import DEFAULT_PINPOINTS
from fire_jax.models.config import ARCHITECTURES, LlamaConfig, LlavaNextConfig, LoraConfig, VisionConfig
from fire_jax.models.layers import InitKeys, LoRAParam
from fire_jax.models.llava_next import LlavaNext

# Defaults of transformers' config classes, for keys a config.json leaves out.
_HF_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False)
_HF_CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                         image_size=224, patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu")
# LlavaNextConfig's vision tower when its config.json has no vision_config at all.
_LLAVA_DEFAULT_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                             image_size=336, patch_size=14)


# --------------------------------------------------------------------------- configs

def hf_architecture(hf: dict) -> str:
    """``LlavaNextConfig.architecture`` of a HF ``config.json`` dict: by ``model_type``, else ``architectures``."""
    by_type = {"llava_next": "llava_next", "llava": "llava"}
    model_type, architectures = hf.get("model_type"), hf.get("architectures")
    if isinstance(model_type, str) and model_type in by_type:
        return by_type[model_type]
    for name in architectures if isinstance(architectures, list) else ():
        for ours, theirs in ARCHITECTURES.items():
            if name == theirs:
                return ours
    if "model_type" in hf or architectures:
        raise ValueError(f"model_type={model_type!r}, architectures={architectures!r} is neither of "
                         f"{sorted(ARCHITECTURES.values())}")
    return "llava_next"


def _check_shape_fields(section: dict, what: str, ints: Sequence[str], numbers: Sequence[str] = (),
                        optional: Sequence[str] = ()) -> None:
    """ValueError naming the first field of a config section that is not a positive integer (``ints``, and
    ``optional`` ones when set) or a positive number (``numbers``): a damaged config.json ends in one line, not in
    a shape error deep in the model."""
    for name in (*ints, *(n for n in optional if section.get(n) is not None)):
        value = section.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"field {name!r} ({what}) = {value!r}: expected a positive integer")
    for name in numbers:
        value = section.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"field {name!r} ({what}) = {value!r}: expected a positive number")


def config_from_hf(hf: dict, lora: LoraConfig | None = LoraConfig(), **overrides) -> LlavaNextConfig:
    """Our config from a HF LLaVA-NeXT or LLaVA ``config.json`` dict (missing keys take HF's defaults).

    A LLaVA (1.5) config gives ``architecture="llava"``, ``image_mode="pad"`` (``image_grid_pinpoints`` unused).
    """
    architecture = hf_architecture(hf)
    text = {**_HF_LLAMA_DEFAULTS, **hf.get("text_config", {})}
    vision = {**_HF_CLIP_DEFAULTS, **hf.get("vision_config", _LLAVA_DEFAULT_VISION)}
    if hf.get("vision_feature_select_strategy", "default") != "default":
        raise ValueError("only vision_feature_select_strategy='default' (CLS dropped) is supported")
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer}: only a single layer is supported")
    if vision["hidden_act"] != "quick_gelu" or text.get("hidden_act", "silu") != "silu":
        raise ValueError("expected CLIP quick_gelu and Llama silu activations")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"projector_hidden_act={hf['projector_hidden_act']!r}: only exact 'gelu' is supported")
    _check_shape_fields(text, "the LLM's", ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "intermediate_size"), ("rms_norm_eps",),
                        optional=("num_key_value_heads", "head_dim"))
    rope = dict(text.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", text["rope_theta"])
    _check_shape_fields({"rope_theta": theta}, "the LLM's", (), ("rope_theta",))
    scaling = text.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = text["num_attention_heads"]
    # transformers' LlavaNext ties by the top-level flag; configs written without one carry it in text_config.
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    llm = LlamaConfig(
        vocab_size=text["vocab_size"], dim=text["hidden_size"], layers=text["num_hidden_layers"], heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads, mlp_dim=text["intermediate_size"],
        norm_eps=text["rms_norm_eps"], rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None, attention_bias=text["attention_bias"],
        tie_word_embeddings=bool(tied))
    vis = vision_config_from_hf(vision, feature_layer=layer)
    kwargs = dict(vision=vis, llm=llm, lora=lora, image_token_id=hf.get("image_token_index", 32000),
                  image_grid_pinpoints=tuple(tuple(p) for p in hf.get("image_grid_pinpoints", DEFAULT_PINPOINTS)),
                  projector_bias=hf.get("multimodal_projector_bias", True), architecture=architecture)
    if architecture == "llava":
        kwargs.update(image_mode="pad", pad_newline=False)
        seq = hf.get("image_seq_length", vis.num_patches)
        if seq != vis.num_patches:  # a processor field: transformers' model uses the tower's count, and so do we
            warnings.warn(f"config.json: image_seq_length={seq} (read by transformers' processor only), but the "
                          f"vision tower gives {vis.num_patches} patches per image: using {vis.num_patches}")
    kwargs.update(overrides)
    return LlavaNextConfig(**kwargs)


def vision_config_from_hf(vision: dict, feature_layer: int = -2) -> VisionConfig:
    """Our VisionConfig from a HF ``CLIPVisionConfig`` dict (missing keys take HF's defaults)."""
    vision = {**_HF_CLIP_DEFAULTS, **vision}
    _check_shape_fields(vision, "the vision tower's", ("image_size", "patch_size", "hidden_size", "num_hidden_layers",
                                                       "num_attention_heads", "intermediate_size"), ("layer_norm_eps",))
    if vision["hidden_act"] != "quick_gelu":
        raise ValueError(f"vision hidden_act={vision['hidden_act']!r}: only CLIP's quick_gelu is supported")
    return VisionConfig(image_size=vision["image_size"], patch_size=vision["patch_size"], width=vision["hidden_size"],
                        layers=vision["num_hidden_layers"], heads=vision["num_attention_heads"],
                        mlp_dim=vision["intermediate_size"], layer_norm_eps=vision["layer_norm_eps"],
                        feature_layer=feature_layer)


def vision_config_to_hf(vis: VisionConfig) -> dict:
    """The ``CLIPVisionConfig`` dict of our VisionConfig (``vision_config`` of LLaVA and CLIP config.json)."""
    return dict(model_type="clip_vision_model", hidden_size=vis.width, intermediate_size=vis.mlp_dim,
                num_hidden_layers=vis.layers, num_attention_heads=vis.heads, image_size=vis.image_size,
                patch_size=vis.patch_size, layer_norm_eps=vis.layer_norm_eps, hidden_act="quick_gelu")


def config_to_hf(cfg: LlavaNextConfig) -> dict:
    """A ``config.json`` dict that transformers' LlavaNextConfig (or LlavaConfig) reads back to the same model."""
    if cfg.projector != "mlp2x_gelu":
        raise ValueError(f"model.projector={cfg.projector!r}: llava-hf's models have the 2-layer GELU connector only "
                         f"(fire_jax.convert.llava writes the original LLaVA format, which has it)")
    llm, vis = cfg.llm, cfg.vision
    text = dict(model_type="llama", vocab_size=llm.vocab_size, hidden_size=llm.dim, intermediate_size=llm.mlp_dim,
                num_hidden_layers=llm.layers, num_attention_heads=llm.heads, num_key_value_heads=llm.kv_heads,
                head_dim=llm.head_dim, rms_norm_eps=llm.norm_eps, rope_theta=llm.rope_theta,
                attention_bias=llm.attention_bias, hidden_act="silu", tie_word_embeddings=llm.tie_word_embeddings)
    text["rope_parameters"] = {"rope_theta": llm.rope_theta, **(dict(llm.rope_scaling) if llm.rope_scaling
                                                                   else {"rope_type": "default"})}
    if llm.rope_scaling:
        text["rope_scaling"] = dict(llm.rope_scaling)
    vision = vision_config_to_hf(vis)
    out = dict(architectures=[ARCHITECTURES[cfg.architecture]], model_type=cfg.architecture, text_config=text,
               vision_config=vision, image_token_index=cfg.image_token_id, projector_hidden_act="gelu",
               vision_feature_select_strategy="default", vision_feature_layer=vis.feature_layer,
               multimodal_projector_bias=cfg.projector_bias, tie_word_embeddings=llm.tie_word_embeddings)
    if cfg.architecture == "llava":
        out["image_seq_length"] = vis.num_patches
    else:
        out["image_grid_pinpoints"] = [list(p) for p in cfg.image_grid_pinpoints]
    return out


# --------------------------------------------------------------------------- key mapping

def canonical_key(key: str) -> str:
    """Any supported HF key layout -> the hub layout (``language_model.model.*`` ...)."""
    key = re.sub(r"^model\.language_model\.", "language_model.model.", key)
    key = re.sub(r"^lm_head\.", "language_model.lm_head.", key)
    key = re.sub(r"^model\.(vision_tower|multi_modal_projector|image_newline)", r"\1", key)
    return key.replace("vision_tower.vision_model.", "vision_tower.")


def _linear(w):
    return np.ascontiguousarray(np.asarray(w).T)


def _patch_conv(w):
    w = np.asarray(w)  # [width, 3, p, p] -> [3*p*p, width], flattened (channel, row, col)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def _same(w):
    return np.asarray(w)


# HF key pattern (hub layout) -> (our path template, tensor transform); "W" = kernel or norm weight.
_RULES: list[tuple[str, str, Callable | None]] = [
    (r"vision_tower\.embeddings\.patch_embedding\.weight", "vision_tower.patch_embedding", _patch_conv),
    (r"vision_tower\.embeddings\.class_embedding", "vision_tower.class_embedding", _same),
    (r"vision_tower\.embeddings\.position_embedding\.weight", "vision_tower.position_embedding", _same),
    (r"vision_tower\.encoder\.layers\.(\d+)\.(.+)\.weight", "vision_tower.layers.{0}.{1}.W", None),
    (r"vision_tower\.encoder\.layers\.(\d+)\.(.+)\.bias", "vision_tower.layers.{0}.{1}.bias", _same),
    (r"vision_tower\.(pre_layrnorm|post_layernorm)\.(weight|bias)", "vision_tower.{0}.{1}", _same),
    (r"language_model\.model\.embed_tokens\.weight", "language_model.model.embed_tokens.embedding", _same),
    (r"(language_model\.(?:model\.layers\.\d+\..+|lm_head))\.weight", "{0}.W", None),
    (r"(language_model\.model\.layers\.\d+\..+)\.bias", "{0}.bias", _same),
    (r"language_model\.model\.norm\.weight", "language_model.model.norm.weight", _same),
    (r"multi_modal_projector\.(linear_[12])\.weight", "multi_modal_projector.{0}.kernel", _linear),
    (r"multi_modal_projector\.(linear_[12])\.bias", "multi_modal_projector.{0}.bias", _same),
    (r"image_newline", "image_newline", _same),
]


def _flat_params(state) -> dict[str, Any]:
    """``{"a.b.0.kernel": leaf}`` for an nnx State (Variables' values)."""
    return {".".join(str(p) for p in path): leaf for path, leaf in nnx.to_flat_state(state)}


_LAYER_PATH = re.compile(r"(language_model\.model\.layers)\.(\d+)\.(.+)")


def _in_model(path: str, ours: dict[str, Any]) -> tuple[str, int | None]:
    """Where a per-layer path lives: (path, None) as is, or (stacked path, layer index) in a model whose
    LLM layers are stacked (``scan_layers=True``: ``layers.self_attn.q_proj.kernel`` ``[layers, ...]``)."""
    m = _LAYER_PATH.fullmatch(path)
    if path not in ours and m and f"{m[1]}.{m[3]}" in ours:
        return f"{m[1]}.{m[3]}", int(m[2])
    return path, None


def hf_to_path(key: str, ours: dict[str, Any]) -> tuple[str, Callable]:
    """Our (per-layer) parameter path and tensor transform for a HF key; ``W`` marks "kernel or weight"."""
    key = canonical_key(key)
    for pattern, template, fn in _RULES:
        m = re.fullmatch(pattern, key)
        if not m:
            continue
        path = template.format(*m.groups())
        if path.endswith(".W"):  # a Linear's kernel (transposed) or a norm's weight (as is)
            stem = path[:-2]
            return (stem + ".kernel", _linear) if _in_model(stem + ".kernel", ours)[0] in ours else (
                stem + ".weight", _same)
        return path, fn
    raise KeyError(f"unknown Hugging Face key {key!r}")


def per_layer_params(model: LlavaNext) -> Iterator[tuple[str, np.ndarray]]:
    """(per-layer path, host array) for every frozen parameter, stacked LLM layers split into their layers."""
    for path, leaf in _flat_params(nnx.state(model, nnx.Param)).items():
        value = leaf[...] if hasattr(leaf, "get_value") else leaf
        m = re.fullmatch(r"(language_model\.model\.layers)\.([a-z_].*)", path)
        if m and model.language_model.model.scan_layers:
            for i in range(value.shape[0]):
                yield f"{m[1]}.{i}.{m[2]}", np.asarray(jax.device_get(value[i]))
        else:
            yield path, np.asarray(jax.device_get(value))


def path_to_hf(path: str) -> tuple[str, Callable]:
    """The hub-layout key and inverse transform for one of our frozen parameters."""
    if path == "vision_tower.patch_embedding":
        return "vision_tower.vision_model.embeddings.patch_embedding.weight", None
    fixed = {"vision_tower.class_embedding": "vision_tower.embeddings.class_embedding",
             "vision_tower.position_embedding": "vision_tower.embeddings.position_embedding.weight",
             "language_model.model.embed_tokens.embedding": "language_model.model.embed_tokens.weight"}
    if path in fixed:
        key, fn = fixed[path], _same
    elif path.endswith(".kernel"):
        key, fn = path[: -len(".kernel")] + ".weight", _linear
    else:
        key, fn = path, _same
    key = re.sub(r"^vision_tower\.layers\.", "vision_tower.encoder.layers.", key)
    return key.replace("vision_tower.", "vision_tower.vision_model.", 1), fn


def hub_tensor(path: str, arr: np.ndarray, patch_size: int) -> tuple[str, np.ndarray]:
    """The hub-layout key and tensor of one of our frozen parameters (:func:`path_to_hf`)."""
    key, fn = path_to_hf(path)
    if fn is None:  # patch conv: [3*p*p, width] -> [width, 3, p, p]
        return key, arr.T.reshape(arr.shape[1], 3, patch_size, patch_size)
    return key, fn(arr)


# --------------------------------------------------------------------------- loading

def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        return index_files(index)
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def iter_hf_tensors(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, numpy array) pairs, one tensor in memory at a time (bf16 kept as ml_dtypes.bfloat16)."""
    for path in _safetensors_files(directory):
        yield from read_safetensors(path)


def read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, numpy array) pairs of one safetensors file; a file that does not decode (truncated, not
    safetensors) raises :class:`InputError` naming it (and the tensor, when its header did decode)."""
    from safetensors import SafetensorError, safe_open

    key = None
    try:
        with safe_open(path, framework="flax") as f, jax.default_device(jax.devices("cpu")[0]):
            for key in f.keys():
                yield key, np.asarray(f.get_tensor(key))
    except (SafetensorError, OSError) as e:
        at = f", tensor {key!r}" if key else ""
        raise InputError(f"{path}{at}: does not read as safetensors (truncated or damaged?): {e}") from None


def abstract_model(cfg: LlavaNextConfig) -> LlavaNext:
    """The model's structure with ShapeDtypeStructs for leaves: nothing allocated."""
    return nnx.eval_shape(lambda: LlavaNext(cfg, rngs=InitKeys(0)))


def fresh_lora_state(cfg: LlavaNextConfig, seed: int = 0):
    """Freshly initialised LoRA factors (A random, B zero) without materialising frozen weights.

    Under jit the frozen initialisers are dead code that XLA removes. The program is compiled once per
    (config, seed) in a process: compiling it traces the whole model's init, and an evaluation loads a model
    per agent.
    """
    return _lora_init(cfg, seed)()


@functools.lru_cache(maxsize=8)
def _lora_init(cfg: LlavaNextConfig, seed: int):
    return jax.jit(lambda: nnx.state(LlavaNext(cfg, rngs=InitKeys(seed)), LoRAParam))


def load_tensors(tensors: Iterable[tuple[str, np.ndarray]], ours: dict[str, Any], where: str,
                 sharding: Callable[[str, Any], Any] | None = None,
                 key_to_path: Callable[[str, dict], tuple[str, Callable]] = hf_to_path) -> dict[str, jax.Array]:
    """Our path -> device array for each (HF key, host tensor) pair, one tensor on the host at a time.

    Keys map by ``key_to_path`` (default :func:`hf_to_path`: any layout :func:`canonical_key` reads; CLIP's
    own in ``fire_jax.convert.clip``); each tensor must have the
    shape of its target in ``ours`` (``{path: Variable}``, abstract or not) and takes its dtype. The
    weights of stacked LLM layers are filled on the host layer by layer and placed once every layer
    came. ``where`` names the source in errors; ``sharding(path, target)`` may place each array.
    """
    loaded: dict[str, jax.Array] = {}
    stacks: dict[str, tuple[np.ndarray, set[int]]] = {}
    for key, tensor in tensors:
        try:
            per_layer, fn = key_to_path(key, ours)
        except KeyError:
            raise InputError(f"{where}: tensor {key!r} is no weight of this model") from None
        path, layer = _in_model(per_layer, ours)
        if path not in ours:
            raise InputError(f"{where}: HF key {key!r} maps to {per_layer!r}, which the model does not have")
        target = ours[path]
        shape = target.shape if layer is None else target.shape[1:]
        value = fn(tensor)
        if value.shape != shape:
            raise InputError(f"{where}: {key} has shape {value.shape}, the model expects {shape} at {per_layer}")
        value = value.astype(target.dtype)
        if layer is None:
            loaded[path] = jax.device_put(value, sharding(path, target) if sharding else None)
        else:
            stack, layers = stacks.setdefault(path, (np.empty(target.shape, target.dtype), set()))
            stack[layer] = value
            layers.add(layer)
        del tensor, value
    for path, (stack, layers) in stacks.items():
        if len(layers) == stack.shape[0]:
            loaded[path] = jax.device_put(stack, sharding(path, ours[path]) if sharding else None)
    return loaded


def load_hf_checkpoint(directory: str, lora: LoraConfig | None = LoraConfig(), *, seed: int = 0,
                       sharding: Callable[[str, Any], Any] | None = None, **overrides) -> LlavaNext:
    """Load a llava-hf LLaVA-NeXT or LLaVA-1.5 checkpoint directory (config.json + safetensors) into a fresh NNX
    model (a folder of either format, the original LLaVA format's too: :func:`fire_jax.convert.load.load_checkpoint`).

    ``overrides`` set LlavaNextConfig fields (e.g. ``dtype``, ``param_dtype``,
    ``remat``, ``image_mode``). ``sharding(path, abstract_leaf)`` may return a
    ``jax.sharding.Sharding`` to place each tensor directly on a mesh.
    LoRA factors are freshly initialised (B = 0). A tied model (``tie_word_embeddings``) has no
    lm_head; a checkpoint's copy of it, if any, is skipped.
    """
    try:
        cfg = config_from_hf(read_config(directory), lora=lora, **overrides)
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"{os.path.join(directory, 'config.json')}: {e}") from None
    return model_from_tensors(cfg, iter_hf_tensors(directory), directory, seed=seed, sharding=sharding)


def read_config(directory: str) -> dict:
    """A checkpoint folder's config.json."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise InputError(f"{directory}: no config.json (not a checkpoint folder)")
    return read_json_object(path)


def index_files(index: str) -> list[str]:
    """The weight files a sharded checkpoint's index names (``weight_map``: tensor name -> file in its folder);
    an index without that map, or with a name that is no file of the folder, raises :class:`InputError`."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index}: field 'weight_map' must be a non-empty object (tensor name -> file)")
    bad = next((v for v in weight_map.values() if not isinstance(v, str) or os.path.basename(v) != v or not v), None)
    if bad is not None:
        raise InputError(f"{index}: field 'weight_map' names {bad!r}, not a file name of the checkpoint's folder")
    folder = os.path.dirname(index)
    return sorted({os.path.join(folder, v) for v in weight_map.values()})


def lora_settings(path: str) -> dict:
    """rank, alpha, dropout and the other fields of a PEFT ``adapter_config.json``, each checked: ``r`` an
    integer >= 1, ``lora_alpha`` a positive number, ``lora_dropout`` in [0, 1); else :class:`InputError` naming
    the file and the field."""
    peft = read_json_object(path)
    rank, alpha, dropout = peft.get("r"), peft.get("lora_alpha"), peft.get("lora_dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"{path}: field 'r' = {rank!r}: expected the LoRA rank, an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise InputError(f"{path}: field 'lora_alpha' = {alpha!r}: expected a positive number")
    dropout = 0.0 if dropout is None else dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise InputError(f"{path}: field 'lora_dropout' = {dropout!r}: expected a number in [0, 1)")
    return {**peft, "r": rank, "lora_alpha": float(alpha), "lora_dropout": float(dropout)}


def model_from_tensors(cfg: LlavaNextConfig, tensors: Iterable[tuple[str, np.ndarray]], where: str, *,
                       seed: int = 0, sharding: Callable[[str, Any], Any] | None = None,
                       source_key: Callable[[str], str] = lambda key: key) -> LlavaNext:
    """A model of ``cfg`` whose frozen weights are ``tensors`` ((hub-layout key, host tensor) pairs, every
    weight of the model once) and whose LoRA factors are fresh. ``source_key`` names a hub-layout key as the
    source folder names it, for the error on a weight the folder lacks."""
    graphdef, frozen, lora_state = nnx.split(abstract_model(cfg), nnx.Param, LoRAParam)
    ours = _flat_params(frozen)
    if cfg.llm.tie_word_embeddings:
        tensors = ((k, t) for k, t in tensors if not canonical_key(k).startswith("language_model.lm_head."))
    loaded = load_tensors(tensors, ours, where, sharding)
    missing = sorted(set(ours) - set(loaded))
    if missing:
        keys = [source_key(path_to_hf(path)[0]) for path in missing]
        raise InputError(f"{where}: checkpoint lacks {len(missing)} tensor(s) (of a stacked layer weight: "
                         f"some layers), e.g. {keys[:5]}")
    for path, variable in nnx.to_flat_state(frozen):
        variable.set_value(loaded[".".join(str(p) for p in path)])
    if cfg.lora is not None:
        lora_state = fresh_lora_state(cfg, seed)
    return nnx.merge(graphdef, frozen, lora_state)


# --------------------------------------------------------------------------- saving

def save_hf_checkpoint(model: LlavaNext, directory: str, *, max_shard_bytes: int = 5 * 2**30,
                       dtype: str | None = None, config: dict | None = None,
                       rename: Callable[[str], str | None] = lambda key: key) -> None:
    """Write the frozen weights (merge LoRA first to keep it) as a HF checkpoint directory.

    Shards of at most ``max_shard_bytes``; one shard at a time lives on the host. ``config`` (default: the
    llava-hf config.json of the model) and ``rename`` (of each hub-layout key; None leaves the tensor out) write
    another layout of the same tensors (:mod:`fire_jax.convert.llava`: the original LLaVA format, a CLIP folder).
    """
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_to_hf(model.cfg) if config is None else config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for path, arr in per_layer_params(model):
        key, arr = hub_tensor(path, arr, model.cfg.vision.patch_size)
        key = rename(key)
        if key is None:
            continue
        if dtype:
            arr = arr.astype(jnp.dtype(dtype))
        if size + arr.nbytes > max_shard_bytes and shards[-1]:
            _write_shard(directory, shards, len(shards) - 1)
            shards.append({})
            size = 0
        shards[-1][key] = np.ascontiguousarray(arr)
        size += arr.nbytes
    _write_shard(directory, shards, len(shards) - 1)
    names = [_shard_name(i, len(shards)) for i in range(len(shards))]
    if len(shards) == 1:
        os.replace(os.path.join(directory, _shard_name(0, None)), os.path.join(directory, "model.safetensors"))
        return
    for i in range(len(shards)):
        os.replace(os.path.join(directory, _shard_name(i, None)), os.path.join(directory, names[i]))
    weight_map = {k: names[i] for i, shard in enumerate(shards) for k in shard}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def _shard_name(i: int, total: int | None) -> str:
    return f"shard-{i:05d}.tmp" if total is None else f"model-{i + 1:05d}-of-{total:05d}.safetensors"


def _write_shard(directory: str, shards: list[dict], i: int) -> None:
    """Write shard i under a temporary name and keep only its key list in memory."""
    from safetensors.numpy import save_file

    save_file(shards[i], os.path.join(directory, _shard_name(i, None)), metadata={"format": "pt"})
    shards[i] = {k: None for k in shards[i]}


# --------------------------------------------------------------------------- PEFT

_PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_peft_adapter(model: LlavaNext, directory: str, base_model_name_or_path: str = "") -> None:
    """Export the LoRA factors as a PEFT adapter (adapter_config.json + adapter_model.safetensors).

    Keys follow transformers' LlavaNextForConditionalGeneration module names
    (``base_model.model.model.language_model.layers.N.self_attn.q_proj.lora_A.weight``);
    target_modules is a regex so the CLIP tower's q/k projections are not matched.
    """
    from safetensors.numpy import save_file

    lora = model.cfg.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapter to export")
    tensors = {}
    for (i, sub, proj, ab), (variable, layer) in _lora_factors(model).items():
        value = jax.device_get(variable[...] if layer is None else variable[...][layer])
        tensors[f"base_model.model.model.language_model.layers.{i}.{sub}.{proj}.lora_{ab}.weight"] = _linear(value)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    names = "|".join(_PEFT_MODULES[t].split(".")[1] for t in lora.targets)
    config = dict(peft_type="LORA", task_type=None, r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                  bias="none", fan_in_fan_out=False, init_lora_weights=True, inference_mode=True,
                  target_modules=rf".*language_model.*\.({names})", base_model_name_or_path=base_model_name_or_path)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


_PEFT_KEY = re.compile(r".*language_model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight")


def _lora_factors(model) -> dict[tuple[int, str, str, str], tuple[nnx.Variable, int | None]]:
    """(layer, "self_attn"/"mlp", projection, "A"/"B") -> (its LoRA variable, layer index into it when stacked)."""
    llama = model.language_model.model
    targets = model.cfg.lora.targets if model.cfg.lora else ()
    factors = {}
    for i in range(llama.cfg.layers):
        layer = llama.layers if llama.scan_layers else llama.layers[i]
        for target in targets:
            sub, proj = _PEFT_MODULES[target].split(".")
            linear = getattr(getattr(layer, sub), proj)
            for ab, variable in (("A", linear.lora_a), ("B", linear.lora_b)):
                factors[(i, sub, proj, ab)] = (variable, i if llama.scan_layers else None)
    return factors


def peft_lora_config(directory: str) -> dict:
    """``config.model.lora`` of a PEFT adapter (adapter_config.json: r, lora_alpha, target_modules)."""
    path = os.path.join(directory, "adapter_config.json")
    peft = lora_settings(path)
    if peft.get("use_rslora") or peft.get("use_dora"):
        raise ValueError(f"{path}: rsLoRA / DoRA adapters are not supported (plain LoRA only)")
    modules = peft.get("target_modules") or []
    names = set(re.findall(r"\w+_proj", modules)) if isinstance(modules, str) else set(modules)
    targets = tuple(t for t, module in _PEFT_MODULES.items() if module.split(".")[1] in names)
    if not targets:
        raise ValueError(f"{path}: field 'target_modules' names no Llama projection: {modules!r}")
    return dict(rank=peft["r"], alpha=peft["lora_alpha"], dropout=peft["lora_dropout"], targets=targets)


def load_peft_adapter(model, directory: str):
    """Set ``model``'s LoRA factors from a PEFT adapter; every factor of the model must be in it.

    PEFT stores A as [rank, in] and B as [out, rank]; ours are A [in, rank], B [rank, out].
    """
    from safetensors.numpy import load_file

    path = os.path.join(directory, "adapter_model.safetensors")
    factors = _lora_factors(model)
    targets, layers = (model.cfg.lora.targets if model.cfg.lora else ()), model.cfg.llm.layers
    missing = set(factors)
    values: dict[int, tuple[nnx.Variable, np.ndarray]] = {}  # id(variable) -> (variable, new value), set once
    for key, value in load_file(path).items():
        m = _PEFT_KEY.fullmatch(key)
        index = None if m is None else (int(m[1]), m[2], m[3], m[4])
        if index is None or "vision" in key or index not in missing:
            raise KeyError(f"{path}: tensor {key!r} is no LoRA factor of the model's language model (or a repeat) "
                           f"(LoRA targets {targets}, {layers} layers)")
        missing.remove(index)
        variable, layer = factors[index]
        _, new = values.setdefault(id(variable), (variable, np.array(jax.device_get(variable[...]))))
        value = np.ascontiguousarray(value.T)
        expected = new.shape if layer is None else new.shape[1:]
        if value.shape != expected:
            raise ValueError(f"{path}: {key} has shape {value.T.shape}, the model expects {expected[::-1]}")
        if layer is None:
            new[...] = value
        else:
            new[layer] = value
    if missing:
        raise KeyError(f"{path}: lacks {len(missing)} LoRA factor(s) of the model, e.g. (layer, module, A/B) "
                       f"{sorted((i, proj, ab) for i, _, proj, ab in missing)[:4]}")
    for variable, new in values.values():
        variable[...] = jnp.asarray(new, variable[...].dtype)
    return model
