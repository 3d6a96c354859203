"""Transparent huge pages for XLA:CPU's buffers: the command-line tools re-run themselves once with glibc's
``malloc.hugetlb`` tunable on.

XLA:CPU takes every large buffer of a step (activations, logits, gradients, temporaries) from ``malloc``, and
glibc serves each one above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` that it unmaps again on
``free``. So every step touches its large buffers page by page for the first time: 4 KiB pages, each one a page
fault that the kernel zero-fills. Where the kernel's transparent huge pages are in ``madvise`` mode (Debian's and
Ubuntu's default), glibc 2.35+ marks those mappings for 2 MiB pages when the process starts with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: one fault where there were 512.

A train step then runs faster with a small fraction of the page faults and the same loss to the last printed digit;
a decode step is unchanged (its buffers are small and reused). ``benchmarks/train_step.py`` measures it, and
docs/performance.md ("Huge pages") holds the comparison.

The tunable is read by the dynamic loader when a process starts, so it cannot be switched on from inside
Python: :func:`reexec_with_huge_pages` re-executes the interpreter with the same arguments, before any heavy
import, when it would help (Linux, glibc >= 2.35, transparent huge pages in ``madvise`` mode, the tunable not
set already). ``FIRE_JAX_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word of ``path``: always, madvise or never)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_at_least(major: int, minor: int) -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        return tuple(int(part) for part in version.split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


def wanted(environ=os.environ, thp_mode: str | None = None) -> bool:
    """Whether re-executing with the tunable would change anything here."""
    if environ.get("FIRE_JAX_HUGE_PAGES", "1") == "0" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux") or not _glibc_at_least(2, 35):
        return False
    return (thp_mode if thp_mode is not None else _thp_mode()) == "madvise"


def tunables(environ=os.environ) -> str:
    """``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=1`` added to whatever it held."""
    current = environ.get("GLIBC_TUNABLES", "")
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def reexec_with_huge_pages() -> None:
    """Re-execute this process (same interpreter, same arguments) with glibc's malloc asking for transparent huge
    pages, when :func:`wanted`; otherwise return. Call it first thing in a command's ``__main__``, before jax is
    imported; never from a library function (a test calling ``main()`` must not be replaced by a new process)."""
    if not wanted():
        return
    os.environ["GLIBC_TUNABLES"] = tunables()
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    os.execv(sys.executable, [sys.executable, *argv[1:]])
