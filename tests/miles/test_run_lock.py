"""RunLock: run.lock, a lease that keeps a second process off a run directory, on this host or another."""

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from miles.state import run_lock
from miles.state.run_dir import RunDir
from miles.state.run_lock import RunLock
from tests.helpers.waiting import eventually


def write_lock(path, **fields):
    """run.lock as a holder with these fields would have written it (by default: a process of another host)."""
    record = {"host": "trainer-7", "pid_ns": "boot ns", "pid": 4242, "start": 123, "token": uuid.uuid4().hex}
    record.update({"heartbeat": time.time(), **fields})
    path.write_text(json.dumps(record))
    return record


def this_host(pid, **fields):
    return {"host": socket.gethostname(), "pid_ns": run_lock._pid_namespace(), "pid": pid, **fields}


def read_lock(path):
    return json.loads(path.read_text())


def test_second_holder_is_refused_until_release(tmp_path):
    lock = RunDir(tmp_path).lock()
    record = read_lock(tmp_path / "run.lock")
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    assert record["start"] == run_lock._start_time(os.getpid())
    with pytest.raises(RuntimeError, match=f"being trained by process {os.getpid()} on {socket.gethostname()}"):
        RunDir(tmp_path).lock()
    lock.release()
    assert not (tmp_path / "run.lock").exists()
    RunDir(tmp_path).lock().release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left beside it


def test_lock_of_a_live_other_process_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "run.lock").write_text(str(sleeper.pid))  # the lock of an older version: a bare pid
        with pytest.raises(RuntimeError, match=str(sleeper.pid)):
            RunDir(tmp_path).lock()
        write_lock(tmp_path / "run.lock", **this_host(sleeper.pid, start=run_lock._start_time(sleeper.pid)))
        with pytest.raises(RuntimeError, match=str(sleeper.pid)):
            RunDir(tmp_path).lock()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("old_format", [True, False])
def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog, old_format):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    if old_format:
        (tmp_path / "run.lock").write_text(str(pid))
    else:
        write_lock(tmp_path / "run.lock", **this_host(pid, start=1))
    with caplog.at_level(logging.WARNING, logger="miles.state.run_lock"):
        lock = RunDir(tmp_path).lock()
    assert read_lock(tmp_path / "run.lock")["pid"] == os.getpid()
    assert "stale lock" in caplog.text and f"process {pid} " in caplog.text and "dead" in caplog.text
    lock.release()


def test_lock_of_another_host_is_refused_while_its_lease_runs_and_taken_over_after(tmp_path, caplog):
    renewed = time.time() - run_lock.LEASE_S / 2
    write_lock(tmp_path / "run.lock", heartbeat=renewed)
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(renewed))
    with pytest.raises(RuntimeError, match=f"by process 4242 on trainer-7 .*heartbeat last renewed at {at}"):
        RunDir(tmp_path).lock()
    assert read_lock(tmp_path / "run.lock")["host"] == "trainer-7"

    write_lock(tmp_path / "run.lock", heartbeat=time.time() - run_lock.LEASE_S - 5)
    with caplog.at_level(logging.WARNING, logger="miles.state.run_lock"):
        lock = RunDir(tmp_path).lock()
    assert read_lock(tmp_path / "run.lock")["host"] == socket.gethostname()
    assert "process 4242 on trainer-7" in caplog.text and "lease expired" in caplog.text
    lock.release()


def test_a_pid_of_this_host_is_judged_by_its_process_not_its_heartbeat(tmp_path):
    # The same host name in another pid namespace (a container) or boot: its pid means nothing here, its lease does.
    write_lock(tmp_path / "run.lock", **this_host(os.getppid(), pid_ns="another boot", start=0))
    with pytest.raises(RuntimeError, match=f"process {os.getppid()}"):
        RunDir(tmp_path).lock()
    # Here, a live holder keeps its lock whatever its heartbeat says (a process paused in a debugger).
    write_lock(tmp_path / "run.lock", **this_host(os.getppid(), start=run_lock._start_time(os.getppid())), heartbeat=0)
    with pytest.raises(RuntimeError, match=f"process {os.getppid()}"):
        RunDir(tmp_path).lock()


def test_lock_of_a_reused_pid_is_taken_over(tmp_path, caplog):
    parent = os.getppid()  # alive, but not the process that wrote the lock: that one started at another time
    write_lock(tmp_path / "run.lock", **this_host(parent, start=run_lock._start_time(parent) - 1))
    with caplog.at_level(logging.WARNING, logger="miles.state.run_lock"):
        lock = RunDir(tmp_path).lock()
    assert read_lock(tmp_path / "run.lock")["pid"] == os.getpid()
    assert f"process {parent} " in caplog.text and "another process" in caplog.text
    lock.release()


