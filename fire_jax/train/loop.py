"""The training loop: resume, step, log, checkpoint, export (docs/training.md).

``python -m fire_jax.train --config configs/<x>.py --workdir DIR`` runs it;
the same code trains the tiny model on a laptop CPU and the 8B model on a
GPU/TPU mesh, multi-host through ``jax.distributed``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import numpy as np

from fire_jax.weights.build import build_model
from fire_jax.weights.checkpoint import Checkpointer
from fire_jax.core.cli import StopSignals
from fire_jax.core.config import WriteFailed, check_config, writing
from fire_jax.core.files import output_folder, write_text
from fire_jax.models import LlavaNext
from fire_jax.models.clip import CLIPModel
from fire_jax.weights.sharding import make_mesh, put_batch
from fire_jax.train.step import Trainer, batch_example_ids


class MetricWriter:
    """Metrics to ``metrics.jsonl`` and a TensorBoard event file in the workdir (process 0 only), both written
    and flushed in the loop's own thread at every step: a write that fails (a full disk) raises
    :class:`WriteFailed` there, naming the file and the space left. (tensorboardX's ``SummaryWriter`` writes from
    a thread of its own; once a write kills it, the next ``add_scalar`` waits for ever on its full queue.)

    ``resumed_at``: the step the run resumed from (0: from scratch). ``metrics.jsonl`` is first cut back to the
    lines of steps up to it (a run stopped after its last checkpoint wrote steps it now does again), saying so.
    """

    def __init__(self, workdir: str, resumed_at: int = 0):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        from tensorboardX.event_file_writer import EventsWriter

        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tensorboard")
        with writing(self.path):
            cut_metrics(self.path, resumed_at)
            self.jsonl = open(self.path, "a")
        with writing(self.tb_dir):
            os.makedirs(self.tb_dir, exist_ok=True)
            self.tb = EventsWriter(os.path.join(self.tb_dir, "events"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        flat = {}
        for key, value in metrics.items():
            value = np.asarray(value)
            if value.ndim:  # per-turn arrays: turn_loss/1, turn_loss/2, ...
                for i, v in enumerate(value):
                    flat[f"{key}/{i}"] = float(v)
            else:
                flat[key] = float(value)
        with writing(self.path):
            self.jsonl.write(json.dumps({"step": step, **flat}) + "\n")
            self.jsonl.flush()
        with writing(self.tb_dir):
            for key, value in flat.items():
                if math.isfinite(value):
                    self.tb.write_event(Event(summary=scalar(key, value), step=step, wall_time=time.time()))
            self.tb.flush()

    def close(self, quiet: bool = False):
        """Close both files; ``quiet``: ignore a failing flush (the run is ending on an error already)."""
        if self.enabled:
            for path, close in ((self.path, self.jsonl.close), (self.tb_dir, self.tb.close)):
                try:
                    with writing(path):
                        close()
                except WriteFailed:
                    if not quiet:
                        raise


def cut_metrics(path: str, step: int) -> None:
    """Cut ``path`` (metrics.jsonl) after its last line of a step <= ``step``, printing what was cut: the lines
    of later steps and a last line cut short by the kill. A line that is not a JSON record of a step before
    that ends in an :class:`InputError` naming the file and line."""
    from fire_jax.core.config import InputError

    if not os.path.exists(path):
        return
    keep, cut, partial = 0, [], False
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            complete = line.endswith(b"\n")
            try:
                record_step = int(json.loads(line)["step"]) if complete else None
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path}: line {number}: not a JSON record with a step ({e})") from None
            if record_step is None:
                partial = True
            elif record_step <= step and not cut:
                keep += len(line)
            else:
                cut.append(record_step)
    if not cut and not partial:
        return
    with open(path, "r+b") as f:
        f.truncate(keep)
    what = []
    if cut:
        what.append(f"the line of step {cut[0]}" if len(cut) == 1
                    else f"{len(cut)} lines of steps {min(cut)}-{max(cut)}")
    if partial:
        what.append("a last line cut short")
    print(f"{path}: cut back to step {step}: {' and '.join(what)} written after that checkpoint dropped "
          f"(those steps run again)")


def total_steps(config, pipeline) -> int:
    """``train.total_steps``, or the steps that read the data once per epoch: the usable examples (after bad
    records) of this process's share, divided by its batch, the last batch partial (one epoch, FIRE Sec. 5.1)."""
    if config.train.get("total_steps"):
        return int(config.train.total_steps)
    epochs = config.data.get("num_epochs") or config.train.epochs
    if config.data.get("num_epochs") and config.train.epochs != config.data.num_epochs:
        raise ValueError(f"train.epochs={config.train.epochs} but data.num_epochs={config.data.num_epochs}: "
                         f"the data ends after data.num_epochs passes; make them equal")
    return pipeline.steps(epochs)


