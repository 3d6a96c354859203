"""The sharded train step: one ``jax.jit`` with explicit shardings and donated state.

Trainable parameters (LoRA, optionally the connector) and their AdamW state
are float32; frozen weights keep their storage dtype (bf16 at 8B), are never
differentiated and never enter the optimizer. Gradient accumulation scans
over micro-batches inside the step; the loss weights are computed over the
whole global batch first, so accumulation is exact (docs/spec.md, "Training sequences and the loss").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fire_jax.core.config import InputError
from fire_jax.weights.build import check_trainable, trainable_filter
from fire_jax.models import LlavaNext
from fire_jax.models.clip import contrastive_loss, dense_loss, fact_loss
from fire_jax.weights.sharding import DEFAULT_RULES, activation_sharding, batch_sharding, state_shardings
from fire_jax.train import loss as losses
from fire_jax.train.policy import PolicyGradient

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "turn_ids", "pixel_values", "image_index",
              "view_pixels", "feature_index", "facts", "dense_facts",  # these four: a vision stage's (data/captions.py)
              "advantages", "old_logprobs", "ref_logprobs")  # a reinforcement step's (fire_jax.train.policy)


def make_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW + linear warm-up (``warmup_frac`` of the steps), then cosine to 0 (``lr_schedule="cosine"``, the
    release's) or the peak lr held to the end (``"constant"``); global-norm clip."""
    warmup = int(round(cfg.warmup_frac * total_steps))
    kind = cfg.get("lr_schedule", "cosine")
    if kind == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total_steps, warmup + 1), 0.0)
    elif kind == "constant":
        # (optax's warm-up schedules stay at their initial value when the warm-up has no steps)
        schedule = optax.warmup_constant_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    else:
        raise InputError(f"train.lr_schedule must be 'cosine' or 'constant', got {kind!r}")
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return tx, schedule


@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State  # trainable, float32
    opt_state: Any


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"], meta_fields=[])


class Trainer:
    """Builds and runs the jitted step for one model, optimizer and mesh."""

    def __init__(self, model: LlavaNext, train_cfg, loss_cfg, total_steps: int, mesh: Mesh, rules=DEFAULT_RULES,
                 *, abstract: bool = False):
        """``abstract=True`` takes a model from ``nnx.eval_shape`` and allocates nothing: the state and
        frozen weights are ShapeDtypeStructs with shardings, for lowering and memory analysis at 8B."""
        self.mesh, self.rules = mesh, rules
        self.train_cfg, self.loss_cfg = train_cfg, loss_cfg
        # the model's loss: its kind picks it, as it picks its data, unless the config names one (train.objective)
        self.objective = OBJECTIVES[train_cfg.get("objective") or model.kind]
        self.objective.check(train_cfg)
        check_trainable(model, train_cfg)
        self.graphdef, params, frozen = nnx.split(model, trainable_filter(train_cfg), ...)
        # A copy even when already float32: the step donates its state, and the model must stay usable.
        to_f32 = lambda tree: jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), tree)
        params = jax.eval_shape(to_f32, params) if abstract else to_f32(params)
        self.tx, self.schedule = make_optimizer(train_cfg, total_steps)
        replicated = NamedSharding(mesh, P())
        self.param_sharding = state_shardings(params, mesh, rules)
        self.frozen_sharding = state_shardings(frozen, mesh, rules)
        # AdamW moments take their parameters' shardings; counters are replicated.
        opt_sharding = optax.tree_map_params(
            self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, params), self.param_sharding,
            transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.state_sharding = TrainState(replicated, self.param_sharding, opt_sharding)
        if abstract:
            self.frozen = _with_shardings(frozen, self.frozen_sharding)
            step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            self.initial_state = TrainState(step, _with_shardings(params, self.param_sharding),
                                            _with_shardings(jax.eval_shape(self.tx.init, params), opt_sharding))
        else:
            self.frozen = jax.device_put(frozen, self.frozen_sharding)
            params = jax.device_put(params, self.param_sharding)
            opt_state = jax.jit(self.tx.init, out_shardings=opt_sharding)(params)
            step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
            # Note: the step donates its input state; copy this one to reuse it.
            self.initial_state = TrainState(step, params, opt_state)
        self._steps: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ the step
    def _step(self, state: TrainState, frozen, batch, rng):
        with activation_sharding(self.mesh, self.rules):
            grads, metrics = self.objective.grads(self, state, frozen, batch, rng)
            return self._update(state, grads, metrics)

    def _update(self, state: TrainState, grads, metrics: dict):
        """One optimizer step from ``grads``; the metrics get the gradient norm and the learning rate."""
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def compiled_step(self, batch: dict[str, jax.Array]):
        """The jitted step for this batch's keys and shapes (compiled once per shape), with
        ``train.xla_options`` as its compile options (they override ``XLA_FLAGS`` for this program only)."""
        key = tuple(sorted((k, v.shape) for k, v in batch.items()))
        if key not in self._steps:
            batch_sh = {k: batch_sharding(self.mesh, v.ndim, self.rules) for k, v in batch.items()}
            replicated = NamedSharding(self.mesh, P())
            self._steps[key] = jax.jit(
                self._step,
                in_shardings=(self.state_sharding, self.frozen_sharding, batch_sh, replicated),
                out_shardings=(self.state_sharding, replicated),
                donate_argnums=(0,),
                compiler_options=dict(self.train_cfg.get("xla_options", ())) or None)
        return self._steps[key]

    def step(self, state: TrainState, batch: dict[str, jax.Array], rng: jax.Array):
        batch = {k: v for k, v in batch.items() if k in BATCH_KEYS}
        return self.compiled_step(batch)(state, self.frozen, batch, rng)

    def logprobs(self, state: TrainState, batch: dict[str, jax.Array], *, reference: bool = False) -> jax.Array:
        """Per-token log-probs ``[batch, seq]`` of ``batch``'s labelled tokens under the state's parameters, or
        (``reference``) under the objective's reference parameters: an objective with ``token_logprobs`` and
        ``reference_params`` (:class:`fire_jax.train.policy.PolicyGradient`). One program for both, jitted once per
        shape, sharded as the step."""
        batch = {k: v for k, v in batch.items() if k in BATCH_KEYS}
        key = ("logprobs", tuple(sorted((k, v.shape) for k, v in batch.items())))
        if key not in self._steps:
            def run(params, frozen, b):
                with activation_sharding(self.mesh, self.rules):
                    return self.objective.token_logprobs(self, params, frozen, b)

            batch_sh = {k: batch_sharding(self.mesh, v.ndim, self.rules) for k, v in batch.items()}
            self._steps[key] = jax.jit(run, in_shardings=(self.param_sharding, self.frozen_sharding, batch_sh),
                                       out_shardings=batch_sharding(self.mesh, 2, self.rules))
        params = self.objective.reference_params(state.params) if reference else state.params
        return self._steps[key](params, self.frozen, batch)

    def model(self, state: TrainState) -> LlavaNext:
        """The model with the state's trainable parameters (for evaluation and export)."""
        return nnx.merge(self.graphdef, state.params, self.frozen)


