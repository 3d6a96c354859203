"""The package as a user gets it: ``python -m build`` of the source tree, and its wheel installed alone into an
empty virtual environment (no system site-packages, no test extra; the suite's pinned versions)."""

import os
import subprocess
import sys

from loopback import child_env

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))


def build(out, *, sdist: bool = True):
    """The wheel (built from the sdist when ``sdist``) and the sdist (or None) of the source tree, in ``out``."""
    command = [sys.executable, "-m", "build", "--outdir", str(out), ROOT] + ([] if sdist else ["--wheel"])
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel, (next(out.glob("*.tar.gz")) if sdist else None)


def installed(wheel, where) -> tuple[str, dict]:
    """(python, env): an empty virtual environment in ``where``/venv with ``wheel`` installed, its declared
    dependencies alone, and the environment a job runs in (one host device, no PYTHONPATH): ``import fire_jax``
    there finds the installed package, not the source tree."""
    env_dir = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = str(env_dir / "bin" / "python")
    # --no-compile: no byte-compiling of every installed module (17 of pip's 45 s on 2 cores); the job compiles what
    # it imports
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "-c",
                              os.path.join(ROOT, "constraints.txt"), str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    env = child_env(devices=1)
    env.pop("PYTHONPATH", None)
    found = subprocess.run([python, "-c", "import fire_jax; print(fire_jax.__file__)"], cwd=where, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(env_dir)), found
    return python, env
