"""The main job end to end (FIRE, Sec. 5): train FD and FIRE, evaluate them against the baseline.

0. (synthetic data) train a CLIP on the training images' captions (with auxiliary heads on what they state), the
   connector (and LoRA) on the captions as chats, then a base model on single-turn instruction data answered right
   (LLaVA's lineage): the baseline, and where FD and FIRE start (with a
   ``compare_train`` stage, FD starts from its merged export instead: text-only comparisons in the teacher's words);
1. train the teacher (FD) and 2. the student (FIRE) with ``fire_jax.train``;
3. fixed dialogues (Tables 2-3): the baseline as student and teacher, then FIRE student + FD teacher;
4. free dialogues (Tables 4-6, Fig. 7): the baseline student with the FD teacher, then the FIRE student with
   the FD teacher, AT normalised by the baseline's mean turns.
Every stage resumes from its workdir, so an interrupted pipeline picks up where it stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import ml_collections

from fire_jax.core.cli import Stopped
from fire_jax.core.config import check_config
from fire_jax.core.files import write_text
from fire_jax.core.results import markdown_table, write_json

#: Columns of the summary: (label, setting, role or None, metric key).
SUMMARY = (("student BLEU-4", "fixed", "student", "BLEU-4"), ("student CIDEr", "fixed", "student", "CIDEr"),
           ("teacher CIDEr", "fixed", "teacher", "CIDEr"), ("teacher MAE", "fixed", "teacher", "MAE"),
           ("AT", "free", None, "AT"), ("ADR", "free", None, "ADR"), ("ATR", "free", None, "ATR"),
           ("RR", "free", None, "RR"), ("K", "free", None, "K"))
#: Columns of the free dialogues with the exact teacher (the synthetic set's own rule as the teacher).
EXACT_COLUMNS = ("acc turn 1", "acc final", "judged RR")
#: Exact-judge columns (synthetic test sets, fire_jax/eval/judge.py): (label, setting, path into metrics["judged"]).
JUDGED = (("fixed student acc", "fixed", ("student", "accuracy")),
          ("fixed teacher agreement", "fixed", ("teacher", "agreement")),
          ("acc turn 1", "free", ("accuracy_turn1",)), ("acc final", "free", ("accuracy_final",)),
          ("judged RR", "free", ("refinement_rate",)), ("teacher agreement", "free", ("agreement",)),
          ("teacher direction", "free", ("teacher_direction",)),
          ("teacher distance score", "free", ("teacher_distance_score",)),
          ("blind direction", "free", ("blind_direction",)),
          ("blind distance score", "free", ("blind_distance_score",)),
          ("solved but wrong", "free", ("solved_but_wrong",)), ("solved", "free", ("solved",)),
          ("stopped but right", "free", ("stopped_but_right",)))


def train_stage(config, workdir: str, name: str) -> str:
    return train_and_report(config, workdir, name)["workdir"]


def train_and_report(config, workdir: str, name: str) -> dict:
    """Train one model (resuming); returns its workdir, steps and usable examples per source."""
    from fire_jax.train.loop import train

    print(f"\n== train the {name} -> {workdir}")
    summary = train(config, workdir)
    loss = summary["metrics"].get("loss")  # none when the stage had finished before this run
    print(f"{name}: step {summary['step']}/{summary['total_steps']}, "
          + (f"last loss {loss:.4f}" if loss is not None else "finished before (nothing left to train)"))
    if summary.get("preempted"):  # the next stage starts from this one's export, which a stopped stage lacks
        by = summary.get("stopped_by") or signal.SIGTERM
        raise Stopped(by, f"{name}: stopped by {signal.Signals(by).name} at step {summary['step']} of "
                          f"{summary['total_steps']} (checkpoint in {workdir}); the same command resumes")
    return {"workdir": workdir, "step": summary["step"], "source_sizes": summary.get("source_sizes", {})}


#: The main job's budget, machine-independent: its minutes times its machine's float32 matmul rate (GFLOP/s),
#: measured idle (15 minutes at 400 GFLOP/s). The last line prints the product.
BUDGET = 6000

#: The ",rl" variant's reinforcement stages, machine-independent as :data:`BUDGET` (10 minutes at 400 GFLOP/s).
RL_BUDGET = 4000
#: Columns of the reinforcement stages' summary: (label, setting, its value in that run's metrics). "free":
#: dialogues with FD (the exact judge's verdicts), "free_exact": with the exact teacher.
RL_COLUMNS = (("acc final", "free", lambda m: _get(m, ("judged", "overall", "accuracy_final"))),
              ("judged RR", "free", lambda m: _get(m, ("judged", "overall", "refinement_rate"))),
              ("mean turns", "free", lambda m: _mean_turns(m)),
              ("FD solved but wrong", "free", lambda m: _get(m, ("judged", "overall", "solved_but_wrong_share"))),
              ("exact: acc final", "free_exact", lambda m: _get(m, ("judged", "overall", "accuracy_final"))),
              ("exact: judged RR", "free_exact", lambda m: _get(m, ("judged", "overall", "refinement_rate"))),
              ("exact: mean turns", "free_exact", lambda m: _mean_turns(m)))


def _mean_turns(metrics: dict) -> float | None:
    """The dialogues' mean number of turns (no penalty for the unsolved), from the run's turn counts."""
    counts = {int(turns): n for turns, n in metrics["overall"]["turns"].items()}
    return sum(t * n for t, n in counts.items()) / sum(counts.values()) if counts else None


#: The teacher spec of the exact teacher (fire_jax.dialogue.agents.ExactTeacher): no model, the generator's rule.
EXACT_TEACHER = dict(name="exact teacher", init="exact:synthetic", adapter="")


def eval_stage(base, workdir: str, *, student: dict, teacher: dict, baseline_results: str = "") -> dict:
    """One FIRE-Bench evaluation; ``teacher=EXACT_TEACHER`` pairs the student with the synthetic set's rule."""
    from fire_jax.eval.fire_bench import evaluate

    config = ml_collections.ConfigDict(base.to_dict())
    config.student, config.teacher = dict(student), dict(teacher)
    if baseline_results:
        config.free.baseline_results = baseline_results
    print(f"\n== {config.setting} dialogues: student {student['name']}, teacher {teacher['name']} -> {workdir}")
    return evaluate(config, workdir)  # an "exact:" teacher is the judge's rule (fire_jax.dialogue.agents.from_spec)


