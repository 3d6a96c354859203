"""How command-line tools end on bad input: one line naming the file, record, field and reason, exit 2.

A traceback is for bugs; a missing file, a JSON file that does not parse, a record
without its question, a config typo or a split in which every record is bad is the
user's input, and the tool says so in one line on stderr::

    build_dataset: error: no usable record in split 'fire_100k' of ['bad.json']: 3 bad records skipped
    (missing_field: 2, invalid_json: 1; e.g. bad.json: record 0: field 'question': missing_field)

``FIRE_JAX_TRACEBACK=1`` shows the traceback instead. An output that cannot be
written (:class:`fire_jax.core.config.WriteFailed`: a full disk) ends a job the same
way, naming the path and the space left, exit 1; and SIGTERM / SIGINT end the
long jobs in bounded time (:class:`StopSignals`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time

from fire_jax.core.config import InputError, WriteFailed, config_path, load_config, override_target


#: What a CLI reports in one line (:class:`fire_jax.data.bad_records.BadRecordError` is an InputError).
INPUT_ERRORS = (InputError, FileNotFoundError, IsADirectoryError, json.JSONDecodeError)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


#: Seconds an ending process may take to exit (threads joined, files closed) after a :class:`WriteFailed` before
#: it is ended without waiting: a thread writing to the same full disk may never finish.
EXIT_TIMEOUT_S = 10.0


def input_errors_end_in_one_line(prog: str):
    """Decorate a CLI's main: input errors (:class:`InputError`, bad records, missing files, invalid JSON)
    print ``<prog>: error: <what and where>`` on stderr and exit 2; an output that cannot be written
    (:class:`WriteFailed`) the same, exit 1, the process ended within :data:`EXIT_TIMEOUT_S` seconds; a stop by
    SIGTERM / SIGINT (:class:`StopSignals`) one line too, exit 128 + the signal's number."""

    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except INPUT_ERRORS as error:
                if os.environ.get("FIRE_JAX_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
                sys.exit(2)
            except WriteFailed as error:
                if os.environ.get("FIRE_JAX_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
                end_within(EXIT_TIMEOUT_S, 1, f"{prog}: still running {EXIT_TIMEOUT_S:g} s after the error: "
                                              "ended without waiting for its threads")
                sys.exit(1)
            except Stopped as stopped:
                print(f"{prog}: {one_line(stopped)}", file=sys.stderr, flush=True)
                sys.exit(128 + stopped.number)
            except KeyboardInterrupt:
                stop = StopSignals.active
                if stop is None or stop.requested is None or os.environ.get("FIRE_JAX_TRACEBACK"):
                    raise
                print(f"{prog}: stopped by {stop.requested.name}", file=sys.stderr)
                sys.exit(128 + stop.requested)

        return guarded

    return wrap


class Stopped(Exception):
    """A job that stopped on a signal after keeping what it had done (a committed checkpoint): its command ends
    in this one line, exit 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a
    process a signal ended, so that a scheduler does not read the job as finished."""

    def __init__(self, number: int, message: str):
        self.number = int(number)
        super().__init__(message)


def end_within(seconds: float, status: int, why: str) -> None:
    """End the process with ``status`` (printing ``why``) if it is still running ``seconds`` from now: a daemon
    timer, so it neither keeps the process alive nor waits for the threads the exit waits for."""
    timer = threading.Timer(seconds, end_now, (status, why))
    timer.daemon = True
    timer.start()


def end_now(status: int, why: str) -> None:
    """Print ``why`` on stderr and end the process with ``status`` at once (no cleanup, no thread joined); the
    line is given a second to be written (stderr may be a pipe that nobody reads)."""
    writer = threading.Thread(target=os.write, args=(2, f"{why}\n".encode()), daemon=True)
    writer.start()
    writer.join(1.0)
    os._exit(status)


class StopSignals:
    """SIGTERM and SIGINT end a long job, in bounded time.

    The first signal asks the job to stop: inside :meth:`checked` (the training loop) it only sets
    :attr:`requested`, and the loop writes a last checkpoint and returns; elsewhere the main thread gets
    KeyboardInterrupt at once (evaluations have flushed every finished unit already). With ``timeout_s``, a
    process still running that long after the first signal (a write that never returns, a thread the exit
    waits for), or getting a second one, is ended there by a watchdog thread, exit 128 + the signal's number.
    The watchdog hears the signals through :func:`signal.set_wakeup_fd`, which the interpreter writes to from
    its C-level handler: it works while the main thread is blocked in a call that does not return.

    :meth:`install` is for a command's process (:func:`run_absl` installs one, ``--stop_timeout`` seconds);
    a loop uses ``StopSignals.active`` when there is one, else its own without a watchdog.
    """

    #: The instance installed for the process (:meth:`install`), if any.
    active: "StopSignals | None" = None

    def __init__(self, timeout_s: float | None = None, prog: str = ""):
        self.timeout_s, self.prog = timeout_s, prog or os.path.basename(sys.argv[0])
        self.requested: signal.Signals | None = None
        self._checked = 0
        self._previous: dict | None = None

    def install(self) -> "StopSignals":
        """Handle SIGTERM and SIGINT in this process (main thread only); start the watchdog when ``timeout_s``."""
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        if self.timeout_s is not None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._sockets = (reader, writer)  # kept open for the process's life
            threading.Thread(target=self._watch, args=(reader,), name="stop-watchdog", daemon=True).start()
        StopSignals.active = self
        return self

    def uninstall(self) -> None:
        for number, handler in (self._previous or {}).items():
            signal.signal(number, handler)
        self._previous = None
        if StopSignals.active is self:
            StopSignals.active = None

    @contextlib.contextmanager
    def checked(self):
        """While inside, the first signal only sets :attr:`requested` (the caller checks it between steps);
        installs the handlers for the block when they are not installed."""
        own = self._previous is None
        if own:
            self.install()
        self._checked += 1
        try:
            yield self
        finally:
            self._checked -= 1
            if own:
                self.uninstall()

    def _handle(self, number, frame) -> None:
        first = self.requested is None
        if first:
            self.requested = signal.Signals(number)
        if first and self._checked:  # on a line of its own: a progress bar may be on the current one
            print(f"\n{self.requested.name}: stopping after this step", file=sys.stderr, flush=True)
        elif first or self.timeout_s is None:  # a second signal is the watchdog's, where there is one
            raise KeyboardInterrupt(signal.Signals(number).name)

    def _watch(self, reader) -> None:
        first, deadline = None, None
        while True:
            reader.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                received = reader.recv(64)
            except socket.timeout:
                received = b""
            if deadline is not None and time.monotonic() >= deadline:
                end_now(128 + first, f"{self.prog}: still running {self.timeout_s:g} s after {first.name}: ended "
                                     "without waiting for the job to finish")
            for number in received:
                if number not in (signal.SIGTERM, signal.SIGINT):
                    continue
                if first is None:
                    first, deadline = signal.Signals(number), time.monotonic() + self.timeout_s
                else:
                    end_now(128 + number, f"{self.prog}: a second signal ({signal.Signals(number).name}): ended "
                                          "without waiting for the job to finish")


def int_at_least(low: int):
    """An argparse ``type``: an integer >= ``low`` (argparse then ends a bad value in its one error line, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


def existing_dir(text: str) -> str:
    """An argparse ``type``: a directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory" + ("" if os.path.exists(text) else
                                                                          " (it does not exist)"))
    return text


