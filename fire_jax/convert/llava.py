"""The original LLaVA codebase's checkpoints (``LlavaLlamaForCausalLM``, ``model_type`` "llava_llama") in and out.

The format of haotian-liu/LLaVA, LLaVA-NeXT's open reproductions (``Lin-Chen/open-llava-next-llama3-8b``) and
the FIRE release (MM-FIRE/FIRE, ``llava/model/``): the models that FIRE's paper trained and evaluated.

- ``config.json``: the Llama fields at the top level, and ``mm_vision_tower`` (a CLIP folder or hub name),
  ``mm_projector_type`` ("mlp2x_gelu": Linear, GELU, Linear; or "linear"), ``mm_vision_select_layer``,
  ``mm_vision_select_feature`` ("patch": CLS dropped), ``image_aspect_ratio`` ("anyres", "pad"),
  ``image_grid_pinpoints``, ``mm_patch_merge_type`` ("spatial_unpad", "flat").
- weights (safetensors, or torch ``.bin`` pickles, sharded or not): ``model.embed_tokens``, ``model.layers.*``,
  ``model.norm``, ``lm_head``, ``model.mm_projector.{0,2}`` (a linear one: ``model.mm_projector``), ``model.image_newline`` and
  ``model.vision_tower.vision_tower.vision_model.*``. The vision tower's weights come from the CLIP folder
  ``mm_vision_tower`` names when the checkpoint has none.
- the vocabulary has no image token: the release splices image features where its prompt ids hold -200
  (``llava/constants.py``: ``IMAGE_TOKEN_INDEX``). Here ``<image>`` takes the next free id after the
  checkpoint's vocabulary (``config.json``'s ``vocab_size``), as llava-hf's conversion appends it; the logits
  stay over the checkpoint's vocabulary, so decoding never emits it.
- a LoRA model (the FIRE teacher): PEFT's ``adapter_config.json`` and adapter weights, plus
  ``non_lora_trainables.bin`` (the connector and any other trained non-LoRA weight), merged into the base as
  the release's ``llava/model/builder.py`` does (:func:`merged_tensors`).

The llava-hf key mapping (transformers' ``convert_llava_next_weights_to_hf.py``), both ways
(:data:`KEY_PREFIXES`): ``model.mm_projector.0/2`` <-> ``multi_modal_projector.linear_1/2``, ``model.X`` <->
the language model's ``model.X``, ``lm_head`` <-> the language model's ``lm_head``,
``model.vision_tower.vision_tower.`` <-> ``vision_tower.``, ``model.image_newline`` <-> ``image_newline``.
Once in that layout every tensor goes through :mod:`fire_jax.convert.hf`'s rules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np

from fire_jax.core.config import InputError
from fire_jax.core.files import output_folder
from fire_jax.core.results import read_json_object
from fire_jax.convert import hf as hub
from fire_jax.models.config import PROJECTORS, LlavaNextConfig, LoraConfig
from fire_jax.models.llava_next import LlavaNext

MODEL_TYPE = "llava_llama"
ARCHITECTURE = "LlavaLlamaForCausalLM"

#: CLIP ViT-L/14 at 336 px (``openai/clip-vit-large-patch14-336``), the tower of every released LLaVA-NeXT.
CLIP_L14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, layer_norm_eps=1e-5, hidden_act="quick_gelu")
KNOWN_TOWERS = {"openai/clip-vit-large-patch14-336": CLIP_L14_336}

#: (original key prefix, llava-hf hub-layout prefix), the first that matches wins.
KEY_PREFIXES = (
    ("model.vision_tower.vision_tower.", "vision_tower."),
    ("model.mm_projector.0.", "multi_modal_projector.linear_1."),
    ("model.mm_projector.2.", "multi_modal_projector.linear_2."),
    ("model.mm_projector.weight", "multi_modal_projector.linear_1.weight"),  # mm_projector_type "linear"
    ("model.mm_projector.bias", "multi_modal_projector.linear_1.bias"),
    ("model.image_newline", "image_newline"),
    ("lm_head.", "language_model.lm_head."),
    ("model.embed_tokens.", "language_model.model.embed_tokens."),
    ("model.layers.", "language_model.model.layers."),
    ("model.norm.", "language_model.model.norm."),
)
#: Keys the original format may hold that no model weight reads: the (empty) vision resampler, and the
#: position-id and rotary buffers older transformers saved.
IGNORED_KEYS = re.compile(r"model\.vision_resampler\..*|.*\.position_ids|.*\.rotary_emb\.inv_freq")
#: The LLaVA fields of a config.json (the rest are the Llama model's).
_MM_FIELDS = ("mm_", "image_aspect_ratio", "image_grid_pinpoints", "tokenizer_", "tune_", "freeze_",
              "use_mm_proj", "unfreeze_", "s2", "image_crop_resolution", "image_split_resolution")


def is_llava_config(hf: dict) -> bool:
    """Whether a ``config.json`` dict is the original LLaVA format's."""
    architectures = hf.get("architectures")
    return hf.get("model_type") == MODEL_TYPE or (isinstance(architectures, list) and ARCHITECTURE in architectures)


