"""Llama-3 decoder: RMSNorm, RoPE (with Llama-3.1 "llama3" scaling), GQA, SwiGLU.

Readable top to bottom. The KV cache is an explicit pytree passed in and out
(fixed size, updated with ``dynamic_update_slice``) so prefill and decode are
pure functions that ``jax.jit`` compiles once per shape.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.core import axes as ax
from fire_jax.models.config import LlamaConfig, LoraConfig
from fire_jax.models.layers import Embed, Linear, RMSNorm, attention
from fire_jax.models.partitioning import constrain

#: Per-layer rematerialisation policies, chosen by name in the config.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


#: The column (slot) axis of a cached key array ``[batch, kv_heads, head_dim, len]`` and of a cached value
#: array ``[batch, kv_heads, len, head_dim]``.
KEY_COLUMNS, VALUE_COLUMNS = 3, 2


class KVCache(NamedTuple):
    """Fixed-size cache, per layer: k ``[batch, kv_heads, head_dim, max_len]`` (keys transposed) and v
    ``[batch, kv_heads, max_len, head_dim]``, each head's columns contiguous, the layouts
    :func:`fire_jax.models.layers.attention` reads in place. With the keys transposed, a decode step's scores
    are a reduction over head_dim across contiguous columns, not a reduction of each column's head_dim
    contiguous values, which was the slowest op of a decode step on XLA:CPU (docs/decoding.md, measurements).

    ``mask`` ``[batch, max_len]`` marks filled, non-padding slots; ``index`` is
    the next slot to write: a scalar shared by the batch (``generate``: prompts
    are left-padded to one bucket), or ``[batch]``, a write column per row
    (the continuous-batching engine: each slot's request at its own length).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mask: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, cfg: LlamaConfig, batch: int, max_len: int, dtype) -> "KVCache":
        """An empty cache, every array its own buffer (so each can be donated)."""
        keys = (batch, cfg.kv_heads, cfg.head_dim, max_len)
        values = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        return cls(tuple(jnp.zeros(keys, dtype) for _ in range(cfg.layers)),
                   tuple(jnp.zeros(values, dtype) for _ in range(cfg.layers)),
                   jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))

    def map_columns(self, fn, *others: "KVCache") -> "KVCache":
        """``fn(array, *the others' arrays, axis=column axis)`` for every k, v and the mask (axis 1); the
        index is kept."""
        k = tuple(fn(*xs, axis=KEY_COLUMNS) for xs in zip(self.k, *(o.k for o in others)))
        v = tuple(fn(*xs, axis=VALUE_COLUMNS) for xs in zip(self.v, *(o.v for o in others)))
        return KVCache(k, v, fn(self.mask, *(o.mask for o in others), axis=1), self.index)


def columns(axis: int, rows, cols) -> tuple:
    """An index of ``rows`` on axis 0 and ``cols`` on ``axis``, every axis between whole."""
    return (rows,) + (slice(None),) * (axis - 1) + (cols,)


def write_columns(cache: jax.Array, new: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """``new`` written into ``cache`` (batch first, the same shape but ``seq`` columns on ``axis``:
    :data:`KEY_COLUMNS` for keys, :data:`VALUE_COLUMNS` for values, 1 for the mask ``[batch, len]``) from column
    ``index``: a scalar (one slice, in place) or one column per row ``[batch]`` (a scatter; columns past the
    end are dropped, so a finished row may keep stepping)."""
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache, new, tuple(index if a == axis else 0 for a in range(cache.ndim)))
    b, t = new.shape[0], new.shape[axis]
    where = columns(axis, jnp.arange(b)[:, None], index[:, None] + jnp.arange(t))  # rows [batch, 1], cols [batch, seq]
    return cache.at[where].set(jnp.moveaxis(new, axis, 1), mode="drop")  # indexed: [batch, seq, ...]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """RoPE inverse frequencies; ``scaling`` is Llama-3.1's "llama3" rule or None."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if not scaling:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[batch, seq, 1, head_dim]`` (float32) of rotate-half RoPE at ``positions [batch, seq]``,
    computed once per forward and read by every layer's q and k.

    On CPU they come out of a conditional whose other branch never runs (no position is below -2^30): left
    alone, XLA:CPU fuses the cosine and the sine into each of their 2 x layers consumers and evaluates them there
    for every head (an ``optimization_barrier`` does not stop it; the result of a conditional is always
    materialised), so the tables are read from memory instead (docs/decoding.md, measurements). On GPUs a
    conditional waits for its predicate on the host, and recomputing is cheap there.
    """

    def tables(positions):
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [batch, seq, head_dim/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
        return jnp.cos(emb), jnp.sin(emb)

    if jax.default_backend() != "cpu":
        return tables(positions)

    def never(positions):
        return tuple(jnp.zeros((*positions.shape, 1, 2 * len(inv_freq)), jnp.float32) for _ in range(2))

    return jax.lax.cond(jnp.any(positions < -(1 << 30)), never, tables, positions)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE (HF Llama layout). x ``[batch, seq, heads, head_dim]``; ``rope``: :func:`rope_tables`."""
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def take_rows(x: jax.Array, rows: jax.Array, axis: int) -> jax.Array:
    """Row b's entry ``rows[b]`` along ``axis`` of ``x`` (batch first), kept as an axis of length 1."""
    index = rows.reshape((-1,) + (1,) * (x.ndim - 1)).astype(jnp.int32)
    return jnp.take_along_axis(x, index, axis=axis, mode="clip")


