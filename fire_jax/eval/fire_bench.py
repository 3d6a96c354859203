"""FIRE-Bench with fire_jax models: agents from a config, a run, its results, tables and plots (SPEC 6).

``python -m fire_jax.evaluate --config configs/eval_fixed.py|eval_free.py --workdir OUT`` calls
:func:`evaluate`, which

1. reads the test set (``config.test``, a data source: raw JSON + image root,
   or a built TFDS split), counting bad records by reason;
2. builds the student and the teacher (``config.student`` / ``config.teacher``:
   ``init`` a Hugging Face checkpoint folder or "" for random weights,
   ``adapter`` a PEFT adapter folder, a training workdir, or ""; see
   :func:`agent_model`);
3. runs fixed dialogues (:mod:`fire_jax.eval.fixed`) or free dialogues
   (:mod:`fire_jax.eval.free`), appending to ``OUT/<setting>_outputs.jsonl``
   (a rerun resumes; ``OUT/settings.json`` stops a rerun with other settings
   from mixing outputs);
4. writes ``OUT/results.json``, ``OUT/results.md`` (the paper's tables with
   our row, :mod:`fire_jax.eval.report`) and PNG plots (:mod:`fire_jax.eval.plots`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from typing import Any, Mapping

import numpy as np

from fire_jax.data.config import resolve_path
from fire_jax.data.records import BadRecords
from fire_jax.eval import fixed, free, plots, report
from fire_jax.eval.bench_io import item_of, load_conversations

SETTINGS = ("fixed", "free")

# ----------------------------------------------------------------------------
# The student and the teacher
# ----------------------------------------------------------------------------

_PEFT_KEY = re.compile(r".*language_model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])"
                       r"(?:\.default)?\.weight")
_PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}


def peft_lora_config(directory: str) -> dict:
    """``model.lora`` of a PEFT adapter folder (adapter_config.json: r, lora_alpha, target_modules)."""
    with open(os.path.join(directory, "adapter_config.json")) as f:
        peft = json.load(f)
    modules = peft["target_modules"]
    names = set(re.findall(r"\w+_proj", modules)) if isinstance(modules, str) else set(modules)
    targets = tuple(t for name, t in _PEFT_TARGETS.items() if name in names)
    if not targets:
        raise ValueError(f"{directory}: no Llama projection among target_modules {modules!r}")
    return dict(rank=int(peft["r"]), alpha=float(peft["lora_alpha"]), dropout=float(peft.get("lora_dropout", 0.0)),
                targets=targets)


def load_peft_adapter(model, directory: str):
    """Set the model's LoRA factors from a PEFT adapter (``convert.hf.save_peft_adapter``'s layout, or
    transformers' older ``language_model.model.layers`` one); every LoRA module must be covered."""
    from safetensors.numpy import load_file

    layers = model.language_model.model.layers
    covered = set()
    for key, value in load_file(os.path.join(directory, "adapter_model.safetensors")).items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None or "vision" in key:
            raise KeyError(f"{directory}: adapter tensor {key!r} is not a LoRA factor of the language model")
        layer, sub, proj, which = int(match[1]), match[2], match[3], match[4]
        linear = getattr(getattr(layers[layer], sub), proj, None) if layer < len(layers) else None
        factor = None if linear is None else getattr(linear, "lora_a" if which == "A" else "lora_b", None)
        if factor is None:
            raise KeyError(f"{directory}: {key!r} has no LoRA factor in the model (lora "
                           f"{model.cfg.lora.targets if model.cfg.lora else None})")
        value = np.ascontiguousarray(value.T)  # PEFT [out, in] -> ours [in, out]
        if value.shape != factor[...].shape:
            raise ValueError(f"{directory}: {key} has shape {value.T.shape}, the model expects "
                             f"{factor[...].shape[::-1]}")
        factor[...] = value.astype(factor[...].dtype)
        covered.add((layer, sub, proj, which))
    expected = 2 * len(layers) * len(model.cfg.lora.targets)
    if len(covered) != expected:
        raise KeyError(f"{directory}: the adapter has {len(covered)} of the model's {expected} LoRA factors")
    return model


def restore_trained(model, workdir: str, train_config):
    """The model with the trainable parameters (LoRA, and the connector if it trained) of the latest
    orbax checkpoint in ``workdir/checkpoints`` (restored on one device)."""
    import jax

    from fire_jax.train.checkpoint import Checkpointer
    from fire_jax.train.sharding import make_mesh
    from fire_jax.train.step import Trainer

    trainer = Trainer(model, train_config.train, train_config.loss, 1, make_mesh((1, 1, 1), jax.devices()[:1]))
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        restored = checkpointer.restore(trainer.initial_state)
    finally:
        checkpointer.close()
    if restored is None:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint")
    state, _, step = restored
    print(f"restored the trained parameters of {workdir} at step {step}")
    return trainer.model(state)


