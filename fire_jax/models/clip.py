"""CLIP (Radford et al. 2021): the ViT vision tower LLaVA-NeXT uses, the text tower, and the contrastive loss.

:class:`CLIPVisionTower` called returns the hidden state of one layer (HF's
``vision_feature_layer``: index into ``hidden_states`` where 0 is the
embeddings after ``pre_layrnorm``), CLS dropped, as LLaVA reads it; layers
after the selected one are kept (checkpoints round-trip) but never run there.
:meth:`CLIPVisionTower.pooled` runs every layer and returns the normalised CLS
state, CLIP's image representation. :class:`CLIPModel` projects both towers'
pooled states into one space and scores every image against every text
(Sec. 2.3, Fig. 3); :func:`contrastive_loss` is the symmetric cross-entropy
over those scores.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from fire_jax.core import axes as ax
from fire_jax.models.config import CLIPConfig, CLIPTextConfig, VisionConfig
from fire_jax.models.layers import LayerNorm, Linear, attention


def quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


class CLIPAttention(nnx.Module):
    """Multi-head self-attention with biases; ``causal`` for the text tower (each token sees those before it)."""

    def __init__(self, cfg: VisionConfig | CLIPTextConfig, *, param_dtype, rngs: nnx.Rngs, kernel: str = "auto",
                 causal: bool = False):
        w = cfg.width
        self.kernel = kernel  # models.layers.ATTENTION_KERNELS
        self.causal = causal
        self.heads = cfg.heads
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, Linear(w, w, axes=(ax.VISION_EMBED, ax.VISION_HEADS), bias=True,
                                       param_dtype=param_dtype, rngs=rngs))
        self.out_proj = Linear(w, w, axes=(ax.VISION_HEADS, ax.VISION_EMBED), bias=True,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, w = x.shape
        split = lambda y: y.reshape(b, t, self.heads, w // self.heads)  # [batch, tokens, heads, head_dim]
        heads_major = lambda y: split(y).transpose(0, 2, 1, 3)  # [batch, heads, seq, head_dim]
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None] if self.causal else None
        out = attention(split(self.q_proj(x)), heads_major(self.k_proj(x)), heads_major(self.v_proj(x)), mask,
                        causal=self.causal, kernel=self.kernel)
        return self.out_proj(out.reshape(b, t, w))


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig | CLIPTextConfig, *, param_dtype, rngs: nnx.Rngs):
        self.fc1 = Linear(cfg.width, cfg.mlp_dim, axes=(ax.VISION_EMBED, ax.VISION_MLP), bias=True,
                          param_dtype=param_dtype, rngs=rngs)
        self.fc2 = Linear(cfg.mlp_dim, cfg.width, axes=(ax.VISION_MLP, ax.VISION_EMBED), bias=True,
                          param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(quick_gelu(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig | CLIPTextConfig, *, param_dtype, rngs: nnx.Rngs, kernel: str = "auto",
                 causal: bool = False):
        self.layer_norm1 = LayerNorm(cfg.width, cfg.layer_norm_eps, param_dtype=param_dtype)
        self.self_attn = CLIPAttention(cfg, param_dtype=param_dtype, rngs=rngs, kernel=kernel, causal=causal)
        self.layer_norm2 = LayerNorm(cfg.width, cfg.layer_norm_eps, param_dtype=param_dtype)
        self.mlp = CLIPMLP(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, attention: str = "auto"):
        self.cfg = cfg
        self.dtype = dtype
        p, w = cfg.patch_size, cfg.width
        # The patch conv as a matmul over flattened (channel, row, col) patches.
        self.patch_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (3 * p * p, w), param_dtype) * 0.02, axes=(None, ax.VISION_EMBED))
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (w,), param_dtype) * 0.02,
                                         axes=(ax.VISION_EMBED,))
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.num_patches + 1, w), param_dtype) * 0.02, axes=(None, ax.VISION_EMBED))
        self.pre_layrnorm = LayerNorm(w, cfg.layer_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List(
            [CLIPEncoderLayer(cfg, param_dtype=param_dtype, rngs=rngs, kernel=attention) for _ in range(cfg.layers)])
        # post_layernorm only feeds CLIP's pooled output, which LLaVA never uses; kept for checkpoints.
        self.post_layernorm = LayerNorm(w, cfg.layer_norm_eps, param_dtype=param_dtype)

    @property
    def num_layers_run(self) -> int:
        k = self.cfg.feature_layer
        n = k if k >= 0 else self.cfg.layers + 1 + k
        if not 0 <= n <= self.cfg.layers:
            raise ValueError(f"vision feature_layer {k} out of range for {self.cfg.layers} layers")
        return n

    def _embed(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values ``[n, 3, H, W]`` -> ``[n, 1 + num_patches, width]``: CLS and patches, after pre_layrnorm."""
        n, c, h, w = pixel_values.shape
        p = self.cfg.patch_size
        patches = pixel_values.astype(self.dtype).reshape(n, c, h // p, p, w // p, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(n, (h // p) * (w // p), c * p * p)
        x = patches @ self.patch_embedding[...].astype(self.dtype)  # [n, patches, width]
        cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype), (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...].astype(self.dtype)
        return self.pre_layrnorm(x)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values ``[n, 3, H, W]`` -> features ``[n, num_patches, width]`` (CLS dropped)."""
        return self.hidden_states(pixel_values, self.num_layers_run)[-1]

    def hidden_states(self, pixel_values: jax.Array, layers: int) -> list[jax.Array]:
        """The patches' hidden states after the embeddings and after each of the first ``layers`` layers (HF's
        ``hidden_states[:layers + 1]``, CLS dropped): ``layers + 1`` arrays ``[n, num_patches, width]``."""
        x = self._embed(pixel_values)
        states = [x[:, 1:]]
        for layer in self.layers[:layers]:
            x = layer(x)
            states.append(x[:, 1:])
        return states

    def pooled(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values ``[n, 3, H, W]`` -> ``[n, width]``: the CLS state after every layer and post_layernorm."""
        x = self._embed(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x[:, 0])


