"""The student's reinforcement objective: rewards from the teacher's scores, group-relative advantages per turn,
and the clipped policy-gradient loss with a KL term to the reference (docs/training.md, "Reinforcement from the
teacher's scores").

The pieces are pure: :func:`turn_rewards` and :func:`advantages` run on the host over a rollout's scores (each turn's
advantage then labels that turn's sampled tokens: turn-level credit), :func:`policy_loss` is the per-token loss, and
:class:`PolicyGradient` is the objective the trainer runs (``train.objective="rl"``, ``step.OBJECTIVES``). The
rollouts that produce the scores live above the dialogues (:mod:`fire_jax.rl`).

Per-token arrays of a batch (``advantages``, ``old_logprobs``, ``ref_logprobs``) are aligned with ``input_ids``:
entry t belongs to token t (predicted at position t - 1), as ``loss_mask`` is; entry 0 is never labelled.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fire_jax.core.config import InputError
from fire_jax.train import loss as losses

ADVANTAGES = ("grpo", "rloo")
NORMALIZE = ("token", "sequence")


def turn_rewards(scores: Sequence[float], *, score: float = 1.0, improvement: float = 0.0) -> list[float]:
    """r_k = score * a_k / 10 + improvement * (a_k - a_{k-1}) / 10 per turn, with a_0 = 0 (teacher scores a_k on
    the 0-10 scale). ``improvement`` alone telescopes: the rewards from turn k on sum to (a_K - a_{k-1}) / 10."""
    out, previous = [], 0.0
    for a in scores:
        out.append(score * a / 10.0 + improvement * (a - previous) / 10.0)
        previous = a
    return out


def _to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    """sum_{j >= k} gamma^(j-k) r_j for each turn k."""
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def advantages(rewards: Sequence[Sequence[float] | None], groups: Sequence[int], *, method: str = "grpo",
               gamma: float = 1.0, eps: float = 1e-6) -> list[list[float] | None]:
    """Each dialogue's advantage per turn, relative to the other dialogues of its group (the same item).

    ``rewards[i]``: dialogue i's per-turn rewards, or None (a reward that could not be read: the dialogue leaves
    its group and the update). ``groups[i]``: its group.

    - ``"grpo"``: GRPO with process supervision (DeepSeekMath, arXiv 2402.03300, Sec. 4.1.3): every turn reward of
      the group normalised by the group's mean and standard deviation, a turn's advantage the (``gamma``-discounted)
      sum of the normalised rewards from that turn on.
    - ``"rloo"``: REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740, Sec. 3.2) per turn: a turn's
      return-to-go minus the mean return-to-go, at the same turn, of the group's other dialogues that reached it
      (0 when none did).
    """
    if method not in ADVANTAGES:
        raise InputError(f"rl.advantage must be one of {ADVANTAGES}, got {method!r}")
    out: list[list[float] | None] = [None] * len(rewards)
    for group in sorted(set(groups)):
        members = [i for i, g in enumerate(groups) if g == group and rewards[i] is not None]
        if method == "grpo":
            pooled = np.asarray([r for i in members for r in rewards[i]], np.float64)
            mean, std = (pooled.mean(), pooled.std()) if pooled.size else (0.0, 0.0)
            for i in members:
                out[i] = _to_go([(r - mean) / (std + eps) for r in rewards[i]], gamma)
        else:
            to_go = {i: _to_go(rewards[i], gamma) for i in members}
            for i in members:
                row = []
                for k, value in enumerate(to_go[i]):
                    others = [to_go[j][k] for j in members if j != i and len(to_go[j]) > k]
                    row.append(value - float(np.mean(others)) if others else 0.0)
                out[i] = row
    return out


def sequence_weights(mask: jax.Array, normalize: str, turn_ids: jax.Array | None = None) -> jax.Array:
    """Per-token weights over the global batch, summing to 1: ``"token"`` every sampled token alike; ``"sequence"``
    GRPO's 1/|o_i| within a response, then the mean over the responses (arXiv 2402.03300, Eq. 3). A response is
    one turn's r_k: a run of labelled tokens with one ``turn_ids`` value (a row holds a dialogue's turns); without
    ``turn_ids``, a run of labelled tokens."""
    if normalize == "token":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if normalize != "sequence":
        raise InputError(f"rl.normalize must be one of {NORMALIZE}, got {normalize!r}")
    labelled = mask > 0
    turn = jnp.where(labelled, jnp.ones_like(mask, jnp.int32) if turn_ids is None else turn_ids, -1)
    starts = labelled & (turn != jnp.pad(turn[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
    response = jnp.maximum(jnp.cumsum(starts.reshape(-1)) - 1, 0)  # each token's response, over the flat batch
    sizes = jax.ops.segment_sum(mask.reshape(-1), response, num_segments=mask.size)[response].reshape(mask.shape)
    return mask / jnp.maximum(sizes, 1.0) / jnp.maximum(starts.sum(), 1)


def policy_loss(logp, old_logp, ref_logp, advantage, weights, *, clip: float, kl_coef: float):
    """The clipped surrogate with a KL penalty, per token, weighted and summed (GRPO, arXiv 2402.03300, Eq. 3):

        rho = exp(logp - old_logp)
        loss = -min(rho A, clip(rho, 1 - clip, 1 + clip) A) + kl_coef * (exp(ref - logp) - (ref - logp) - 1)

    (the clipped ratio: PPO, Schulman et al., arXiv 1707.06347, Eq. 7; the KL estimate: the unbiased, positive "k3"
    estimator of Schulman's note "Approximating KL divergence", as GRPO's Eq. 4 uses it). All arrays ``[batch,
    seq]``; ``weights`` are 0 off the student's tokens. Returns (loss, per-token k3 KL, per-token clipped flag)."""
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * advantage
    clipped = jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantage
    log_ref_ratio = ref_logp - logp
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
    per_token = -jnp.minimum(unclipped, clipped) + kl_coef * kl
    return jnp.sum(weights * per_token), kl, clipped < unclipped


