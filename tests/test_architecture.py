"""Imports point one way (ARCHITECTURE.md): each layer imports only the layers below it.

Every ``import`` / ``from ... import`` in a module counts, at any depth (function-level imports too).
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGE = os.path.join(ROOT, "fire_jax")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str) -> set[str]:
    """The absolute module names ``path`` imports (relative imports resolved)."""
    tree = ast.parse(open(path).read(), path)
    package = _module_name(path).rsplit(".", 1)[0] if not path.endswith("__init__.py") else _module_name(path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from fire_jax import train`
    return names


def modules(under: str) -> list[str]:
    out = []
    for root, _, files in os.walk(under):
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _violations(paths, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{os.path.relpath(path, ROOT)} imports {name}" for path in paths for name in sorted(imports_of(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


UPPER = ("fire_jax.data", "fire_jax.train", "fire_jax.infer", "fire_jax.eval", "fire_jax.vlrmbench",
         "fire_jax.main_job", "fire_jax.run", "fire_jax.serve", "fire_jax.demo", "fire_jax.chat",
         "fire_jax.batch_infer", "fire_jax.evaluate", "fire_jax.evaluate_vlrm", "fire_jax.make_fire100k")


@pytest.mark.parametrize("layer, forbidden", [
    ("models", UPPER + ("fire_jax.checkpoint", "fire_jax.sharding", "fire_jax.convert")),
    ("convert", UPPER + ("fire_jax.checkpoint", "fire_jax.sharding")),
    ("checkpoint.py", UPPER),
    ("sharding.py", UPPER + ("fire_jax.checkpoint",)),
    ("machine.py", UPPER + ("fire_jax.checkpoint", "fire_jax.sharding", "fire_jax.models", "fire_jax.convert")),
    ("data", ("fire_jax.models", "fire_jax.train", "fire_jax.infer", "fire_jax.eval", "fire_jax.vlrmbench",
              "fire_jax.checkpoint", "fire_jax.convert")),
    ("infer", ("fire_jax.train", "fire_jax.eval", "fire_jax.vlrmbench", "fire_jax.main_job")),
    ("geometry.py", ("fire_jax.config", "fire_jax.results", "fire_jax.cli") + ("fire_jax.models", "fire_jax.data", "fire_jax.convert", "fire_jax.checkpoint", "fire_jax.sharding") + UPPER),
    ("results.py", ("fire_jax.geometry", "fire_jax.cli") + ("fire_jax.models", "fire_jax.data", "fire_jax.convert", "fire_jax.checkpoint", "fire_jax.sharding") + UPPER),
    ("cli.py", ("fire_jax.geometry", "fire_jax.results") + ("fire_jax.models", "fire_jax.data", "fire_jax.convert", "fire_jax.checkpoint", "fire_jax.sharding") + UPPER),
    ("eval", ("fire_jax.vlrmbench", "fire_jax.main_job", "fire_jax.run", "fire_jax.serve", "fire_jax.demo",
              "fire_jax.chat", "fire_jax.batch_infer", "fire_jax.evaluate", "fire_jax.evaluate_vlrm",
              "fire_jax.make_fire100k")),
    ("vlrmbench", ("fire_jax.eval", "fire_jax.main_job", "fire_jax.run", "fire_jax.serve", "fire_jax.demo",
              "fire_jax.chat", "fire_jax.batch_infer", "fire_jax.evaluate", "fire_jax.evaluate_vlrm",
              "fire_jax.make_fire100k")),
    ("train", ("fire_jax.infer", "fire_jax.eval", "fire_jax.vlrmbench", "fire_jax.main_job")),
])
def test_layers_import_only_downwards(layer, forbidden):
    path = os.path.join(PACKAGE, layer)
    paths = modules(path) if os.path.isdir(path) else [path]
    assert paths
    assert _violations(paths, forbidden) == []


def test_metrics_import_no_model_code():
    metrics = [os.path.join(PACKAGE, "eval", "metrics.py")]
    metrics += [p for p in modules(os.path.join(PACKAGE, "vlrmbench")) if os.path.basename(p) in ("score.py", "parse.py")]
    assert len(metrics) >= 1
    assert _violations(metrics, ("fire_jax.models", "fire_jax.infer", "fire_jax.train", "fire_jax.checkpoint",
                                 "fire_jax.convert")) == []
    for path in metrics:
        assert not {n for n in imports_of(path) if n.split(".")[0] in ("jax", "flax", "torch")}, path


def test_config_layer_imports_only_ml_collections():
    """fire_jax.config is read by every config file and CLI: no jax, nothing of the package."""
    import sys

    names = imports_of(os.path.join(PACKAGE, "config.py"))
    assert {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) == {"ml_collections"}


def test_hugepages_imports_only_the_standard_library():
    """fire_jax.hugepages runs before a command imports anything heavy (it may re-execute the process)."""
    import sys

    names = imports_of(os.path.join(PACKAGE, "hugepages.py"))
    assert names and {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_config_files_import_only_the_config_layer():
    paths = modules(os.path.join(ROOT, "configs"))
    assert len(paths) >= 10
    for path in paths:
        ours = {n for n in imports_of(path) if n.split(".")[0] == "fire_jax"}
        assert ours <= {"fire_jax.config"} | {f"fire_jax.config.{x}" for x in dir(__import__("fire_jax.config").config)}, \
            (path, ours)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The test above cannot pass vacuously: an import inside a function, and a relative one, are found."""
    package = tmp_path / "fire_jax" / "models"
    package.mkdir(parents=True)
    source = package / "bad.py"
    source.write_text("def f():\n    from fire_jax.train.step import Trainer\n\nfrom ..infer import decode\n")
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        assert imports_of(str(source)) >= {"fire_jax.train.step", "fire_jax.infer", "fire_jax.infer.decode"}
        assert len(_violations([str(source)], ("fire_jax.train", "fire_jax.infer"))) >= 2
    finally:
        ROOT = old


def decode_loops(path: str) -> list[str]:
    """Where a module builds a decode loop: a call of ``jax.lax.while_loop`` / ``fori_loop`` / ``scan``, or a
    :class:`fire_jax.models.KVCache` made or extended (``KVCache(...)``, ``KVCache.init``) outside the model."""
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name.split(".")[-1] in ("while_loop", "fori_loop", "scan") or name in ("KVCache", "KVCache.init"):
            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {name}")
    return found


def test_only_the_engine_holds_a_decode_loop():
    """One decoder: outside the model (which defines the cache) and training (whose loss scans over chunks of
    the sequence), only the engine's kernels (infer/kernels.py) loop over tokens or build a KV cache; generate,
    the agents, the server and the runners drive an Engine."""
    outside = (os.path.join(PACKAGE, "models") + os.sep, os.path.join(PACKAGE, "train") + os.sep)
    paths = [p for p in modules(PACKAGE)
             if not p.startswith(outside) and p != os.path.join(PACKAGE, "infer", "kernels.py")]
    assert [hit for p in paths for hit in decode_loops(p)] == []
    assert len(decode_loops(os.path.join(PACKAGE, "infer", "kernels.py"))) >= 3  # the checker sees the engine's


def test_the_decode_loop_checker_sees_a_loop(tmp_path):
    source = tmp_path / "decode.py"
    source.write_text("import jax\nfrom jax import lax\ndef f(c):\n    return jax.lax.while_loop(a, b, c)\n"
                      "def g(c):\n    return lax.fori_loop(0, 3, b, c)\ncache = KVCache.init(cfg, 1, 8, d)\n")
    assert len(decode_loops(str(source))) == 3