def rl_stages(config, workdir: str, fire: dict, fd: dict, seconds: dict) -> dict:
    """The ",rl" variant: the FIRE student's reinforcement stage (fire_jax.rl) once per reward teacher
    (``config.rl_rewards``: "exact", the synthetic set's rule; "fd", the trained teacher), each student then in free
    dialogues with FD and with the exact teacher, judged as FIRE's are. Returns their results by (run, setting)."""
    from fire_jax.rl.stage import train_rl

    results, out = {}, os.path.join(workdir, "eval")
    for reward in config.rl_reward_teachers:
        teacher, name = (EXACT_TEACHER if reward == "exact" else fd), f"rl_{reward}"
        stage = ml_collections.ConfigDict(config.rl_train.to_dict())
        stage.student, stage.teacher = dict(fire), dict(teacher)
        rl_dir = os.path.join(workdir, name)
        print(f"\n== reinforcement stage, reward: {teacher['name']}'s scores -> {rl_dir}")
        summary = _timed(seconds, name, train_rl, stage, rl_dir)
        if summary["preempted"]:
            by = summary["stopped_by"] or signal.SIGTERM
            raise Stopped(by, f"{name}: stopped by {signal.Signals(by).name} at step {summary['step']} of "
                              f"{summary['total_steps']} (checkpoint in {rl_dir}); the same command resumes")
        student = dict(name=f"FIRE + RL ({teacher['name']})", adapter="",
                       init=os.path.abspath(os.path.join(rl_dir, "export", "hf_merged")))
        for setting, judge_teacher in (("free", fd), ("free_exact", EXACT_TEACHER)):
            results[(name, setting)] = _timed(
                seconds, f"{name}_{setting}", eval_stage, config.eval_free, os.path.join(out, f"{name}_{setting}"),
                student=student, teacher=judge_teacher,
                baseline_results=os.path.join(out, f"baseline_{setting}", "results.json"))
    return results


def rl_summary(results: dict, runs) -> dict:
    """:data:`RL_COLUMNS` for FIRE and each reinforcement stage's student (``runs``: "rl_exact", ...)."""
    return {run: {label: value(results[(run, setting)]["metrics"]) for label, setting, value in RL_COLUMNS}
            for run in ("fire", *runs)}


def rl_cost(seconds: dict, rate: float) -> str:
    """The reinforcement stages' line: their minutes (training alone) times the matmul rate, against
    :data:`RL_BUDGET`."""
    stages = {k: v for k, v in seconds.items() if k.startswith("rl_") and not k.endswith(("_free", "_free_exact"))}
    minutes = sum(stages.values()) / 60
    return (f"reinforcement stages ({', '.join(f'{k} {v / 60:.1f}' for k, v in stages.items())} min): "
            f"{minutes:.1f} min at {rate:.0f} GFLOP/s: {minutes * rate:,.0f} GFLOP/s-min (their budget: {RL_BUDGET:,})")


