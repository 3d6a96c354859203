"""CLIP ViT vision tower (pre-LN, quick_gelu), as LLaVA-NeXT uses it.

Returns the hidden state of one layer (HF's ``vision_feature_layer``: index
into ``hidden_states`` where 0 is the embeddings after ``pre_layrnorm``), CLS
dropped. Layers after the selected one are kept (checkpoints round-trip) but
never run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fire_jax.models.config import VisionConfig
from fire_jax.models.layers import LayerNorm, Linear, attention


def quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


class CLIPAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype, rngs: nnx.Rngs, kernel: str = "auto"):
        w = cfg.width
        self.kernel = kernel  # models.layers.ATTENTION_KERNELS
        self.heads = cfg.heads
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, Linear(w, w, axes=("vision_embed", "vision_heads"), bias=True,
                                       param_dtype=param_dtype, rngs=rngs))
        self.out_proj = Linear(w, w, axes=("vision_heads", "vision_embed"), bias=True,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, w = x.shape
        split = lambda y: y.reshape(b, t, self.heads, w // self.heads)  # [batch, tokens, heads, head_dim]
        heads_major = lambda y: split(y).transpose(0, 2, 1, 3)  # [batch, heads, seq, head_dim]
        out = attention(split(self.q_proj(x)), heads_major(self.k_proj(x)), heads_major(self.v_proj(x)), None,
                        kernel=self.kernel)
        return self.out_proj(out.reshape(b, t, w))


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype, rngs: nnx.Rngs):
        self.fc1 = Linear(cfg.width, cfg.mlp_dim, axes=("vision_embed", "vision_mlp"), bias=True,
                          param_dtype=param_dtype, rngs=rngs)
        self.fc2 = Linear(cfg.mlp_dim, cfg.width, axes=("vision_mlp", "vision_embed"), bias=True,
                          param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(quick_gelu(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype, rngs: nnx.Rngs, kernel: str = "auto"):
        self.layer_norm1 = LayerNorm(cfg.width, cfg.layer_norm_eps, param_dtype=param_dtype)
        self.self_attn = CLIPAttention(cfg, param_dtype=param_dtype, rngs=rngs, kernel=kernel)
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
            jax.random.normal(rngs.params(), (3 * p * p, w), param_dtype) * 0.02, axes=(None, "vision_embed"))
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (w,), param_dtype) * 0.02,
                                         axes=("vision_embed",))
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.num_patches + 1, w), param_dtype) * 0.02, axes=(None, "vision_embed"))
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

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values ``[n, 3, H, W]`` -> features ``[n, num_patches, width]`` (CLS dropped)."""
        n, c, h, w = pixel_values.shape
        p = self.cfg.patch_size
        patches = pixel_values.astype(self.dtype).reshape(n, c, h // p, p, w // p, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(n, (h // p) * (w // p), c * p * p)
        x = patches @ self.patch_embedding[...].astype(self.dtype)  # [n, patches, width]
        cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype), (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...].astype(self.dtype)
        x = self.pre_layrnorm(x)
        for layer in self.layers[: self.num_layers_run]:
            x = layer(x)
        return x[:, 1:]
