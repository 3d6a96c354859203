"""Every experiment script starts: ``--help`` prints its usage and exits 0 (an import that no longer exists, or a
launcher flag that changed, fails here rather than when a user runs it)."""

import os
import runpy
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments")
SCRIPTS = sorted(name for name in os.listdir(EXPERIMENTS) if name.endswith(".py") and not name.startswith("_"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_experiment_help(name, monkeypatch, capsys):
    monkeypatch.syspath_prepend(EXPERIMENTS)  # the scripts import their launcher, _launch.py, as a sibling
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(EXPERIMENTS, name), run_name="__main__")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")