def fetch_stage(config) -> float:
    """Fetch the pretrained LLM the stages start from (once, into the cache); returns the seconds it took."""
    first = config.base_train or config.teacher_train
    spec = first.get("init", {}).get("gguf") if first.get("init") else None
    if not spec:
        return 0.0
    from fire_jax.convert.fetch import prepare

    start = time.perf_counter()
    print(f"\n== pretrained LLM {spec}: {prepare(spec)}")
    return time.perf_counter() - start


@contextlib.contextmanager
def compile_cache(workdir: str):
    """JAX's persistent compilation cache under ``<workdir>/xla_cache`` for the job's length, unless one is set
    already (``JAX_COMPILATION_CACHE_DIR``). The evaluations build a new engine each, on models of the same
    shapes, and compiled the same decode programs again: a free-dialogue evaluation spent a third of its time
    compiling (docs/performance.md). The cache lives in the workdir, so a fresh run starts with none."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir:
        yield jax.config.jax_compilation_cache_dir
        return
    path = os.path.join(os.path.abspath(workdir), "xla_cache")
    compilation_cache.set_cache_dir(path)
    compilation_cache.reset_cache()  # a process that compiled before has checked the (then unset) cache once
    try:
        yield path
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


def run(config, workdir: str) -> dict[str, Any]:
    """Train both agents, run all four evaluations, print and write ``summary.json`` / ``summary.md``."""
    check_config(config)  # every stage's fields, before the first stage runs
    with compile_cache(workdir):
        return _run(config, workdir)


def _run(config, workdir: str) -> dict[str, Any]:
    fetch_seconds = fetch_stage(config)
    from fire_jax.core.machine import matmul_rate

    rate = matmul_rate() / 1e9  # printed beside the minutes: a time alone does not compare across machines
    print(f"\n== this machine: float32 matmul {rate:.0f} GFLOP/s (2048^3 under jax.jit)")
    start = time.perf_counter()
    seconds: dict[str, float] = {}  # each stage's wall time in this invocation (a resumed stage: its remainder)
    baseline, fd = base_and_teacher(config, workdir, seconds)
    student_dir = _timed(seconds, "student", train_stage, config.student_train, os.path.join(workdir, "student"),
                         "student (FIRE)")
    fire = dict(name="FIRE (ours)", init=baseline["init"], adapter=student_dir)
    untrained_teacher = dict(baseline, name=f"{baseline['name']} teacher")
    out = os.path.join(workdir, "eval")
    runs = [("baseline", "fixed", baseline, untrained_teacher), ("fire", "fixed", fire, fd),
            ("baseline", "free", baseline, fd), ("fire", "free", fire, fd)]
    if config.get("exact_teacher_runs"):  # synthetic test set: both students with a teacher that never errs
        runs += [("baseline", "free_exact", baseline, EXACT_TEACHER), ("fire", "free_exact", fire, EXACT_TEACHER)]
    results = {}
    for agent, setting, student, teacher in runs:
        name = f"{agent}_{setting}"
        # FIRE's free dialogues report AT / ADR against the baseline's in the same setting.
        baseline_results = (os.path.join(out, f"baseline_{setting}", "results.json")
                            if agent == "fire" and setting != "fixed" else "")
        results[(agent, setting)] = _timed(
            seconds, name, eval_stage, config.eval_fixed if setting == "fixed" else config.eval_free,
            os.path.join(out, name), student=student, teacher=teacher, baseline_results=baseline_results)
    rl_runs = [f"rl_{reward}" for reward in config.rl_reward_teachers] if config.get("rl_train") else []
    if rl_runs:  # the ",rl" variant: after FIRE, its reinforcement stages and their evaluations
        results.update(rl_stages(config, workdir, fire, fd, seconds))
    from fire_jax.dialogue.stop import StopRule

    summary = summarize(results)
    if rl_runs:
        summary["rl"] = rl_summary(results, rl_runs)
    threshold = StopRule.from_config(config.eval_free.free).threshold  # what the free dialogues stopped at
    figures = [p for r in results.values() for p in r.get("figures", {}).values()]
    if summary.get("judged"):
        figures.append(os.path.join(workdir, "accuracy_by_turn.png"))
        plot_judged_curves(results, figures[-1], threshold=threshold)
    summary["figures"] = sorted(os.path.relpath(p, workdir) for p in figures)
    fixed = config.eval_fixed.get("fixed", {})
    table = summary_table(summary, threshold=threshold) + (f"\nTeacher BLEU/CIDEr compare fixed.teacher_text="
                                      f"{fixed.get('teacher_text', 'feedback')!r} ('feedback': the text after "
                                      f"\"Feedback:\", as the release's analyze_feedback.py; 'whole': the reply).\n")
    # summary.json holds results only (no timings or absolute paths), so reruns can be compared byte for byte.
    write_json(os.path.join(workdir, "summary.json"), summary)
    write_text(os.path.join(workdir, "summary.md"), table)
    minutes = (time.perf_counter() - start) / 60
    write_json(os.path.join(workdir, "timing.json"),
               {"minutes": minutes, "fetch_seconds": fetch_seconds, "matmul_gflops": round(rate),
                "gflops_minutes": round(minutes * rate), "budget_gflops_minutes": BUDGET,
                "stage_seconds": {k: round(v, 1) for k, v in seconds.items()}})
    print("\n== summary (overall, synthetic test set)\n" + table)
    print("plots:\n  " + "\n  ".join(os.path.join(workdir, p) for p in summary["figures"]))
    print("stage minutes: " + ", ".join(f"{name} {value / 60:.1f}" for name, value in seconds.items()))
    if rl_runs:
        print(rl_cost(seconds, rate))
    print(f"done in {minutes:.1f} min on a machine whose float32 matmul runs at {rate:.0f} GFLOP/s (and "
          f"{fetch_seconds:.0f} s fetching the pretrained LLM before it): {minutes * rate:,.0f} GFLOP/s-min "
          f"(the SmolLM2 job's budget: {BUDGET:,}); {workdir}/summary.json, summary.md, eval/*/results.md")
    return summary


def _get(metrics: dict, path: tuple):
    for key in path:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def summarize(results: dict) -> dict:
    """Paper metrics per run (``rows``) and, on synthetic test sets, the exact judge's (``judged``)."""
    rows, judged = {}, {}
    for run_name in ("baseline", "fire"):
        row = {}
        for label, setting, role, key in SUMMARY:
            metrics = results[(run_name, setting)]["metrics"]
            overall = metrics[role]["overall"] if role else metrics["overall"]
            row[label] = overall.get(key)
        rows[run_name] = row
        if all("judged" in results[(run_name, s)]["metrics"] for s in ("fixed", "free")):
            judged[run_name] = {label: _get(results[(run_name, setting)]["metrics"]["judged"]["overall"], path)
                                for label, setting, path in JUDGED}
            free_judged = results[(run_name, "free")]["metrics"]["judged"]["overall"]
            judged[run_name]["acc by turn"] = free_judged["accuracy_by_turn"]
            judged[run_name]["agreement by turn"] = free_judged["agreement_by_turn"]
    summary = {"rows": rows, "judged": judged} if judged else {"rows": rows}
    exact = {}
    for run_name in ("baseline", "fire"):
        if (run_name, "free_exact") in results:
            metrics = results[(run_name, "free_exact")]["metrics"]
            judged_exact = metrics["judged"]["overall"]
            exact[run_name] = {**{key: metrics["overall"].get(key) for key in ("AT", "ADR", "ATR", "RR", "K")},
                               **{label: _get(judged_exact, path) for label, _, path in JUDGED
                                  if label in EXACT_COLUMNS}}
    if exact:
        summary["exact_teacher"] = exact
    return summary


