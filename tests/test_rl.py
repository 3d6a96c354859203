"""The student's reinforcement stage: the objective against hand-computed values, the rollouts' rows and masks, the
reference, a toy reward that rises, resume, and unreadable rewards (fire_jax.train.policy, fire_jax.rl)."""

import json
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fire_jax.core.config import InputError, check_config, load_config
from fire_jax.dialogue.agents import ExactTeacher, Feedback, Student
from fire_jax.dialogue.loop import run_dialogues
from fire_jax.dialogue.stop import StopRule
from fire_jax.eval.fire_bench import model_config
from fire_jax.infer.api import ApiError
from fire_jax.infer.backends import InProcess
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.loading import load
from fire_jax.infer.sampling import SamplingParams
from fire_jax.models import fold_lora
from fire_jax.rl import stage
from fire_jax.rl.rollouts import Rollout, ScoringTeacher, dialogue_rewards, dialogue_rows, rollout, rollout_batch
from fire_jax.weights.sharding import make_mesh, put_batch
from fire_jax.train.policy import PolicyGradient, advantages, policy_loss, sequence_weights, turn_rewards
from fire_jax.train.step import BATCH_KEYS, Trainer


# ---------------------------------------------------------------------------------------------- the objective


def test_policy_loss_hand_computed():
    """Three student tokens: one clipped above (A > 0, ratio e^0.2), one clipped below (A < 0, ratio e^-1), one
    inside the clip range; the k3 KL of each against the reference; weights 1/3 each."""
    logp = jnp.array([[0.0, -1.0, -2.0, -1.0]])
    old = jnp.array([[0.0, -1.2, -1.0, -1.1]])
    ref = jnp.array([[0.0, -0.5, -2.5, -1.0]])
    adv = jnp.array([[0.0, 2.0, -1.0, 1.0]])
    weights = jnp.array([[0.0, 1 / 3, 1 / 3, 1 / 3]])
    loss, kl, clipped = policy_loss(logp, old, ref, adv, weights, clip=0.2, kl_coef=0.1)
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-0.5) + 0.5 - 1, 0.0]  # exp(ref - logp) - (ref - logp) - 1
    per_token = [-(1.2 * 2.0) + 0.1 * k3[0],  # min(e^0.2 * 2, 1.2 * 2) = 2.4: clipped
                 -(0.8 * -1.0) + 0.1 * k3[1],  # min(e^-1 * -1, 0.8 * -1) = -0.8: clipped
                 -(math.exp(0.1) * 1.0) + 0.1 * k3[2]]  # inside [0.8, 1.2]: the ratio itself
    assert float(loss) == pytest.approx(sum(per_token) / 3, abs=1e-6)
    np.testing.assert_allclose(np.asarray(kl)[0, 1:], k3, atol=1e-6)
    assert np.asarray(clipped)[0, 1:].tolist() == [True, True, False]


def test_one_update_needs_no_old_logprobs():
    """A rollout's only update leaves ``old_logprobs`` out: pi_old is the current policy without its gradient, so
    the loss and its gradient are those given the same log-probs as pi_old's, and the ratio is 1."""
    base = jnp.array([[0.0, -0.7, -1.9, -0.3]])
    ref, advantage = jnp.array([[0.0, -0.5, -2.2, -0.1]]), jnp.array([[0.0, 1.5, -0.5, 2.0]])
    weights = jnp.array([[0.0, 1 / 3, 1 / 3, 1 / 3]])

    def loss(theta, batch):
        logp = theta * base
        return policy_loss(logp, PolicyGradient.old_logprobs(batch, logp), ref, advantage, weights, clip=0.2,
                           kl_coef=0.1)[0]

    theta = 1.3
    given = jax.value_and_grad(loss)(theta, {"old_logprobs": theta * base})
    left_out = jax.value_and_grad(loss)(theta, {})
    np.testing.assert_allclose(left_out, given, rtol=1e-6)
    # d/dtheta of -rho A (rho = 1) is -A d logp / dtheta, plus the KL term's: both by hand
    kl_grad = jnp.sum(weights * (1.0 - jnp.exp(ref - theta * base)) * base) * 0.1
    assert float(left_out[1]) == pytest.approx(float(-jnp.sum(weights * advantage * base) + kl_grad), rel=1e-5)


