"""How training ends when its disk fails it or it is told to stop: a checkpoint or metrics write that fails ends
the run in one line naming the path and the space left (exit 1), the checkpoints before it intact and a resume
working once space is freed; SIGTERM ends the process even while a write hangs (a watchdog, --stop_timeout)."""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

from fire_jax.core.config import WriteFailed
from fire_jax.train import loop
from loopback import child_env
from test_train import tiny_config

#: How WriteFailed gives the space left ("1.2 GiB free of 252.0 GiB on its filesystem").
SPACE = r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB) free of \d+(?:\.\d)? (?:B|KiB|MiB|GiB) on its filesystem"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRAIN = ["-m", "fire_jax.train", "--config", os.path.join(ROOT, "configs", "tiny.py"),
         "--config.train.total_steps=4", "--config.train.checkpoint_every=2", "--config.train.export=False",
         "--config.data.buckets=(256,)", "--config.data.max_len=256"]


def train_command(workdir, *args: str, timeout: float = 300) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m fire_jax.train`` on the tiny config (4 steps, a checkpoint
    every 2); a process that does not end within ``timeout`` fails the test."""
    done = subprocess.run([sys.executable, *TRAIN, "--workdir", str(workdir), *args], cwd=ROOT,
                          env=child_env(FIRE_JAX_HUGE_PAGES="0"), capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def messages(stderr: str) -> list[str]:
    """stderr's lines without the progress bar's."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("train:")]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, where the test may mount one (root); else the test is skipped (the in-process test below
    makes the same writes fail with ENOSPC)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def fill(disk, leave: int) -> None:
    """A ballast file taking all the free space of ``disk`` but ``leave`` bytes (a tmpfs counts whole pages)."""
    ballast = disk / "ballast"
    ballast.unlink(missing_ok=True)
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    assert shutil.disk_usage(disk).free <= leave


def test_a_full_disk_ends_training_in_one_line_and_resume_works_once_freed(small_disk):
    run = small_disk / "run"
    status, out, err = train_command(run, "--max_steps", "2")
    assert status == 0 and sorted(os.listdir(run / "checkpoints")) == ["2"], err[-2000:]

    fill(small_disk, leave=0)  # the run's config.json is written whole (a new file, then a rename): no page for it
    status, out, err = train_command(run)
    assert status == 1 and "Traceback" not in out + err
    assert messages(err) == [f"fire_jax.train: error: could not write {run / 'config.json'}: No space left on "
                             f"device (0 B free of 4.0 MiB on its filesystem)"]
    assert sorted(os.listdir(run)) == ["checkpoints", "config.json", "metrics.jsonl", "tensorboard"]  # no leftover

    fill(small_disk, leave=64 << 10)  # room for the metrics of steps 3-4, not for the checkpoint of step 4
    status, out, err = train_command(run)
    assert status == 1 and "Traceback" not in out + err
    assert len(messages(err)) == 1, err[-3000:]
    (line,) = messages(err)
    assert line.startswith(f"fire_jax.train: error: checkpoint of step 4: could not write {run / 'checkpoints'}/4: "
                           "No space left on device (") and line.endswith(
        "free of 4.0 MiB on its filesystem); the steps before it are intact (latest: 2)")
    assert "4" not in os.listdir(run / "checkpoints")

    (small_disk / "ballast").unlink()  # space freed: the run resumes from step 2 and finishes
    status, out, err = train_command(run)
    assert status == 0, err[-2000:]
    assert f"resumed from {run}/checkpoints at step 2" in out and "done: step 4/4" in out
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]  # the unfinished step 4 was cleared away
    with open(run / "metrics.jsonl") as f:
        assert [int(line.split(",")[0].split(":")[1]) for line in f] == [1, 2, 3, 4]


def test_a_write_that_raises_enospc_ends_training_with_the_path_and_free_space(tmp_path, monkeypatch):
    """The same without a disk to fill: orbax's save and the metrics file raise ENOSPC as they do on a full disk
    (tensorstore's error is a ValueError quoting the errno)."""
    config = tiny_config(total_steps=4, checkpoint_every=2, export=False)
    workdir = tmp_path / "run"
    assert loop.train(config, str(workdir), max_steps=2)["step"] == 2

    def full_save(self, step, *args, **kwargs):
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{self.directory}/{step}.orbax-checkpoint-'
                         "tmp/params/_sharding\": Failed to write 6886 bytes to file 7: No space left on device "
                         "[os_error_code='28']")

    with monkeypatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, "save", full_save)
        with pytest.raises(WriteFailed) as failed:
            loop.train(config, str(workdir))
    # the space left is matched by its form: other processes write to this disk meanwhile
    assert re.fullmatch(rf"checkpoint of step 4: could not write {workdir}/checkpoints/4: No space left on device "
                        rf"\({SPACE}\); the steps before it are intact \(latest: 2\)", str(failed.value))

    class FullFile:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.file, name)

    def open_full(path, *args, **kwargs):
        file = open(path, *args, **kwargs)
        return FullFile(file) if str(path).endswith("metrics.jsonl") and args == ("a",) else file

    with monkeypatch.context() as patch:
        patch.setattr(loop, "open", open_full, raising=False)
        with pytest.raises(WriteFailed, match=rf"^could not write {workdir}/metrics.jsonl: No space left on "
                                              rf"device \({SPACE}\)$"):
            loop.train(config, str(workdir))
    summary = loop.train(config, str(workdir))  # the disk works again: resumed from step 2
    assert summary["step"] == 4