def _cell(value) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(rows: dict, labels) -> str:
    return markdown_table(("run", *labels), [(name, *(row[k] for k in labels)) for name, row in rows.items()],
                          align="l" + "r" * len(labels), cell=_cell)


def summary_table(summary: dict, *, threshold: float) -> str:
    """summary.md: the paper metrics, the exact judge's columns (the teacher's verdict: a score >= the free
    dialogues' ``threshold``) and the exact teacher's runs."""
    lines = [_table(summary["rows"], [label for label, *_ in SUMMARY])]
    if summary.get("judged"):
        lines += ["", "Exact judge (answer = groundtruth) in the same runs: fixed-dialogue student accuracy and "
                  "teacher agreement; free dialogues with the FD teacher: accuracy at turn 1 and at the end, judged "
                  "refinement rate (right at the end of those wrong at turn 1), the teacher's agreement with the judge "
                  f"over all turns (score >= {threshold:g} iff right), on wrong answers the share of its feedback "
                  "that points the way the set's rule does and of its scores that are the rule's distance score, "
                  "the same two shares for a blind teacher on the same turns (the hint and score most often given "
                  "to that answer in the FD teacher's training turns: neither groundtruth nor image, the floor a "
                  "teacher that compares must clear), solved-but-wrong of solved, "
                  "stopped-but-right.", ""]
        lines.append(_table(summary["judged"], [label for label, *_ in JUDGED]))
    if summary.get("exact_teacher"):
        lines += ["", "Free dialogues with the exact teacher (the synthetic set's own feedback rule, never wrong): "
                  "what each student does with informative feedback, apart from the FD teacher's mistakes.", ""]
        lines.append(_table(summary["exact_teacher"], ["AT", "ADR", "ATR", "RR", "K", *EXACT_COLUMNS]))
    if summary.get("rl"):
        lines += ["", "After FIRE, the reinforcement stages (rl_exact: the exact teacher's scores as the reward; rl_fd: "
                  "FD's), judged in free dialogues with FD (the first four columns; FD solved but wrong: the share of "
                  "the dialogues FD stopped as solved whose last answer is wrong, the sign of a student that games its "
                  "teacher) and with the exact teacher (exact: ...); mean turns: turns a dialogue, no penalty.", ""]
        lines.append(_table(summary["rl"], [label for label, *_ in RL_COLUMNS]))
    return "\n".join(lines) + "\n"