def to_hub(key: str) -> str | None:
    """The llava-hf (hub layout) key of an original key; None for a key no weight reads (:data:`IGNORED_KEYS`)."""
    if IGNORED_KEYS.fullmatch(key):
        return None
    for original, hf_prefix in KEY_PREFIXES:
        if key.startswith(original):
            return hf_prefix + key[len(original):]
    raise KeyError(key)


def to_original(key: str, projector: str = "mlp2x_gelu") -> str:
    """The original key of a hub-layout key (:func:`fire_jax.convert.hf.path_to_hf`'s); a ``linear`` connector's
    is ``model.mm_projector.weight``."""
    if projector == "linear" and key.startswith("multi_modal_projector.linear_1."):
        return "model.mm_projector." + key[len("multi_modal_projector.linear_1."):]
    for original, hf_prefix in KEY_PREFIXES:
        if key.startswith(hf_prefix):
            return original + key[len(hf_prefix):]
    raise KeyError(key)


# --------------------------------------------------------------------------- config

def _where(directory: str) -> str:
    return os.path.join(directory, "config.json")


def clip_folder(hf: dict, directory: str) -> str | None:
    """The local CLIP folder ``mm_vision_tower`` names (as given, or relative to the checkpoint), else None."""
    name = hf.get("mm_vision_tower") or hf.get("vision_tower") or ""
    if not isinstance(name, str):
        raise InputError(f"{_where(directory)}: field 'mm_vision_tower' = {name!r}: expected a CLIP folder or hub name")
    for candidate in (name, os.path.join(directory, name)):
        if name and os.path.exists(os.path.join(candidate, "config.json")):
            return candidate
    return None


def vision_config(hf: dict, directory: str) -> dict:
    """The vision tower's transformers ``CLIPVisionConfig`` fields: from the local CLIP folder (a CLIPModel's
    config.json with ``vision_config``, or a CLIPVisionModel's), else the known shape of a hub name."""
    name = hf.get("mm_vision_tower") or hf.get("vision_tower")
    folder = clip_folder(hf, directory)
    if folder is not None:
        clip = read_json_object(os.path.join(folder, "config.json"))
        return dict(clip.get("vision_config", clip))
    if name in KNOWN_TOWERS:
        return dict(KNOWN_TOWERS[name])
    raise InputError(f"{_where(directory)}: field 'mm_vision_tower' = {name!r} is neither a local CLIP folder "
                     f"(config.json + vision_model.* weights) nor one of {sorted(KNOWN_TOWERS)}")


def _image_layout(hf: dict, where: str) -> tuple[str, dict]:
    """(llava-hf model_type, LlavaNextConfig overrides) of ``image_aspect_ratio`` x ``mm_patch_merge_type``.

    anyres + spatial_unpad is LLaVA-NeXT. "pad" gives one padded tile: the release's ``llava_arch.py`` sends a
    4-d image batch straight through ``encode_images`` (no image_newline, whatever the merge type), so pad +
    spatial_unpad is a LLaVA-NeXT (its image_newline weight unused) in ``image_mode="pad"``, and pad + flat a
    LLaVA-1.5.
    """
    aspect, merge = hf.get("image_aspect_ratio", "square"), hf.get("mm_patch_merge_type", "flat")
    if aspect == "anyres" and merge == "spatial_unpad":
        return "llava_next", {}
    if aspect == "pad" and merge == "spatial_unpad":
        return "llava_next", dict(image_mode="pad", pad_newline=False)
    if aspect == "pad" and merge == "flat":
        return "llava", {}
    raise InputError(f"{where}: fields image_aspect_ratio={aspect!r}, mm_patch_merge_type={merge!r}: supported are "
                     f"anyres + spatial_unpad (LLaVA-NeXT), pad + spatial_unpad and pad + flat (LLaVA-1.5)")