class CLIPTextTower(nnx.Module):
    """CLIP's text transformer: token and position embeddings, causal pre-LN layers, a final LayerNorm; the
    sequence is represented by the state of its end token (:class:`CLIPTextConfig`)."""

    def __init__(self, cfg: CLIPTextConfig, *, dtype, param_dtype, rngs: nnx.Rngs, attention: str = "auto"):
        self.cfg = cfg
        self.dtype = dtype
        w = cfg.width
        self.token_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, w), param_dtype) * 0.02, axes=(None, ax.VISION_EMBED))
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.max_positions, w), param_dtype) * 0.01, axes=(None, ax.VISION_EMBED))
        self.layers = nnx.List([CLIPEncoderLayer(cfg, param_dtype=param_dtype, rngs=rngs, kernel=attention, causal=True)
                                for _ in range(cfg.layers)])
        self.final_layer_norm = LayerNorm(w, cfg.layer_norm_eps, param_dtype=param_dtype)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """input_ids ``[n, t]`` (padding after the end token) -> ``[n, width]``, the end token's final state.

        Causal attention alone: padding follows the end token, so no position up to it ever sees padding."""
        t = input_ids.shape[1]
        if t > self.cfg.max_positions:
            raise ValueError(f"text of {t} tokens: the text tower has {self.cfg.max_positions} positions")
        x = self.token_embedding[...].astype(self.dtype)[input_ids] + self.position_embedding[...][:t].astype(self.dtype)
        for layer in self.layers:
            x = layer(x)
        x = self.final_layer_norm(x)
        if self.cfg.eos_token_id == 2:  # the first OpenAI configs: the end token is the largest id
            end = jnp.argmax(input_ids, axis=-1)
        else:
            end = jnp.argmax(input_ids == self.cfg.eos_token_id, axis=-1)
        return jnp.take_along_axis(x, end[:, None, None], axis=1)[:, 0]