def test_an_unreadable_lock_is_taken_over(tmp_path, caplog):
    (tmp_path / "run.lock").write_text('{"host": "trainer-7", "pi')
    with caplog.at_level(logging.WARNING, logger="miles.state.run_lock"):
        RunDir(tmp_path).lock().release()
    assert "cannot be read" in caplog.text


def test_the_heartbeat_is_renewed_while_held_and_stops_at_release(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    lock = RunDir(tmp_path).lock()
    first = read_lock(tmp_path / "run.lock")
    assert eventually(lambda: read_lock(tmp_path / "run.lock")["heartbeat"] > first["heartbeat"], timeout_s=5)
    assert read_lock(tmp_path / "run.lock")["token"] == first["token"]
    lock.release()
    assert not lock._thread.is_alive()
    time.sleep(0.1)
    assert not (tmp_path / "run.lock").exists()  # no renewal brought it back


def test_the_heartbeat_stops_when_the_lock_was_taken_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    lock = RunDir(tmp_path).lock()
    taker = write_lock(tmp_path / "run.lock")  # another host took it over (this process stalled past its lease)
    with caplog.at_level(logging.ERROR, logger="miles.state.run_lock"):
        assert eventually(lambda: not lock._thread.is_alive(), timeout_s=5)
    assert "lost the lock" in caplog.text
    lock.release()
    assert read_lock(tmp_path / "run.lock") == taker  # neither renewed nor removed


def test_a_start_with_an_outdated_view_does_not_remove_the_lock_that_replaced_the_stale_one(tmp_path):
    stale = write_lock(tmp_path / "run.lock", heartbeat=0)
    slow = RunLock.__new__(RunLock)  # judged `stale` gone, then was overtaken before acting on it
    slow.path = tmp_path / "run.lock"
    (tmp_path / "run.lock").unlink()
    winner = RunDir(tmp_path).lock()
    slow._take_over(stale, "its lease expired", {})
    assert read_lock(tmp_path / "run.lock")["token"] == winner.record["token"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]
    winner.release()


def test_a_claim_left_by_a_start_that_died_taking_over_is_cleared(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "CLAIM_S", 0.2)
    stale = write_lock(tmp_path / "run.lock", heartbeat=0)
    os.link(tmp_path / "run.lock", tmp_path / f"run.lock.takeover-{stale['token']}")
    lock = RunDir(tmp_path).lock()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]
    lock.release()


def race(path, starts):
    """`starts` threads start on `path` at once: the locks won, and how many were refused."""
    barrier = threading.Barrier(starts)
    won, refused = [], []

    def start():
        barrier.wait()
        try:
            won.append(RunLock(path))
        except RuntimeError:
            refused.append(1)

    threads = [threading.Thread(target=start) for _ in range(starts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, len(refused)


def test_threads_racing_to_take_over_one_stale_lock_one_wins(tmp_path):
    for _ in range(20):
        write_lock(tmp_path / "run.lock", heartbeat=0)
        won, refused = race(tmp_path / "run.lock", 6)
        assert (len(won), refused) == (1, 5)
        assert read_lock(tmp_path / "run.lock")["token"] == won[0].record["token"]
        won[0].release()
        assert list(tmp_path.iterdir()) == []


RACER = textwrap.dedent(
    """
    import sys, time
    from miles.state.run_lock import RunLock
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
    try:
        lock = RunLock(sys.argv[1])
    except RuntimeError:
        print("refused", flush=True)
    else:
        print("won", lock.record["token"], flush=True)
        sys.stdin.read()  # hold it until the test has seen every racer's answer
        lock.release()
    """
)


def test_processes_racing_to_take_over_one_stale_lock_one_wins(tmp_path):
    path = tmp_path / "run.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lock(path, **this_host(int(dead.stdout), start=1))
    go = str(time.time() + 2)
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(path), go],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        answers = [r.stdout.readline().split() for r in racers]
        assert sorted(a[0] for a in answers) == ["refused", "refused", "refused", "won"], answers
        assert read_lock(path)["token"] == next(a[1] for a in answers if a[0] == "won")
    finally:
        for r in racers:
            r.communicate("", timeout=30)
    assert list(tmp_path.iterdir()) == []