def hf_config(hf: dict, directory: str) -> tuple[dict, dict]:
    """(the llava-hf ``config.json`` dict of the same model, LlavaNextConfig overrides) for an original one;
    ``image_token_index`` is the checkpoint's ``vocab_size`` (the next free id)."""
    where = _where(directory)
    projector = hf.get("mm_projector_type", "linear")
    if projector not in PROJECTORS:
        raise InputError(f"{where}: field 'mm_projector_type' = {projector!r}: supported are {PROJECTORS}")
    feature = hf.get("mm_vision_select_feature", "patch")
    if feature != "patch":
        raise InputError(f"{where}: field 'mm_vision_select_feature' = {feature!r}: only 'patch' (CLS dropped) is "
                         f"supported")
    if hf.get("mm_use_im_start_end"):
        raise InputError(f"{where}: field 'mm_use_im_start_end' = true: images between <im_start> / <im_end> tokens "
                         f"are not supported")
    pinpoints = hf.get("image_grid_pinpoints")
    if pinpoints is not None and not (isinstance(pinpoints, list) and all(len(p) == 2 for p in pinpoints)):
        raise InputError(f"{where}: field 'image_grid_pinpoints' = {pinpoints!r}: expected [[width, height], ...]")
    cut = hf.get("tokenizer_model_max_length") or 0
    if isinstance(cut, bool) or not isinstance(cut, int) or cut < 0:
        raise InputError(f"{where}: field 'tokenizer_model_max_length' = {cut!r}: expected a number of tokens")
    model_type, overrides = _image_layout(hf, where)
    # Run as the release runs it (fire_jax.core.geometry, "release"): its pinpoints are (width, height), its
    # inputs cut at tokenizer_model_max_length; a config's model.conventions overrides this.
    overrides.update(projector=projector, conventions="release", max_input_tokens=cut)
    if "vocab_size" not in hf:
        raise InputError(f"{where}: no field 'vocab_size'")
    text = {k: v for k, v in hf.items() if not k.startswith(_MM_FIELDS)}
    out = dict(model_type=model_type, text_config=text, vision_config=vision_config(hf, directory),
               image_token_index=hf["vocab_size"], vision_feature_layer=hf.get("mm_vision_select_layer", -2),
               vision_feature_select_strategy="default", projector_hidden_act="gelu",
               multimodal_projector_bias=True, tie_word_embeddings=hf.get("tie_word_embeddings", False))
    if pinpoints is not None:
        out["image_grid_pinpoints"] = pinpoints
    return out, overrides


def config_from_llava(hf: dict, directory: str, lora: LoraConfig | None = LoraConfig(),
                      **overrides) -> LlavaNextConfig:
    """Our config of an original-format ``config.json`` dict (``directory`` holds it: a relative CLIP folder)."""
    converted, layout = hf_config(hf, directory)
    try:
        return hub.config_from_hf(converted, lora=lora, **{**layout, **overrides})
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"{_where(directory)}: {e}") from None


# --------------------------------------------------------------------------- weights

def weight_files(directory: str) -> list[str]:
    """The weight files of a folder: safetensors (single or sharded by an index), else torch ``.bin``."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if os.path.exists(os.path.join(directory, index)):
            return hub.index_files(os.path.join(directory, index))
        if os.path.exists(os.path.join(directory, single)):
            return [os.path.join(directory, single)]
    raise InputError(f"{directory}: no weights (model.safetensors[.index.json] or pytorch_model.bin[.index.json])")


def read_weights(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, numpy array) pairs of one safetensors or torch ``.bin`` file."""
    return hub.read_safetensors(path) if path.endswith(".safetensors") else read_torch(path)


