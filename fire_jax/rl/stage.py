"""The student's reinforcement stage (docs/training.md, "Reinforcement from the teacher's scores"): rollouts of
sampled dialogues with the current weights, rewards from a teacher's scores, and the one trainer's jitted, sharded
step with the ``"rl"`` objective (:class:`fire_jax.train.policy.PolicyGradient`).

``python -m fire_jax.train --config configs/fire_rl.py --workdir DIR`` runs it (a config with an ``rl`` section),
as does the main job's ",rl" variant. Each iteration: ``rl.items_per_step`` items, ``rl.group_size`` dialogues
each (:func:`fire_jax.rl.rollouts.rollout`), their per-turn rewards and group-relative advantages, the old and
reference log-probs, then ``rl.updates`` optimizer steps on that batch. The stage resumes from its workdir: the
step picks the rollout, its items and its sampling key, so a resumed run repeats the uninterrupted one's steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np

from fire_jax.core.cli import StopSignals
from fire_jax.core.config import InputError, check_config
from fire_jax.core.files import write_text
from fire_jax.data.items import item_of, load_conversations
from fire_jax.dialogue.loop import dialogue_record
from fire_jax.dialogue.stop import StopRule
from fire_jax.eval.fire_bench import agent_from_section, agent_spec, model_config
from fire_jax.eval.judge import is_right
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams
from fire_jax.rl.rollouts import ScoringTeacher, dialogue_rewards, items_at, rollout, rollout_batch
from fire_jax.weights.checkpoint import Checkpointer
from fire_jax.weights.sharding import make_mesh, put_batch
from fire_jax.train.loop import MetricWriter, cut_metrics, export
from fire_jax.train.policy import advantages
from fire_jax.train.step import BATCH_KEYS, Trainer


class TeacherDown(InputError):
    """The teacher gave no readable reward in ``rl.max_failed_rollouts`` rollouts in a row: the stage ends in one
    line, its last checkpoint kept; the same command resumes."""


def load_policy(config):
    """The student to train (``config.student``, any checkpoint an agent section names) with its adapter folded
    into its weights and restarted from zero (:func:`fire_jax.models.fold_lora`): the adapter off is that student,
    the reference."""
    from fire_jax.infer.loading import load
    from fire_jax.models import fold_lora, set_remat

    spec, init = agent_spec(config.student)
    settings = model_config(config)
    if init:
        settings.init = dict(hf_checkpoint=init)
    loaded = load(settings, spec)
    fold_lora(loaded.model)
    set_remat(loaded.model, config.model.get("remat", "none"))  # the stage's, not the checkpoint's training config
    print(f"rl: student {loaded.description}, adapter folded (the reference)")
    return loaded


def training_items(config) -> list:
    """The (I, q, gt) items the stage draws from (``config.item_source``: a FIRE source, its conversations' first
    question and groundtruth)."""
    pairs = load_conversations(config.item_source, on_bad_record=config.get("on_bad_record", "skip"))
    if not pairs:
        raise InputError(f"config field item_source: {dict(config.item_source)} holds no FIRE conversation")
    return [item_of(record, image) for record, image in pairs]


def check_rl(config) -> None:
    """The settings the stage needs to agree, each bad one one line naming its field."""
    rl = config.rl
    rows = rl.items_per_step * rl.group_size
    if config.train.batch_size != rows:
        raise InputError(f"config field train.batch_size = {config.train.batch_size}: expected rl.items_per_step x "
                         f"rl.group_size = {rows} (one row a dialogue)")
    if config.train.get("objective") != "rl":
        raise InputError(f"config field train.objective = {config.train.get('objective')!r}: expected 'rl'")
    if rl.group_size < 2:
        raise InputError(f"config field rl.group_size = {rl.group_size}: expected >= 2 (advantages are relative "
                         f"to the group)")


def train_rl(config, workdir: str, *, max_steps: int | None = None, teacher=None) -> dict[str, Any]:
    """Run (or resume) the stage in ``workdir``; returns a summary dict as :func:`fire_jax.train.loop.train`'s.
    ``max_steps``: stop after that many optimizer steps (as a preemption would); ``teacher``: an agent with the
    teacher's ``feedback`` to score with instead of ``config.teacher``'s (a toy reward)."""
    check_config(config)
    check_rl(config)
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(tuple(config.mesh.shape))
    rules = tuple((name, tuple(axes)) for name, axes in config.mesh.rules)
    policy = load_policy(config)
    steps = config.rl.iterations * config.rl.updates
    trainer = Trainer(policy.model, config.train, config.rl, steps, mesh, rules)
    rule = StopRule.from_config(config.free)
    if teacher is None:
        teacher = agent_from_section(config, "teacher", teacher_history=config.free.teacher_history)
    teacher = ScoringTeacher(teacher, rule)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.train.keep_checkpoints,
                                clear_unfinished=True)
    state, resumed_at = trainer.initial_state, 0
    restored = checkpointer.restore(state, fallback=True)
    if restored is not None:
        state, _, resumed_at = restored
        print(f"resumed from {workdir}/checkpoints at step {resumed_at}")
    config_json = json.loads(config.to_json())
    write_text(os.path.join(workdir, "config.json"), json.dumps(config_json, indent=2))
    stage = _Stage(config, config_json, trainer, policy.chat, policy.model.cfg.geometry, training_items(config),
                   teacher, rule, checkpointer,
                   StopSignals.active or StopSignals(), mesh, rules, steps, workdir)
    state, metrics = stage.run(state, resumed_at, max_steps)
    final_step = int(jax.device_get(state.step))
    if final_step == steps and config.train.get("export", True):
        export(trainer.model(state), workdir, config)
    return {"step": final_step, "total_steps": steps, "preempted": stage.stop.requested is not None,
            "stopped_by": stage.stop.requested, "state": state, "trainer": trainer, "seconds": stage.seconds,
            "metrics": {k: np.asarray(v).tolist() for k, v in metrics.items()}}


@dataclasses.dataclass
class _Stage:
    """What the iterations work with."""

    config: Any
    config_json: dict
    trainer: Trainer
    chat: Any
    geometry: Any  # the student's image geometry (fire_jax.core.geometry.ImageGeometry)
    items: list
    teacher: ScoringTeacher
    rule: StopRule
    checkpointer: Checkpointer
    stop: StopSignals
    mesh: Any
    rules: tuple
    total: int
    workdir: str
    seconds: dict = dataclasses.field(default_factory=lambda: {"rollout": 0.0, "update": 0.0})

    def run(self, state, resumed_at: int, max_steps: int | None):
        """Iterations until the end, ``max_steps`` or a stop signal; returns (state, the last metrics)."""
        from tqdm.auto import tqdm

        rl, metrics, failed = self.config.rl, {}, 0
        end = self.total if max_steps is None else min(self.total, resumed_at + max_steps)
        writer = MetricWriter(self.workdir, resumed_at)
        dialogues_path = os.path.join(self.workdir, "rollouts.jsonl")
        cut_metrics(dialogues_path, resumed_at)  # a rollout written after the last checkpoint is drawn again
        progress = tqdm(total=self.total, initial=resumed_at, desc="rl", dynamic_ncols=True,
                        disable=jax.process_index() != 0)
        with self.stop.checked():
            try:
                while int(jax.device_get(state.step)) < end and not self.stop.requested:
                    step = int(jax.device_get(state.step))
                    result = self.iteration(state, step // rl.updates)
                    if result is None:
                        failed += 1
                        if failed >= rl.max_failed_rollouts:
                            raise self.teacher_down(failed, step)
                        continue
                    failed = 0
                    state, metrics, records = result
                    step = int(jax.device_get(state.step))
                    writer.write(step, metrics)
                    self.write_dialogues(dialogues_path, step, records)
                    progress.update(rl.updates)
                    progress.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}")
                    if step % self.config.train.checkpoint_every == 0 or step == end or self.stop.requested:
                        self.checkpointer.save(step, state, {}, self.config_json, metrics={"loss": metrics["loss"]},
                                               force=True)
                self.checkpointer.wait()
            finally:
                progress.close()
                writer.close(quiet=True)
                self.checkpointer.close()
        return state, metrics

    def iteration(self, state, iteration: int):
        """One rollout and its updates: (state, metrics, dialogue records), or None when no reward was read."""
        rl, start = self.config.rl, time.perf_counter()
        self.teacher.failures.clear()
        sampling = SamplingParams.from_config(self.config.decode, source="config.decode (rl sampling)",
                                              temperature=rl.temperature, top_p=rl.top_p)
        out = rollout(self.trainer.model(state), self.chat, items_at(self.items, iteration, rl.items_per_step,
                                                                      self.config.seed),
                      self.teacher, self.rule, group_size=rl.group_size, sampling=sampling,
                      engine=EngineConfig.from_config(self.config.decode), rng=self._key(iteration, 0),
                      mesh=self.mesh if self.mesh.size > 1 else None)
        rewards = dialogue_rewards(out.dialogues, rl.reward)
        rollout_seconds = time.perf_counter() - start
        self.seconds["rollout"] += rollout_seconds
        if all(r is None for r in rewards):
            return None
        start = time.perf_counter()
        per_turn = advantages(rewards, out.groups, method=rl.advantage, gamma=rl.gamma)
        host = rollout_batch(out, per_turn, rows=self.config.train.batch_size, buckets=rl.buckets,
                             pad_id=self.chat.pad_id, image_token_id=self.chat.image_token_id, geometry=self.geometry)
        batch = put_batch({k: v for k, v in host.items() if k in BATCH_KEYS}, self.mesh, self.rules)
        if rl.updates > 1:  # one update: pi_old is the policy being updated (PolicyGradient.old_logprobs)
            batch["old_logprobs"] = self.trainer.logprobs(state, batch)
        batch["ref_logprobs"] = self.trainer.logprobs(state, batch, reference=True)
        for update in range(rl.updates):
            state, update_metrics = self.trainer.step(state, batch, self._key(iteration, 1 + update))
        update_metrics = jax.device_get(update_metrics)
        update_seconds = time.perf_counter() - start
        self.seconds["update"] += update_seconds
        metrics = {**update_metrics, **rollout_metrics(out.dialogues, rewards, host, self.teacher.failures,
                                                       self.rule, judged=self._judged()),
                   "rollout_seconds": rollout_seconds, "update_seconds": update_seconds}
        records = [dict(dialogue_record(d), group=g, rewards=r) for d, g, r in zip(out.dialogues, out.groups, rewards)]
        return state, metrics, records

    def _key(self, iteration: int, use: int):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.seed), iteration), use)

    def _judged(self) -> bool:
        choice = self.config.get("exact_judge", "auto")
        return all(item.source.startswith("synthetic") for item in self.items) if choice == "auto" else bool(choice)

    def teacher_down(self, failed: int, step: int) -> TeacherDown:
        reasons = ", ".join(f"{why} x{n}" for why, n in sorted(self.teacher.failures.items()))
        first = "; ".join(f"{why}: {message}" for why, message in self.teacher.errors.items())
        return TeacherDown(f"rl: the teacher ({self.teacher.description}) gave no readable reward in {failed} "
                           f"rollouts in a row ({reasons}{'; ' + first if first else ''}); the checkpoint of step "
                           f"{step} is in {self.workdir}/checkpoints: the same command resumes")

    @staticmethod
    def write_dialogues(path: str, step: int, records: list[dict]) -> None:
        """Every dialogue of the rollout that led to ``step``, one JSON line each (what the rewards rewarded)."""
        if jax.process_index() != 0:
            return
        with open(path, "a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}) + "\n")


def rollout_metrics(dialogues, rewards, batch: dict, failures, rule: StopRule, *, judged: bool) -> dict:
    """A rollout's metrics: reward (mean return of the readable dialogues), final score, turns, the student's
    tokens a turn, the batch's rows a dialogue (1: every dialogue in one row), unreadable rewards by reason, the teacher's solved share by turn and (``judged``: the exact
    judge applies) the judged accuracy by turn, each dialogue's last answer carried past its end."""
    readable = [r for r in rewards if r is not None]
    turns = [len(d.turns) for d in dialogues]
    labelled = float(np.asarray(batch["loss_mask"]).sum())
    solved = [[rule.solves(d.turns[min(t, len(d.turns) - 1)].score) for d in dialogues] for t in range(rule.max_turns)]
    out = {"reward": float(np.mean([sum(r) for r in readable])), "readable": len(readable) / len(rewards),
           "final_score": float(np.mean([d.scores[-1] for d, r in zip(dialogues, rewards) if r is not None])),
           "turns": float(np.mean(turns)), "response_tokens": labelled / max(sum(len(r) for r in readable), 1),
           "rows_per_dialogue": float(batch["rows_used"]) / max(len(readable), 1),
           "solved_by_turn": np.mean(solved, axis=1)}
    out.update({f"unreadable/{why}": float(n) for why, n in failures.items()})
    if judged:
        right = [[is_right(d.turns[min(t, len(d.turns) - 1)].response, d.item.groundtruth) for d in dialogues]
                 for t in range(rule.max_turns)]
        out["accuracy_by_turn"] = np.mean(right, axis=1)
    return out
