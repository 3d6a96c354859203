"""The main job end to end in a reduced form, run from the wheel in an empty environment, and the Fig. 6 ablation
launcher at tiny scale."""

import json
import os
import signal
import subprocess
import sys

import pytest

from fire_jax.core.config import load_config
from fire_jax.eval import judge
from fire_jax.dialogue.stop import FREE_DIALOGUE
from fire_jax.stages.main_job import JUDGED, SUMMARY
from wheel_env import ROOT, build, installed

REDUCED = os.path.join(ROOT, "tests", "reduced_main_job.py")


def reduced_config(steps: int = 12):
    """configs/main_job.py:tiny,compare,see at test scale (tests/reduced_main_job.py)."""
    return load_config(f"{REDUCED}:{steps}")


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory):
    """(python, env): the wheel, built from the source tree, installed alone into an empty virtual environment
    (tests/wheel_env.py), and the environment its jobs run in."""
    wheel, _ = build(tmp_path_factory.mktemp("wheel"), sdist=False)
    return installed(wheel, tmp_path_factory.mktemp("env"))


@pytest.fixture(scope="module")
def pipeline_run(wheel_python, tmp_path_factory):
    """The reduced main job as a user runs it: ``python -m fire_jax.run`` from the wheel, installed alone into an
    empty virtual environment, in a folder that holds no source (a module importing an undeclared package, an
    asset or a config left out of the wheel, a path into the source tree, fails here). Returns (its workdir, its
    summary.json)."""
    python, env = wheel_python
    where = tmp_path_factory.mktemp("pipeline")
    workdir = str(where / "run")
    job = subprocess.run([python, "-m", "fire_jax.run", "--config", REDUCED, "--workdir", workdir], cwd=where,
                         env=env, capture_output=True, text=True, timeout=1200)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    last = job.stdout.strip().splitlines()[-1]
    assert last.startswith("done in ") and "GFLOP/s" in last, last
    return workdir, json.load(open(os.path.join(workdir, "summary.json")))


def test_pipeline_writes_every_table_and_plot(pipeline_run):
    workdir, summary = pipeline_run
    assert set(summary["rows"]) == {"baseline", "fire"}
    for name in ("baseline_fixed", "fire_fixed", "baseline_free", "fire_free"):
        results = json.load(open(os.path.join(workdir, "eval", name, "results.json")))
        assert results["conversations"] == 6
        assert "(paper)" in open(os.path.join(workdir, "eval", name, "results.md")).read()
    figures = [os.path.join(workdir, p) for p in summary["figures"]]
    assert len(figures) == 15 and all(os.path.getsize(p) > 1000 for p in figures)
    for stage in ("clip", "align", "base", "compare", "teacher", "student"):
        assert os.listdir(os.path.join(workdir, stage, "checkpoints")) == ["12"]
    for stage in ("align", "base", "compare"):
        assert os.path.exists(os.path.join(workdir, stage, "export", "hf_merged", "config.json"))
    # FIRE starts from the base model; the comparison stage too, on the shipped comparisons alone; FD from its export
    init = lambda stage: json.load(open(os.path.join(workdir, stage, "config.json")))["init"]["hf_checkpoint"]
    base, compare = (os.path.abspath(os.path.join(workdir, s, "export", "hf_merged")) for s in ("base", "compare"))
    assert init("student") == init("compare") == base and init("teacher") == compare
    compared = json.load(open(os.path.join(workdir, "compare", "config.json")))["data"]["sources"]
    assert list(compared) == ["comparisons"] and compared["comparisons"]["json"].endswith("comparisons.json")
    fd = json.load(open(os.path.join(workdir, "eval", "fire_free", "results.json")))["teacher"]
    assert fd["init"] == compare and fd["adapter"] == os.path.join(workdir, "teacher")
    # the alignment stage's vision tower started from the CLIP stage's, and the base model from its export
    clip = os.path.join(workdir, "clip", "export", "clip")
    assert json.load(open(os.path.join(workdir, "align", "config.json")))["init"]["vision_tower"] == os.path.abspath(clip)
    assert init("base") == os.path.abspath(os.path.join(workdir, "align", "export", "hf_merged"))
    aligned = json.load(open(os.path.join(workdir, "align", "config.json")))["data"]["sources"]
    assert list(aligned) == ["captions", "generated"] and aligned["captions"]["json"].endswith("caption_chats.json")
    assert aligned["generated"] == dict(generate=160, seed=1, split="align_generated")
    clip_losses = [json.loads(line)["loss"] for line in open(os.path.join(workdir, "clip", "metrics.jsonl"))]
    assert len(clip_losses) == 12 and clip_losses[-1] < clip_losses[0]
    timing = json.load(open(os.path.join(workdir, "timing.json")))
    # the budget's measure: minutes x the matmul rate (rounded to a GFLOP/s in the file)
    assert abs(timing["gflops_minutes"] - timing["minutes"] * timing["matmul_gflops"]) <= timing["minutes"] / 2 + 1
    assert timing["budget_gflops_minutes"] == 6000
    assert list(timing["stage_seconds"]) == ["clip", "align", "base", "compare", "teacher", "student", "baseline_fixed", "fire_fixed",
                                             "baseline_free", "fire_free", "baseline_free_exact", "fire_free_exact"]
    assert 0 < sum(timing["stage_seconds"].values()) <= 60 * timing["minutes"] + 1


