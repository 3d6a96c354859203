"""The package as a user gets it: ``python -m build`` makes an sdist and, from it, a wheel; the wheel holds every
module, asset and config of the source tree, and installed into an empty virtual environment (no system
site-packages, no test extra) it runs the main job from outside the source tree."""

import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from loopback import child_env

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
PACKAGE_DATA = ("assets", os.path.join("eval", "paper_results"), "vlrmbench")


def package_files() -> set[str]:
    """What the wheel must hold, as paths inside it: fire_jax's modules, its data files, and ``configs/*.py`` as
    ``fire_jax/configs/*.py``."""
    out = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "fire_jax")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(folder, ROOT)
        inside = os.path.relpath(folder, os.path.join(ROOT, "fire_jax"))
        is_data = any(inside == d or inside.startswith(d + os.sep) for d in PACKAGE_DATA)
        out.update(os.path.join(rel, f) for f in files if f.endswith(".py") or (is_data and not f.endswith(".pyc")))
    out.update(os.path.join("fire_jax", "configs", f) for f in os.listdir(os.path.join(ROOT, "configs"))
               if f.endswith(".py"))
    return {p.replace(os.sep, "/") for p in out}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), ROOT], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def test_the_wheel_and_the_sdist_hold_every_module_asset_and_config(dist):
    wheel, sdist = dist
    expected = package_files()
    assert {"fire_jax/assets/chat_templates/llama3.jinja", "fire_jax/assets/synthetic_fire/test.json",
            "fire_jax/configs/main_job.py", "fire_jax/eval/paper_results/fire.json",
            "fire_jax/vlrmbench/prompts.json"} <= expected
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(expected - in_wheel) == []
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    tests = {f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")}
    wanted = ({p for p in expected if not p.startswith("fire_jax/configs/")} | tests
              | {"configs/main_job.py", "pyproject.toml", "constraints.txt", ".ci/run"})
    assert sorted(wanted - in_sdist) == []


def test_the_wheel_runs_the_main_job_in_an_empty_environment(dist, tmp_path):
    """``pip install`` of the wheel alone (its declared dependencies, the suite's pinned versions), then the tiny
    main job at test scale from a folder that holds no source: a module importing an undeclared package, an
    asset or a config left out of the wheel, fails here."""
    wheel, _ = dist
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = str(env_dir / "bin" / "python")
    # --no-compile: no byte-compiling of every installed module (17 of pip's 45 s here); the job compiles what
    # it imports
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "-c",
                              os.path.join(ROOT, "constraints.txt"), str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    env = child_env(devices=1)
    env.pop("PYTHONPATH", None)
    where = subprocess.run([python, "-c", "import fire_jax; print(fire_jax.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(env_dir)), where
    workdir = tmp_path / "run"
    overrides = [f"--config.{stage}.train.{field}={value}" for stage in ("clip_train", "base_train", "teacher_train",
                                                                           "student_train")
                 for field, value in (("total_steps", 2), ("checkpoint_every", 100))]
    overrides += [f"--config.clip_train.{part}.batch_size=8" for part in ("data", "train")]
    overrides += [f"--config.{setting}.{field}={value}" for setting in ("eval_fixed", "eval_free")
                  for field, value in (("test.max_examples", 2), ("decode.max_new_tokens", 6))]
    job = subprocess.run([python, "-m", "fire_jax.run", "--config", "configs/main_job.py:tiny", "--workdir",
                          str(workdir), *overrides], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.load(open(workdir / "summary.json"))
    assert set(summary["rows"]) == {"baseline", "fire"}
    last = job.stdout.strip().splitlines()[-1]
    assert last.startswith("done in ") and "GFLOP/s" in last, last
    timing = json.load(open(workdir / "timing.json"))
    assert timing["matmul_gflops"] > 0