def plan_report(config, pipeline, steps: int) -> str:
    """What the step count was computed from, per source: stated size, usable records, bad ones."""
    lines = []
    for name, usable in pipeline.source_sizes.items():
        stated = pipeline.stated_sizes.get(name)
        lines.append(f"  source {name}: {usable:,} usable" + (f" (stated {stated:,})" if stated else ""))
    if config.train.get("total_steps"):
        head = f"steps: {steps:,} (train.total_steps)"
    else:
        epochs = config.data.get("num_epochs") or config.train.epochs
        per_process = pipeline.examples_per_process(epochs)
        head = (f"steps: {steps:,} = ceil({per_process:,} usable examples per process / {pipeline.batch_size} per "
                f"process) from {pipeline.num_examples:,} usable examples x {epochs:g} epoch(s) over "
                f"{pipeline.process_count} process(es); {sum(pipeline.bad_records.values()):,} bad records skipped")
    return "\n".join([head, *lines])


def _check_fact_heads(model: CLIPModel, pipeline) -> None:
    """A vision stage's data and heads agree: facts need heads, one per fact, and dense facts one per dense fact and
    patch (configs/clip.py)."""
    from fire_jax.core.config import InputError

    facts = pipeline.extra.get("facts")
    heads = len(model.cfg.fact_classes)
    if facts is not None and facts.shape[1] != heads:
        raise InputError(f"data.facts gives {facts.shape[1]} facts an image, model.fact_classes has {heads} heads"
                         + (" (a CLIP from init.clip_checkpoint has none: set data.facts=False)" if not heads else ""))
    dense = pipeline.extra.get("dense_facts")
    if dense is not None and dense.shape[2] != len(model.cfg.dense_classes):
        raise InputError(f"data.layout gives {dense.shape[2]} dense facts a patch, model.dense_classes has "
                         f"{len(model.cfg.dense_classes)} heads")
    if dense is not None and dense.shape[1] != model.cfg.vision.num_patches:
        raise InputError(f"data.layout gives {dense.shape[1]} patches an image, the tower has "
                         f"{model.cfg.vision.num_patches}")


