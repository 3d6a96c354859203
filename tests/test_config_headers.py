"""Every command a config file's header names parses: the module exists, each flag is one it defines, the
--config file and its arg load, it is of the kind the CLI takes (``fire_jax.core.cli.check_config_kind``), and every
--config.x=y override names a field.

One subprocess per CLI module (absl flags are process-global): it imports the module, then parses each
command's argv with the module's own flags, as ``app.run`` would, without running ``main``.
"""

import collections
import glob
import json
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARSE = r"""
import importlib, json, sys
from absl import flags
from fire_jax.core import cli
module, commands = sys.argv[1], json.loads(sys.argv[2])
importlib.import_module(module)
kinds = sorted(set(cli.CLI_CONFIG_KINDS.values()))
assert len(kinds) == 1, f"{module} declares config kinds {kinds}"
failures = []
for argv in commands:
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)  # config_flags defines the override flags while it parses --config
    flags.FLAGS.unparse_flags()
    sys.argv = [module, *argv]  # config_flags reads the overrides from sys.argv
    try:
        flags.FLAGS(sys.argv)
        config = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
        assert config is None or hasattr(config, "keys"), f"--config loaded {type(config)}"
        flags.FLAGS.validate_all_flags()
        cli.check_config_kind(argv, kinds[0])
    except Exception as e:  # report every command, not only the first that fails
        failures.append(f"{' '.join(argv)}: {type(e).__name__}: {e}")
print(json.dumps(failures))
"""

#: How each CLI is imported without running it (a package's __main__ runs only as ``python -m``).
MODULES = {"fire_jax.train": "fire_jax.train.__main__"}


def header_commands() -> dict[str, list[tuple[str, list[str]]]]:
    """{module: [(where, argv)]} from the comment lines above each config file's docstring."""
    out = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))):
        lines, header = open(path, encoding="utf-8").read().splitlines(), []
        for line in lines:
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
        text = re.sub(r"\\\s*\n\s*", " ", "\n".join(header))  # join continued lines
        for line in text.splitlines():
            if not line.startswith("python -m "):
                continue
            line = re.sub(r"\s+(#|\().*$", "", line)  # trailing remarks: "# ..." or "(...)"
            words = shlex.split(line)
            out[words[2]].append((f"{os.path.basename(path)}: {line}", words[3:]))
    return out


def test_every_config_header_command_parses():
    commands = header_commands()
    assert sum(map(len, commands.values())) >= 15, commands  # the headers were read
    assert set(commands) == {"fire_jax.train", "fire_jax.run", "fire_jax.evaluate", "fire_jax.evaluate_vlrm"}
    failures = []
    for module, entries in commands.items():
        result = subprocess.run([sys.executable, "-c", PARSE, MODULES.get(module, module),
                                 json.dumps([argv for _, argv in entries])],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        failures += [f"{module}: {f}" for f in json.loads(result.stdout.strip().splitlines()[-1])]
    assert not failures, "\n".join(failures)


def test_a_bad_header_command_is_caught():
    """The check can fail: an unknown flag, an unknown config arg, an unknown override and a config of another
    kind (a training config given to the main job) are reported."""
    bad = [["--config", "configs/tiny.py", "--workdir", "DIR", "--hf-checkpoint", "X"],
           ["--config", "configs/main_job.py:nonsense"],
           ["--config", "configs/eval_free.py", "--config.teacher.no_such_field=1"],
           ["--config", "configs/tiny.py", "--workdir", "DIR"]]
    modules = ["fire_jax.train.__main__", "fire_jax.run", "fire_jax.evaluate", "fire_jax.run"]
    for module, argv in zip(modules, bad):
        result = subprocess.run([sys.executable, "-c", PARSE, module, json.dumps([argv])], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(json.loads(result.stdout.strip().splitlines()[-1])) == 1, (module, argv, result.stdout)


def test_every_header_cli_runs_with_help():
    """Each CLI a header names runs as a program (``python -m MODULE --help``: absl prints the module's flags and
    exits 1 by design), and its help lists every flag the headers pass it."""
    for module, entries in header_commands().items():
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode in (0, 1) and "Traceback" not in result.stderr, (module, result.stderr[-2000:])
        used = {word.split("=")[0] for _, argv in entries for word in argv
                if word.startswith("--") and not word.startswith("--config.")}
        missing = sorted(flag for flag in used if f"{flag}:" not in result.stdout + result.stderr)
        assert used and not missing, (module, missing)