def test_rewards_advantages_and_weights_hand_computed():
    assert turn_rewards([4, 9], score=1.0, improvement=0.5) == pytest.approx([0.4 + 0.2, 0.9 + 0.25])
    assert turn_rewards([4, 9], score=0.0, improvement=1.0) == pytest.approx([0.4, 0.5])  # sums to a_K / 10
    # GRPO, process supervision: the group's turn rewards [1, 0, 1] -> mean 2/3, std sqrt(2/9); normalised 1 ->
    # 1/sqrt(2), 0 -> -sqrt(2); a turn's advantage the rewards from it on (gamma 0.5). An unreadable one: None.
    out = advantages([[1.0], [0.0, 1.0], None, [0.3]], [0, 0, 0, 1], method="grpo", gamma=0.5)
    s = math.sqrt(2)
    assert out[0] == pytest.approx([1 / s], abs=1e-5)
    assert out[1] == pytest.approx([-s + 0.5 / s, 1 / s], abs=1e-5)
    assert out[2] is None and out[3] == pytest.approx([0.0])  # a group of one: no signal
    # RLOO per turn: returns-to-go [1], [1, 1], [0.7, 0.5]; each minus the others' mean at that turn.
    out = advantages([[1.0], [0.0, 1.0], [0.2, 0.5]], [0, 0, 0], method="rloo", gamma=1.0)
    assert out[0] == pytest.approx([1 - 0.85]) and out[1] == pytest.approx([1 - 0.85, 0.5])
    assert out[2] == pytest.approx([0.7 - 1.0, 0.5 - 1.0])
    mask = jnp.array([[0.0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(sequence_weights(mask, "sequence"), [[0, 1 / 6, 1 / 6, 1 / 6], [0, 1 / 2, 0, 0],
                                                                  [0, 0, 0, 0]], atol=1e-7)
    np.testing.assert_allclose(sequence_weights(mask, "token"), mask / 4)
    # a row holding a dialogue: r_1 (2 tokens), r_2 (1 token, right after r_1), r_3 (1 token); a row of one turn
    mask = jnp.array([[0.0, 1, 1, 1, 0, 1], [0, 0, 1, 1, 0, 0]])
    turns = jnp.array([[-1, 1, 1, 2, -1, 3], [-1, -1, 1, 1, -1, -1]])
    np.testing.assert_allclose(sequence_weights(mask, "sequence", turns),
                               [[0, 1 / 8, 1 / 8, 1 / 4, 0, 1 / 4], [0, 0, 1 / 8, 1 / 8, 0, 0]], atol=1e-7)
    with pytest.raises(InputError, match="rl.advantage"):
        advantages([[1.0]], [0], method="ppo")


# ------------------------------------------------------------------------------------------- rollouts, a model


@pytest.fixture(scope="module")
def tiny():
    config = load_config("configs/fire_rl.py:tiny")
    config.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")
    config.model.lora.dropout = 0.0
    config.item_source.max_examples = 8
    config.free.max_turns = 2
    config.decode.max_new_tokens = 4
    config.rl.update(dict(items_per_step=2, group_size=4, iterations=2, buckets=(384,), kl_coef=0.0))
    config.train.update(dict(batch_size=8, lr=2e-3, checkpoint_every=1))
    config.decode.batch_size = 8
    loaded = load(model_config(config), None)
    return config, loaded, stage.training_items(config)[:2]


def test_greedy_rollouts_are_the_greedy_dialogues_and_rows_hold_what_was_sampled(tiny):
    config, loaded, items = tiny
    rule = StopRule(max_turns=2, stop_on_no_increase=False)
    greedy = SamplingParams(max_tokens=4)
    out = rollout(loaded.model, loaded.chat, items, ScoringTeacher(ExactTeacher(), rule), rule, group_size=2,
                  sampling=greedy, engine=EngineConfig(), rng=jax.random.key(0))
    reference = {}
    student = Student(InProcess(loaded.model, loaded.chat, greedy, batch_size=4))  # the rollout's engine shape
    run_dialogues(items, student, ExactTeacher(), rule, batch_size=2, on_finish=lambda d: reference.__setitem__(d.item.id, d))
    for dialogue, group in zip(out.dialogues, out.groups):
        assert dialogue.turns == reference[items[group].id].turns
    per_turn = [[0.5, -0.25], None, [1.0, 2.0], [3.0, 4.0]]  # the second dialogue's reward was not read
    batch = rollout_batch(out, per_turn, rows=8, buckets=(384,), pad_id=loaded.chat.pad_id,
                          image_token_id=loaded.chat.image_token_id, geometry=loaded.model.cfg.geometry)
    assert batch["input_ids"].shape == (8, 384)
    rows = dialogue_rows(out, per_turn, 384)
    assert len(rows) == batch["rows_used"] and 3 <= len(rows) <= 6  # a row a dialogue where its prompts extend
    spans = [(row, span) for row, (_, row_spans, _) in enumerate(rows) for span in row_spans]
    kept = [(k, sample, value) for d, values in zip(out.samples, per_turn) if values is not None
            for k, (sample, value) in enumerate(zip(d, values))]
    assert len(spans) == len(kept) == 6
    for (row, (start, stop, turn, advantage)), (k, (request, result), value) in zip(spans, kept):
        assert (turn, advantage) == (k + 1, value)
        assert batch["input_ids"][row, :start].tolist() == list(request.prompt)  # the prompt the engine read
        assert batch["input_ids"][row, start:stop].tolist() == list(result.tokens)  # exactly the sampled ids
        assert set(batch["advantages"][row, start:stop]) == {value} and set(batch["turn_ids"][row, start:stop]) == {k + 1}
        assert (batch["image_index"][row] >= 0).sum() > 0  # the prompt's image placeholders
    for row in range(len(rows)):  # nothing labelled but the sampled ids
        labelled = sum(stop - start for r, (start, stop, _, _) in spans if r == row)
        assert batch["loss_mask"][row].sum() == labelled
    assert batch["loss_mask"][len(rows):].sum() == 0 and batch["advantages"][len(rows):].sum() == 0


def test_a_dialogue_is_one_row_where_its_prompts_extend_each_other():
    """Turn 2's prompt begins with turn 1's prompt and sampled ids: one row; a prompt that re-encoded the reply
    otherwise, or a row that would pass the limit, starts a row of its own."""
    def sample(prompt, tokens):
        return (types.SimpleNamespace(prompt=prompt, pixel_values=None, image_sizes=[]),
                types.SimpleNamespace(tokens=tokens))

    first = sample([1, 2, 3], [7, 8])
    extends = sample([1, 2, 3, 7, 8, 4, 5], [9])
    re_encoded = sample([1, 2, 3, 6, 4, 5], [9])  # the reply's text encoded to other ids
    out = Rollout(dialogues=[], groups=[0, 0, 0], samples=[[first, extends], [first, re_encoded], [first, extends]])
    rows = dialogue_rows(out, [[0.5, 1.5], [0.5, 1.5], None], limit=16)
    assert [ids for ids, _, _ in rows] == [[1, 2, 3, 7, 8, 4, 5, 9], [1, 2, 3, 7, 8], [1, 2, 3, 6, 4, 5, 9]]
    assert [spans for _, spans, _ in rows] == [[(3, 5, 1, 0.5), (7, 8, 2, 1.5)], [(3, 5, 1, 0.5)], [(6, 7, 2, 1.5)]]
    rows = dialogue_rows(out, [[0.5, 1.5], None, None], limit=7)  # 8 ids would pass 7: turn 2 in a row of its own
    assert [ids for ids, _, _ in rows] == [[1, 2, 3, 7, 8], [1, 2, 3, 7, 8, 4, 5]]
    assert [spans for _, spans, _ in rows] == [[(3, 5, 1, 0.5)], []]  # the cut removed turn 2's sampled id


def test_the_reference_is_the_student_with_its_adapter_off(tiny):
    """The student is folded (its adapter into its weights, the adapter restarted at 0): the reference's and the
    policy's log-probs are then the unfolded student's, and the reference stays so when the adapter trains; on the
    8B recipes' mesh."""
    config, _, items = tiny
    loaded = load(model_config(config), None)
    for path, variable in nnx.iter_graph(loaded.model):
        if path and path[-1] == "lora_b":
            variable[...] = 0.05 * jax.random.normal(jax.random.key(len(path)), variable[...].shape)
    rule = StopRule(max_turns=1)
    out = rollout(loaded.model, loaded.chat, items, ScoringTeacher(ExactTeacher(), rule), rule, group_size=4,
                  sampling=SamplingParams(max_tokens=4, temperature=1.0), engine=EngineConfig(), rng=jax.random.key(1))
    host = rollout_batch(out, [[1.0]] * 8, rows=8, buckets=(384,), pad_id=loaded.chat.pad_id,
                         image_token_id=loaded.chat.image_token_id, geometry=loaded.model.cfg.geometry)
    logits = loaded.model(jnp.asarray(host["input_ids"]), jnp.asarray(host["pixel_values"]),
                          jnp.asarray(host["image_index"]), jnp.asarray(host["attention_mask"]))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32)),
                               jnp.asarray(host["input_ids"])[:, 1:, None], -1)[..., 0]
    student = np.pad(np.asarray(logp), ((0, 0), (1, 0))) * host["loss_mask"]
    fold_lora(loaded.model)
    mesh = make_mesh((1, -1, 1))  # the 8B recipes' mesh: FSDP over the 8 host devices
    trainer = Trainer(loaded.model, config.train, config.rl, 4, mesh)
    batch = put_batch({k: v for k, v in host.items() if k in BATCH_KEYS}, mesh)
    state = trainer.initial_state
    np.testing.assert_allclose(trainer.logprobs(state, batch, reference=True), student, atol=2e-4)
    np.testing.assert_allclose(trainer.logprobs(state, batch), student, atol=2e-4)
    moved = dataclasses_replace_params(state, 0.05)
    assert np.abs(np.asarray(trainer.logprobs(moved, batch)) - student).max() > 1e-2
    np.testing.assert_allclose(trainer.logprobs(moved, batch, reference=True), student, atol=2e-4)