def train(config, workdir: str, *, max_steps: int | None = None) -> dict[str, Any]:
    """Train (resuming from ``workdir`` if it holds a checkpoint); returns a summary dict.

    ``max_steps`` stops early (as a preemption would), for tests and smoke runs.
    """
    check_config(config)
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(tuple(config.mesh.shape))
    rules = tuple((name, tuple(axes)) for name, axes in config.mesh.rules)
    if config.data.batch_size != config.train.batch_size:
        raise ValueError(f"data.batch_size={config.data.batch_size} != train.batch_size={config.train.batch_size}")
    model, pipeline = _model_and_data(config, mesh, rules)
    steps = total_steps(config, pipeline)
    if jax.process_index() == 0:
        print(plan_report(config, pipeline, steps))
    trainer = Trainer(model, config.train, config.loss, steps, mesh, rules)
    del model
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.train.keep_checkpoints,
                                clear_unfinished=True)  # a save a full disk cut short: its space back
    state = trainer.initial_state
    restored = checkpointer.restore(state, fallback=True)  # a damaged latest step: the one before, said so
    resumed_at = 0
    if restored is not None:
        state, data_state, resumed_at = restored
        pipeline.set_state(data_state)
        print(f"resumed from {workdir}/checkpoints at step {resumed_at}")
    config_json = json.loads(config.to_json())
    if jax.process_index() == 0:
        write_text(os.path.join(workdir, "config.json"), json.dumps(config_json, indent=2))
    stop = StopSignals.active or StopSignals()  # the command's (with its watchdog), else one for this loop
    run = _Run(config, config_json, trainer, pipeline, checkpointer, stop, mesh, rules, steps)
    state, metrics, data_ended = run.steps(state, MetricWriter(workdir, resumed_at), max_steps)
    final_step = int(jax.device_get(state.step))
    if stop.requested:
        print(f"{stop.requested.name}: checkpoint of step {final_step} committed in {workdir}/checkpoints",
              flush=True)
    if (final_step == steps or data_ended) and config.train.get("export", True) and jax.process_index() == 0:
        export(trainer.model(state), workdir, config)
    return {"step": final_step, "total_steps": steps, "data_ended": data_ended,
            "preempted": stop.requested is not None, "stopped_by": stop.requested, "state": state, "trainer": trainer,
            "source_sizes": dict(pipeline.source_sizes),  # usable examples per source (one epoch, all processes)
            "metrics": {k: np.asarray(v).tolist() for k, v in metrics.items()}}


def _model_and_data(config, mesh, rules):
    """The model to train and its input pipeline, by the model's kind (:data:`PIPELINES`)."""
    model = build_model(config, mesh, rules) if config.train.get("shard_init") else build_model(config)
    return model, PIPELINES[model.kind](config, model)


def _records_pipeline(config, model: LlavaNext):
    """A LLaVA's data: FIRE / instruction records, its per-turn labels (fire_jax.data.pipeline)."""
    from fire_jax.data.pipeline import InputPipeline

    return InputPipeline(config.data, model.cfg.geometry, image_token_id=model.cfg.image_token_id,
                         process_index=jax.process_index(), process_count=jax.process_count(),
                         student_first_turn=config.loss.get("student_first_turn", False))


def _captions_pipeline(config, model: CLIPModel):
    """A CLIP's data: image-caption pairs (configs/clip.py; a vision stage's facts for its heads)."""
    from fire_jax.data.captions import CaptionPipeline

    pipeline = CaptionPipeline(config.data, model.cfg.vision.image_size, eos_token_id=model.cfg.text.eos_token_id,
                               process_count=jax.process_count(), patch_size=model.cfg.vision.patch_size)
    _check_fact_heads(model, pipeline)
    return pipeline


#: Each model kind's input pipeline (``model.kind``; its loss: fire_jax.train.step.OBJECTIVES, its export:
#: :data:`EXPORTS`).
PIPELINES = {"llava": _records_pipeline, "clip": _captions_pipeline}