def test_summary_equals_results_and_tables(pipeline_run):
    """Every summary figure is the one in its run's results.json, and summary.md / results.md print it."""
    workdir, summary = pipeline_run
    table = open(os.path.join(workdir, "summary.md")).read()
    for run_name in ("baseline", "fire"):
        row = summary["rows"][run_name]
        for label, setting, role, key in SUMMARY:
            results = json.load(open(os.path.join(workdir, "eval", f"{run_name}_{setting}", "results.json")))
            overall = results["metrics"][role]["overall"] if role else results["metrics"]["overall"]
            assert row[label] == overall[key], (run_name, label)
        line = next(line for line in table.splitlines() if line.startswith(f"| {run_name} |"))
        assert f"| {row['student BLEU-4']:.3f} |" in line and f"| {row['teacher MAE']:.3f} |" in line
        judged = summary["judged"][run_name]
        for label, setting, path in JUDGED:
            results = json.load(open(os.path.join(workdir, "eval", f"{run_name}_{setting}", "results.json")))
            value = results["metrics"]["judged"]["overall"]
            for key in path:
                value = value[key]
            assert judged[label] == value, (run_name, label)
        free = json.load(open(os.path.join(workdir, "eval", f"{run_name}_free", "results.json")))
        markdown = open(os.path.join(workdir, "eval", f"{run_name}_free", "results.md")).read()
        overall = free["metrics"]["judged"]["overall"]
        agreement = "–" if overall["agreement"] is None else f"{100 * overall['agreement']:.1f}%"
        assert "| overall | " in markdown and f"| {agreement} |" in markdown
    # the non-trivial part: the trained student writes the answer format the base model learned from r_1
    assert summary["rows"]["fire"]["student BLEU-4"] > 0


def test_judged_fields_present_and_in_range(pipeline_run):
    workdir, summary = pipeline_run
    for run_name in ("baseline", "fire"):
        free = json.load(open(os.path.join(workdir, "eval", f"{run_name}_free", "results.json")))
        judged = free["metrics"]["judged"]["overall"]
        records = [json.loads(line) for line in open(os.path.join(workdir, "eval", f"{run_name}_free",
                                                                   "free_outputs.jsonl"))]
        assert judged["items"] == len(records) == 6
        turns = sum(len(r["turns"]) for r in records)
        assert judged["turns_judged"] == turns == sum(judged["confusion"].values())
        for key in ("accuracy_turn1", "accuracy_final", "agreement"):
            assert 0 <= judged[key] <= 1
        assert all(0 <= a <= 1 for a in judged["accuracy_by_turn"]) and len(judged["accuracy_by_turn"]) == 5
        assert 0 <= judged["refined"] <= judged["wrong_first"] <= 6
        assert judged["solved_but_wrong"] <= judged["solved"] == sum(r["stop"] == "solved" for r in records)
        # recomputed from the outputs by the judge itself
        assert judged == json.loads(json.dumps(judge.judged_free(records, rule=FREE_DIALOGUE)))
        fixed = json.load(open(os.path.join(workdir, "eval", f"{run_name}_fixed", "results.json")))
        assert 0 <= fixed["metrics"]["judged"]["overall"]["teacher"]["agreement"] <= 1
        assert 0 <= fixed["metrics"]["judged"]["overall"]["student"]["accuracy"] <= 1
        for label in ("acc turn 1", "acc final", "teacher agreement", "judged RR", "teacher direction",
                      "teacher distance score"):
            assert summary["judged"][run_name][label] is None or 0 <= summary["judged"][run_name][label] <= 1