def _lora_args(lora: LoraConfig | None, target: str) -> dict:
    if lora is None or target not in lora.targets:
        return {}
    return dict(lora_rank=lora.rank, lora_scale=lora.scale, lora_dropout=lora.dropout)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, lora: LoraConfig | None, *, param_dtype, rngs: nnx.Rngs,
                 kernel: str = "auto"):
        self.cfg = cfg
        self.kernel = kernel  # models.layers.ATTENTION_KERNELS
        d, q_dim, kv_dim = cfg.dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        kw = dict(bias=cfg.attention_bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(d, q_dim, axes=(ax.EMBED, ax.HEADS), **kw, **_lora_args(lora, "q"))
        self.k_proj = Linear(d, kv_dim, axes=(ax.EMBED, ax.KV_HEADS), **kw, **_lora_args(lora, "k"))
        self.v_proj = Linear(d, kv_dim, axes=(ax.EMBED, ax.KV_HEADS), **kw, **_lora_args(lora, "v"))
        self.o_proj = Linear(q_dim, d, axes=(ax.HEADS, ax.EMBED), **kw, **_lora_args(lora, "o"))

    def __call__(self, x, rope, mask, cache_kv, cache_index, rngs, rows=None):
        """``rows`` ``[batch]`` (or None: every position): the one position per row whose output is wanted;
        keys and values are still computed (and cached) at every position, queries only at ``rows``."""
        b, t, _ = x.shape
        c = self.cfg
        x_q, rope_q = x, rope
        if rows is not None:
            x_q, rope_q = take_rows(x, rows, 1), tuple(take_rows(r, rows, 1) for r in rope)
            mask = take_rows(mask, rows, 2)
        tq = x_q.shape[1]
        q = self.q_proj(x_q, rngs[0]).reshape(b, tq, c.heads, c.head_dim)  # [batch, seq, heads, head_dim]
        k = self.k_proj(x, rngs[1]).reshape(b, t, c.kv_heads, c.head_dim)  # [batch, seq, kv_heads, head_dim]
        v = self.v_proj(x, rngs[2]).reshape(b, t, c.kv_heads, c.head_dim)
        q, k = apply_rope(q, rope_q), apply_rope(k, rope)
        v = v.transpose(0, 2, 1, 3)  # [batch, kv_heads, seq, head_dim]
        if cache_kv is None:
            k, transposed = k.transpose(0, 2, 1, 3), False  # [batch, kv_heads, seq, head_dim]
        else:  # the cache's layouts (KVCache)
            k_all = write_columns(cache_kv[0], k.transpose(0, 2, 3, 1).astype(cache_kv[0].dtype), cache_index,
                                  KEY_COLUMNS)
            v_all = write_columns(cache_kv[1], v.astype(cache_kv[1].dtype), cache_index, VALUE_COLUMNS)
            cache_kv = (k_all, v_all)
            k, v, transposed = k_all.astype(x.dtype), v_all.astype(x.dtype), True
        out = attention(q, k, v, mask, causal=rows is None, kernel=self.kernel, keys_transposed=transposed)
        return self.o_proj(out.reshape(b, tq, c.heads * c.head_dim), rngs[3]), cache_kv


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, lora: LoraConfig | None, *, param_dtype, rngs: nnx.Rngs):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(cfg.dim, cfg.mlp_dim, axes=(ax.EMBED, ax.MLP), **kw, **_lora_args(lora, "gate"))
        self.up_proj = Linear(cfg.dim, cfg.mlp_dim, axes=(ax.EMBED, ax.MLP), **kw, **_lora_args(lora, "up"))
        self.down_proj = Linear(cfg.mlp_dim, cfg.dim, axes=(ax.MLP, ax.EMBED), **kw, **_lora_args(lora, "down"))

    def __call__(self, x, rngs):
        return self.down_proj(jax.nn.silu(self.gate_proj(x, rngs[0])) * self.up_proj(x, rngs[1]), rngs[2])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, lora: LoraConfig | None, *, param_dtype, rngs: nnx.Rngs,
                 kernel: str = "auto"):
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, lora, param_dtype=param_dtype, rngs=rngs, kernel=kernel)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg, lora, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, rope, mask, cache_kv, cache_index, dropout_rng, rows=None):
        """``rows`` ``[batch]``: only those positions' outputs (``[batch, 1, dim]``), see :class:`Attention`."""
        rngs = [None] * 7 if dropout_rng is None else list(jax.random.split(dropout_rng, 7))
        h, cache_kv = self.self_attn(self.input_layernorm(x), rope, mask, cache_kv, cache_index, rngs[:4], rows)
        x = (x if rows is None else take_rows(x, rows, 1)) + h
        return x + self.mlp(self.post_attention_layernorm(x), rngs[4:]), cache_kv


