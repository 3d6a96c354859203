"""Building a config's model: random weights (created straight onto a mesh when one is given), a Hugging Face or
original-LLaVA checkpoint, a GGUF file's LLM under a fresh vision tower, or a CLIP; and which of its weights a run
trains (:func:`trainable_filter`). Training and inference build models the same way.
"""

from __future__ import annotations

import os
import re

import jax
import ml_collections
from flax import nnx

from fire_jax.core.config import InputError, resolve_path
from fire_jax.models import InitKeys, LlavaNext, LlavaNextConfig, LoRAParam


#: The build options of ``config.model`` that a Hugging Face checkpoint does not set.
_RUNTIME_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "image_mode", "pad_newline")


def build_model(config, mesh=None, rules=None) -> LlavaNext:
    """The model of ``config`` (:func:`_weights`); with ``config.init.lora_from``, a PEFT adapter folder (a
    trainer's ``export/peft_adapter``), its LoRA factors start from that adapter's instead of fresh ones: a stage
    that continues another's LoRA on the same base."""
    init = config.get("init") or {}
    lora_from = init.get("lora_from") if init else None
    if lora_from and config.model.get("kind") == "clip":
        raise InputError("init.lora_from: a CLIP has no LoRA")
    model = _weights(config, mesh, rules)
    if lora_from:
        from fire_jax.convert.hf import load_peft_adapter

        model = load_peft_adapter(model, resolve_path(lora_from))
    return model


def _weights(config, mesh=None, rules=None) -> LlavaNext:
    """Random weights (``config.seed``), a Hugging Face checkpoint when ``config.init.hf_checkpoint`` is set, or
    a GGUF file's LLM under a fresh vision tower when ``config.init.gguf`` is (and no checkpoint is); with
    ``config.init.vision_tower`` (a HF CLIPModel directory, as ``fire_jax.train`` exports a CLIP), that
    CLIP's vision tower replaces the model's. ``model.kind="clip"``: a :class:`fire_jax.models.clip.CLIPModel`.

    The checkpoint is llava-hf's or the original LLaVA format's (:mod:`fire_jax.convert.llava`);
    ``config.init.adapter``, a LoRA folder of the original format (the FIRE release's teacher), is merged into it
    as the release's builder merges it. An adapter without a checkpoint goes on the base its
    ``adapter_config.json`` names.

    With ``mesh``, random weights are created already sharded by ``rules`` (each device makes only its
    shard: nothing lands on one device first); a Hugging Face checkpoint is read and then placed.
    """
    from fire_jax.weights.sharding import DEFAULT_RULES, state_shardings

    init = config.get("init", {})
    if config.model.get("kind") == "clip":
        return _clip(config, init)
    checkpoint = init.get("hf_checkpoint") if init else None
    adapter = init.get("adapter") if init else None
    if adapter and not checkpoint:
        from fire_jax.convert.llava import adapter_base

        checkpoint = adapter_base(adapter)
    cfg = LlavaNextConfig.from_dict(config.model)
    if init and init.get("vision_tower"):  # a CLIP's tower under whatever LLM the rest of ``init`` gives
        from fire_jax.convert.clip import load_clip_vision_tower

        rest = ml_collections.ConfigDict(config.to_dict())
        rest.init.vision_tower = ""
        model = _weights(rest, mesh, rules)
        load_clip_vision_tower(model, resolve_path(init.vision_tower))
        return model
    if init and init.get("gguf") and not checkpoint:
        return _from_gguf(config, cfg, mesh, rules)
    if not checkpoint:
        if mesh is None:
            return LlavaNext(cfg, rngs=nnx.Rngs(config.seed))
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LlavaNext(cfg, rngs=InitKeys(config.seed))))
        shardings = state_shardings(abstract, mesh, rules or DEFAULT_RULES)
        state = jax.jit(lambda: nnx.state(LlavaNext(cfg, rngs=InitKeys(config.seed))), out_shardings=shardings)()
        return nnx.merge(graphdef, state)
    from fire_jax.convert.load import load_checkpoint

    overrides = {k: v for k, v in config.model.items() if k in _RUNTIME_FIELDS}
    if config.model.get("conventions"):  # "" (or absent): the checkpoint's (fire_jax.core.geometry.CONVENTIONS)
        overrides["conventions"] = config.model.conventions
    model = load_checkpoint(checkpoint, cfg.lora, seed=config.seed, adapter=adapter or None, **overrides)
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules or DEFAULT_RULES)))
    return model