class TurnLanguageModeling:
    """A LLaVA's loss (FIRE Eqs. 5-6): masked cross-entropy on the labelled turns, summed over ``accum_steps``
    micro-batches in one ``lax.scan``, weighted per ``loss.normalize``; metrics per turn."""

    def check(self, train_cfg) -> None:
        pass

    @staticmethod
    def _loss(trainer, params, frozen, batch, weights, rng):
        """sum(weights * nll) over a micro-batch, plus per-token nll / correctness."""
        model = nnx.merge(trainer.graphdef, params, frozen)
        hidden, _ = model.hidden_states(batch["input_ids"], batch.get("pixel_values"), batch.get("image_index"),
                                        batch["attention_mask"], dropout_rng=rng)
        targets = batch["input_ids"][:, 1:]
        kernel = model.language_model.head_kernel()
        labelled = batch["loss_mask"][:, 1:] > 0  # only these positions' logits are formed
        nll, correct = losses.chunked_cross_entropy(hidden[:, :-1], kernel, targets, trainer.train_cfg.loss_chunk,
                                                    labelled)
        return jnp.sum(weights * nll), (nll, correct)

    def grads(self, trainer, state: TrainState, frozen, batch, rng):
        accum, max_turns = trainer.train_cfg.accum_steps, trainer.loss_cfg.max_turns
        mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
        turns = batch["turn_ids"][:, 1:]
        weights = losses.token_weights(mask, turns, trainer.loss_cfg.normalize, max_turns)
        step_rng = jax.random.fold_in(rng, state.step)  # LoRA dropout (a no-op at rate 0), per micro-batch
        grad_fn = jax.value_and_grad(lambda *args: self._loss(trainer, *args), has_aux=True)

        def micro_grads(params, micro_batch, rng_i):
            rest = {k: v for k, v in micro_batch.items() if k != "_weights"}
            return grad_fn(params, frozen, rest, micro_batch["_weights"], rng_i)

        grads, _, (nll, correct) = losses.accumulated_grads(micro_grads, state.params, {**batch, "_weights": weights},
                                                            accum, step_rng)
        tokens = mask.sum()
        # Turns 0..max_turns, then one "> max_turns" bucket: every labelled token is in one of them.
        turn_tokens = losses.turn_counts(mask, turns, max_turns)  # [max_turns + 2]
        turn_loss = losses.turn_counts(mask * nll, turns, max_turns) / jnp.maximum(turn_tokens, 1.0)
        return grads, {
            "loss": jnp.sum(weights * nll),
            "token_loss": jnp.sum(mask * nll) / jnp.maximum(tokens, 1.0),
            "turn_loss": turn_loss[:-1],
            "turn_tokens": turn_tokens[:-1],
            "turn_loss_above_max": turn_loss[-1],  # turns > loss.max_turns, pooled
            "turn_tokens_above_max": turn_tokens[-1],
            "labelled_tokens": tokens,
            "accuracy": jnp.sum(mask * correct) / jnp.maximum(tokens, 1.0),
        }


