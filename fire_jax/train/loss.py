"""Per-turn masked cross-entropy (SPEC section 3, Eqs. 5-6).

The model predicts token t+1 at position t. Only tokens of labelled turns
(the student's r_i, i >= 2, or the teacher's f_i, each with its <|eot_id|>)
carry weight. Logits are formed chunk by chunk over the sequence in the
compute dtype and reduced in float32 under ``jax.checkpoint``, so neither the
forward nor the backward pass holds a float32 ``[batch, seq, vocab]`` array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_weights(loss_mask: jax.Array, turn_ids: jax.Array, normalize: str, max_turns: int) -> jax.Array:
    """Per-token loss weights over the *global* batch, summing to 1.

    ``"token"``: every labelled token weighs 1/N (mean over labelled tokens).
    ``"turn"``: each turn index present weighs equally, split evenly over its
    tokens (mean of per-turn means). Linear in the per-token losses, so
    gradient accumulation over micro-batches is exact.
    """
    mask = loss_mask.astype(jnp.float32)
    if normalize == "token":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if normalize != "turn":
        raise ValueError(f"loss.normalize={normalize!r}: choose 'token' or 'turn'")
    per_turn = turn_counts(mask, turn_ids, max_turns)  # [max_turns + 1]
    present = jnp.maximum((per_turn > 0).sum(), 1)
    count = per_turn[jnp.clip(turn_ids, 0, max_turns)]
    return jnp.where(mask > 0, 1.0 / (present * jnp.maximum(count, 1.0)), 0.0)


def turn_counts(values: jax.Array, turn_ids: jax.Array, max_turns: int) -> jax.Array:
    """Sum of ``values`` per turn index 0..max_turns (unlabelled tokens, turn -1, go nowhere)."""
    onehot = jax.nn.one_hot(turn_ids, max_turns + 1, dtype=jnp.float32)  # -1 -> all zeros
    return jnp.einsum("bs,bst->t", values.astype(jnp.float32), onehot)


def chunked_cross_entropy(hidden: jax.Array, lm_head, targets: jax.Array, chunk: int):
    """Negative log-likelihood and correctness per position.

    hidden ``[batch, seq, dim]`` (compute dtype), ``lm_head`` maps it to logits,
    targets ``[batch, seq]``. Returns (nll float32 ``[batch, seq]``, correct bool).
    """
    b, s, d = hidden.shape
    chunk = min(chunk, s)
    pad = (-s) % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (s + pad) // chunk
    hidden = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [chunks, batch, chunk, dim]
    targets = targets.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        h, t = args
        logits = lm_head(h).astype(jnp.float32)  # [batch, chunk, vocab], one chunk at a time
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return logz - gold, jnp.argmax(logits, axis=-1) == t

    nll, correct = jax.lax.map(one, (hidden, targets))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :s]
    return unchunk(nll), unchunk(correct)