def test_exact_teacher_runs_agree_with_the_judge(pipeline_run):
    """Free dialogues with the exact teacher: its verdicts are the judge's, on every turn of both students."""
    workdir, summary = pipeline_run
    for run_name in ("baseline", "fire"):
        results = json.load(open(os.path.join(workdir, "eval", f"{run_name}_free_exact", "results.json")))
        judged = results["metrics"]["judged"]["overall"]
        assert judged["agreement"] == 1.0 and judged["solved_but_wrong"] == 0 and judged["stopped_but_right"] == 0
        # it is the rule the direction and distance are checked against
        expected = 1.0 if judged["wrong_turns_on_scale"] else None
        assert judged["teacher_direction"] == judged["teacher_distance_score"] == expected
        assert results["teacher"]["init"] == "exact:synthetic"
        assert summary["exact_teacher"][run_name]["acc final"] == judged["accuracy_final"]
        assert summary["exact_teacher"][run_name]["RR"] == results["metrics"]["overall"]["RR"]


#: The determinism test's second run, in the pipeline's own environment (the wheel's interpreter, one host device):
#: the suite's process has 8 host devices, and XLA:CPU then sums some reductions in another order (the last bit of
#: a loss at step 3).
AGAIN = """
import json, os, sys
from fire_jax.core.config import load_config
from fire_jax.stages.main_job import eval_stage
from fire_jax.train.loop import train

reduced, workdir, out = sys.argv[1:]
config = load_config(reduced)
compare, base = (os.path.join(workdir, stage, "export", "hf_merged") for stage in ("compare", "base"))
config.teacher_train.init.hf_checkpoint = compare
# The first 4 of the stage's 12 steps, under the same 12-step schedule (as a stopped run would log them).
train(config.teacher_train, os.path.join(out, "teacher"), max_steps=4)
eval_stage(config.eval_free, os.path.join(out, "fire_free"),
           student=dict(name="FIRE (ours)", init=base, adapter=os.path.join(workdir, "student")),
           teacher=dict(name="FD (ours)", init=compare, adapter=os.path.join(workdir, "teacher")),
           baseline_results=os.path.join(workdir, "eval", "baseline_free", "results.json"))
"""


