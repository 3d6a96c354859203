"""Every package fire_jax imports is one it declares, and every declared one is used (deptry, configured in
pyproject.toml's ``[tool.deptry]``): a missing, unused, transitive-only or test-only dependency fails here."""

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))


def deptry(root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", "--no-ansi", "."], cwd=root, capture_output=True,
                          text=True)


def test_every_import_has_its_declared_dependency():
    run = deptry(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No dependency issues found" in run.stdout + run.stderr


def test_an_undeclared_import_fails_the_check(tmp_path):
    """The same tree with ``jinja2`` (fire_jax.data.templates imports it) taken out of the dependencies: deptry
    names the module and the package (DEP001 where jinja2 is absent, DEP003 where another package brought it)."""
    shutil.copytree(os.path.join(ROOT, "fire_jax"), tmp_path / "fire_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    without, n = re.subn(r'\n\s*"jinja2",[^\n]*', "", pyproject)
    assert n == 1
    (tmp_path / "pyproject.toml").write_text(without)
    run = deptry(str(tmp_path))
    assert run.returncode == 1
    report = run.stdout + run.stderr
    assert re.search(r"fire_jax/data/templates\.py:\d+:\d+: DEP00[13] 'jinja2' imported but", report), report
