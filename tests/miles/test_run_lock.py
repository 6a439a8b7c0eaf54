"""RunLock: one process trains a run directory at a time; a dead holder's lock is taken over."""

import logging
import os
import subprocess
import sys

import pytest

from miles.checkpoint import RunLock


def test_second_holder_is_refused_until_release(tmp_path):
    lock = RunLock(tmp_path)
    assert (tmp_path / "run.lock").read_text() == str(os.getpid())
    with pytest.raises(RuntimeError, match=f"being trained by process {os.getpid()}"):
        RunLock(tmp_path)
    lock.release()
    assert not (tmp_path / "run.lock").exists()
    RunLock(tmp_path).release()


def test_lock_of_a_live_other_process_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "run.lock").write_text(str(sleeper.pid))
        with pytest.raises(RuntimeError, match=str(sleeper.pid)):
            RunLock(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "run.lock").write_text(dead.stdout.strip())
    with caplog.at_level(logging.WARNING, logger="miles.checkpoint"):
        lock = RunLock(tmp_path)
    assert (tmp_path / "run.lock").read_text() == str(os.getpid())
    assert "stale lock" in caplog.text and dead.stdout.strip() in caplog.text
    lock.release()