class Contrastive:
    """A CLIP's loss (Radford et al. 2021): the symmetric cross-entropy over the batch's image-text scores
    (fire_jax.models.clip), times ``loss.contrastive_weight`` (1), plus, for a vision stage's batches (``facts``),
    ``loss.fact_weight`` times its auxiliary heads' cross-entropy and ``loss.dense_weight`` times its dense heads'
    (``dense_facts``). One batch a step: its negatives are the other pairs in it. With ``contrastive_weight`` 0
    the towers' contrastive pass is not run (the text tower then never trains)."""

    def check(self, train_cfg) -> None:
        if train_cfg.accum_steps != 1:
            raise ValueError(f"train.accum_steps={train_cfg.accum_steps}: a contrastive batch is one micro-batch "
                             f"(its negatives are the other pairs in it); use 1")

    @staticmethod
    def _loss(trainer, params, frozen, batch):
        model = nnx.merge(trainer.graphdef, params, frozen)
        loss, metrics = jnp.zeros((), jnp.float32), {}
        weight = trainer.loss_cfg.get("contrastive_weight", 1.0)
        if weight:
            logits = model(batch["pixel_values"], batch["input_ids"])
            labels = jnp.arange(logits.shape[0])
            contrastive = contrastive_loss(logits)
            metrics = {"contrastive_loss": contrastive,
                       "image_to_text_accuracy": jnp.mean(jnp.argmax(logits, 1) == labels),
                       "text_to_image_accuracy": jnp.mean(jnp.argmax(logits, 0) == labels),
                       "temperature": 1 / jnp.exp(model.logit_scale[...])}
            loss = weight * contrastive
        if "facts" in batch:  # a vision stage's auxiliary heads on the features LLaVA reads (configs/clip.py)
            facts = batch["facts"]
            fact_logits, dense_logits = model.fact_logits(batch["view_pixels"], batch["feature_index"])
            aux, correct = fact_loss(fact_logits, facts, trainer.loss_cfg.get("fact_head_weights") or None)
            loss = loss + trainer.loss_cfg.get("fact_weight", 1.0) * aux
            applies = facts >= 0
            metrics.update(fact_loss=aux, fact_accuracy=correct.sum() / jnp.maximum(applies.sum(), 1),
                           # the last head apart (the synthetic set's: the tallest bar), the rest pooled
                           last_fact_accuracy=correct[:, -1].sum() / jnp.maximum(applies[:, -1].sum(), 1),
                           # the counts that are not 0, the hard part of the first heads
                           nonzero_count_accuracy=(correct[:, :-1] & (facts[:, :-1] > 0)).sum()
                           / jnp.maximum((facts[:, :-1] > 0).sum(), 1))
            if "dense_facts" in batch:  # what each patch of the whole-image tile holds (data.layout)
                dense, dense_correct = dense_loss(dense_logits, batch["dense_facts"])
                loss = loss + trainer.loss_cfg.get("dense_weight", 1.0) * dense
                marked = batch["dense_facts"] > 0
                metrics.update(dense_loss=dense,
                               dense_marked_accuracy=(dense_correct & marked).sum() / jnp.maximum(marked.sum(), 1))
        return loss, metrics

    def grads(self, trainer, state: TrainState, frozen, batch, rng):
        (loss, metrics), grads = jax.value_and_grad(lambda *args: self._loss(trainer, *args), has_aux=True)(
            state.params, frozen, batch)
        return grads, {"loss": loss, **metrics}


#: Each model kind's training objective (``model.kind``: ``LlavaNext.kind``, ``CLIPModel.kind``), and the ones a
#: config names instead (``train.objective``): "rl", a LLaVA student's reinforcement from the teacher's scores.
OBJECTIVES = {"llava": TurnLanguageModeling(), "clip": Contrastive(), "rl": PolicyGradient()}


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying shardings (inside their Variables), for lowering without allocating."""

    def one(sharding, x):
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            return x.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, shardings, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_example_ids(batch: dict[str, np.ndarray]) -> list[str]:
    ids = batch.get("example_id")
    return [] if ids is None else [str(x) for x in np.asarray(ids).reshape(-1)]