@dataclasses.dataclass
class _Run:
    """What the step loop works with: the config, the trainer, the data, the checkpoints and the stop flag."""

    config: Any
    config_json: dict
    trainer: Trainer
    pipeline: Any
    checkpointer: Checkpointer
    stop: StopSignals
    mesh: Any
    rules: tuple
    total: int

    def save(self, step: int, state, metrics: dict) -> None:
        self.checkpointer.save(step, state, self.pipeline.get_state(), self.config_json, metrics=_loss_of(metrics),
                               force=True)

    def steps(self, state, writer: MetricWriter, max_steps: int | None):
        """Steps until the end, ``max_steps``, the data's end or a stop signal, checkpointing as configured and
        at the last step; returns (state, last metrics, whether the data ended)."""
        start = int(jax.device_get(state.step))
        end = self.total if max_steps is None else min(self.total, start + max_steps)
        rng, metrics, data_ended, last_saved = jax.random.key(self.config.seed), {}, False, start
        progress, tokens_done, t0 = _progress(start, self.total), 0, time.perf_counter()
        failed: BaseException | None = None
        with self.stop.checked():  # SIGTERM / SIGINT: a flag checked after each step
            try:
                for step in range(start, end):
                    try:
                        batch = next(self.pipeline)
                    except StopIteration:  # examples dropped while training (image_cut, ...) end the data early
                        data_ended = True
                        progress.write(f"the data ended after step {step} of {self.total} (examples dropped while "
                                       f"training: {sum(self.pipeline.dropped.values()):,}); saving and exporting there")
                        if step > last_saved:
                            self.save(step, state, metrics)
                        break
                    state, metrics = self.trainer.step(state, put_batch(batch, self.mesh, self.rules), rng)
                    metrics = jax.device_get(metrics)
                    if not np.isfinite(metrics["loss"]):
                        raise FloatingPointError(f"non-finite loss {metrics['loss']} at step {step + 1}; batch "
                                                 f"examples: {batch_example_ids(batch)}")
                    tokens_done += int(np.asarray(batch["attention_mask"]).sum()) * jax.process_count()
                    metrics["tokens_per_s"] = tokens_done / (time.perf_counter() - t0)
                    writer.write(step + 1, metrics)
                    self.checkpointer.check()  # a background save that failed ends the run now, not at the next
                    progress.update(1)
                    progress.set_postfix(loss=f"{float(metrics['loss']):.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                    if (step + 1) % self.config.train.checkpoint_every == 0 or step + 1 == end or self.stop.requested:
                        self.save(step + 1, state, metrics)
                        last_saved = step + 1
                    if self.stop.requested:
                        break
                self.checkpointer.wait()  # committed: a stopped run says so only now (a second signal may end it)
            except BaseException as e:
                failed = e
                raise
            finally:
                progress.close()
                self.pipeline.close()
                print(self.pipeline.report())
                # On a failed write the files and the checkpoint in flight are let go without waiting or a second
                # error: the disk that failed one write fails the others, or hangs them.
                writer.close(quiet=failed is not None)
                self.checkpointer.close(wait=not isinstance(failed, WriteFailed), quiet=failed is not None)
        return state, metrics, data_ended


def export(model: LlavaNext | CLIPModel, workdir: str, config) -> None:
    """The trained model under ``workdir/export``, by its kind (:data:`EXPORTS`); each folder written whole or not
    at all (the last good one is kept)."""
    EXPORTS[model.kind](model, workdir, config)


def _export_llava(model: LlavaNext, workdir: str, config) -> None:
    """Final LoRA as a PEFT adapter, and (``train.export_merged``) merged HF weights with the run's tokenizer
    (``tokenizer.json``, and its ``tokenizer_config.json`` with the chat template when it has one), so the
    folder loads on its own."""
    import shutil

    from fire_jax.core.config import resolve_path
    from fire_jax.convert.hf import save_hf_checkpoint, save_peft_adapter
    from fire_jax.models import merge_lora

    adapter, merged = os.path.join(workdir, "export", "peft_adapter"), os.path.join(workdir, "export", "hf_merged")
    with output_folder(adapter) as written:
        save_peft_adapter(model, written)
    if config.train.get("export_merged", False):
        with output_folder(merged) as written:
            save_hf_checkpoint(merge_lora(model), written)
            tokenizer = resolve_path(config.data.tokenizer)
            shutil.copyfile(tokenizer, os.path.join(written, "tokenizer.json"))
            template = os.path.join(os.path.dirname(tokenizer), "tokenizer_config.json")
            if os.path.exists(template):
                shutil.copyfile(template, os.path.join(written, "tokenizer_config.json"))


def _export_clip(model: CLIPModel, workdir: str, config) -> None:
    """A CLIP: its HF CLIPModel checkpoint in ``export/clip`` (a LLaVA's ``init.vision_tower`` reads it)."""
    from fire_jax.convert.clip import save_clip_checkpoint

    with output_folder(os.path.join(workdir, "export", "clip")) as written:
        save_clip_checkpoint(model, written)


#: Each model kind's export (``model.kind``).
EXPORTS = {"llava": _export_llava, "clip": _export_clip}


def _loss_of(metrics: dict[str, Any]) -> dict[str, float]:
    return {"loss": float(metrics["loss"])} if "loss" in metrics else {}


def _progress(start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", disable=jax.process_index() != 0, dynamic_ncols=True)