def plot_judged_curves(results: dict, out_path: str, *, threshold: float) -> None:
    """Fig. 7 for the main job: judged accuracy beside the teacher's (score >= ``threshold``, the free dialogues'
    stop rule's) for the baseline and FIRE."""
    from fire_jax.eval.plots import plot_accuracy_by_turn

    curves = {}
    for run_name in ("baseline", "fire"):
        judged = results[(run_name, "free")]["metrics"]["judged"]["overall"]
        curves[f"{run_name}: exact judge"] = judged["accuracy_by_turn"]
        curves[f"{run_name}: teacher score >= {threshold:g}"] = judged["teacher_accuracy_by_turn"]
    for run_name in ("baseline", "fire"):
        if (run_name, "free_exact") in results:
            judged = results[(run_name, "free_exact")]["metrics"]["judged"]["overall"]
            curves[f"{run_name} + exact teacher: exact judge"] = judged["accuracy_by_turn"]
    plot_accuracy_by_turn(curves, out_path, title="free dialogues: judged vs teacher accuracy")


# ---------------------------------------------------------------------------- paper experiments


def _timed(seconds: dict | None, name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its wall time added to ``seconds[name]``."""
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def base_and_teacher(config, workdir: str, seconds: dict | None = None) -> tuple[dict, dict]:
    """The baseline agent spec (training the base model when the config has one) and the trained FD teacher's
    (its comparison stage first when the config has one: the teacher's adapter then sits on that stage's merged
    export); ``seconds`` gets each stage's wall time."""
    baseline = dict(config.baseline)
    if config.get("clip_train"):  # the base model's vision tower starts from a CLIP trained on captions
        clip_dir = _timed(seconds, "clip", train_stage, config.clip_train, os.path.join(workdir, "clip"),
                          "CLIP (image-caption pairs)")
        tower = os.path.abspath(os.path.join(clip_dir, "export", "clip"))
        if config.get("align_train"):  # after LLaVA's first stage: the connector (and LoRA) on captions, then the base
            config.align_train.init.vision_tower = tower
            data = "caption chats" + (", fresh drawings answered" if "generated" in config.align_train.data.sources
                                      else "")
            align_dir = _timed(seconds, "align", train_stage, config.align_train, os.path.join(workdir, "align"),
                               f"connector alignment ({data})")
            config.base_train.init.hf_checkpoint = os.path.abspath(os.path.join(align_dir, "export", "hf_merged"))
        else:
            config.base_train.init.vision_tower = tower
    if config.get("base_train"):
        base_dir = _timed(seconds, "base", train_stage, config.base_train, os.path.join(workdir, "base"),
                          "base model (instruction data)")
        baseline["init"] = os.path.abspath(os.path.join(base_dir, "export", "hf_merged"))
        for stage in (config.get("compare_train"), config.teacher_train, config.student_train):
            if stage:
                stage.init.hf_checkpoint = baseline["init"]
    init = baseline["init"]
    if config.get("compare_train"):  # the order of two values side by side, before the teacher's long prompt
        compare_dir = _timed(seconds, "compare", train_stage, config.compare_train, os.path.join(workdir, "compare"),
                             "comparison stage (the teacher's start)")
        init = config.teacher_train.init.hf_checkpoint = os.path.abspath(os.path.join(compare_dir, "export",
                                                                                      "hf_merged"))
    teacher_dir = _timed(seconds, "teacher", train_stage, config.teacher_train, os.path.join(workdir, "teacher"),
                         "teacher (FD)")
    return baseline, dict(name="FD (ours)", init=init, adapter=teacher_dir)
