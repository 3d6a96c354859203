"""Per-turn masked cross-entropy over the student and teacher sequences (FIRE Eqs. 5-6; docs/spec.md).

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


def accumulated_grads(grad_fn, params, batch: dict, accum: int, rng: jax.Array):
    """A loss's gradients summed over ``accum`` micro-batches of ``batch`` in one ``lax.scan``, the batch split
    strided so that every shard holds every micro-batch. ``grad_fn(params, micro_batch, rng_i)`` returns
    ``((loss, aux), grads)`` (``rng_i``: ``rng`` folded with the micro-batch's index). Returns (grads, the summed
    loss, aux back in the batch's order ``[batch, ...]``): exact when the loss's weights were computed over the
    whole batch first."""

    def micro(x):  # [batch, ...] -> [accum, batch/accum, ...]
        return x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)

    def body(carry, xs):
        grads, total = carry
        i, micro_batch = xs
        (loss, aux), g = grad_fn(params, micro_batch, jax.random.fold_in(rng, i))
        return (jax.tree.map(jnp.add, grads, g), total + loss), aux

    zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (grads, total), aux = jax.lax.scan(body, zeros, (jnp.arange(accum), jax.tree.map(micro, batch)))
    return grads, total, jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), aux)


def turn_counts(values: jax.Array, turn_ids: jax.Array, max_turns: int) -> jax.Array:
    """Sum of ``values`` per turn bucket: indices 0..max_turns, then one "> max_turns" bucket.

    Returns ``[max_turns + 2]``; unlabelled tokens (turn -1) go nowhere.
    """
    buckets = jnp.where(turn_ids > max_turns, max_turns + 1, turn_ids)
    onehot = jax.nn.one_hot(buckets, max_turns + 2, dtype=jnp.float32)  # -1 -> all zeros
    return jnp.einsum("bs,bst->t", values.astype(jnp.float32), onehot)


def chunked_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, chunk: int,
                          mask: jax.Array | None = None):
    """Negative log-likelihood and correctness per position, logits formed chunk by chunk.

    hidden ``[batch, seq, dim]`` (compute dtype), kernel ``[dim, vocab]`` (the lm_head),
    targets ``[batch, seq]``, mask ``[batch, seq]`` (optional): the positions whose loss is
    wanted. Returns (nll float32 ``[batch, seq]``, correct bool); both are 0 / False, with no
    gradient, where ``mask`` is False.

    Only the masked-in positions' logits are formed: they are gathered to the front of the
    flattened batch (a stable sort on the mask), cut into chunks of ``chunk`` tokens, and a
    chunk past the last of them is skipped (``lax.cond``). A FIRE student sequence labels only
    r_i for i >= 2, a small part of it (image features, prompt, r_1 and feedback are not), and
    the vocabulary matmuls are most of a small model's step.

    The gradient is fused into the forward pass: d nll / d hidden = (softmax - onehot) @ kernel^T
    does not depend on the loss weights, so each chunk computes it while its logits exist and
    keeps only that ``[chunk, dim]`` result; the backward pass scales it by the incoming
    per-token cotangent. Two vocabulary matmuls per chunk instead of three (forward, recompute,
    backward). The kernel's own gradient (when the lm_head trains) is recomputed chunk by chunk
    in the backward pass, and removed by XLA when nothing asks for it.
    """
    if mask is None:
        mask = jnp.ones(targets.shape, bool)
    nll, correct, _ = _fused_ce(hidden, kernel, targets, mask.astype(bool), chunk)
    return nll, correct


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[batch, seq, ...] -> [chunks, batch, chunk, ...] (seq padded to a multiple of chunk)."""
    b, s = x.shape[:2]
    pad = (-s) % chunk
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, (s + pad) // chunk, chunk, *x.shape[2:]).swapaxes(0, 1)


def _chunk_logits(h, kernel):
    return (h @ kernel.astype(h.dtype)).astype(jnp.float32)  # [..., chunk, vocab]


def _fused_ce_impl(hidden, kernel, targets, mask, chunk):
    b, s, d = hidden.shape
    n = b * s
    chunk = min(chunk, n)
    chunks = -(-n // chunk)
    # Masked-in tokens first, in order; the padding slots repeat token 0 and are dropped below.
    order = jnp.pad(jnp.argsort(~mask.reshape(n), stable=True), (0, chunks * chunk - n))  # [chunks * chunk]
    count = mask.sum()
    h_sorted = hidden.reshape(n, d)[order].reshape(chunks, chunk, d)
    t_sorted = targets.reshape(n)[order].reshape(chunks, chunk)

    def compute(h, t):
        logits = _chunk_logits(h, kernel)  # [chunk, vocab]
        top = jnp.max(logits, axis=-1)
        logz = top + jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
        gold = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        dlogits = jnp.exp(logits - logz[:, None]) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
        dhidden = (dlogits.astype(h.dtype) @ kernel.astype(h.dtype).T).astype(h.dtype)  # [chunk, dim]
        # Correct: the gold logit is the largest (an argmax is a two-operand reduce, slow on CPU; exact ties differ).
        return logz - gold, gold >= top, dhidden

    def skip(h, t):
        return jnp.zeros(t.shape, jnp.float32), jnp.zeros(t.shape, bool), jnp.zeros_like(h)

    def one(args):
        i, h, t = args
        return jax.lax.cond(i * chunk < count, compute, skip, h, t)

    nll, correct, dhidden = jax.lax.map(one, (jnp.arange(chunks), h_sorted, t_sorted))
    inverse = jnp.zeros(n, jnp.int32).at[order[:n]].set(jnp.arange(n, dtype=jnp.int32))
    flat_mask = mask.reshape(n)

    def unsort(x):
        x = x.reshape(chunks * chunk, *x.shape[2:])[inverse]
        return jnp.where(flat_mask.reshape(n, *([1] * (x.ndim - 1))), x, jnp.zeros((), x.dtype)).reshape(
            b, s, *x.shape[1:])

    return unsort(nll), unsort(correct), unsort(dhidden)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_ce(hidden, kernel, targets, mask, chunk):
    return _fused_ce_impl(hidden, kernel, targets, mask, chunk)


def _fused_ce_fwd(hidden, kernel, targets, mask, chunk):
    nll, correct, dhidden = _fused_ce_impl(hidden, kernel, targets, mask, chunk)
    return (nll, correct, dhidden), (hidden, kernel, targets, mask, dhidden)


def _fused_ce_bwd(chunk, residuals, cotangents):
    hidden, kernel, targets, mask, dhidden = residuals
    dnll = jnp.where(mask, cotangents[0].astype(jnp.float32), 0.0)  # [batch, seq]: the loss weights
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
    zero_mask = np.zeros(mask.shape, dtype=jax.dtypes.float0)
    return grad_hidden, grad_kernel.astype(kernel.dtype), zero_targets, zero_mask


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)
