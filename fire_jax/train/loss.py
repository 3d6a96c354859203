"""Per-turn masked cross-entropy (SPEC section 3, Eqs. 5-6).

The model predicts token t+1 at position t. Only tokens of labelled turns
(the student's r_i, i >= 2, or the teacher's f_i, each with its <|eot_id|>)
carry weight. Logits are formed chunk by chunk over the sequence and reduced
in float32, with the gradient fused into the forward pass, so neither pass
holds a float32 ``[batch, seq, vocab]`` array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def token_weights(loss_mask: jax.Array, turn_ids: jax.Array, normalize: str, max_turns: int) -> jax.Array:
    """Per-token loss weights over the *global* batch, summing to 1.

    ``"token"``: every labelled token weighs 1/N (mean over labelled tokens).
    ``"turn"``: each turn index present weighs equally, split evenly over its
    tokens (mean of per-turn means), for any turn index: ``max_turns`` only
    sizes the per-turn metric. Linear in the per-token losses, so gradient
    accumulation over micro-batches is exact.
    """
    del max_turns  # weights count every turn index; see turn_counts for the metric's buckets
    mask = loss_mask.astype(jnp.float32)
    if normalize == "token":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if normalize != "turn":
        raise ValueError(f"loss.normalize={normalize!r}: choose 'token' or 'turn'")
    # Tokens per turn for any turn index: sort the labelled tokens' turn ids (unlabelled ones -> -1), count
    # equal ids by binary search, count distinct ones where the sorted ids change. [batch * seq]
    ids = jnp.where(mask > 0, turn_ids, -1).reshape(-1)
    ordered = jnp.sort(ids)
    count = (jnp.searchsorted(ordered, ids, side="right") - jnp.searchsorted(ordered, ids, side="left"))
    starts = jnp.concatenate([ordered[:1] >= 0, (ordered[1:] != ordered[:-1]) & (ordered[1:] >= 0)])
    present = jnp.maximum(starts.sum(), 1)
    count = count.reshape(turn_ids.shape).astype(jnp.float32)
    return jnp.where(mask > 0, 1.0 / (present * jnp.maximum(count, 1.0)), 0.0)


def turn_counts(values: jax.Array, turn_ids: jax.Array, max_turns: int) -> jax.Array:
    """Sum of ``values`` per turn bucket: indices 0..max_turns, then one "> max_turns" bucket.

    Returns ``[max_turns + 2]``; unlabelled tokens (turn -1) go nowhere.
    """
    buckets = jnp.where(turn_ids > max_turns, max_turns + 1, turn_ids)
    onehot = jax.nn.one_hot(buckets, max_turns + 2, dtype=jnp.float32)  # -1 -> all zeros
    return jnp.einsum("bs,bst->t", values.astype(jnp.float32), onehot)


def chunked_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, chunk: int):
    """Negative log-likelihood and correctness per position, logits formed chunk by chunk.

    hidden ``[batch, seq, dim]`` (compute dtype), kernel ``[dim, vocab]`` (the lm_head),
    targets ``[batch, seq]``. Returns (nll float32 ``[batch, seq]``, correct bool).

    The gradient is fused into the forward pass: d nll / d hidden = (softmax - onehot) @ kernel^T
    does not depend on the loss weights, so each chunk computes it while its logits exist and
    keeps only that ``[batch, chunk, dim]`` result; the backward pass scales it by the incoming
    per-token cotangent. Two vocabulary matmuls per chunk instead of three (forward, recompute,
    backward). The kernel's own gradient (when the lm_head trains) is recomputed chunk by chunk
    in the backward pass, and removed by XLA when nothing asks for it.
    """
    nll, correct, _ = _fused_ce(hidden, kernel, targets, chunk)
    return nll, correct


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[batch, seq, ...] -> [chunks, batch, chunk, ...] (seq padded to a multiple of chunk)."""
    b, s = x.shape[:2]
    pad = (-s) % chunk
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, (s + pad) // chunk, chunk, *x.shape[2:]).swapaxes(0, 1)


def _unchunk(x: jax.Array, s: int) -> jax.Array:
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])[:, :s]


def _chunk_logits(h, kernel):
    return (h @ kernel.astype(h.dtype)).astype(jnp.float32)  # [batch, chunk, vocab]


def _fused_ce_impl(hidden, kernel, targets, chunk):
    s = hidden.shape[1]
    chunk = min(chunk, s)

    def one(args):
        h, t = args
        logits = _chunk_logits(h, kernel)
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        dlogits = jnp.exp(logits - logz[..., None]) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
        dhidden = (dlogits.astype(h.dtype) @ kernel.astype(h.dtype).T).astype(h.dtype)  # [batch, chunk, dim]
        return logz - gold, jnp.argmax(logits, axis=-1) == t, dhidden

    nll, correct, dhidden = jax.lax.map(one, (_chunks(hidden, chunk), _chunks(targets, chunk)))
    return _unchunk(nll, s), _unchunk(correct, s), _unchunk(dhidden, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_ce(hidden, kernel, targets, chunk):
    return _fused_ce_impl(hidden, kernel, targets, chunk)


def _fused_ce_fwd(hidden, kernel, targets, chunk):
    nll, correct, dhidden = _fused_ce_impl(hidden, kernel, targets, chunk)
    return (nll, correct, dhidden), (hidden, kernel, targets, dhidden)


def _fused_ce_bwd(chunk, residuals, cotangents):
    hidden, kernel, targets, dhidden = residuals
    dnll = cotangents[0].astype(jnp.float32)  # [batch, seq]: the loss weights
    grad_hidden = (dnll[..., None] * dhidden.astype(jnp.float32)).astype(hidden.dtype)
    chunk = min(chunk, hidden.shape[1])

    def kernel_grad(acc, args):  # only when the lm_head is trained; XLA drops it otherwise
        h, t, w = args
        logits = _chunk_logits(h, kernel)
        dlogits = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
        return acc + jnp.einsum("bcd,bcv->dv", h.astype(jnp.float32), w[..., None] * dlogits), None

    grad_kernel, _ = jax.lax.scan(kernel_grad, jnp.zeros(kernel.shape, jnp.float32),
                                  (_chunks(hidden, chunk), _chunks(targets, chunk), _chunks(dnll, chunk)))
    zero_targets = np.zeros(targets.shape, dtype=jax.dtypes.float0)
    return grad_hidden, grad_kernel.astype(kernel.dtype), zero_targets


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)