#: ``python -m fire_jax.train`` whose orbax saves never finish: waiting for one blocks for ever, as a save thread
#: stuck on a dead filesystem does.
HANGING_SAVE = """
import runpy, sys, threading
import orbax.checkpoint as ocp

def never_finishes(self):
    print("waiting for a save that never finishes", flush=True)
    threading.Event().wait()

ocp.CheckpointManager.wait_until_finished = never_finishes
runpy.run_module("fire_jax.train", run_name="__main__", alter_sys=True)
"""


def test_sigterm_ends_training_while_a_write_hangs(tmp_path):
    """The first SIGTERM asks the loop to stop after its step, which it never finishes; --stop_timeout 2 s later
    the watchdog ends the process (exit 128 + 15), saying so in one line."""
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", HANGING_SAVE, *TRAIN[2:], "--workdir", str(tmp_path / "run"),
                                    "--stop_timeout", "2"], cwd=ROOT, env=child_env(FIRE_JAX_HUGE_PAGES="0"),
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            for line in process.stdout:
                if line.startswith("waiting for a save that never finishes"):
                    break
            assert process.poll() is None, open(tmp_path / "stderr").read()[-2000:]
            start = time.monotonic()
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=60)
            took = time.monotonic() - start
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert status == 128 + signal.SIGTERM and 2 <= took < 30
    said = messages(open(tmp_path / "stderr").read())
    # the loop's handler runs only if the blocked call lets it: the watchdog does not depend on that
    assert said[-1] == "fire_jax.train: still running 2 s after SIGTERM: ended without waiting for the job to finish"
    assert set(said[:-1]) <= {"SIGTERM: stopping after this step"}


def test_sigint_stops_training_after_a_last_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C as SIGTERM: the step finishes, its checkpoint is written, train() returns (KeyboardInterrupt used
    to unwind the loop without one)."""
    from fire_jax.data.pipeline import InputPipeline

    original, calls = InputPipeline.__next__, []

    def next_with_sigint(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    monkeypatch.setattr(InputPipeline, "__next__", next_with_sigint)
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN in a pytest-xdist worker
    summary = loop.train(tiny_config(total_steps=6, export=False), str(tmp_path / "run"))
    assert summary["step"] == 2 and summary["preempted"]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


#: A command whose main blocks (``--checked``: in a loop that checks StopSignals.requested) under
#: :func:`fire_jax.core.cli.input_errors_end_in_one_line` with the process's StopSignals, as run_absl sets them up.
BLOCKED_COMMAND = """
import sys, threading, time
from fire_jax.core.cli import StopSignals, input_errors_end_in_one_line

def main():
    stop = StopSignals(float(sys.argv[1]), "job").install()
    if sys.argv[2] == "--checked":
        with stop.checked():
            print("blocked", flush=True)
            threading.Event().wait()
    print("blocked", flush=True)
    time.sleep(600)

input_errors_end_in_one_line("job")(main)()
"""


@pytest.mark.parametrize("checked,signals,status,said", [
    (False, [signal.SIGTERM], 128 + signal.SIGTERM, ["job: stopped by SIGTERM"]),  # an evaluation: ends at once
    (False, [signal.SIGINT], 128 + signal.SIGINT, ["job: stopped by SIGINT"]),
    (True, [signal.SIGTERM, signal.SIGINT], 128 + signal.SIGINT,
     ["job: a second signal (SIGINT): ended without waiting for the job to finish"]),
])
def test_signals_end_a_command(checked, signals, status, said):
    """Outside a checked loop the first signal ends the command in one line; a second signal ends it at once
    whatever it is blocked in (the timeout here, 600 s, is never reached)."""
    process = subprocess.Popen([sys.executable, "-c", BLOCKED_COMMAND, "600", "--checked" if checked else "-"],
                               cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "blocked\n"
        for number in signals:
            process.send_signal(number)
            time.sleep(0.5)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == status
    assert [line for line in err.splitlines() if line and line != "SIGTERM: stopping after this step"] == said