def stack_layers(layers) -> DecoderLayer:
    """One DecoderLayer whose every weight is the layers' weights stacked ``[layers, ...]`` (copies once).

    The leading axis is named "layers" in the weights' logical axes (never sharded).
    """
    graphdef = nnx.split(layers[0])[0]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[nnx.split(layer)[1] for layer in layers])
    for _, variable in nnx.to_flat_state(stacked):
        axes = variable.get_metadata().get("axes")
        if axes is not None:
            variable.set_metadata("axes", ("layers", *axes))
    return nnx.merge(graphdef, stacked)


def unstack_layers(stacked: DecoderLayer, n: int) -> list[DecoderLayer]:
    """The inverse of :func:`stack_layers`: ``n`` DecoderLayers (copies once)."""
    graphdef, state = nnx.split(stacked)
    layers = []
    for i in range(n):
        layer = jax.tree.map(lambda x: x[i], state)
        for _, variable in nnx.to_flat_state(layer):
            axes = variable.get_metadata().get("axes")
            if axes is not None and axes[:1] == ("layers",):
                variable.set_metadata("axes", tuple(axes[1:]))
        layers.append(nnx.merge(graphdef, layer))
    return layers


class LlamaModel(nnx.Module):
    """Embeddings + decoder layers + final norm (HF ``LlamaModel``).

    Layer storage follows ``scan_layers``. True (training, scoring): ``layers`` is one
    DecoderLayer whose weights are stacked ``[layers, ...]`` once, at creation, and a
    ``lax.scan`` runs over them, so the step never copies the frozen LLM (MaxText's
    layout). False (decoding): ``layers`` is a list; each decode step reads every
    layer's weights in place. On XLA:CPU a layer sliced out of a stacked weight is a
    copy (and a dot fed by a slice loses its fast kernel), which costs a memory-bound
    decode step 2-4x; so decoding a stacked model works, but load it with
    ``scan_layers=False`` to generate (as MaxText decodes unscanned checkpoints).
    Both layouts give the same weights from the same seed: the stacked one is
    built layer by layer and stacked once (``nnx.vmap`` would split the RNG differently).
    """

    def __init__(self, cfg: LlamaConfig, lora: LoraConfig | None, *, dtype, param_dtype, remat: str,
                 rngs: nnx.Rngs, scan_layers: bool = False, attention: str = "auto"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={remat!r}: choose from {sorted(REMAT_POLICIES)}")
        self.cfg = cfg
        self.dtype = dtype
        self.remat = remat
        self.scan_layers = scan_layers
        # The layers below the top ``lora.train_layers`` run forward only in training (see LoraConfig).
        trained = cfg.layers if lora is None or not lora.train_layers else min(lora.train_layers, cfg.layers)
        self.frozen_layers = cfg.layers - trained
        self.embed_tokens = Embed(cfg.vocab_size, cfg.dim, axes=(ax.VOCAB, ax.EMBED), param_dtype=param_dtype,
                                  rngs=rngs)
        layers = [DecoderLayer(cfg, lora, param_dtype=param_dtype, rngs=rngs, kernel=attention)
                  for _ in range(cfg.layers)]
        self.layers = stack_layers(layers) if scan_layers else nnx.List(layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype=param_dtype)

    def set_layout(self, scan_layers: bool) -> None:
        """Restack (``scan_layers=True``) or unstack the layers in place; one copy of their weights."""
        if scan_layers != self.scan_layers:
            self.layers = (stack_layers(list(self.layers)) if scan_layers
                           else nnx.List(unstack_layers(self.layers, self.cfg.layers)))
            self.scan_layers = scan_layers

    def embed(self, input_ids: jax.Array) -> jax.Array:
        return self.embed_tokens(jnp.clip(input_ids, 0, self.cfg.vocab_size - 1), self.dtype)

    def __call__(self, embeds: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                 cache: KVCache | None = None, dropout_rng: jax.Array | None = None, last: jax.Array | None = None):
        """embeds ``[batch, seq, dim]``; attention_mask ``[batch, seq]`` (1 = real token).

        Without a cache, attention is causal over this sequence. With one, the
        new keys are written at ``cache.index`` and queries attend causally to
        every filled slot. Returns (normed hidden ``[batch, seq, dim]``, cache).

        ``last`` ``[batch]``: only position ``last[b]`` of row b is wanted (a prefill, whose next token comes
        from its prompt's last position): the hidden states come back ``[batch, 1, dim]`` and the top layer
        runs its queries, MLP and the final norm at those positions alone (its keys and values, which the
        cache keeps, at every position): over every position XLA:CPU would run that top layer's output
        projection, MLP and final norm for hidden states nobody reads (docs/decoding.md, measurements).
        """
        b, t, _ = embeds.shape
        attention_mask = attention_mask.astype(bool)
        if cache is None:
            index, key_valid, q_idx = 0, attention_mask, jnp.arange(t)
        else:
            index = cache.index
            key_valid = write_columns(cache.mask, attention_mask, index, 1)
            q_idx = jnp.broadcast_to(index[..., None] + jnp.arange(t), (b, t))  # [batch, seq]
        k_idx = jnp.arange(key_valid.shape[1])
        mask = (k_idx[None, None, :] <= q_idx[..., None]) & key_valid[:, None, :]  # [batch, seq, kv_len]
        mask = mask[:, None]  # broadcast over heads
        c = self.cfg
        rope = rope_tables(positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))

        policy = REMAT_POLICIES[self.remat]

        def apply(graphdef, state, x, kv, rng, rows=None):
            return nnx.merge(graphdef, state)(x, rope, mask, kv, index, rng, rows)

        if self.remat != "none":
            apply = jax.checkpoint(apply, policy=policy, static_argnums=(0,))

        x = constrain(embeds.astype(self.dtype), (ax.BATCH, None, None))  # [batch, seq, dim]
        if cache is None and self.scan_layers:
            x = self._scan(apply, x, dropout_rng)
            return self.norm(x if last is None else take_rows(x, last, 1)), None
        if self.scan_layers:  # a stacked model decoding: layer i's weights sliced out (a copy on CPU)
            graphdef, stacked = nnx.split(self.layers)
            layers = [(graphdef, jax.tree.map(lambda w: w[i], stacked)) for i in range(self.cfg.layers)]
        else:
            layers = [nnx.split(layer) for layer in self.layers]
        new_k, new_v = [], []
        for i, (graphdef, state) in enumerate(layers):
            if i < self.frozen_layers:
                state = jax.lax.stop_gradient(state)
            kv = None if cache is None else (cache.k[i], cache.v[i])
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
            rows = last if i == len(layers) - 1 else None
            x, kv = apply(graphdef, state, x, kv, rng, rows)
            x = constrain(x, (ax.BATCH, None, None))
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if cache is not None:
            cache = KVCache(tuple(new_k), tuple(new_v), key_valid, index + t)
        return self.norm(x), cache

    def _scan(self, apply, x, dropout_rng):
        """The stacked layers as one ``lax.scan`` (no cache: training / scoring).

        XLA schedules a scanned layer once instead of 32 unrolled copies, which keeps
        rematerialised training at a few layers' worth of live memory (MaxText scans too);
        each step reads layer i's weights straight from the stacked storage.
        """
        graphdef, stacked = nnx.split(self.layers)  # [layers, ...] per weight

        def body(x, xs):
            i, state = xs
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
            x, _ = apply(graphdef, state, x, None, rng)
            return constrain(x, (ax.BATCH, None, None)), None

        layer_ids = jnp.arange(self.cfg.layers)
        n = self.frozen_layers
        if not n:
            return jax.lax.scan(body, x, (layer_ids, stacked))[0]
        # Two scans: the bottom n layers with their weights (adapters included) held constant, so autodiff
        # keeps no residuals for them and, when x carries no gradient either, runs no backward pass there.
        bottom = jax.tree.map(lambda w: jax.lax.stop_gradient(w[:n]), stacked)
        x, _ = jax.lax.scan(body, x, (layer_ids[:n], bottom))
        return jax.lax.scan(body, x, (layer_ids[n:], jax.tree.map(lambda w: w[n:], stacked)))[0]