def read_torch(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, numpy array) pairs of a torch pickle of tensors, read with ``weights_only=True`` (no code runs);
    bf16 kept as ml_dtypes.bfloat16."""
    try:
        import torch
    except ImportError:
        raise InputError(f"{path}: reading PyTorch .bin weights needs torch (pip install -e \".[release]\"), or "
                         f"convert the folder to safetensors") from None
    import ml_dtypes

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... by damage
        raise InputError(f"{path}: does not read as a torch checkpoint (truncated or damaged?): "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(state, dict):
        raise InputError(f"{path}: holds a {type(state).__name__}, not a dict of tensors")
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise InputError(f"{path}: key {key!r} is not a string (a state dict's keys are weight names)")
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"{path}: {key!r} holds a {type(tensor).__name__}, not a tensor")
        if tensor.dtype == torch.bfloat16:
            yield key, tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            yield key, tensor.numpy()


def iter_weights(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, numpy array) pairs of every weight file of a folder, one file open at a time."""
    for path in weight_files(directory):
        yield from read_weights(path)


def hub_tensors(tensors, where: str) -> Iterator[tuple[str, np.ndarray]]:
    """Original-format (key, tensor) pairs as hub-layout pairs (ignored keys dropped); an unknown key raises
    :class:`InputError` naming ``where`` and the key."""
    for key, tensor in tensors:
        try:
            mapped = to_hub(key)
        except KeyError:
            raise InputError(f"{where}: tensor {key!r} is no weight of a LlavaLlamaForCausalLM") from None
        if mapped is not None:
            yield mapped, tensor