def dataclasses_replace_params(state, scale: float):
    """``state`` with every trainable (LoRA) parameter moved by ``scale`` times a fixed random draw."""
    import dataclasses

    leaves, tree = jax.tree.flatten(state.params)
    moved = [x + scale * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)]
    return dataclasses.replace(state, params=jax.tree.unflatten(tree, moved))


# ------------------------------------------------------------------------------------------------ the stage


class Lowercase:
    """A toy teacher: 10 x the share of the reply's characters that are lowercase letters."""

    description = "toy: lowercase share"

    def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None):
        return [Feedback(f"Score: {10 * sum(c.islower() for c in a) / max(len(a), 1):.2f}",
                         10 * sum(c.islower() for c in a) / max(len(a), 1)) for a in answers]


def toy_student(monkeypatch):
    """The random tiny student with one direction of its hidden state that raises every lowercase word's logit (a
    feature the toy reward reads, so that a few updates can find it)."""
    real = stage.load_policy

    def policy(config):
        loaded = real(config)
        head = loaded.model.language_model.lm_head.kernel
        decode = loaded.chat.tokenizer.decode
        words = np.asarray([decode([i]).strip().isalpha() and decode([i]).strip().islower()
                            for i in range(head[...].shape[1])])
        u = np.random.default_rng(0).standard_normal(head[...].shape[0])
        head[...] = head[...] + jnp.asarray(np.outer(u / np.linalg.norm(u), np.where(words, 1.0, -1.0)), jnp.float32)
        return loaded

    monkeypatch.setattr(stage, "load_policy", policy)