def _config_args(argv: list[str]):
    """(position, value, prefix) of each ``--config VALUE`` / ``--config=VALUE`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            yield i + 1, argv[i + 1], ""
        elif arg.startswith("--config="):
            yield i, arg[len("--config="):], "--config="


def config_argv(argv: list[str]) -> list[str]:
    """``argv`` with its ``--config PATH[:ARG]`` made absolute when PATH is not under the current directory but
    under the repository (``configs/x.py`` from anywhere, as :func:`fire_jax.core.config.load_config` reads it); the
    absl CLIs call this on ``sys.argv`` before ``app.run``, since ml_collections reads the file itself."""
    out = list(argv)
    for at, value, prefix in _config_args(out):
        path, colon, rest = value.partition(":")
        if path and not os.path.exists(path):
            try:
                out[at] = prefix + config_path(path) + colon + rest
            except FileNotFoundError:
                pass  # ml_collections reports the missing file itself
    return out


def _given_config(argv: list[str], default_config: str | None):
    """(spec, loaded config) of the last ``--config`` in ``argv``, else of ``default_config``; None when there is
    neither (absl then says the flag is missing)."""
    spec = ([value for _, value, _ in _config_args(argv)] or [default_config])[-1]
    return None if spec is None else (spec, load_config(spec))


def check_override_fields(argv: list[str], default_config: str | None = None) -> None:
    """Raise :class:`InputError` when a ``--config.a.b`` override of ``argv`` names no field of the config
    (ml_collections would end the absl CLI with a traceback); values are left to ml_collections."""
    names = [a[len("--config."):].partition("=")[0] for a in argv if a.startswith("--config.")]
    given = _given_config(argv, default_config) if names else None
    if given is None:
        return
    spec, config = given
    for name in names:
        try:
            override_target(config, name, source=f" of {spec}")
        except InputError as e:
            raise InputError(f"--config.{name}: {e}") from None


#: The kinds of config file: a top-level field that only that kind has, its name, and the command that runs it.
CONFIG_KINDS = (
    ("base_train", "a main-job config", "python -m fire_jax.run"),
    ("vlrm", "a VLRMBench config", "python -m fire_jax.evaluate_vlrm"),
    ("setting", "a FIRE-Bench evaluation config", "python -m fire_jax.evaluate"),
    ("train", "a training config", "python -m fire_jax.train"),
)


#: The config kind (a field of :data:`CONFIG_KINDS`) each absl CLI takes, by program name
#: (:func:`define_config_flag` fills it).
CLI_CONFIG_KINDS: dict[str, str] = {}


def check_config_kind(argv: list[str], kind: str, default_config: str | None = None) -> None:
    """Raise :class:`InputError` when the ``--config`` of ``argv`` is not of ``kind`` (a field of
    :data:`CONFIG_KINDS`), naming the kind it is and the command that runs it: the CLI would otherwise end
    with a traceback on the first field it reads."""
    given = _given_config(argv, default_config)
    if given is None:
        return
    spec, config = given
    if kind in config:
        return
    wanted = next(name for field, name, _ in CONFIG_KINDS if field == kind)
    found = config_kind(config)
    if found:
        field, name, command = found
        raise InputError(f"--config {spec}: {name} (it has '{field}'), not {wanted}; {command} runs it")
    raise InputError(f"--config {spec}: not {wanted} (no field '{kind}'); its fields: {sorted(config)}")


def config_kind(config) -> tuple[str, str, str] | None:
    """The entry of :data:`CONFIG_KINDS` whose field ``config`` has (None: none)."""
    return next((entry for entry in CONFIG_KINDS if entry[0] in config), None)


def require_model_config(config, spec: str):
    """``config`` when it has a ``model`` field (a training or evaluation config, as the serving and chat CLIs
    take), else :class:`InputError` naming its kind."""
    if "model" in config:
        return config
    found = config_kind(config)
    kind = f"{found[1]} (it has '{found[0]}')" if found else f"fields {sorted(config)}"
    raise InputError(f"--config {spec}: {kind} has no 'model' field; give a training or evaluation config "
                     f"(configs/tiny.py, configs/smollm2_llava.py, configs/fire_student.py)")


def prepare_absl_argv(prog: str, default_config: str | None = None, kind: str | None = None) -> None:
    """Before an absl CLI defines its ``--config`` flag (ml_collections loads the file and applies the
    ``--config.x`` overrides while defining it): resolve the ``--config`` path like load_config, and end with
    one line on a config of another kind than ``kind`` (:data:`CONFIG_KINDS`) or an override that names no
    field."""
    sys.argv = config_argv(sys.argv)
    if kind is not None:
        input_errors_end_in_one_line(prog)(check_config_kind)(sys.argv, kind, default_config)
    input_errors_end_in_one_line(prog)(check_override_fields)(sys.argv, default_config)


def define_config_flag(module: str, prog: str, default: str | None, help_text: str, *, kind: str | None = None):
    """An absl CLI's ``--config`` flag (``ml_collections.config_flags``). When ``module`` is ``"__main__"`` the
    command line is first prepared (:func:`prepare_absl_argv`): ml_collections loads the file and applies the
    ``--config.x`` overrides while it defines the flag. ``kind``: the field of :data:`CONFIG_KINDS` that this
    CLI's configs have."""
    from ml_collections import config_flags

    from absl import flags

    if kind is not None:
        CLI_CONFIG_KINDS[prog] = kind
    if module == "__main__":
        prepare_absl_argv(prog, default, kind)
    holder = config_flags.DEFINE_config_file("config", default, help_text)
    # A key flag of the CLI's own module (absl names the main module by sys.argv[0]), so its --help lists it.
    flags.FLAGS.register_key_flag_for_module(sys.argv[0] if module == "__main__" else module, flags.FLAGS["config"])
    return holder