def test_same_command_same_results(pipeline_run, wheel_python, tmp_path):
    """Determinism: a stage trained again from scratch logs the same losses (its first 4 steps, under the same
    12-step schedule); an evaluation run again writes the same metrics (the whole summary.json is then identical,
    which the README's two-run check shows)."""
    workdir, _ = pipeline_run
    python, env = wheel_python
    again = subprocess.run([python, "-c", AGAIN, REDUCED, workdir, str(tmp_path)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    losses = lambda d: [json.loads(line).get("loss") for line in open(os.path.join(d, "metrics.jsonl"))]
    retrained = losses(str(tmp_path / "teacher"))
    assert len(retrained) == 4 and retrained == losses(os.path.join(workdir, "teacher"))[:4]
    first, second = (json.load(open(os.path.join(d, "fire_free", "results.json")))
                     for d in (os.path.join(workdir, "eval"), str(tmp_path)))
    assert second["metrics"] == first["metrics"]


def data_size_ablation(*args):
    """experiments/data_size_ablation.py's function (the paper's Fig. 6 is a user's command, kept beside it)."""
    import importlib.util

    experiments = os.path.join(ROOT, "experiments")
    sys.path.insert(0, experiments)  # it imports its launcher, _launch.py, as a sibling
    try:
        spec = importlib.util.spec_from_file_location("data_size_ablation",
                                                      os.path.join(experiments, "data_size_ablation.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(experiments)
    return module.data_size_ablation(*args)


def test_ablation_trains_two_sizes_and_writes_fig6(pipeline_run):
    workdir, _ = pipeline_run  # base model, teacher and baseline evaluation are reused (resumed)
    config = reduced_config()
    config.student_train.train.total_steps = 4  # the launcher's wiring is the point here, not the students
    points = data_size_ablation(config, workdir, [40, 80])
    assert [p["size"] for p in points] == [40, 80]
    # the sizes are the trained ones: the student's pipeline held exactly that many examples of the named source
    assert [(p["source"], p["examples"], p["steps"]) for p in points] == [("synthetic", 40, 4), ("synthetic", 80, 4)]
    assert json.load(open(os.path.join(workdir, "fig6.json"))) == points
    assert os.path.getsize(os.path.join(workdir, "fig6.png")) > 1000
    for point in points:
        size = point["size"]
        config = json.load(open(os.path.join(workdir, f"student_{size}", "config.json")))
        assert config["data"]["sources"]["synthetic"]["max_examples"] == size
        results = json.load(open(os.path.join(workdir, "eval", f"student_{size}_free", "results.json")))
        assert {k: point[k] for k in ("AT", "ADR", "ATR", "RR", "K")} == \
            {k: results["metrics"]["overall"][k] for k in ("AT", "ADR", "ATR", "RR", "K")}


def test_ablation_source_must_be_the_students(pipeline_run):
    workdir, _ = pipeline_run
    config = reduced_config()
    config.ablation_source = "fire_1m"
    with pytest.raises(ValueError, match="ablation_source 'fire_1m' is not a source"):
        data_size_ablation(config, workdir, [40])


def test_accuracy_by_turn_launcher(pipeline_run, tmp_path):
    workdir, _ = pipeline_run
    out = str(tmp_path / "fig7.png")
    runs = [f"{name}={os.path.join(workdir, 'eval', f'{name}_free', 'results.json')}" for name in ("baseline", "fire")]
    subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "accuracy_by_turn.py"), "--out", out, *runs],
                   check=True, cwd=ROOT)
    assert os.path.getsize(out) > 1000


def test_8b_ablation_subsamples_fire_1m():
    """At 8B the Fig. 6 ablation names FIRE-1M, a source of the student's data, not whatever sorts last."""
    config = load_config(os.path.join(ROOT, "configs", "main_job.py:8b"))
    sources = config.student_train.data.sources
    assert config.ablation_source == "fire_1m" and "fire_1m" in sources
    assert sorted(sources)[-1] != "fire_1m"  # the old rule (last in sort order) would have picked another source
    assert sources["fire_1m"].split == "fire_1m"


def test_the_smollm2_base_stage_trains_the_connector_and_image_newline():
    """configs/main_job.py's base stage trains the connector and image_newline beside LoRA, the CLIP stage's tower
    frozen (LLaVA-1.5's instruction stage): its ``train.trainable`` regexes select exactly those weights of a LLaVA
    with the SmolLM2 model's parameter names (configs/tiny.py's shapes), no tower weight and no frozen LLM one.
    A regex that selects nothing (the paths are '/'-joined, so ``vision_tower\\..*`` is one) is refused."""
    from flax import nnx

    from fire_jax.core.config import InputError
    from fire_jax.models import LoRAParam
    from fire_jax.weights.build import build_model, check_trainable, param_path, trainable_filter

    train = load_config(os.path.join(ROOT, "configs", "main_job.py")).base_train.train
    model = build_model(load_config(os.path.join(ROOT, "configs", "tiny.py")))
    check_trainable(model, train)
    weights = nnx.state(model, nnx.Any(nnx.Param, LoRAParam))
    every = {param_path(path): var for path, var in nnx.to_flat_state(weights)}
    trained = {param_path(path) for path, _ in nnx.to_flat_state(nnx.state(model, trainable_filter(train)))}
    for part in ("multi_modal_projector/", "image_newline"):
        wanted = {path for path in every if path.startswith(part)}
        assert wanted and wanted <= trained, part
    assert not any(path.startswith("vision_tower/") for path in trained)  # the CLIP stage's tower stays frozen
    llm = {path for path in trained if path.startswith("language_model/")}
    assert llm and all(isinstance(every[path], LoRAParam) for path in llm)
    assert len(trained) < len(every)

    with pytest.raises(InputError, match=r"'vision_tower\\\\\.\.\*' fully matches none .* e\.g\. 'vision_tower/"):
        check_trainable(model, {"trainable": (r"vision_tower/.*", r"vision_tower\..*")})


def test_a_stage_stopped_by_sigterm_ends_the_job_with_how_to_resume(monkeypatch, tmp_path, capsys):
    """A stage stopped by SIGTERM (the train loop checkpointed and returned early) ends the main job there, with
    one line saying how to resume, instead of starting the next stage without this one's export."""
    from fire_jax.stages import main_job
    from fire_jax.train import loop

    monkeypatch.setattr(loop, "train", lambda config, workdir: {"step": 16, "total_steps": 20, "preempted": True,
                                                                 "metrics": {"loss": 0.1}})
    from fire_jax.core.cli import Stopped

    with pytest.raises(Stopped, match="stopped by SIGTERM at step 16 of 20 .* the same command resumes") as e:
        main_job.train_stage(reduced_config().base_train, str(tmp_path / "base"), "base model")
    assert e.value.number == signal.SIGTERM  # the command exits 143
    monkeypatch.setattr(loop, "train", lambda config, workdir: {"step": 20, "total_steps": 20, "preempted": False,
                                                                 "metrics": {"loss": 0.1}})
    assert main_job.train_stage(reduced_config().base_train, str(tmp_path / "base"), "base model") == str(
        tmp_path / "base")


def test_compile_cache_is_the_workdirs_for_the_job_and_a_cache_set_before_is_kept(tmp_path):
    """The main job keeps its compiled programs under <workdir>/xla_cache while it runs (its evaluations build an
    engine each on the same shapes) and unsets it after; a cache set already (the suite's, conftest) is kept."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    from fire_jax.stages.main_job import compile_cache

    own, min_time = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    if own:
        with compile_cache(str(tmp_path / "kept")) as path:
            assert path == own and jax.config.jax_compilation_cache_dir == own
        assert jax.config.jax_compilation_cache_dir == own and not os.path.exists(tmp_path / "kept")
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    try:
        with compile_cache(str(tmp_path / "job")) as path:
            assert path == str(tmp_path / "job" / "xla_cache")
            assert jax.jit(lambda x: x * 3.25 + 1.75)(jnp.arange(7.0)).tolist() == [1.75 + 3.25 * i for i in range(7)]
            assert os.listdir(path)  # the program was written there
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", own)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        compilation_cache.reset_cache()


def test_the_compare_variant_adds_fds_comparison_stage_and_the_default_has_none():
    """configs/main_job.py:smollm2,compare: FD's comparison stage (150 steps of 8 on the shipped comparisons, its
    export merged) and a teacher stage on the quarter-right turns at a constant lr; the default job has neither."""
    from fire_jax.core.config import InputError

    load = lambda arg: load_config(os.path.join(ROOT, "configs", f"main_job.py:{arg}"))
    default, compare = load("smollm2"), load("smollm2,compare")
    assert default.compare_train is None and default.teacher_train.train.lr_schedule == "cosine"
    assert default.teacher_train.data.sources.synthetic.json == "assets:synthetic_fire/teacher_turns.json"
    stage = compare.compare_train
    assert (stage.train.total_steps, stage.train.batch_size, stage.data.buckets) == (150, 8, (96,))
    assert stage.train.export_merged and stage.data.sources.to_dict() == {
        "comparisons": {"json": "assets:synthetic_fire/comparisons.json"}}
    assert compare.teacher_train.train.lr_schedule == "constant"
    assert compare.teacher_train.data.sources.synthetic.json == "assets:synthetic_fire/teacher_turns_quarter_right.json"
    assert compare.student_train.to_dict() == default.student_train.to_dict()
    with pytest.raises(InputError, match=r"arg must be 'smollm2\[,compare\]\[,see\]\[,rl\]', "
                                         r"'tiny\[,compare\]\[,see\]\[,rl\]'"):
        load("smollm2,other")
    with pytest.raises(InputError, match="expected key=value, got 'compare'"):  # 8b's options are configs/fire.py's
        load("8b,compare")


def test_the_see_variant_adds_the_vision_stage_the_alignment_and_right_answers():
    """configs/main_job.py:smollm2,see: the CLIP stage with the fact heads on every token of the whole-image tile and
    dense heads below them, the connector's alignment stage, the base stage on right answers; every stage and
    evaluation reads the 64-px tower. The default keeps the plain CLIP, no alignment stage and the first answers."""
    load = lambda arg: load_config(os.path.join(ROOT, "configs", f"main_job.py:{arg}"))
    default, see = load("smollm2"), load("smollm2,see")
    assert default.align_train is None and not default.clip_train.data.facts
    assert default.base_train.data.sources.instruct.json.endswith("/instruct.json")
    assert (default.base_train.train.total_steps, default.base_train.train.batch_size) == (20, 8)
    assert see.clip_train.data.facts and see.clip_train.data.views == "anyres" and see.clip_train.data.layout
    assert see.clip_train.model.fact_pooling == "token" and see.clip_train.model.dense_layer == 2
    assert see.clip_train.model.vision.layers == 5 and see.clip_train.data.sources.generated.generate == 25600
    assert see.align_train.data.sources.captions.json.endswith("caption_chats.json")
    assert list(see.align_train.data.sources) == ["captions"]  # no drawings: ALIGN_GENERATED
    assert see.base_train.data.sources.instruct.json.endswith("instruct_right.json")
    assert (see.base_train.train.total_steps, see.base_train.train.batch_size) == (80, 4)
    for stage in (see.clip_train, see.align_train, see.base_train, see.teacher_train, see.student_train,
                  see.eval_free, see.eval_fixed):
        assert stage.model.vision.image_size == 64 and stage.model.vision.patch_size == 16
    assert tuple(map(tuple, see.eval_free.model.image_grid_pinpoints)) == ((64, 128), (128, 64))
    assert load("smollm2,compare,see").compare_train is not None
