"""FIRE-Bench with fire_jax models: agents from a config, a run, its results, tables and plots (docs/fire_bench.md).

``python -m fire_jax.evaluate --config configs/eval_fixed.py|eval_free.py --workdir OUT`` calls
:func:`evaluate`, which

1. reads the test set (``config.test``, a data source: raw JSON + image root,
   or a built TFDS split), counting bad records by reason;
2. builds the student and the teacher (``config.student`` / ``config.teacher``:
   ``init`` a Hugging Face checkpoint folder or "" for random weights,
   ``adapter`` a PEFT adapter folder, a training workdir, or ""; see
   :func:`agent_spec`, built by :func:`fire_jax.dialogue.agents.from_spec`);
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
import os
from typing import Any, Mapping

from fire_jax.core.config import resolve_path
from fire_jax.data.items import item_of, load_conversations
from fire_jax.data.bad_records import BadRecords
from fire_jax.eval import fixed, free, judge, plots, report
from fire_jax.dialogue.stop import StopRule
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams
from fire_jax.core.results import check_settings, write_json
from fire_jax.core.files import write_text

SETTINGS = ("fixed", "free")

# ----------------------------------------------------------------------------
# The student and the teacher
# ----------------------------------------------------------------------------


def agent_spec(agent: Mapping[str, Any]) -> tuple[str | None, str]:
    """(spec, init) of one agent section ``dict(init=..., adapter=...)`` for
    :func:`fire_jax.dialogue.agents.from_spec`.

    ``init``: a Hugging Face LLaVA-NeXT folder, ""/None for random weights of ``config.model``, or a backend
    spec (``api:<base_url>#<model>``, ``exact:``), which is then the agent. ``adapter``: ""/None; a PEFT
    adapter folder (its r, alpha and targets set the LoRA; the base weights are ``init``); or a training
    workdir (``python -m fire_jax.train``): the model of the run's own config.json with the trainable
    parameters (LoRA, and the connector if it trained) of its latest orbax checkpoint.
    """
    from fire_jax.dialogue.agents import spec_prefix

    init, adapter = agent.get("init") or "", agent.get("adapter") or ""
    if spec_prefix(init):
        return init, ""
    return adapter or None, resolve_path(init)


def model_config(config):
    """What of an evaluation config builds its agents' models: seed, model and data (the chat template)."""
    import ml_collections

    return ml_collections.ConfigDict(dict(seed=config.seed, model=copy.deepcopy(config.model),
                                          data=copy.deepcopy(config.data), init=dict(hf_checkpoint="")))


def agent_from_section(config, role: str, *, teacher_history: str = "latest", teacher_prompt: str = "paper",
                       models: dict | None = None):
    """The ``role`` agent of ``config[role]`` (or of the section passed as ``config.student`` / ``teacher``)
    through :func:`fire_jax.dialogue.agents.from_spec`, with the config's decode settings and batch size (a
    teacher's history and prompt: :class:`fire_jax.dialogue.agents.Teacher`)."""
    from fire_jax.dialogue.agents import from_spec

    section = config[role]
    spec, init = agent_spec(section)
    agent = from_spec(spec, role, SamplingParams.from_config(config.decode, source="config.decode"),
                      engine=EngineConfig.from_config(config.decode), config=model_config(config), init=init,
                      teacher_history=teacher_history, teacher_prompt=teacher_prompt, batch_size=config.decode.get("batch_size", 0),
                      seed=config.seed, models=models)
    print(f"{agent_name(section)}: {agent.description}")
    return agent


def agent_name(agent: Mapping[str, Any]) -> str:
    """An agent section's name in tables: :func:`fire_jax.infer.loading.display_name` of its name / adapter / init."""
    from fire_jax.infer.loading import display_name

    return display_name(name=agent.get("name") or "", checkpoint=agent.get("adapter") or "", init=agent.get("init") or "")


def build_agents(config, teacher_history: str, teacher_prompt: str = "paper"):
    """(student, teacher) of ``config.student`` / ``config.teacher``; identical specs share one model."""
    models = {}
    return (agent_from_section(config, "student", models=models),
            agent_from_section(config, "teacher", teacher_history=teacher_history, teacher_prompt=teacher_prompt,
                               models=models))


# ----------------------------------------------------------------------------
# A run
# ----------------------------------------------------------------------------


#: Fixed-dialogue options read only when the metrics are computed: a rerun may change them.
METRIC_OPTIONS = ("teacher_text", "score_parser")


def run_settings(config) -> dict:
    """What changes a run's outputs (the batch size and the fixed dialogues' metric options do not); a rerun
    in the same workdir must match it."""
    from fire_jax.dialogue.agents import spec_prefix
    from fire_jax.weights.build import conventions_of

    setting = config.setting

    def agent(a) -> dict:  # its weights and the input conventions it runs with (a resumed run cannot mix them)
        init, adapter = (resolve_path(a.get(k) or "") for k in ("init", "adapter"))
        conventions = None if spec_prefix(init) else conventions_of(init, adapter, config.model.get("conventions"))
        return {"init": a.get("init") or "", "adapter": a.get("adapter") or "", "conventions": conventions}

    decode = {k: v for k, v in config.decode.to_dict().items() if k != "batch_size"}
    protocol = {k: v for k, v in config[setting].to_dict().items() if setting == "free" or k not in METRIC_OPTIONS}
    return {"setting": setting, "seed": config.seed, "model": config.model.to_dict(),
            "tokenizer": config.data.tokenizer, "test": config.test.to_dict(), "student": agent(config.student),
            "teacher": agent(config.teacher), "decode": decode, setting: protocol}


def evaluate(config, workdir: str, *, agents=None) -> dict:
    """Run ``config.setting`` ("fixed" or "free") and write results.json, results.md and plots.

    ``agents``: a (student, teacher) pair to use instead of building them from
    the config (anything with ``respond`` / ``feedback`` like
    :class:`fire_jax.dialogue.Student` / ``Teacher``).
    """
    setting = config.setting
    if setting not in SETTINGS:
        raise ValueError(f"config.setting must be one of {SETTINGS}, got {setting!r}")
    SamplingParams.from_config(config.decode, source="config.decode")  # bad settings end the run before it records them
    os.makedirs(workdir, exist_ok=True)
    settings = run_settings(config)
    check_settings(os.path.join(workdir, "settings.json"), settings, where=workdir)
    bad = BadRecords()
    pairs = load_conversations(config.test, on_bad_record=config.on_bad_record, bad=bad)
    print(f"test set: {len(pairs)} conversations from {config.test.get('json') or config.test.get('tfds')}")
    print(bad.report("test set bad records"))
    if not pairs:
        raise ValueError("the test set has no usable conversation")
    protocol = PROTOCOLS[setting](config[setting])
    if agents is None:
        agents = build_agents(config, protocol.section.teacher_history,
                              protocol.section.get("teacher_prompt", "paper"))
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
    records = protocol.run(pairs, student, teacher, outputs, batch_size=config.decode.batch_size, rng=rng)
    results["metrics"] = protocol.score(records)
    markdown = protocol.report(results)
    figures.update(protocol.plot(pairs, records, results, workdir))
    if use_exact_judge(config, [record for record, _ in pairs]):
        results["metrics"]["judged"] = protocol.judged(records)
        markdown += "\n" + report.judged_report(results)
        figures.update(protocol.plot_judged(results, workdir))
    results["figures"] = figures
    results = write_json(os.path.join(workdir, "results.json"), results)
    title = f"# FIRE-Bench, {setting} dialogues\n\n"
    write_text(os.path.join(workdir, "results.md"), title + markdown)
    print(title + markdown)
    print(f"wrote {workdir}/results.json, results.md, " + ", ".join(os.path.basename(p) for p in figures.values()))
    return results


class Protocol:
    """A FIRE-Bench setting (``config.fixed`` or ``config.free``): it runs the dialogues, scores them, writes its
    tables and plots. :attr:`rule` is the one source of the stop threshold, which the exact judge also reads:
    a teacher score >= ``rule.threshold`` says "right"."""

    setting = ""

    def __init__(self, section):
        self.section = section
        self.rule = StopRule()

    def run(self, pairs, student, teacher, outputs: str, *, batch_size: int, rng=None) -> list[dict]:
        raise NotImplementedError

    def score(self, records) -> dict:
        raise NotImplementedError

    def report(self, results: dict) -> str:
        raise NotImplementedError

    def plot(self, pairs, records, results: dict, workdir: str) -> dict[str, str]:
        raise NotImplementedError

    def judged(self, records) -> dict:
        """The exact judge's metrics (synthetic test sets: the groundtruth is the answer)."""
        return judged_metrics(self.setting, records, rule=self.rule)

    def plot_judged(self, results: dict, workdir: str) -> dict[str, str]:
        return {}


class FixedProtocol(Protocol):
    """Fixed dialogues (Table 3): each labelled turn of a test dialogue, generated from its true history
    (:mod:`fire_jax.eval.fixed`); BLEU/CIDEr of the texts, the teacher's score MAE. Nothing stops a fixed
    dialogue: the rule's default threshold only says which teacher scores count as "right" for the judge."""

    setting = "fixed"

    def run(self, pairs, student, teacher, outputs, *, batch_size, rng=None):
        turns = fixed.labelled_turns(pairs, self.section.roles, student_first_turn=self.section.student_first_turn)
        return fixed.run_fixed(turns, student, teacher, outputs, batch_size=batch_size, rng=rng)

    def score(self, records):
        return fixed.fixed_results(records, teacher_text=self.section.get("teacher_text", "feedback"),
                                   score_parser=self.section.get("score_parser", "robust"))

    def report(self, results):
        return report.fixed_report(results)

    def plot(self, pairs, records, results, workdir):
        path = os.path.join(workdir, "data_statistics.png")
        plots.plot_data_statistics([record for record, _ in pairs], path, title=f"test set: {len(pairs)} dialogues")
        return {"data_statistics": path}


class FreeProtocol(Protocol):
    """Free dialogues (Tables 4-6): the student and the teacher talk until :attr:`rule` stops them
    (:mod:`fire_jax.eval.free`); AT, ADR, ATR, RR."""

    setting = "free"

    def __init__(self, section):
        super().__init__(section)
        self.rule = StopRule.from_config(section)

    def run(self, pairs, student, teacher, outputs, *, batch_size, rng=None):
        items = [item_of(record, image) for record, image in pairs]
        return free.run_free(items, student, teacher, outputs, rule=self.rule, batch_size=batch_size, rng=rng)

    def score(self, records):
        baseline = (free.load_baseline(resolve_path(self.section.baseline_results))
                    if self.section.baseline_results else None)
        return free.free_results(records, rule=self.rule, penalty_turns=self.section.penalty_turns, baseline=baseline)

    def report(self, results):
        return report.free_report(results, threshold=self.rule.threshold)

    def plot(self, pairs, records, results, workdir):
        figures = {"accuracy_by_turn": os.path.join(workdir, "accuracy_by_turn.png")}
        metrics = results["metrics"]
        curves = {f"{results['student']['name']} (all)": metrics["overall"]["accuracy_by_turn"]}
        curves.update({source: m["accuracy_by_turn"] for source, m in metrics["per_source"].items()})
        plots.plot_accuracy_by_turn(curves, figures["accuracy_by_turn"],
                                    paper=report.paper_results()["figure7_accuracy_by_turn"])
        figures["dialogue_statistics"] = os.path.join(workdir, "dialogue_statistics.png")
        plots.plot_data_statistics(records, figures["dialogue_statistics"],
                                   title=f"free dialogues of {results['student']['name']}")
        return figures

    def plot_judged(self, results, workdir):
        judged = results["metrics"]["judged"]["overall"]
        path = os.path.join(workdir, "judged_accuracy_by_turn.png")
        plots.plot_accuracy_by_turn(
            {"exact judge: answer = groundtruth": judged["accuracy_by_turn"],
             f"teacher: score >= {self.rule.threshold:g}": judged["teacher_accuracy_by_turn"]},
            path, title=f"accuracy by turn, judged two ways ({results['student']['name']})")
        return {"judged_accuracy_by_turn": path}


PROTOCOLS = {"fixed": FixedProtocol, "free": FreeProtocol}


def use_exact_judge(config, conversations) -> bool:
    """``config.exact_judge``: True/False, or "auto" (the default): on when every test conversation comes from
    a synthetic source (``source`` starting with "synthetic"), whose groundtruth is the exact answer sentence."""
    choice = config.get("exact_judge", "auto")
    if choice == "auto":
        return bool(conversations) and all(c.source.startswith("synthetic") for c in conversations)
    if not isinstance(choice, bool):
        raise ValueError(f"config.exact_judge must be True, False or 'auto', got {choice!r}")
    return choice


def judged_metrics(setting: str, records, *, rule: StopRule) -> dict:
    """The exact judge's metrics (:mod:`fire_jax.eval.judge`) overall and per source dataset, the teacher's
    verdicts read by ``rule``; ``threshold`` records its threshold for the reports."""
    def block(group):
        if setting == "free":
            return judge.judged_free(group, rule=rule)
        return judge.judged_fixed(group, rule=rule)

    by_source = {}
    for record in records:
        by_source.setdefault(record["source"], []).append(record)
    return {"overall": block(records), "per_source": {s: block(g) for s, g in sorted(by_source.items())},
            "threshold": rule.threshold}


# ----------------------------------------------------------------------------
# Statistics of a FIRE split (Fig. 5)
# ----------------------------------------------------------------------------


def read_conversations(path: str, image_root: str | None = None) -> tuple[list, BadRecords]:
    """(FIRE conversations, bad record counts) of a records file; images are checked only with an image root."""
    from fire_jax.data.jsonl import read_objects
    from fire_jax.data.records import Conversation, load_records, parse_record

    if image_root:
        records, bad = load_records(path, image_root)
    else:
        bad = BadRecords()
        records = list(read_objects(path, lambda raw, where, default_id: parse_record(
            raw, default_id=default_id, where=where), bad=bad))
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
