"""The main job end to end in a reduced form, and the Fig. 6 ablation launcher at tiny scale."""

import json
import os
import subprocess
import sys

import pytest

from fire_jax.data.config import load_config
from fire_jax.pipeline import data_size_ablation, run

ROOT = os.path.join(os.path.dirname(__file__), "..")


def reduced_config(steps=12):
    config = load_config(os.path.join(ROOT, "configs", "pipeline.py"))
    for stage in (config.base_train, config.teacher_train, config.student_train):
        stage.train.total_steps = steps
        stage.train.checkpoint_every = 100
    for setting in (config.eval_fixed, config.eval_free):
        setting.test.max_examples = 6
        setting.decode.max_new_tokens = 12
    return config


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("pipeline"))
    return workdir, run(reduced_config(), workdir)


def test_pipeline_writes_every_table_and_plot(pipeline_run):
    workdir, summary = pipeline_run
    assert set(summary["rows"]) == {"baseline", "fire"}
    for row in summary["rows"].values():
        assert row["student BLEU-4"] is not None and row["teacher MAE"] is not None
    for name in ("baseline_fixed", "fire_fixed", "baseline_free", "fire_free"):
        results = json.load(open(os.path.join(workdir, "eval", name, "results.json")))
        assert results["conversations"] == 6
        assert "(paper)" in open(os.path.join(workdir, "eval", name, "results.md")).read()
    assert len(summary["figures"]) == 6 and all(os.path.getsize(p) > 1000 for p in summary["figures"])
    assert "| fire |" in open(os.path.join(workdir, "summary.md")).read()
    for stage in ("base", "teacher", "student"):
        assert os.listdir(os.path.join(workdir, stage, "checkpoints")) == ["12"]
    assert os.path.exists(os.path.join(workdir, "base", "export", "hf_merged", "config.json"))


def test_ablation_trains_two_sizes_and_writes_fig6(pipeline_run):
    workdir, _ = pipeline_run  # base model, teacher and baseline evaluation are reused (resumed)
    points = data_size_ablation(reduced_config(), workdir, [40, 80])
    assert [p["size"] for p in points] == [40, 80]
    assert json.load(open(os.path.join(workdir, "fig6.json"))) == points
    assert os.path.getsize(os.path.join(workdir, "fig6.png")) > 1000
    for size in (40, 80):
        config = json.load(open(os.path.join(workdir, f"student_{size}", "config.json")))
        assert config["data"]["sources"]["synthetic"]["max_examples"] == size


def test_accuracy_by_turn_launcher(pipeline_run, tmp_path):
    workdir, _ = pipeline_run
    out = str(tmp_path / "fig7.png")
    runs = [f"{name}={os.path.join(workdir, 'eval', f'{name}_free', 'results.json')}" for name in ("baseline", "fire")]
    subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "accuracy_by_turn.py"), "--out", out, *runs],
                   check=True, cwd=ROOT)
    assert os.path.getsize(out) > 1000
