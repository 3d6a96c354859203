"""Imports point one way (ARCHITECTURE.md): each layer imports only the layers beneath it, a package's modules
import each other without cycles, and the root of the package holds only the entry points.

Every ``import`` / ``from ... import`` in a module counts, at any depth (function-level imports too, and those
under ``if TYPE_CHECKING:``).
"""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGE = os.path.join(ROOT, "fire_jax")

#: fire_jax's packages, bottom to top; a package imports only packages of the layers below its own.
LAYERS = (
    ("fire_jax.core",),
    ("fire_jax.models", "fire_jax.data"),
    ("fire_jax.convert",),
    ("fire_jax.weights",),
    ("fire_jax.train", "fire_jax.infer"),
    ("fire_jax.dialogue",),
    ("fire_jax.eval", "fire_jax.vlrmbench"),
    ("fire_jax.rl",),
    ("fire_jax.serving", "fire_jax.stages"),
)


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


def entry_points() -> list[str]:
    """The jobs, ``python -m fire_jax.<job>``: the root's modules and ``train/__main__.py``."""
    root = [os.path.join(PACKAGE, f) for f in sorted(os.listdir(PACKAGE)) if f.endswith(".py") and f != "__init__.py"]
    return root + [os.path.join(PACKAGE, "train", "__main__.py")]


def layer_of(module: str) -> int | None:
    return next((k for k, layer in enumerate(LAYERS) for p in layer if module == p or module.startswith(p + ".")),
                None)


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(paths, forbidden) -> list[str]:
    return [f"{os.path.relpath(path, ROOT)} imports {name}" for path in paths for name in sorted(imports_of(path))
            if _within(name, forbidden)]


def _package_of(path: str) -> str:
    return next(p for layer in LAYERS for p in layer if _within(_module_name(path), (p,)))


def test_the_root_holds_only_the_entry_points():
    """A module at the root of fire_jax is a job a user runs (``if __name__ == "__main__"``); the library is in
    the layers' packages."""
    for path in entry_points():
        assert 'if __name__ == "__main__":' in open(path).read(), os.path.relpath(path, ROOT)
    packages = {os.path.join(PACKAGE, d) for d in os.listdir(PACKAGE)
                if os.path.exists(os.path.join(PACKAGE, d, "__init__.py"))}
    assert {f"fire_jax.{os.path.basename(p)}" for p in packages} == {p for layer in LAYERS for p in layer}


@pytest.mark.parametrize("package", [p for layer in LAYERS for p in layer])
def test_each_package_imports_only_the_layers_beneath_it(package):
    """Not a layer above, nor a package beside it at the same height, nor an entry point."""
    k = layer_of(package)
    forbidden = [p for j, layer in enumerate(LAYERS) for p in layer if j >= k and p != package]
    forbidden += [_module_name(p) for p in entry_points() if not p.endswith("__main__.py")]
    paths = [p for p in modules(os.path.join(PACKAGE, *package.split(".")[1:])) if not p.endswith("__main__.py")]
    assert paths
    assert _violations(paths, forbidden) == []


def test_inference_and_dialogues_never_import_training():
    """infer/ sits beside train/ and dialogue/ above both: neither imports training (ARCHITECTURE.md), so changing
    the optimizer or the training loop never breaks evaluation, serving or data generation."""
    paths = modules(os.path.join(PACKAGE, "infer")) + modules(os.path.join(PACKAGE, "dialogue"))
    assert len(paths) > 10
    assert _violations(paths, ("fire_jax.train",)) == []


#: What lies beneath infer/'s backends: the engine, its requests, scheduler and kernels, and the fixed-batch driver.
BENEATH_THE_BACKENDS = ("fire_jax.infer.engine", "fire_jax.infer.requests", "fire_jax.infer.scheduler",
                        "fire_jax.infer.kernels", "fire_jax.infer.decode")


def test_the_server_and_the_demo_reach_models_through_the_backends():
    """serving/ (the OpenAI-compatible server, the demo) goes through infer/'s backends (``Serving``, a
    ``Backend``), never the engine beneath them: what a served request may ask and what it gets back is the
    backends' to say, in one place."""
    paths = modules(os.path.join(PACKAGE, "serving"))
    assert os.path.join(PACKAGE, "serving", "server.py") in paths
    assert _violations(paths, BENEATH_THE_BACKENDS) == []


def test_entry_points_do_not_import_each_other():
    jobs = [_module_name(p) for p in entry_points() if not p.endswith("__main__.py")]
    assert len(jobs) >= 8
    assert _violations(entry_points(), jobs) == []


def cycles(paths) -> list[list[str]]:
    """The import cycles among ``paths`` (modules of one package), each as the modules around it."""
    names = {_module_name(p): p for p in paths}
    graph = {m: sorted(n for n in imports_of(p) if n in names and n != m and not names[n].endswith("__init__.py"))
             for m, p in names.items()}
    found, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


@pytest.mark.parametrize("package", ["fire_jax"] + [p for layer in LAYERS for p in layer])
def test_no_import_cycles_inside_a_package(package):
    """Modules of one package may import each other, one way only (function-level imports count: a cycle
    hidden in a function is still two modules that need each other)."""
    folder = os.path.join(PACKAGE, *package.split(".")[1:])
    paths = [p for p in modules(folder) if os.path.dirname(p) == folder] if package != "fire_jax" else entry_points()
    assert [" -> ".join(c) for c in cycles(paths)] == []


