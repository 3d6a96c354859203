"""A pytest plugin: where the suite's time goes between JAX compiling and everything else, per test file.

    PYTHONPATH=tools python -m pytest -q tests -p pytest_compile_report [--compile-report-json out.json]

For each test it sums JAX's own compile events (``jax.monitoring``): tracing to a jaxpr, lowering to MLIR, the
backend compile (which includes loading a program from the persistent compilation cache) and the cache's hits,
and prints a table per test file at the end, the slowest files first. Only the pytest process is measured: the
CLI, server and training subprocesses that some tests start count as wall time only. Run it without workers
(no ``-n``, or ``-n 0``): under pytest-xdist the tests run in worker processes it does not see.
"""

import collections
import json
import time

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"
COLUMNS = (("compile s", BACKEND), ("compiles", BACKEND + "#"), ("trace s", TRACE), ("lower s", LOWER),
           ("cache hits", CACHE_HIT + "#"))


class CompileReport:
    def __init__(self, json_path: str | None):
        self.json_path = json_path
        self.current = collections.Counter()
        self.rows: list[dict] = []
        self.listening = False

    def _listen(self, event: str, duration: float, **_) -> None:
        self.current[event] += duration
        self.current[event + "#"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.listening:  # jax is imported by now (conftest), and its device flags are set
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._listen)
            self.listening = True
        self.current.clear()
        start = time.perf_counter()
        yield
        self.rows.append(dict(test=item.nodeid, wall=time.perf_counter() - start, **self.current))

    def pytest_terminal_summary(self, terminalreporter):
        files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for row in self.rows:
            totals = files[row["test"].split("::")[0]]
            for key, value in row.items():
                if key != "test":
                    totals[key] += value
        files["all"] = sum(files.values(), collections.Counter())
        write = terminalreporter.write_line
        write("")
        write("| file | wall s | " + " | ".join(name for name, _ in COLUMNS) + " |")
        write("|---|" + "---:|" * (len(COLUMNS) + 1))
        for name, totals in sorted(files.items(), key=lambda kv: -kv[1]["wall"]):
            cells = [f"{totals[key]:.0f}" if key.endswith("#") else f"{totals[key]:.1f}" for _, key in COLUMNS]
            write(f"| {name} | {totals['wall']:.1f} | " + " | ".join(cells) + " |")
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(self.rows, f, indent=1)


def pytest_addoption(parser):
    parser.addoption("--compile-report-json", default=None, help="also write the per-test rows to this file")


def pytest_configure(config):
    config.pluginmanager.register(CompileReport(config.getoption("--compile-report-json")), "compile_report")