def _metrics(workdir) -> list[dict]:
    timing = ("rollout_seconds", "update_seconds")
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in open(workdir / "metrics.jsonl")]


def test_a_toy_reward_rises_and_a_resumed_stage_repeats_it(tiny, tmp_path, monkeypatch):
    config, _, _ = tiny
    toy_student(monkeypatch)
    config = config.copy_and_resolve_references()
    config.free.max_turns = 1
    whole = stage.train_rl(config, str(tmp_path / "whole"), teacher=Lowercase())
    metrics = _metrics(tmp_path / "whole")
    rewards = [m["reward"] for m in metrics]
    assert whole["step"] == 2 and rewards[-1] > rewards[0] + 0.2, rewards  # one update: 0.5 -> 0.9 or so
    # the first update: the policy is the reference and the sampler (KL 0, ratio 1, nothing clipped)
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6) and metrics[0]["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics[0]["clip_fraction"] == 0.0 and metrics[-1]["kl"] > 0 and metrics[0]["readable"] == 1.0
    stage.train_rl(config, str(tmp_path / "resumed"), teacher=Lowercase(), max_steps=1)
    resumed = stage.train_rl(config, str(tmp_path / "resumed"), teacher=Lowercase())
    assert resumed["step"] == 2
    assert _metrics(tmp_path / "resumed") == metrics
    assert (tmp_path / "whole" / "export" / "hf_merged" / "config.json").exists()


class Down:
    """A teacher over an endpoint that times out on every request."""

    description = "api:http://127.0.0.1:9/v1#judge"

    class backend:
        @staticmethod
        def generate(images, prompts, sampling=None, rng=None, *, errors=False):
            return [ApiError("api:...: request failed (timeout) after 3 tries", "timeout") for _ in prompts]

    @staticmethod
    def prompts(questions, groundtruths, answers, histories):
        return [[] for _ in questions]


def test_unreadable_rewards_are_counted_by_reason_and_a_teacher_down_ends_the_stage(tiny, tmp_path, monkeypatch):
    class Flaky(Down):
        class backend:
            @staticmethod
            def generate(images, prompts, sampling=None, rng=None, *, errors=False):
                return [ApiError("down", "http_503"), "Score: 7.\nFeedback: Close.", "Feedback: no score here."]

    rule = StopRule()
    teacher = ScoringTeacher(Flaky(), rule)
    replies = teacher.feedback([None] * 3, ["q"] * 3, ["gt"] * 3, ["a"] * 3)
    assert [r.score for r in replies] == [None, 7.0, None]
    assert dict(teacher.failures) == {"teacher_http_503": 1, "no_score": 1}

    class Turns:  # dialogues with those scores
        def __init__(self, scores):
            self.scores = scores

    assert dialogue_rewards([Turns([7.0]), Turns([3.0, None])], rule_reward()) == [[0.7], None]
    config, _, _ = tiny
    toy_student(monkeypatch)
    with pytest.raises(stage.TeacherDown, match=r"no readable reward in 3 rollouts in a row \(teacher_timeout x8; "
                                                r"teacher_timeout: .*timeout.*the same command resumes"):
        stage.train_rl(config, str(tmp_path / "down"), teacher=Down())


def rule_reward():
    import ml_collections

    return ml_collections.ConfigDict(dict(score=1.0, improvement=0.0))


def test_the_main_jobs_rl_variant_and_its_checks():
    default, variant = load_config("configs/main_job.py:tiny"), load_config("configs/main_job.py:tiny,rl")
    assert "rl_train" not in default and tuple(variant.rl_reward_teachers) == ("exact", "fd")
    assert variant.rl_train.train.batch_size == 16 and variant.rl_train.train.objective == "rl"
    assert variant.rl_train.model.to_dict() == variant.eval_free.model.to_dict()
    for key in default:
        assert default[key] == variant[key], key  # the stages before it are the default's: a workdir resumes
    check_config(variant)
    variant.rl_train.rl.group_size = 1
    with pytest.raises(InputError, match=r"rl_train\.rl\.group_size = 1: expected an integer >= 2"):
        check_config(variant)



def test_set_remat_switches_a_loaded_model_and_keeps_its_gradients():
    """The stage rematerialises the policy it loads (``set_remat``, the stage's ``model.remat``, not the
    checkpoint's training config): the forward then holds a checkpoint per layer, and the gradients are the same."""
    from fire_jax.models import LoRAParam, set_remat
    from fire_jax.weights.build import build_model

    model = build_model(load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")))
    ids = jnp.arange(1, 13, dtype=jnp.int32).reshape(2, 6)

    def grads_and_program(m):
        graphdef, lora, rest = nnx.split(m, LoRAParam, ...)

        def loss(p):
            hidden, _ = nnx.merge(graphdef, p, rest).hidden_states(ids, None, None, jnp.ones_like(ids))
            return jnp.sum(hidden ** 2)

        return jax.grad(loss)(lora), str(jax.make_jaxpr(jax.grad(loss))(lora))

    plain, program = grads_and_program(model)
    assert model.cfg.remat == "none" and "checkpoint" not in program and "remat" not in program
    set_remat(model, "full")
    remat, program = grads_and_program(model)
    assert model.cfg.remat == "full" and ("checkpoint" in program or "remat" in program)
    assert len(jax.tree.leaves(plain)) > 0
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="model.remat='often'"):
        set_remat(model, "often")