def test_the_cycle_checker_sees_a_cycle_through_a_function(tmp_path):
    package = tmp_path / "fire_jax" / "infer"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from fire_jax.infer.b import g\n")
    (package / "b.py").write_text("def g():\n    from fire_jax.infer import a\n")
    (package / "c.py").write_text("from fire_jax.infer import a, b\n")
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        found = cycles([str(package / f) for f in ("a.py", "b.py", "c.py")])
    finally:
        ROOT = old
    assert found == [["fire_jax.infer.a", "fire_jax.infer.b", "fire_jax.infer.a"]]


def test_metrics_import_no_model_code():
    metrics = [os.path.join(PACKAGE, "eval", "metrics.py")]
    metrics += [p for p in modules(os.path.join(PACKAGE, "vlrmbench")) if os.path.basename(p) in ("score.py", "parse.py")]
    assert len(metrics) == 3
    assert _violations(metrics, ("fire_jax.models", "fire_jax.infer", "fire_jax.dialogue", "fire_jax.train",
                                 "fire_jax.weights", "fire_jax.convert")) == []
    for path in metrics:
        assert not {n for n in imports_of(path) if n.split(".")[0] in ("jax", "flax", "torch")}, path


def test_config_layer_imports_only_ml_collections():
    """fire_jax.core.config is read by every config file and CLI: no jax, nothing of the package but the axis
    names (fire_jax.core.axes, constants that import nothing)."""
    names = imports_of(os.path.join(PACKAGE, "core", "config.py")) - {"fire_jax.core", "fire_jax.core.axes"}
    assert {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) == {"ml_collections"}
    assert imports_of(os.path.join(PACKAGE, "core", "axes.py")) == set()


def test_axis_names_are_written_once():
    """Every logical axis name is fire_jax.core.axes's: no string literal of one in an ``axes=`` or
    ``constrain(...)`` of the models or the engine."""
    from fire_jax.core import axes

    names = {v for k, v in vars(axes).items() if k.isupper() and isinstance(v, str)}
    literal = re.compile(r'(axes=|constrain\().*"(' + "|".join(sorted(names)) + r')"')
    found = [f"{os.path.relpath(path, ROOT)}:{i}" for path in modules(PACKAGE) if not path.endswith("axes.py")
             for i, line in enumerate(open(path), 1) if literal.search(line)]
    assert found == []


def test_hugepages_imports_only_the_standard_library():
    """fire_jax.core.hugepages runs before a command imports anything heavy (it may re-execute the process)."""
    names = imports_of(os.path.join(PACKAGE, "core", "hugepages.py"))
    assert names and {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_config_files_import_only_the_config_layer():
    from fire_jax.core import config

    paths = modules(os.path.join(ROOT, "configs"))
    assert len(paths) >= 10
    for path in paths:
        ours = {n for n in imports_of(path) if n.split(".")[0] == "fire_jax"}
        assert ours <= {"fire_jax.core.config"} | {f"fire_jax.core.config.{x}" for x in dir(config)}, (path, ours)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The tests above cannot pass vacuously: an import inside a function, and a relative one, are found."""
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
    the agents, the server's backends and the runners drive an Engine."""
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


def _fire_jax_names(tree) -> set[str]:
    """The names a module binds to fire_jax's modules and objects (``import fire_jax.x as y``, ``from fire_jax.x
    import z``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] == "fire_jax")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fire_jax" and not node.level:
            names.update(a.asname or a.name for a in node.names)
    return names


def _assignments_into(tree, names: set[str]) -> list[int]:
    """Lines that assign an attribute of one of ``names`` (``loop.build_model = ...``, ``setattr(chat, ...)``)."""
    def root(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and root(t) in names]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                node.args and root(node.args[0]) in names:
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("folder", ["experiments", "tools", "benchmarks"])
def test_scripts_configure_the_library_and_never_patch_it(folder):
    """Experiments, tools and benchmarks reach fire_jax through config fields and public functions: none assigns
    into a fire_jax module or object (a patch that works only while the library looks a name up at call time)."""
    patches = []
    for path in modules(os.path.join(ROOT, folder)):
        tree = ast.parse(open(path).read(), path)
        patches += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _assignments_into(tree, _fire_jax_names(tree))]
    assert patches == []


def test_the_patch_detector_sees_a_patch():
    tree = ast.parse("from fire_jax.train import loop\nimport fire_jax.data.chat as chat_lib\n"
                     "loop.build_model = f\nchat_lib.teacher_messages = g\nsetattr(loop, 'x', 1)\nconfig.x = 1\n")
    assert _assignments_into(tree, _fire_jax_names(tree)) == [3, 4, 5]


#: The longest a function of fire_jax may be, docstring included: one screen, read at once.
MAX_FUNCTION_LINES = 80


def _long_functions(path: str) -> list[str]:
    tree = ast.parse(open(path).read(), path)
    return [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_a_screen():
    assert [f for path in modules(PACKAGE) for f in _long_functions(path)] == []


def test_the_length_checker_sees_a_long_function(tmp_path):
    path = tmp_path / "long.py"
    path.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert len(_long_functions(str(path))) == 1
