"""Every output a job writes (checkpoints aside: :mod:`fire_jax.weights.checkpoint`) is written whole or not at all.

- :func:`output_file`: a file (results, reports, settings, plots, a config) written under a temporary name in
  its own folder, then renamed over ``path`` (``os.replace``, atomic on POSIX): a failure leaves the last good
  file, or none, never a cut one.
- :func:`output_folder`: the same for a folder of files (an exported checkpoint or adapter): written whole
  beside the old one, which is swapped out only once the new one is complete.
- The append-only JSONL stores (:class:`fire_jax.core.results.ResultStore`: outputs, batch outputs, generated
  data) cannot be renamed whole while a job runs; they cut a failed append back to its last whole line instead.

Any error of the write becomes one :class:`fire_jax.core.config.WriteFailed` line naming the path and the space
left on its filesystem: Python's ``OSError`` and the libraries' own errors that quote an errno (safetensors'
``SafetensorError: ... (os error 28)``, tensorstore's ``os_error_code='28'``). Any other error (a bug)
passes through unchanged; the temporary file or folder is removed either way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from fire_jax.core.config import WriteFailed, error_number, write_failed


def is_write_error(error: BaseException) -> bool:
    """An error of the filesystem (an OSError, or a library's error quoting an errno), not a bug."""
    return isinstance(error, OSError) or error_number(error) is not None


def _temporary(path: str, *, folder: bool = False) -> str:
    """A fresh name beside ``path`` (a file or folder created there, private to this writer: two jobs, two test
    workers or two hosts on one shared folder each write their own), readable as a plain write's would be."""
    where, name = os.path.split(os.path.abspath(path))
    os.makedirs(where, exist_ok=True)
    if folder:
        temporary = tempfile.mkdtemp(dir=where, prefix=f".{name}.", suffix=".partial")
        os.chmod(temporary, 0o755)
    else:
        fd, temporary = tempfile.mkstemp(dir=where, prefix=f".{name}.", suffix=".partial")
        os.close(fd)
        os.chmod(temporary, 0o644)
    return temporary


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


@contextlib.contextmanager
def _written_whole(path: str, folder: bool) -> Iterator[str]:
    temporary = old = None
    try:
        temporary = _temporary(path, folder=folder)
        yield temporary
        if folder and os.path.lexists(path):  # a folder cannot be renamed over a non-empty one: swap
            old = temporary + ".old"
            os.replace(path, old)
        os.replace(temporary, path)
        if old is not None:
            _remove(old)
    except BaseException as error:
        if temporary is not None:
            _remove(temporary)
        if old is not None and os.path.lexists(old) and not os.path.lexists(path):
            os.replace(old, path)  # the swap failed half-way: the last good folder back in its place
        if isinstance(error, WriteFailed):
            raise
        if isinstance(error, Exception) and is_write_error(error):
            raise write_failed(path, error) from error
        raise


def output_file(path: str | os.PathLike):
    """A context manager yielding a temporary path beside ``path`` to write the file to; renamed over ``path``
    when the block ends without an error (its folder is created). A write error ends in one
    :class:`WriteFailed` naming ``path``; the temporary file is removed."""
    return _written_whole(str(path), folder=False)


def output_folder(path: str | os.PathLike):
    """A context manager yielding a temporary folder beside ``path`` to write the folder's files to; once the
    block ends without an error it takes the place of ``path`` (an old folder there is removed after the swap)."""
    return _written_whole(str(path), folder=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` as the whole of ``path`` (UTF-8), written whole or not at all."""
    with output_file(path) as temporary, open(temporary, "w", encoding="utf-8") as f:
        f.write(text)


def save_figure(figure, path: str | os.PathLike, **kwargs) -> None:
    """A matplotlib figure saved to ``path`` (its format read from the extension), written whole or not at all."""
    fmt = os.path.splitext(str(path))[1].lstrip(".") or None
    with output_file(path) as temporary, open(temporary, "wb") as f:
        figure.savefig(f, format=fmt, **kwargs)