def run_command(main, prog: str) -> None:
    """A plain command's ``__main__`` (argparse): re-executed with transparent huge pages where they help
    (:mod:`fire_jax.core.hugepages`), then ``main()`` with input errors ending in one line
    (:func:`input_errors_end_in_one_line`). :func:`run_absl` is the same for absl commands."""
    from fire_jax.core.hugepages import reexec_with_huge_pages

    reexec_with_huge_pages()
    input_errors_end_in_one_line(prog)(main)()


def run_absl(main, prog: str) -> None:
    """``app.run(main)``, input errors ending in one line (:func:`input_errors_end_in_one_line`), a flag that
    does not parse too (absl's own report is two lines and exit 1). A command's ``__main__`` only: it first
    re-executes the process with transparent huge pages where they help (:mod:`fire_jax.core.hugepages`)."""
    from absl import app, flags

    from fire_jax.core.hugepages import reexec_with_huge_pages

    reexec_with_huge_pages()
    stop_timeout = flags.DEFINE_float(
        "stop_timeout", 120.0, "seconds the job may take to end after SIGTERM / SIGINT (a last checkpoint "
        "written) before it is ended without waiting; a second signal ends it at once")

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
            sys.exit(2)

    def stoppable(argv):
        StopSignals(stop_timeout.value, prog).install()
        return main(argv)

    app.run(input_errors_end_in_one_line(prog)(stoppable), flags_parser=parse)
