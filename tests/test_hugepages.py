"""fire_jax.core.hugepages: when a command re-executes itself with glibc's ``malloc.hugetlb`` tunable, that it keeps its
arguments and runs once, and that the re-executed process's large ``malloc`` buffers are backed by huge pages."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fire_jax.core import hugepages


def test_thp_mode_is_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hugepages._thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert hugepages._thp_mode(str(path)) == "always"
    assert hugepages._thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not hugepages._glibc_at_least(2, 35) or not sys.platform.startswith("linux"),
                    reason="the tunable needs Linux with glibc >= 2.35")
def test_wanted_only_where_it_changes_something():
    assert hugepages.wanted({}, thp_mode="madvise")
    assert not hugepages.wanted({}, thp_mode="always")  # every large mapping gets huge pages already
    assert not hugepages.wanted({}, thp_mode="never")
    assert not hugepages.wanted({"FIRE_JAX_HUGE_PAGES": "0"}, thp_mode="madvise")
    assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, thp_mode="madvise")  # the user's
    assert hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, thp_mode="madvise")


def test_tunables_keep_what_was_set():
    assert hugepages.tunables({}) == "glibc.malloc.hugetlb=1"
    assert hugepages.tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


# Re-executes itself, then mallocs 64 MiB, touches it, and reports the huge pages behind its anonymous memory.
PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    from fire_jax.core.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    with open("/proc/self/smaps_rollup") as f:
        huge = [int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")][0]
    print(json.dumps([os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], huge]))
""")


@pytest.mark.skipif(not hugepages.wanted({}), reason="huge pages through glibc's tunable need Linux, glibc >= 2.35 "
                    "and transparent huge pages in madvise mode")
def test_a_command_reexecutes_once_with_its_arguments_and_gets_huge_pages():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "FIRE_JAX_HUGE_PAGES")}

    def probe(*args):
        lines = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        assert len(lines) == 1, lines  # the probe ran once, after the re-exec
        return json.loads(lines[0])

    tunable, args, huge_kib = probe("--flag", "two words")
    assert tunable == "glibc.malloc.hugetlb=1"
    assert args == ["--flag", "two words"]
    assert huge_kib >= 32 << 10  # most of the 64 MiB buffer in 2 MiB pages (63,488 KiB here)

    env["FIRE_JAX_HUGE_PAGES"] = "0"
    tunable, args, huge_kib = probe()
    assert tunable is None and huge_kib < 32 << 10  # off: no re-exec, 4 KiB pages (0 KiB here)
