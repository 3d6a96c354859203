"""Shared building blocks: linear layers with optional LoRA, norms, embeddings.

Every weight carries ``axes``: logical axis names that the trainer maps to
mesh axes with the rules in the config (MaxText's vocabulary). LoRA weights
are :class:`LoRAParam`, their own variable type, so "what is trainable" is a
filter (``nnx.split(model, LoRAParam, ...)``), not bookkeeping.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.core import axes as ax
from fire_jax.models.config import ATTENTION_KERNELS


class LoRAParam(nnx.Variable):
    """A LoRA factor: trainable, float32, never merged into frozen state implicitly."""


class InitKeys:
    """The keys of ``nnx.Rngs(seed)`` as the model's constructors draw them (``rngs.params()``: the n-th call
    gives ``fold_in(key(seed), n)``), with the count kept in Python, for building a model under a trace
    (``nnx.eval_shape``, ``jax.jit``).

    There, ``nnx.Rngs``' count is a traced Variable, and flax's update of it asks the new tracer for its
    ``sharding``: JAX's AttributeError message for that walks the trace so far, once per weight, so building
    an abstract 7B model spends nearly all its time there (docs/conversion.md has the measurement); these keys
    give the same shapes and graph, and under ``jax.jit`` the same values.
    """

    def __init__(self, seed: int):
        self.key, self.count = jax.random.key(seed), 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        return key


class Linear(nnx.Module):
    """y = x W (+ b) (+ alpha/r * dropout(x) A B).

    Kernel is stored ``[in, out]`` (Flax convention; HF stores ``[out, in]``).
    LoRA follows PEFT: A ``[in, r]`` ~ kaiming-uniform(a=sqrt 5), i.e.
    U(-1/sqrt(in), 1/sqrt(in)); B ``[r, out]`` = 0, so a fresh adapter is a no-op.
    """

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None],
                 bias: bool = False, lora_rank: int = 0, lora_scale: float = 1.0, lora_dropout: float = 0.0,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype), axes=(axes[1],)) if bias else None
        self.lora_scale = lora_scale
        self.lora_dropout = lora_dropout
        if lora_rank:
            bound = 1.0 / math.sqrt(in_features)
            a = jax.random.uniform(rngs.params(), (in_features, lora_rank), jnp.float32, -bound, bound)
            self.lora_a = LoRAParam(a, axes=(axes[0], None))
            self.lora_b = LoRAParam(jnp.zeros((lora_rank, out_features), jnp.float32), axes=(None, axes[1]))
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        y = x @ self.kernel[...].astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        if self.lora_a is not None:
            h = x
            if dropout_rng is not None and self.lora_dropout > 0:
                keep = jax.random.bernoulli(dropout_rng, 1.0 - self.lora_dropout, x.shape)
                h = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
            y = y + ((h @ self.lora_a[...].astype(x.dtype)) @ self.lora_b[...].astype(x.dtype)) * self.lora_scale
        return y

    def merge_lora(self) -> None:
        """Fold the adapter into the kernel and drop it (PEFT's merge_and_unload)."""
        if self.lora_a is None:
            return
        delta = (self.lora_a[...] @ self.lora_b[...]) * self.lora_scale
        self.kernel[...] = (self.kernel[...].astype(jnp.float32) + delta).astype(self.kernel[...].dtype)
        self.lora_a = self.lora_b = None

    def fold_lora(self) -> None:
        """Fold the adapter into the kernel and restart it from zero (``lora_b`` = 0, ``lora_a`` kept): the same
        function, with an adapter whose "off" is the model as it now is (a reinforcement stage's reference)."""
        if self.lora_a is None:
            return
        delta = (self.lora_a[...] @ self.lora_b[...]) * self.lora_scale
        self.kernel[...] = (self.kernel[...].astype(jnp.float32) + delta).astype(self.kernel[...].dtype)
        self.lora_b[...] = jnp.zeros_like(self.lora_b[...])


class RMSNorm(nnx.Module):
    """Llama RMSNorm: statistics in float32, result cast back before the scale."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), axes=(ax.NORM,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with bias (CLIP); statistics in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), axes=(ax.NORM,))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=(ax.NORM,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, num: int, dim: int, *, axes: tuple[str, str], param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (num, dim), param_dtype) * 0.02, axes=axes)

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(dtype)


#: Query positions per block in the memory-bounded attention path (non-GPU backends).
QUERY_CHUNK = 512

#: Query positions per block of causal self-attention on non-GPU backends: block i attends only to the
#: keys up to its end, so the masked upper triangle is (mostly) never computed.
CAUSAL_BLOCK = 128

def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool = False,
              kernel: str = "auto", keys_transposed: bool = False) -> jax.Array:
    """Scaled dot-product attention, grouped-query aware.

    q ``[batch, q_len, heads, head_dim]``; k/v ``[batch, kv_heads, kv_len, head_dim]``, one head's
    columns contiguous, so a decode step and the CPU kernels read them in place; ``keys_transposed``: k is
    ``[batch, kv_heads, head_dim, kv_len]``, the KV cache's keys (:class:`fire_jax.models.llama.KVCache`);
    mask bool broadcastable to ``[batch, heads, q_len, kv_len]``. ``causal``: the mask hides every
    key after its query's position, counting both from the start (training, a prefill into a
    fresh cache), so blocks of queries may skip the keys after them. ``kernel``: one of
    :data:`ATTENTION_KERNELS`.

    - a single query (a decode step): reads the KV cache in place, whatever the kernel;
    - "xla", "cudnn", and "auto" on GPUs: ``jax.nn.dot_product_attention`` with that implementation;
    - "cpu", and "auto" elsewhere: :func:`_grouped_attention` (its backward written out); causal self-attention in
      blocks of :data:`CAUSAL_BLOCK` queries, each over the keys up to its end (about half the
      work); other sequences longer than :data:`QUERY_CHUNK` in blocks of queries. Beyond
      :data:`QUERY_CHUNK` queries each block is rematerialised, so scores never exist for the
      whole sequence at once (``[batch, heads, seq, seq]`` float32 per layer otherwise).
    """
    scale = q.shape[-1] ** -0.5
    b, t, heads, d = q.shape
    if t == 1:
        return _single_query(q, k, v, mask, scale, keys_transposed)
    if keys_transposed:  # a prefill over the cache: its keys as the kernels below take them (a copy per layer)
        k = k.swapaxes(2, 3)
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: choose from {ATTENTION_KERNELS}")
    if kernel == "auto":
        kernel = None if jax.default_backend() == "gpu" else "cpu"
    if kernel != "cpu":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_len, kv_heads, head_dim]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=kernel)
    if causal and k.shape[2] == t and t > CAUSAL_BLOCK:
        return _causal_blocks(q, k, v, _full_mask(mask, q, k), scale)
    if t <= QUERY_CHUNK or t % QUERY_CHUNK:
        return _grouped_attention(q, k, v, _full_mask(mask, q, k), scale)
    n = t // QUERY_CHUNK
    blocks = q.reshape(b, n, QUERY_CHUNK, heads, d).swapaxes(0, 1)  # [blocks, batch, chunk, heads, head_dim]
    if mask is None:
        mask = jnp.ones((1, 1, t, k.shape[2]), bool)
    mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], t, k.shape[2]))
    mask_blocks = mask.reshape(mask.shape[0], mask.shape[1], n, QUERY_CHUNK, -1).transpose(2, 0, 1, 3, 4)

    @jax.checkpoint
    def block(args):
        q_block, m_block = args
        return _grouped_attention(q_block, k, v, m_block, scale)

    out = jax.lax.map(block, (blocks, mask_blocks))
    return out.swapaxes(0, 1).reshape(b, t, heads, d)


def _causal_blocks(q, k, v, mask, scale):
    """Causal self-attention, block i of :data:`CAUSAL_BLOCK` queries over keys ``[0, end_i)``: the keys
    after a block are masked for all of its queries, so leaving them out changes nothing but rows that
    see no key at all (padding), whose output nobody reads."""
    t = q.shape[1]
    block = _grouped_attention if t <= QUERY_CHUNK else jax.checkpoint(_grouped_attention, static_argnums=(4,))
    outs = []
    for start in range(0, t, CAUSAL_BLOCK):
        end = min(t, start + CAUSAL_BLOCK)
        outs.append(block(q[:, start:end], k[:, :, :end], v[:, :, :end], mask[:, :, start:end, :end], scale))
    return jnp.concatenate(outs, axis=1)


def _full_mask(mask, q, k):
    """``mask`` as bool ``[batch or 1, 1 or heads, q_len, kv_len]`` (all True when None)."""
    if mask is None:
        return jnp.ones((1, 1, q.shape[1], k.shape[2]), bool)
    return jnp.broadcast_to(mask, (*mask.shape[:2], q.shape[1], k.shape[2]))


def _to_groups(x, kv_heads):
    """[batch, seq, heads, d] -> [batch, kv_heads, group * seq, d]: each KV head's queries in one matrix."""
    b, t, heads, d = x.shape
    return x.reshape(b, t, kv_heads, heads // kv_heads, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)


def _from_groups(x, t):
    b, kv_heads, _, d = x.shape
    return x.reshape(b, kv_heads, -1, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, -1, d)


def _group_mask(mask, kv_heads, group):
    """[batch or 1, 1 or heads, t, s] -> [batch or 1, 1 or kv_heads, group * t, s], matching :func:`_to_groups`."""
    mb, mh, t, s = mask.shape
    if mh == 1:
        return jnp.broadcast_to(mask[:, :, None], (mb, 1, group, t, s)).reshape(mb, 1, group * t, s)
    return mask.reshape(mb, kv_heads, group * t, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_attention(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v with float32 scores, grouped-query, for CPUs.

    Queries of one KV head form one matrix and keys / values ``[batch, kv_heads, kv_len, head_dim]``
    are used as they are, so every
    score-sized array is made by a matmul and read by the next one in its natural layout: XLA's
    generic attention transposes the [batch, heads, q, kv] scores (and their gradients) instead.
    The backward pass is written out (FlashAttention's: dS = P * (dP - rowsum(dO * O))), from the
    probabilities saved by the forward.
    """
    return _grouped_attention_fwd(q, k, v, mask, scale)[0]


def _grouped_attention_fwd(q, kt, vt, mask, scale):
    b, t, heads, d = q.shape
    kv_heads = kt.shape[1]
    qg = _to_groups(q, kv_heads)  # [batch, kv_heads, group * q_len, head_dim]
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, kt, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(_group_mask(mask, kv_heads, heads // kv_heads), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # [batch, kv_heads, group * q_len, kv_len]
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(vt.dtype), vt)
    return _from_groups(out, t), (qg, kt, vt, probs, out, mask)


def _grouped_attention_bwd(scale, residuals, d_out):
    qg, kt, vt, probs, out, mask = residuals
    t = d_out.shape[1]
    do = _to_groups(d_out, kt.shape[1]).astype(jnp.float32)
    dv = jnp.einsum("bkqs,bkqd->bksd", probs, do)
    dp = jnp.einsum("bkqd,bksd->bkqs", do, vt.astype(jnp.float32))
    ds = probs * (dp - jnp.sum(do * out.astype(jnp.float32), axis=-1, keepdims=True)) * scale
    ds = jnp.where(_group_mask(mask, kt.shape[1], qg.shape[2] // t), ds, 0.0)  # a fully masked row: no gradient
    dq = jnp.einsum("bkqs,bksd->bkqd", ds, kt.astype(jnp.float32))
    dk = jnp.einsum("bkqs,bkqd->bksd", ds, qg.astype(jnp.float32))
    return (_from_groups(dq, t).astype(qg.dtype), dk.astype(kt.dtype), dv.astype(vt.dtype),
            np.zeros(mask.shape, jax.dtypes.float0))


_grouped_attention.defvjp(_grouped_attention_fwd, _grouped_attention_bwd)


def _single_query(q, k, v, mask, scale, keys_transposed=False):
    """One query per row (a decode step) over the cache: k ``[batch, kv_heads, head_dim, kv_len]`` with
    ``keys_transposed`` (the KV cache's keys), else ``[batch, kv_heads, kv_len, head_dim]``; v
    ``[batch, kv_heads, kv_len, head_dim]``.

    On CPU the scores are a multiply-and-reduce over head_dim (XLA:CPU's dot for a group of 1-4 query
    rows runs slower than that loop) and the weighted values a dot: faster per decode step than the
    ``[batch, kv_len, kv_heads, head_dim]`` cache this replaced, read by multiply-and-reduce loops
    (docs/performance.md, "Decoding on the CPU"). With the keys transposed the reduction runs across contiguous
    columns.
    """
    b, _, heads, d = q.shape
    kv_heads, group = k.shape[1], heads // k.shape[1]
    qg = q.reshape(b, kv_heads, group, d)  # [batch, kv_heads, group, head_dim]
    if jax.default_backend() == "gpu":
        spec = "bkgd,bkds->bkgs" if keys_transposed else "bkgd,bksd->bkgs"
        scores = jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32)
    elif keys_transposed:
        scores = jnp.sum(qg[:, :, :, :, None].astype(jnp.float32) * k[:, :, None].astype(jnp.float32), axis=-2)
    else:
        scores = jnp.sum(qg[:, :, :, None, :].astype(jnp.float32) * k[:, :, None, :, :].astype(jnp.float32), axis=-1)
    scores = scores * scale  # [batch, kv_heads, group, kv_len]
    kv_len = scores.shape[-1]
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, heads, 1, kv_len)).reshape(b, kv_heads, group, -1)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v).reshape(b, 1, heads, d)
