"""Import every module of fire_jax with what is installed (CI runs it after the base install, before the test
extra): a module that needs a package the base install does not declare fails here.

Modules are imported in one process; the absl CLIs each define the same flags (--workdir, --config), so a module
whose flags clash with an earlier one's is imported again in a process of its own.
"""

import importlib
import os
import pkgutil
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    import fire_jax
    from absl.flags import DuplicateFlagError

    names = sorted(m.name for m in pkgutil.walk_packages(fire_jax.__path__, "fire_jax."))
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except DuplicateFlagError:
            run = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
            if run.returncode:
                failed.append(f"{name}: {run.stderr.strip().splitlines()[-1]}")
        except Exception as e:  # noqa: BLE001  (each failure is reported with its module)
            failed.append(f"{name}: {type(e).__name__}: {e}")
    for line in failed:
        print(f"import_all: {line}", file=sys.stderr)
    print(f"import_all: {len(names) - len(failed)} of {len(names)} modules of fire_jax import with the base install")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