def conventions_of(checkpoint: str = "", adapter: str = "", override: str = "") -> str:
    """The input conventions a model is run with (:data:`fire_jax.core.geometry.CONVENTIONS`): ``override``
    (``config.model.conventions``) when set, else the checkpoint's: "release" for the original LLaVA format (a
    checkpoint folder of ``model_type`` llava_llama, or a LoRA folder of that format), "transformers" for the
    rest (llava-hf folders, GGUF files, random weights)."""
    from fire_jax.convert.hf import read_config
    from fire_jax.convert.llava import is_llava_config, is_llava_lora

    if override:
        return override
    if adapter and os.path.isdir(adapter) and is_llava_lora(adapter):
        return "release"
    if checkpoint and os.path.exists(os.path.join(checkpoint, "config.json")) and is_llava_config(
            read_config(checkpoint)):
        return "release"
    return "transformers"


def _clip(config, init):
    """A CLIP (``model.kind="clip"``): random weights, or the HF CLIPModel checkpoint ``init.clip_checkpoint``."""
    from fire_jax.models.clip import CLIPModel
    from fire_jax.models.config import CLIPConfig

    checkpoint = init.get("clip_checkpoint") if init else None
    if checkpoint:
        from fire_jax.convert.clip import load_clip_checkpoint

        return load_clip_checkpoint(resolve_path(checkpoint))
    return CLIPModel(CLIPConfig.from_dict(config.model), rngs=nnx.Rngs(config.seed))


def _from_gguf(config, cfg: LlavaNextConfig, mesh, rules) -> LlavaNext:
    """``config.init.gguf`` (a model name or a .gguf path): the file's LLM in a LLaVA whose vision tower,
    connector, image_newline and any rows past the file's vocabulary (the image token) start random."""
    from fire_jax.convert.fetch import prepare
    from fire_jax.convert.gguf import load_gguf_llm
    from fire_jax.weights.sharding import DEFAULT_RULES, state_shardings

    model = LlavaNext(cfg, rngs=nnx.Rngs(config.seed))
    load_gguf_llm(model, prepare(config.init.gguf))
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules or DEFAULT_RULES)))
    return model


def trainable_filter(train_cfg):
    """What the optimizer sees: LoRA factors, the connector with ``train_connector``, and any frozen
    weight whose path ("language_model/model/layers/0/mlp/up_proj/kernel") fully matches one of the
    ``trainable`` regexes (big_vision-style; the tiny from-scratch demo trains everything with ".*")."""
    filters = [LoRAParam]
    if train_cfg.train_connector:
        filters.append(nnx.All(nnx.Param, nnx.PathContains("multi_modal_projector")))
    patterns = tuple(train_cfg.get("trainable", ()))
    if patterns:
        regex = re.compile("|".join(f"(?:{p})" for p in patterns))
        filters.append(nnx.All(nnx.Param, lambda path, _: regex.fullmatch(param_path(path)) is not None))
    return nnx.Any(*filters)


def param_path(path) -> str:
    """An NNX state path as ``train.trainable`` regexes see it: its keys joined with "/"."""
    return "/".join(map(str, path))


def check_trainable(model, train_cfg) -> None:
    """Refuse a ``train.trainable`` regex that fully matches no parameter path of ``model``: such a pattern
    would leave the weights it names frozen without a word (``vision_tower\\..*`` against the "/"-joined
    paths, for one). The error names the pattern and a path of the model that it was probably meant for."""
    patterns = tuple(train_cfg.get("trainable", ()))
    if not patterns:
        return
    paths = [param_path(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    for pattern in patterns:
        regex = re.compile(pattern)
        if any(regex.fullmatch(path) for path in paths):
            continue
        head = re.split(r"[^A-Za-z0-9_]", pattern, maxsplit=1)[0]
        near = [path for path in paths if head and path.startswith(head)] or paths
        raise InputError(f"train.trainable: {pattern!r} fully matches none of the model's {len(paths)} parameter "
                         f"paths; they are joined with '/', e.g. {near[0]!r}")
