"""Hugging Face CLIP checkpoints <-> :class:`fire_jax.models.clip.CLIPModel`, and a CLIP's vision tower into a LLaVA.

transformers' ``CLIPModel`` layout: ``config.json`` with ``vision_config``, ``text_config``,
``projection_dim`` and ``logit_scale_init_value``; weights ``vision_model.*``, ``text_model.*``,
``visual_projection.weight``, ``text_projection.weight`` and ``logit_scale``. The vision keys are those of
a LLaVA checkpoint's ``vision_tower.vision_model.*`` (openai/clip-vit-large-patch14-336 is the tower of
llava-hf's and the original LLaVA's checkpoints), so they map by :func:`fire_jax.convert.hf.hf_to_path`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from fire_jax.convert.hf import (_flat_params, _linear, _same, hf_to_path, hub_tensor, iter_hf_tensors, load_tensors,
                                 vision_config_from_hf, vision_config_to_hf)
from fire_jax.core.results import read_json_object
from fire_jax.models.clip import CLIPModel
from fire_jax.models.config import CLIPConfig, CLIPTextConfig
from fire_jax.models.layers import InitKeys

# transformers' CLIPTextConfig defaults, for keys a config.json leaves out.
_HF_TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=8, max_position_embeddings=77, layer_norm_eps=1e-5,
                         hidden_act="quick_gelu", eos_token_id=2)
_VISION = "vision_model."
# Buffers some checkpoints carry that are no weights.
_SKIPPED = re.compile(r"(text_model|vision_model)\.embeddings\.position_ids")


def config_from_hf(hf: dict, **overrides) -> CLIPConfig:
    """Our CLIPConfig from a HF ``CLIPModel`` config.json dict (missing keys take HF's defaults)."""
    text = {**_HF_TEXT_DEFAULTS, **hf.get("text_config", {})}
    if text["hidden_act"] != "quick_gelu":
        raise ValueError(f"text hidden_act={text['hidden_act']!r}: only CLIP's quick_gelu is supported")
    kwargs = dict(
        vision=vision_config_from_hf(hf.get("vision_config", {})),
        text=CLIPTextConfig(vocab_size=text["vocab_size"], max_positions=text["max_position_embeddings"],
                            width=text["hidden_size"], layers=text["num_hidden_layers"],
                            heads=text["num_attention_heads"], mlp_dim=text["intermediate_size"],
                            layer_norm_eps=text["layer_norm_eps"], eos_token_id=text["eos_token_id"]),
        projection_dim=hf.get("projection_dim", 512), logit_scale_init=hf.get("logit_scale_init_value", 2.6592))
    kwargs.update(overrides)
    return CLIPConfig(**kwargs)


def config_to_hf(cfg: CLIPConfig) -> dict:
    """A ``config.json`` dict that transformers' CLIPConfig reads back to the same model."""
    t = cfg.text
    text = dict(model_type="clip_text_model", vocab_size=t.vocab_size, max_position_embeddings=t.max_positions,
                hidden_size=t.width, intermediate_size=t.mlp_dim, num_hidden_layers=t.layers,
                num_attention_heads=t.heads, layer_norm_eps=t.layer_norm_eps, hidden_act="quick_gelu",
                eos_token_id=t.eos_token_id, projection_dim=cfg.projection_dim)
    vision = dict(vision_config_to_hf(cfg.vision), projection_dim=cfg.projection_dim)
    return dict(architectures=["CLIPModel"], model_type="clip", text_config=text, vision_config=vision,
                projection_dim=cfg.projection_dim, logit_scale_init_value=cfg.logit_scale_init)


def key_to_path(key: str, ours: dict[str, Any]) -> tuple[str, Callable]:
    """Our path and tensor transform for a HF CLIPModel key (vision keys through the LLaVA tower's rules)."""
    if key.startswith(_VISION):
        return hf_to_path("vision_tower." + key[len(_VISION):], ours)
    fixed = {"text_model.embeddings.token_embedding.weight": "text_model.token_embedding",
             "text_model.embeddings.position_embedding.weight": "text_model.position_embedding",
             "logit_scale": "logit_scale"}
    if key in fixed:
        return fixed[key], _same
    m = re.fullmatch(r"(text_model\.)encoder\.(layers\.\d+\..+)\.weight|(text_model\.final_layer_norm)\.weight|"
                     r"(visual_projection|text_projection)\.weight", key)
    if m:
        stem = m[3] or m[4] or m[1] + m[2]
        return (stem + ".kernel", _linear) if stem + ".kernel" in ours else (stem + ".weight", _same)
    m = re.fullmatch(r"text_model\.(?:encoder\.)?(.+)\.bias", key)
    if m:
        return f"text_model.{m[1]}.bias", _same
    raise KeyError(f"unknown Hugging Face CLIP key {key!r}")


def path_to_hub(path: str, arr: np.ndarray, cfg: CLIPConfig) -> tuple[str, np.ndarray]:
    """The hub key and tensor of one of our CLIPModel parameters (the inverse of :func:`key_to_path`)."""
    if path.startswith("vision_tower."):
        key, arr = hub_tensor(path, arr, cfg.vision.patch_size)
        return key.replace("vision_tower.vision_model.", _VISION, 1), arr
    fixed = {"text_model.token_embedding": "text_model.embeddings.token_embedding.weight",
             "text_model.position_embedding": "text_model.embeddings.position_embedding.weight",
             "logit_scale": "logit_scale"}
    if path in fixed:
        return fixed[path], arr
    key = re.sub(r"^text_model\.layers\.", "text_model.encoder.layers.", path)
    if key.endswith(".kernel"):
        return key[: -len(".kernel")] + ".weight", _linear(arr)
    return key, arr


def _tensors(directory: str):
    return ((k, t) for k, t in iter_hf_tensors(directory) if not _SKIPPED.fullmatch(k))


def load_clip_checkpoint(directory: str, **overrides) -> CLIPModel:
    """A HF CLIPModel directory (config.json + safetensors) as a :class:`CLIPModel`; ``overrides`` set
    CLIPConfig fields (``dtype``, ``attention``)."""
    cfg = config_from_hf(read_json_object(os.path.join(directory, "config.json")), **overrides)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CLIPModel(cfg, rngs=InitKeys(0))))
    ours = _flat_params(state)
    loaded = load_tensors(_tensors(directory), ours, directory, key_to_path=key_to_path)
    missing = sorted(set(ours) - set(loaded))
    if missing:
        raise KeyError(f"{directory}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    for path, variable in nnx.to_flat_state(state):
        variable.set_value(loaded[".".join(str(p) for p in path)])
    return nnx.merge(graphdef, state)


def save_clip_checkpoint(model: CLIPModel, directory: str) -> None:
    """``config.json`` and ``model.safetensors`` in the hub's CLIPModel layout (transformers loads them)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_to_hf(model.cfg), f, indent=2)
    tensors = dict(path_to_hub(path, np.asarray(jax.device_get(leaf[...])), model.cfg)
                   for path, leaf in _flat_params(nnx.state(model, nnx.Param)).items()
                   if not path.startswith(("fact_heads.", "dense_heads.")))  # a vision stage's training heads: not CLIP's
    save_file({k: np.array(v, order="C") for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


def load_clip_vision_tower(model, directory: str) -> None:
    """Set a LLaVA model's vision tower to the one of the CLIPModel checkpoint in ``directory`` (in place).

    The towers must agree in every field but ``feature_layer`` (which layer LLaVA reads); an
    :class:`fire_jax.core.config.InputError` names the first that differs.
    """
    from fire_jax.core.config import InputError

    vision = config_from_hf(read_json_object(os.path.join(directory, "config.json"))).vision
    ours_cfg = model.cfg.vision
    for field in ("image_size", "patch_size", "width", "layers", "heads", "mlp_dim", "layer_norm_eps"):
        if getattr(vision, field) != getattr(ours_cfg, field):
            raise InputError(f"{directory}/config.json: vision_config {field} is {getattr(vision, field)}, the "
                             f"model's vision tower has {getattr(ours_cfg, field)}")
    state = nnx.state(model.vision_tower, nnx.Param)
    ours = {f"vision_tower.{k}": v for k, v in _flat_params(state).items()}
    tensors = (("vision_tower." + k[len(_VISION):], t) for k, t in _tensors(directory) if k.startswith(_VISION))
    loaded = load_tensors(tensors, ours, directory)
    for path, variable in nnx.to_flat_state(state):
        variable.set_value(loaded["vision_tower." + ".".join(str(p) for p in path)])
