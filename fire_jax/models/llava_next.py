"""LLaVA-NeXT and LLaVA-1.5: CLIP tiles -> 2-layer GELU connector -> merged into Llama embeddings.

One module for both: ``cfg.architecture="llava"`` (LLaVA-1.5, transformers' ``LlavaForConditionalGeneration``)
has no image_newline parameter and one padded-to-square tile per image (``image_mode="pad"``), whose
``grid**2`` features replace its placeholders in raster order, as ``LlavaModel.get_image_features`` /
``masked_scatter`` do; the merge below is the same gather.

The merge has static shapes: the host computes ``image_index`` (see
:func:`fire_jax.core.geometry.place_images`), the position of every image feature
in the token sequence, as an index into a per-example feature bank (all tile
features, then image_newline). The device gathers from the bank and selects
with ``jnp.where``; no boolean scatter, no Python loop over examples.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fire_jax.core import axes as ax
from fire_jax.models.clip import CLIPVisionTower
from fire_jax.models.config import LlavaNextConfig
from fire_jax.models.layers import Linear, LoRAParam
from fire_jax.models.llama import KVCache, LlamaModel


class Projector(nnx.Module):
    """Linear(vision -> llm) -> GELU (exact) -> Linear(llm -> llm); ``cfg.projector="linear"``: the first Linear
    alone (the original LLaVA's ``mm_projector_type: linear``)."""

    def __init__(self, cfg: LlavaNextConfig, *, param_dtype, rngs: nnx.Rngs):
        kw = dict(bias=cfg.projector_bias, param_dtype=param_dtype, rngs=rngs)
        self.linear_1 = Linear(cfg.vision.width, cfg.llm.dim, axes=(ax.VISION_EMBED, ax.EMBED), **kw)
        self.linear_2 = Linear(cfg.llm.dim, cfg.llm.dim, axes=(ax.MLP, ax.EMBED), **kw) \
            if cfg.projector == "mlp2x_gelu" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.linear_1(x)
        return x if self.linear_2 is None else self.linear_2(jax.nn.gelu(x, approximate=False))


class LanguageModel(nnx.Module):
    """Llama decoder + lm_head (HF ``LlamaForCausalLM``).

    With ``tie_word_embeddings`` there is no lm_head: the head is the embedding's transpose.
    """

    def __init__(self, cfg: LlavaNextConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.model = LlamaModel(cfg.llm, cfg.lora, dtype=dtype, param_dtype=param_dtype, remat=cfg.remat, rngs=rngs,
                                scan_layers=cfg.scan_layers, attention=cfg.attention)
        self.lm_head = None if cfg.llm.tie_word_embeddings else Linear(
            cfg.llm.dim, cfg.llm.vocab_size, axes=(ax.EMBED, ax.VOCAB), param_dtype=param_dtype, rngs=rngs)

    def head_kernel(self) -> jax.Array:
        """The LM head ``[dim, vocab]``: lm_head's kernel, or the embedding transposed when tied."""
        if self.lm_head is None:
            return self.model.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]


class LlavaNext(nnx.Module):
    #: What trains it, reads its data and exports it (``config.model.kind``; fire_jax.train: the one table).
    kind = "llava"

    def __init__(self, cfg: LlavaNextConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.dtype = dtype
        self.vision_tower = CLIPVisionTower(cfg.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                            attention=cfg.attention)
        self.multi_modal_projector = Projector(cfg, param_dtype=param_dtype, rngs=rngs)
        self.image_newline = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.llm.dim,), param_dtype) * cfg.llm.dim ** -0.5,
            axes=(ax.EMBED,)) if cfg.has_image_newline else None
        self.language_model = LanguageModel(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def image_features(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values ``[batch, tiles, 3, H, W]`` -> projected features ``[batch, tiles, patches, dim]``."""
        b, t = pixel_values.shape[:2]
        feats = self.vision_tower(pixel_values.reshape(b * t, *pixel_values.shape[2:]))
        feats = self.multi_modal_projector(feats)
        return feats.reshape(b, t, feats.shape[1], feats.shape[2])

    def embed(self, input_ids: jax.Array, pixel_values: jax.Array | None = None,
              image_index: jax.Array | None = None) -> jax.Array:
        """Token embeddings with image features placed by ``image_index`` (-1 = text)."""
        embeds = self.language_model.model.embed(input_ids)  # [batch, seq, dim]
        if pixel_values is None:
            return embeds
        feats = self.image_features(pixel_values)
        b, t, p, d = feats.shape
        bank = feats.reshape(b, t * p, d)
        if self.image_newline is not None:  # [batch, tiles*patches+1, dim]; LLaVA-1.5's index never reaches it
            newline = jnp.broadcast_to(self.image_newline[...].astype(feats.dtype), (b, 1, d))
            bank = jnp.concatenate([bank, newline], axis=1)
        gathered = jnp.take_along_axis(bank, jnp.maximum(image_index, 0)[..., None], axis=1)
        return jnp.where(image_index[..., None] >= 0, gathered.astype(embeds.dtype), embeds)

    def hidden_states(self, input_ids, pixel_values=None, image_index=None, attention_mask=None, positions=None,
                      cache: KVCache | None = None, dropout_rng=None, last=None):
        """Final normed hidden states ``[batch, seq, dim]`` and the updated cache; ``last`` ``[batch]``: only
        row b's position ``last[b]``, ``[batch, 1, dim]`` (:class:`fire_jax.models.llama.LlamaModel`)."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if positions is None:
            offset = 0 if cache is None else cache.index
            positions = jnp.broadcast_to(offset + jnp.arange(input_ids.shape[1]), input_ids.shape)
        embeds = self.embed(input_ids, pixel_values, image_index)
        return self.language_model.model(embeds, positions, attention_mask, cache, dropout_rng, last)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden ``[..., dim]`` -> logits ``[..., vocab]``."""
        return hidden @ self.language_model.head_kernel().astype(hidden.dtype)

    def __call__(self, input_ids, pixel_values=None, image_index=None, attention_mask=None, positions=None,
                 cache: KVCache | None = None, dropout_rng=None):
        """Logits ``[batch, seq, vocab]`` (and the cache when one is given)."""
        hidden, cache = self.hidden_states(input_ids, pixel_values, image_index, attention_mask, positions, cache,
                                           dropout_rng)
        logits = self.logits(hidden)
        return logits if cache is None else (logits, cache)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every LoRA adapter into its frozen kernel, in place; returns the model."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear):
            module.merge_lora()
    return model


def fold_lora(model: nnx.Module) -> nnx.Module:
    """Fold every LoRA adapter into its kernel and restart it from zero (:meth:`Linear.fold_lora`), in place;
    returns the model."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear):
            module.fold_lora()
    return model


def set_layer_layout(model: LlavaNext, scan_layers: bool) -> LlavaNext:
    """Stack the LLM layers (``scan_layers=True``: training, scoring) or list them (decoding), in place.

    One copy of the layer weights; the config records the layout. Returns the model.
    """
    model.language_model.model.set_layout(scan_layers)
    model.cfg = dataclasses.replace(model.cfg, scan_layers=scan_layers)
    return model


def set_attention(model: LlavaNext, kernel: str) -> LlavaNext:
    """Switch every attention layer to ``kernel`` (``models.layers.ATTENTION_KERNELS``) in place; the config
    records it. The weights are untouched; jitted functions retrace for the new graph. Returns the model."""
    model.cfg = dataclasses.replace(model.cfg, attention=kernel)  # validates the name
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "kernel") and isinstance(module.kernel, str):
            module.kernel = kernel
    return model


def set_remat(model: LlavaNext, policy: str) -> LlavaNext:
    """Switch the LLM's per-layer rematerialisation to ``policy`` (``models.llama.REMAT_POLICIES``) in place, as
    :func:`set_attention` switches the kernel: a model loaded from a checkpoint trained with another policy (a
    reinforcement update holds many more rows than its supervised steps did). Returns the model."""
    from fire_jax.models.llama import REMAT_POLICIES

    if policy not in REMAT_POLICIES:
        raise ValueError(f"model.remat={policy!r}: choose from {sorted(REMAT_POLICIES)}")
    model.cfg = dataclasses.replace(model.cfg, remat=policy)
    model.language_model.model.remat = policy
    return model


def count_params(model: nnx.Module, filter_=nnx.Param) -> int:
    """Number of parameters of one variable type (works on abstract models too)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, filter_)))


__all__ = ["LlavaNext", "LoRAParam", "KVCache", "merge_lora", "set_layer_layout", "set_attention", "count_params"]
