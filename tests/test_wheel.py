"""The package as a user gets it: ``python -m build`` makes an sdist and, from it, a wheel; the wheel holds every
module, asset and config of the source tree. Installed into an empty virtual environment (no system
site-packages, no test extra), it runs the reduced main job from outside the source tree: tests/test_main_job.py's
pipeline is that run."""

import os
import tarfile
import zipfile

import pytest

from wheel_env import ROOT, build

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
    return build(tmp_path_factory.mktemp("dist"))


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