class CLIPModel(nnx.Module):
    """Both towers, their projections (no bias) and ``logit_scale``, as transformers' ``CLIPModel``.

    The vision tower is :class:`CLIPVisionTower`, named ``vision_tower`` as in LLaVA, so a trained CLIP's
    tower is a LLaVA tower weight for weight (``fire_jax.convert.clip.load_clip_vision_tower``).
    """

    #: What trains it, reads its data and exports it (``config.model.kind``; fire_jax.train: the one table).
    kind = "clip"

    def __init__(self, cfg: CLIPConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.vision_tower = CLIPVisionTower(cfg.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                            attention=cfg.attention)
        self.text_model = CLIPTextTower(cfg.text, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                        attention=cfg.attention)
        self.visual_projection = Linear(cfg.vision.width, cfg.projection_dim, axes=(ax.VISION_EMBED, None),
                                        param_dtype=param_dtype, rngs=rngs)
        self.text_projection = Linear(cfg.text.width, cfg.projection_dim, axes=(ax.VISION_EMBED, None),
                                      param_dtype=param_dtype, rngs=rngs)
        self.logit_scale = nnx.Param(jnp.asarray(cfg.logit_scale_init, param_dtype))
        if cfg.fact_classes:
            inputs = cfg.vision.width * (1 if cfg.fact_pooling == "token" else 1 + cfg.vision.num_patches)
            self.fact_heads = Linear(inputs, sum(cfg.fact_classes), axes=(ax.VISION_EMBED, None), bias=True,
                                     param_dtype=param_dtype, rngs=rngs)
        if cfg.dense_classes:
            self.dense_heads = Linear(cfg.vision.width, sum(cfg.dense_classes), axes=(ax.VISION_EMBED, None),
                                      bias=True, param_dtype=param_dtype, rngs=rngs)

    def fact_logits(self, view_pixels: jax.Array, feature_index: jax.Array
                    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """The auxiliary heads' logits from what a LLaVA reads of each image: ``view_pixels`` ``[n, tiles, 3, H,
        W]`` (its any-resolution tiles, the whole-image tile first), ``feature_index`` ``[n, k]`` (the features it
        places, -1 pads; as :meth:`fire_jax.core.geometry.ImageGeometry.feature_index`). Returns one
        ``[n, reads, classes]`` array per head of ``cfg.fact_classes``, from the tower's features at the layer
        LLaVA reads:

        - ``fact_pooling="tile"``: one read (``reads`` 1), a linear map of the features averaged over the
          positions LLaVA places beside the whole-image tile's features patch by patch;
        - ``"token"``: a read per patch of the whole-image tile (``reads`` = its patches), the same linear map
          applied to each: every token the LLM gets of that tile must carry the image's facts, as a global
          colour is carried, where the LLM reads it after a few updates. Only that tile is run.

        and one ``[n, patches, classes]`` array per head of ``cfg.dense_classes`` (none without them): a linear map
        of each patch of the whole-image tile at hidden state ``cfg.dense_layer``, below the layer LLaVA reads, so
        that the layers between learn to gather what the patches hold (fire_jax.data.synthetic.layout_facts).
        """
        n, tiles = view_pixels.shape[:2]
        patches, cfg = self.cfg.vision.num_patches, self.cfg
        read = self.vision_tower.num_layers_run
        if cfg.fact_pooling == "token":  # the whole-image tile alone
            view_pixels, tiles = view_pixels[:, :1], 1
        states = self.vision_tower.hidden_states(view_pixels.reshape(n * tiles, *view_pixels.shape[2:]),
                                                 max(read, cfg.dense_layer))
        features = states[read].reshape(n, -1, states[read].shape[-1])  # [n, tiles * patches, width]
        if cfg.fact_pooling == "token":
            logits = self.fact_heads(features[:, :patches]).astype(jnp.float32)  # [n, patches, classes]
        else:
            valid = (feature_index >= 0)[..., None].astype(features.dtype)
            picked = jnp.take_along_axis(features, jnp.maximum(feature_index, 0)[..., None], axis=1) * valid
            pooled = picked.sum(1) / jnp.maximum(valid.sum(1), 1.0)
            base = features[:, :patches].reshape(n, -1)  # the whole-image tile, patch by patch
            logits = self.fact_heads(jnp.concatenate([pooled, base], -1)).astype(jnp.float32)[:, None]
        dense = []
        if cfg.dense_classes:
            below = states[cfg.dense_layer].reshape(n, tiles * patches, -1)[:, :patches]
            dense = _split(self.dense_heads(below).astype(jnp.float32), cfg.dense_classes)
        return _split(logits, cfg.fact_classes), dense

    def image_embeds(self, pixel_values: jax.Array) -> jax.Array:
        """``[n, 3, H, W]`` -> unit-norm ``[n, projection_dim]``."""
        return _unit(self.visual_projection(self.vision_tower.pooled(pixel_values)))

    def text_embeds(self, input_ids: jax.Array) -> jax.Array:
        """``[n, t]`` -> unit-norm ``[n, projection_dim]``."""
        return _unit(self.text_projection(self.text_model(input_ids)))

    def __call__(self, pixel_values: jax.Array, input_ids: jax.Array) -> jax.Array:
        """logits_per_image ``[images, texts]``: exp(logit_scale) times the cosine similarities (Fig. 3)."""
        scale = jnp.exp(self.logit_scale[...].astype(jnp.float32))
        return scale * (self.image_embeds(pixel_values).astype(jnp.float32)
                        @ self.text_embeds(input_ids).astype(jnp.float32).T)


def _split(logits: jax.Array, classes) -> list[jax.Array]:
    """The last axis cut into one array per head of ``classes`` (their sizes)."""
    return jnp.split(logits, [int(b) for b in np.cumsum(classes)[:-1]], axis=-1)


def _unit(x: jax.Array) -> jax.Array:
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _head_nll(head: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log-probabilities ``[..., classes]``, negative log-likelihood of ``target`` ``[...]``) of one head."""
    logp = jax.nn.log_softmax(head, axis=-1)
    return logp, -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]


def fact_loss(logits: list[jax.Array], facts: jax.Array, weights=None) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy of each auxiliary head (``[n, reads, classes]``, :meth:`CLIPModel.fact_logits`) against
    ``facts`` ``[n, heads]`` (-1: the head does not apply to that image), averaged over the reads and over the
    (image, head) pairs that apply, each pair weighted by its head's ``weights`` (default 1); and each pair's
    correctness ``[n, heads]`` (the class of the reads' summed log-probabilities; False where it does not apply)."""
    nll, correct = [], []
    for h, head in enumerate(logits):
        target = jnp.maximum(facts[:, h], 0)
        logp, head_nll = _head_nll(head, jnp.broadcast_to(target[:, None], head.shape[:-1]))  # [n, reads, ...]
        nll.append(head_nll.mean(1))
        correct.append(jnp.argmax(logp.sum(1), axis=-1) == target)
    applies = facts >= 0
    weight = applies * (jnp.ones(len(logits)) if weights is None else jnp.asarray(weights, jnp.float32))
    nll = jnp.where(applies, jnp.stack(nll, 1), 0.0) * weight
    return nll.sum() / jnp.maximum(weight.sum(), 1e-6), jnp.stack(correct, 1) & applies


def dense_loss(logits: list[jax.Array], targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy of each dense head (``[n, patches, classes]``, :meth:`CLIPModel.fact_logits`) against
    ``targets`` ``[n, patches, heads]`` (-1: the head does not apply), summed over the heads that apply to a patch
    and averaged over the patches they apply to; and each (image, patch, head)'s correctness (False where it
    does not apply)."""
    applies = targets >= 0
    nll, correct = [], []
    for h, head in enumerate(logits):
        target = jnp.maximum(targets[..., h], 0)
        logp, head_nll = _head_nll(head, target)  # [n, patches, ...]
        nll.append(head_nll)
        correct.append(jnp.argmax(logp, axis=-1) == target)
    nll = jnp.where(applies, jnp.stack(nll, -1), 0.0)
    rows = applies.any(-1).sum()
    return nll.sum() / jnp.maximum(rows, 1), jnp.stack(correct, -1) & applies


def contrastive_loss(logits_per_image: jax.Array) -> jax.Array:
    """The symmetric InfoNCE loss of Radford et al. 2021 (Fig. 3): image i's text is text i; the mean of the
    cross-entropy over each row (image -> texts) and over each column (text -> images)."""
    labels = jnp.arange(logits_per_image.shape[0])
    image_to_text = -jnp.mean(jax.nn.log_softmax(logits_per_image, axis=1)[labels, labels])
    text_to_image = -jnp.mean(jax.nn.log_softmax(logits_per_image, axis=0)[labels, labels])
    return (image_to_text + text_to_image) / 2