def agent_model(config, agent: Mapping[str, Any]):
    """The model of one agent config ``dict(init=..., adapter=...)``.

    ``init``: a Hugging Face LLaVA-NeXT folder, or ""/None for random weights
    of ``config.model`` (seed ``config.seed``). ``adapter``: ""/None; a PEFT
    adapter folder (its r, alpha and targets set the LoRA); or a training
    workdir (``python -m fire_jax.train``), whose latest orbax checkpoint
    gives the LoRA (and the connector, when the run trained it) under the
    LoRA config in its config.json. The frozen weights always come from
    ``init``: they must be those the adapter was trained on.
    """
    import ml_collections

    from fire_jax.train.loop import build_model

    adapter = resolve_path(agent.get("adapter") or "")
    model_config = copy.deepcopy(config.model)
    train_config = None
    if adapter and os.path.isdir(os.path.join(adapter, "checkpoints")):
        with open(os.path.join(adapter, "config.json")) as f:
            train_config = ml_collections.ConfigDict(json.load(f))
        lora = train_config.model.lora.to_dict()
        model_config.lora = dict(lora, targets=tuple(lora["targets"]))
    elif adapter:
        if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
            raise FileNotFoundError(f"adapter {adapter!r} is neither a PEFT adapter folder (adapter_config.json) "
                                    "nor a training workdir (checkpoints/)")
        model_config.lora = peft_lora_config(adapter)
    init = resolve_path(agent.get("init") or "")
    model = build_model(ml_collections.ConfigDict(dict(seed=config.seed, model=model_config,
                                                       init=dict(hf_checkpoint=init))))
    if train_config is not None:
        frozen = lambda path, seed: os.path.normpath(path) if path else f"random weights (seed {seed})"
        trained_on = frozen(train_config.get("init", {}).get("hf_checkpoint", ""), train_config.seed)
        if trained_on != frozen(init, config.seed):
            print(f"WARNING: {adapter} was trained on {trained_on}, evaluated on {frozen(init, config.seed)}")
        return restore_trained(model, adapter, train_config)
    return load_peft_adapter(model, adapter) if adapter else model


def agent_name(agent: Mapping[str, Any]) -> str:
    """``name``, else the adapter's (or init's) folder name, else "random init"."""
    if agent.get("name"):
        return agent["name"]
    for key in ("adapter", "init"):
        if agent.get(key):
            path = os.path.normpath(agent[key])
            if path.endswith(os.path.join("export", "peft_adapter")):  # a training workdir's export: its name
                path = os.path.dirname(os.path.dirname(path))
            return os.path.basename(path)
    return "random init"


def decode_config(config):
    from fire_jax.infer.decode import DecodeConfig

    d = config.decode
    return DecodeConfig(max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                        bucket_min=d.bucket_min, bucket_step=d.bucket_step)


def build_agents(config, teacher_history: str):
    """(Student, Teacher) of ``config.student`` / ``config.teacher``; identical specs share one model."""
    from fire_jax.data.chat import ChatTokenizer
    from fire_jax.infer.agents import Student, Teacher

    specs = {role: (config[role].get("init") or "", config[role].get("adapter") or "")
             for role in ("student", "teacher")}
    models = {}
    for role in ("student", "teacher"):
        if specs[role] not in models:
            models[specs[role]] = agent_model(config, config[role])
    student_model, teacher_model = models[specs["student"]], models[specs["teacher"]]
    chat = ChatTokenizer.from_file(resolve_path(config.data.tokenizer), student_model.cfg.geometry,
                                   image_token=config.data.image_token, pad_token=config.data.pad_token)
    decode = decode_config(config)
    return (Student(student_model, chat, decode),
            Teacher(teacher_model, chat, decode, history=teacher_history))


# ----------------------------------------------------------------------------
# A run
# ----------------------------------------------------------------------------


def run_settings(config) -> dict:
    """What changes a run's outputs (the batch size does not); a rerun in the same workdir must match it."""
    setting = config.setting
    agent = lambda a: {k: a.get(k) or "" for k in ("init", "adapter")}
    decode = {k: v for k, v in config.decode.to_dict().items() if k != "batch_size"}
    return {"setting": setting, "seed": config.seed, "model": config.model.to_dict(),
            "tokenizer": config.data.tokenizer, "test": config.test.to_dict(), "student": agent(config.student),
            "teacher": agent(config.teacher), "decode": decode, setting: config[setting].to_dict()}


def check_settings(workdir: str, settings: dict) -> None:
    """Write ``workdir/settings.json``, or stop if it holds other settings (outputs would mix)."""
    path = os.path.join(workdir, "settings.json")
    settings = json.loads(json.dumps(settings))  # tuples -> lists, as read back
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        changed = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
        if changed:
            raise ValueError(f"{workdir} holds outputs of other settings (changed: {changed}); "
                             "use another --workdir or remove it")
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)