def checkpoint_tensors(directory: str, tensors, hf: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Hub-layout (key, tensor) pairs of a checkpoint, its vision tower from the CLIP folder when it has none."""
    has_tower = False
    for key, tensor in hub_tensors(tensors, directory):
        has_tower = has_tower or key.startswith("vision_tower.")
        yield key, tensor
    if has_tower:
        return
    folder = clip_folder(hf, directory)
    if folder is None:
        raise InputError(f"{directory}: no vision tower weights (model.vision_tower.vision_tower.vision_model.*), "
                         f"and field 'mm_vision_tower' = {hf.get('mm_vision_tower')!r} names no local CLIP folder")
    for key, tensor in iter_weights(folder):
        if key.startswith("vision_model."):  # a CLIPModel's text tower and projections are not LLaVA's
            yield "vision_tower." + key, tensor


# --------------------------------------------------------------------------- the release's LoRA models

def adapter_base(adapter: str) -> str:
    """The base model a LoRA folder names (``adapter_config.json``'s ``base_model_name_or_path``) when that is
    a local folder; else :class:`InputError` naming the file and the field."""
    path = os.path.join(adapter, "adapter_config.json")
    base = read_json_object(path).get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise InputError(f"{path}: field 'base_model_name_or_path' = {base!r}: expected a path")
    if base and os.path.exists(os.path.join(base, "config.json")):
        return base
    raise InputError(f"{path}: field 'base_model_name_or_path' = {base!r} is no local checkpoint folder; give the "
                     f"base (--model BASE --adapter {adapter}, or config.init.hf_checkpoint)")


def is_llava_lora(directory: str) -> bool:
    """Whether a folder is a LoRA model of the original format: PEFT files beside ``non_lora_trainables.bin``
    or beside an original-format config.json."""
    if not os.path.exists(os.path.join(directory, "adapter_config.json")):
        return False
    if os.path.exists(os.path.join(directory, "non_lora_trainables.bin")):
        return True
    config = os.path.join(directory, "config.json")
    if not os.path.exists(config):
        return False
    return is_llava_config(read_json_object(config))


def non_lora_trainables(adapter: str) -> dict[str, np.ndarray]:
    """``non_lora_trainables.bin`` with the release's key clean-up (``llava/model/builder.py``): the prefix
    ``base_model.`` stripped, then ``model.`` when any key starts with ``model.model.``. No file: empty."""
    path = os.path.join(adapter, "non_lora_trainables.bin")
    if not os.path.exists(path):
        return {}
    state = {(k[len("base_model."):] if k.startswith("base_model.") else k): v for k, v in read_torch(path)}
    if any(k.startswith("model.model.") for k in state):
        state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    return state


_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight")


def lora_deltas(adapter: str) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float, str]:
    """``({original weight key: (A [r, in], B [out, r])}, scale, adapter weights file)`` of a PEFT LoRA
    folder; scale is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), as PEFT merges it."""
    config_path = os.path.join(adapter, "adapter_config.json")
    peft = hub.lora_settings(config_path)
    if peft.get("peft_type", "LORA") != "LORA" or peft.get("use_dora"):
        raise InputError(f"{config_path}: field 'peft_type' = {peft.get('peft_type')!r} (DoRA: "
                         f"{bool(peft.get('use_dora'))}): only plain LoRA merges")
    if peft.get("rank_pattern") or peft.get("alpha_pattern") or peft.get("fan_in_fan_out"):
        raise InputError(f"{config_path}: fields 'rank_pattern' / 'alpha_pattern' / 'fan_in_fan_out' are set: "
                         f"only one rank and alpha for every module merge")
    rank, alpha = peft["r"], peft["lora_alpha"]
    scale = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    files = [os.path.join(adapter, n) for n in ("adapter_model.safetensors", "adapter_model.bin")]
    path = next((p for p in files if os.path.exists(p)), None)
    if path is None:
        raise InputError(f"{adapter}: no adapter_model.safetensors or adapter_model.bin")
    factors: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in read_weights(path):
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise InputError(f"{path}: tensor {key!r} is no LoRA factor (base_model.model.<module>.lora_A/B.weight)")
        factors.setdefault(m[1] + ".weight", {})[m[2]] = tensor
    for key, ab in factors.items():
        module = key[:-len(".weight")]
        if set(ab) != {"A", "B"}:
            raise InputError(f"{path}: module {module!r} has lora_{''.join(ab)} but not both factors")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InputError(f"{path}: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                             f"not [r, in] and [out, r] with r = {rank} (field 'r' of {config_path})")
    return {key: (ab["A"], ab["B"]) for key, ab in factors.items()}, scale, path


def merged_tensors(tensors, adapter: str) -> Iterator[tuple[str, np.ndarray]]:
    """The base's original-format (key, tensor) pairs with a LoRA folder merged in, as the release's builder
    merges it: each key of ``non_lora_trainables.bin`` replaces the base's tensor, then every LoRA module's
    weight becomes ``W + scale * B @ A`` (float32; PEFT's ``merge_and_unload``). A non-LoRA trainable that the
    base lacks is ignored with a warning (the builder loads them with ``strict=False``)."""
    replaced = non_lora_trainables(adapter)
    deltas, scale, path = lora_deltas(adapter)
    seen: set[str] = set()
    for key, tensor in tensors:
        seen.add(key)
        tensor = replaced.get(key, tensor)
        if key in deltas:
            a, b = deltas[key]
            delta = b.astype(np.float32) @ a.astype(np.float32)
            if delta.shape != tensor.shape:
                raise InputError(f"{path}: LoRA of {key!r} gives a {delta.shape} update, the base weight is "
                                 f"{tensor.shape}")
            tensor = tensor.astype(np.float32) + np.float32(scale) * delta
        yield key, tensor
    unmatched = sorted(set(deltas) - seen)
    if unmatched:
        raise InputError(f"{path}: LoRA module weight {unmatched[0]!r} is not in the base ({len(unmatched)} such)")
    ignored = sorted(set(replaced) - seen)
    if ignored:
        warnings.warn(f"{os.path.join(adapter, 'non_lora_trainables.bin')}: {len(ignored)} tensor(s) the base does "
                      f"not have, ignored as the release's builder ignores them, e.g. {ignored[:3]}")


# --------------------------------------------------------------------------- loading

def load_llava_checkpoint(directory: str, lora: LoraConfig | None = LoraConfig(), *, seed: int = 0,
                          sharding: Callable[[str, Any], Any] | None = None, adapter: str | None = None,
                          **overrides) -> LlavaNext:
    """An original-format checkpoint folder (``adapter``: a LoRA folder merged into it) as a fresh NNX model
    (:func:`fire_jax.convert.hf.model_from_tensors`: one tensor on the host at a time, LoRA factors fresh).

    With an adapter the model's config is the adapter folder's config.json when it has one (the builder reads
    the LoRA folder's config), else the base's."""
    config_dir = adapter if adapter and os.path.exists(os.path.join(adapter, "config.json")) else directory
    base = hub.read_config(directory)
    if adapter and not is_llava_config(base):
        raise InputError(f"{_where(directory)}: model_type={base.get('model_type')!r}: the LoRA folder {adapter} of "
                         f"the original LLaVA format goes on a base of that format (LlavaLlamaForCausalLM)")
    hf = hub.read_config(config_dir)
    if not is_llava_config(hf):
        raise InputError(f"{_where(config_dir)}: model_type={hf.get('model_type')!r}: a LoRA folder of the original "
                         f"LLaVA format goes on a LlavaLlamaForCausalLM base")
    cfg = config_from_llava(hf, config_dir, lora, **overrides)
    tensors = iter_weights(directory)
    if adapter:
        tensors = merged_tensors(tensors, adapter)
    where = directory if not adapter else f"{directory} + {adapter}"
    return hub.model_from_tensors(cfg, checkpoint_tensors(directory, tensors, hf), where, seed=seed,
                                  sharding=sharding, source_key=lambda key: to_original(key, cfg.projector))


# --------------------------------------------------------------------------- writing

#: CLIP's image processor settings (``CLIPImageProcessor``), which the release's vision tower loads beside it.
_CLIP_PREPROCESSOR = dict(do_resize=True, do_center_crop=True, do_normalize=True, do_rescale=True,
                          do_convert_rgb=True, rescale_factor=1 / 255, resample=3,
                          image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
                          image_processor_type="CLIPImageProcessor")


def config_to_llava(cfg: LlavaNextConfig, vision_tower: str) -> dict:
    """The original-format ``config.json`` of a model (``vision_tower``: its ``mm_vision_tower``). The image
    layout is the one :func:`config_from_llava` reads back: LLaVA-NeXT -> ``spatial_unpad`` with ``anyres`` (or
    ``pad`` in ``image_mode="pad"``), LLaVA-1.5 -> ``pad`` + ``flat``. The pinpoints are written as the release
    reads them, (width, height), in the model's order: the release then picks the grids this model picks.
    ``tokenizer_model_max_length`` is written when the model has a cut (``max_input_tokens``)."""
    if not cfg.projector_bias:
        raise ValueError("the original format's connector has biases; this model's has none")
    text = hub.config_to_hf(dataclasses.replace(cfg, projector="mlp2x_gelu"))["text_config"]
    text.pop("model_type")
    if cfg.architecture == "llava":
        aspect, merge = "pad", "flat"
    else:
        aspect, merge = ("pad" if cfg.image_mode == "pad" else "anyres"), "spatial_unpad"
    pinpoints = [[w, h] for h, w in cfg.geometry.pinpoints_hw]
    cut = dict(tokenizer_model_max_length=cfg.max_input_tokens) if cfg.max_input_tokens else {}
    return dict(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, **text, mm_vision_tower=vision_tower,
                mm_hidden_size=cfg.vision.width, mm_projector_type=cfg.projector,
                mm_vision_select_layer=cfg.vision.feature_layer, mm_vision_select_feature="patch",
                image_aspect_ratio=aspect, image_grid_pinpoints=pinpoints, mm_patch_merge_type=merge,
                mm_use_im_start_end=False, mm_use_im_patch_token=False, use_mm_proj=True, **cut)


def _known_tower(cfg: LlavaNextConfig) -> str | None:
    v = cfg.vision
    shape = dict(hidden_size=v.width, intermediate_size=v.mlp_dim, num_hidden_layers=v.layers,
                 num_attention_heads=v.heads, image_size=v.image_size, patch_size=v.patch_size,
                 layer_norm_eps=v.layer_norm_eps, hidden_act="quick_gelu")
    return next((name for name, known in KNOWN_TOWERS.items() if known == shape), None)


def save_clip_folder(model: LlavaNext, directory: str) -> str:
    """The model's vision tower as a CLIPVisionModel folder (config.json, ``vision_model.*`` weights, CLIP's
    preprocessor_config.json), as the release's ``CLIPVisionTower.load_model`` reads ``mm_vision_tower``."""
    v = model.cfg.vision
    config = dict(architectures=["CLIPVisionModel"], model_type="clip_vision_model", hidden_size=v.width,
                  intermediate_size=v.mlp_dim, num_hidden_layers=v.layers, num_attention_heads=v.heads,
                  image_size=v.image_size, patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps,
                  hidden_act="quick_gelu", num_channels=3)
    hub.save_hf_checkpoint(model, directory, config=config, rename=lambda key: key[len("vision_tower."):]
                           if key.startswith("vision_tower.") else None)
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(dict(_CLIP_PREPROCESSOR, size={"shortest_edge": v.image_size},
                       crop_size={"height": v.image_size, "width": v.image_size}), f, indent=2)
    return os.path.abspath(directory)


def _vision_tower(model: LlavaNext, written: str, directory: str, vision_tower: str | None) -> str:
    """``mm_vision_tower`` of an export: as given, CLIP ViT-L/14-336's hub name for that shape, else a CLIP folder
    written into the export (``written``: the folder being written, which becomes ``directory``), named by its
    absolute path once in place (``DIR/vision_tower``)."""
    if vision_tower or _known_tower(model.cfg):
        return vision_tower or _known_tower(model.cfg)
    save_clip_folder(model, os.path.join(written, "vision_tower"))
    return os.path.join(os.path.abspath(directory), "vision_tower")


def save_llava_checkpoint(model: LlavaNext, directory: str, *, vision_tower: str | None = None,
                          max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> None:
    """Write the frozen weights (merge LoRA first to keep it) in the original LLaVA format, as the release's own
    scripts load it (``llava/model/builder.py``): config.json and safetensors shards with the original keys, the
    vision tower included. Read back with :func:`load_llava_checkpoint`, every weight is the same; the image
    token is then the next id after the vocabulary. The folder is written whole or not at all
    (:func:`fire_jax.core.files.output_folder`)."""
    with output_folder(directory) as written:
        tower = _vision_tower(model, written, directory, vision_tower)
        hub.save_hf_checkpoint(model, written, max_shard_bytes=max_shard_bytes, dtype=dtype,
                               config=config_to_llava(model.cfg, tower),
                               rename=lambda key: to_original(key, model.cfg.projector))


def save_llava_lora(model: LlavaNext, directory: str, base: str, *, vision_tower: str | None = None) -> None:
    """Write the model's LoRA on ``base`` as the release ships its teacher: PEFT's adapter_config.json and
    adapter_model.safetensors (keys ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``),
    ``non_lora_trainables.bin`` (the connector, keys ``base_model.model.model.mm_projector.*``) and the
    original-format config.json; :func:`merged_tensors` merges it back. The folder is written whole or not at
    all."""
    from safetensors.numpy import save_file

    try:
        import torch
    except ImportError:
        raise InputError("writing non_lora_trainables.bin needs torch (pip install -e \".[release]\")") from None
    lora = model.cfg.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapter to export")
    with output_folder(directory) as written:  # whole or not at all
        factors = {}
        for (i, sub, proj, ab), (variable, layer) in hub._lora_factors(model).items():
            value = np.asarray(jax.device_get(variable[...] if layer is None else variable[...][layer]), np.float32)
            factors[f"base_model.model.model.layers.{i}.{sub}.{proj}.lora_{ab}.weight"] = np.ascontiguousarray(value.T)
        save_file(factors, os.path.join(written, "adapter_model.safetensors"), metadata={"format": "pt"})
        modules = sorted({key.split(".")[-3] for key in factors})
        with open(os.path.join(written, "adapter_config.json"), "w") as f:
            json.dump(dict(peft_type="LORA", task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                           lora_dropout=lora.dropout, bias="none", fan_in_fan_out=False, inference_mode=True,
                           target_modules=modules, base_model_name_or_path=base), f, indent=2)
        connector = {}  # float32: the builder's load_state_dict casts to the model's dtype
        for index, linear in (("linear_1", model.multi_modal_projector.linear_1),
                              ("linear_2", model.multi_modal_projector.linear_2)):
            for name, value in (() if linear is None else (("weight", linear.kernel[...].T), ("bias", linear.bias[...]))):
                host = np.array(jax.device_get(value), np.float32)  # a writable copy, as torch.from_numpy wants
                key = to_original(f"multi_modal_projector.{index}.{name}", model.cfg.projector)
                connector[f"base_model.model.{key}"] = torch.from_numpy(host)
        with open(os.path.join(written, "non_lora_trainables.bin"), "wb") as f:  # a full disk: an OSError
            torch.save(connector, f)
        with open(os.path.join(written, "config.json"), "w") as f:
            json.dump(config_to_llava(model.cfg, _vision_tower(model, written, directory, vision_tower)), f, indent=2)