class PolicyGradient:
    """A LLaVA student's reinforcement step on teacher-scored rollouts (``train.objective="rl"``): the batch
    carries ``advantages``, ``old_logprobs`` (the policy that sampled, before this rollout's updates; left out
    when the rollout has one update, :meth:`old_logprobs`) and
    ``ref_logprobs`` (the reference: the model with its adapter off, :meth:`reference_params`), all
    ``[batch, seq]``; ``rl`` settings come in the trainer's ``loss`` section (``clip``, ``kl_coef``,
    ``normalize``). Gradient accumulation as :class:`fire_jax.train.step.TurnLanguageModeling`'s."""

    def check(self, train_cfg) -> None:
        if tuple(train_cfg.get("trainable", ())) or train_cfg.get("train_connector", False):
            raise InputError("train.trainable / train.train_connector: the RL objective's reference is the model "
                             "with its adapter off, so only LoRA may train (set trainable=() and "
                             "train_connector=False)")

    @staticmethod
    def token_logprobs(trainer, params, frozen, batch) -> jax.Array:
        """log pi(token t | tokens < t) at every labelled token t, ``[batch, seq]`` (0 elsewhere), without
        dropout (the ratio compares the same forward pass at two parameter values)."""
        model = nnx.merge(trainer.graphdef, params, frozen)
        hidden, _ = model.hidden_states(batch["input_ids"], batch.get("pixel_values"), batch.get("image_index"),
                                        batch["attention_mask"])
        labelled = batch["loss_mask"][:, 1:] > 0
        nll, _ = losses.chunked_cross_entropy(hidden[:, :-1], model.language_model.head_kernel(),
                                              batch["input_ids"][:, 1:], trainer.train_cfg.loss_chunk, labelled)
        return jnp.pad(-nll, ((0, 0), (1, 0)))

    @staticmethod
    def reference_params(params):
        """The reference's parameters: every trainable parameter is a LoRA factor (:meth:`check`), so zeroing them all
        is the model with its adapter off, no copy of it."""
        return jax.tree.map(jnp.zeros_like, params)

    @staticmethod
    def old_logprobs(batch, logp):
        """pi_old's log-probs: the batch's, or (none given: the rollout's only update, whose parameters sampled it)
        the current ones without their gradient, so the ratio is 1 and no forward pass is spent on them."""
        old = batch.get("old_logprobs")
        return jax.lax.stop_gradient(logp) if old is None else old

    def _loss(self, trainer, params, frozen, batch):
        rl = trainer.loss_cfg
        logp = self.token_logprobs(trainer, params, frozen, batch)
        loss, kl, clipped = policy_loss(logp, self.old_logprobs(batch, logp), batch["ref_logprobs"],
                                        batch["advantages"], batch["_weights"], clip=rl.clip, kl_coef=rl.kl_coef)
        return loss, (kl, clipped, logp)

    def grads(self, trainer, state, frozen, batch, rng):
        del rng  # no dropout: see token_logprobs
        mask = batch["loss_mask"].astype(jnp.float32).at[:, 0].set(0.0)
        weights = sequence_weights(mask, trainer.loss_cfg.normalize, batch["turn_ids"])
        grad_fn = jax.value_and_grad(lambda p, mb: self._loss(trainer, p, frozen, mb), has_aux=True)
        grads, loss, (kl, clipped, logp) = losses.accumulated_grads(
            lambda params, mb, _: grad_fn(params, mb), state.params, {**batch, "_weights": weights},
            trainer.train_cfg.accum_steps, jax.random.key(0))
        tokens = jnp.maximum(mask.sum(), 1.0)
        ratio = jnp.exp(logp - self.old_logprobs(batch, logp))
        return grads, {
            "loss": loss,
            "kl": jnp.sum(mask * kl) / tokens,
            "clip_fraction": jnp.sum(mask * clipped) / tokens,
            "ratio": jnp.sum(mask * ratio) / tokens,
            "student_tokens": mask.sum(),
        }