def _finite(value):
    """NaN/inf -> None everywhere, so results.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def evaluate(config, workdir: str, *, agents=None) -> dict:
    """Run ``config.setting`` ("fixed" or "free") and write results.json, results.md and plots.

    ``agents``: a (student, teacher) pair to use instead of building them from
    the config (anything with ``respond`` / ``feedback`` like
    :class:`fire_jax.infer.Student` / ``Teacher``).
    """
    setting = config.setting
    if setting not in SETTINGS:
        raise ValueError(f"config.setting must be one of {SETTINGS}, got {setting!r}")
    os.makedirs(workdir, exist_ok=True)
    settings = run_settings(config)
    check_settings(workdir, settings)
    bad = BadRecords()
    pairs = load_conversations(config.test, on_bad_record=config.on_bad_record, bad=bad)
    print(f"test set: {len(pairs)} conversations from {config.test.get('json') or config.test.get('tfds')}")
    print(bad.report("test set bad records"))
    if not pairs:
        raise ValueError("the test set has no usable conversation")
    protocol = config[setting]
    if agents is None:
        agents = build_agents(config, protocol.teacher_history)
    student, teacher = agents
    rng = None
    if config.decode.temperature > 0:
        import jax

        rng = jax.random.key(config.seed)
    outputs = os.path.join(workdir, f"{setting}_outputs.jsonl")
    results = {"setting": setting,
               "student": {"name": agent_name(config.student), **settings["student"]},
               "teacher": {"name": agent_name(config.teacher), **settings["teacher"]},
               "test": config.test.to_dict(), "conversations": len(pairs), "bad_records": dict(bad),
               "outputs": outputs}
    figures = {}
    if setting == "fixed":
        turns = fixed.labelled_turns(pairs, protocol.roles, student_first_turn=protocol.student_first_turn)
        records = fixed.run_fixed(turns, student, teacher, outputs, batch_size=config.decode.batch_size, rng=rng)
        results["metrics"] = fixed.fixed_results(records)
        markdown = report.fixed_report(results)
        figures["data_statistics"] = os.path.join(workdir, "data_statistics.png")
        plots.plot_data_statistics([record for record, _ in pairs], figures["data_statistics"],
                                   title=f"test set: {len(pairs)} dialogues")
    else:
        rule = free.StopRule(max_turns=protocol.max_turns, threshold=protocol.threshold)
        items = [item_of(record, image) for record, image in pairs]
        records = free.run_free(items, student, teacher, outputs, rule=rule, batch_size=config.decode.batch_size,
                                rng=rng)
        baseline = free.load_baseline(resolve_path(protocol.baseline_results)) if protocol.baseline_results else None
        results["metrics"] = free.free_results(records, rule=rule, penalty_turns=protocol.penalty_turns,
                                               baseline=baseline)
        markdown = report.free_report(results)
        figures["accuracy_by_turn"] = os.path.join(workdir, "accuracy_by_turn.png")
        curves = {f"{results['student']['name']} (all)": results["metrics"]["overall"]["accuracy_by_turn"]}
        curves.update({source: m["accuracy_by_turn"] for source, m in results["metrics"]["per_source"].items()})
        plots.plot_accuracy_by_turn(curves, figures["accuracy_by_turn"],
                                    paper=report.paper_results()["figure7_accuracy_by_turn"])
        figures["dialogue_statistics"] = os.path.join(workdir, "dialogue_statistics.png")
        plots.plot_data_statistics(records, figures["dialogue_statistics"],
                                   title=f"free dialogues of {results['student']['name']}")
    results["figures"] = figures
    results = _finite(results)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    title = f"# FIRE-Bench, {setting} dialogues\n\n"
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(title + markdown)
    print(title + markdown)
    print(f"wrote {workdir}/results.json, results.md, " + ", ".join(os.path.basename(p) for p in figures.values()))
    return results


# ----------------------------------------------------------------------------
# Statistics of a FIRE split (Fig. 5)
# ----------------------------------------------------------------------------


def read_conversations(path: str, image_root: str | None = None) -> tuple[list, BadRecords]:
    """(FIRE conversations, bad record counts) of a records file; images are checked only with an image root."""
    from fire_jax.data.records import BadRecordError, Conversation, iter_raw, load_records, parse_record

    if image_root:
        records, bad = load_records(path, image_root)
    else:
        records, bad = [], BadRecords()
        stem = os.path.splitext(os.path.basename(path))[0]
        for index, raw in iter_raw(path):
            try:
                if isinstance(raw, BadRecordError):
                    raise raw
                records.append(parse_record(raw, default_id=f"{stem}:{index}", where=f"{path}: record {index}"))
            except BadRecordError as e:
                bad.add(e)
    return [r for r in records if isinstance(r, Conversation)], bad


def split_statistics(path: str, workdir: str, image_root: str | None = None) -> dict:
    """Fig. 5 of a FIRE records file to ``workdir/data_statistics.png``; prints and returns the numbers."""
    conversations, bad = read_conversations(path, image_root)
    print(bad.report(f"{path}: bad records"))
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "data_statistics.png")
    stats = plots.plot_data_statistics(conversations, out,
                                       title=f"{os.path.basename(path)}: {len(conversations)} dialogues")
    print(json.dumps(stats))
    print(f"wrote {out}")
    return stats
