"""RunLock: run.lock keeps a second process off a run directory that is being trained, on this host or another.

run.lock is a lease, a JSON record of its holder: host name, the boot and pid namespace its pid lives in, pid, the
start time of that process, a token of its own, and a heartbeat time that a thread of the holder renews every
HEARTBEAT_S. A start finds the holder gone when

- it is on this host (same host name, boot and pid namespace) and its pid is dead, or belongs to a process started at
  another time than recorded (the pid was reused);
- it is elsewhere and its heartbeat is older than LEASE_S: a pid of another host means nothing here, its lease does.

Otherwise the start is refused. Hosts sharing a run directory need clocks that agree to well within LEASE_S (NTP).
A run.lock of an older version, a bare pid, is judged as a pid of this host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from miles.state.atomic import write_json_atomic

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0  # how often the holder renews its heartbeat
LEASE_S = 60.0  # a lock of another host whose heartbeat is older than this is taken over
CLAIM_S = 10.0  # a takeover claim still there after this long was left by a start that died while taking over


class RunLock:
    """Held from construction until release(); a second start on the run directory is refused with a RuntimeError."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.record = {
            "host": socket.gethostname(),
            "pid_ns": _pid_namespace(),
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "token": uuid.uuid4().hex,
            "heartbeat": time.time(),
        }
        self._acquire()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"heartbeat {self.path}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove run.lock if it is still ours."""
        self._stop.set()
        self._thread.join()
        if _token(_read(self.path)) == self.record["token"]:
            self.path.unlink(missing_ok=True)

    def _acquire(self) -> None:
        claims_seen: dict[Path, float] = {}
        while True:
            if self._create():
                return
            raw = _read(self.path)
            if raw is None:  # released meanwhile
                continue
            holder = _parse(raw)
            reason = _gone(holder)
            if reason is None:
                raise RuntimeError(
                    f"{self.path.parent} is being trained by process {holder['pid']} on {holder['host']} "
                    f"(lock {self.path}{_renewed(holder)})"
                )
            self._take_over(holder, reason, claims_seen)

    def _create(self) -> bool:
        """Put our record at run.lock unless a lock is there. The record is written whole to a file of its own, then
        linked to run.lock (link fails on an existing name), so that no one reads a lock half written."""
        mine = self.path.with_name(f".{self.path.name}.{self.record['token']}")
        write_json_atomic(mine, self.record)
        try:
            os.link(mine, self.path)
            return True
        except FileExistsError:
            return os.stat(mine).st_nlink == 2  # over NFS a link that succeeded, then was retried, says EEXIST
        finally:
            mine.unlink()

    def _take_over(self, holder: dict[str, Any], reason: str, claims_seen: dict[Path, float]) -> None:
        """Remove the stale lock `holder`, unless another start is doing so; the caller then tries to create its own.

        Two starts may judge the same stale lock at once, and one may have replaced it with its own lock by the time
        the other acts, so removing "the stale lock" must not remove that new one. A start removes a stale lock only
        under a claim: a hard link to run.lock named after the stale lock's token. Only one start can create that name,
        and it removes run.lock only if the file it linked carries the stale token (it may have linked a newer lock).
        run.lock is never moved aside, so a live lock never goes missing; a removed one is replaced through _create,
        which only one start wins.
        """
        token = holder["token"]
        claim = self.path.with_name(f"{self.path.name}.takeover-{token}")
        try:
            os.link(self.path, claim)
        except FileNotFoundError:
            return  # removed meanwhile
        except FileExistsError:
            # Another start is taking it over now (a claim lasts a few system calls), or did and left its claim, or
            # died taking it over: a claim beside a lock that is no longer the stale one, or older than CLAIM_S, goes.
            first_seen = claims_seen.setdefault(claim, time.monotonic())
            if _token(_read(self.path)) != token or time.monotonic() - first_seen > CLAIM_S:
                claim.unlink(missing_ok=True)
            else:
                time.sleep(0.05)
            return
        try:
            if _token(_read(claim)) == token:
                log.warning(
                    "taking over the stale lock %s of process %s on %s: %s",
                    self.path,
                    holder["pid"],
                    holder["host"],
                    reason,
                )
                self.path.unlink(missing_ok=True)
        finally:
            claim.unlink(missing_ok=True)

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if _token(_read(self.path)) != self.record["token"]:
                    log.error("lost the lock %s: it is no longer this process's (was its lease taken over?)", self.path)
                    return
                self.record["heartbeat"] = time.time()
                write_json_atomic(self.path, self.record)
            except OSError as e:  # the storage may come back before the lease runs out
                log.warning("could not renew the lock %s: %s", self.path, e)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict[str, Any]:
    """The holder recorded in `raw`. A bare pid (an older run.lock) is a pid of this host, without a heartbeat."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, int) and not isinstance(data, bool):
        return {"host": socket.gethostname(), "pid": data, "token": f"pid-{data}", "heartbeat": None}
    if isinstance(data, dict) and {"host", "pid", "token", "heartbeat"} <= data.keys():
        return data
    token = "unreadable-" + hashlib.sha256(raw).hexdigest()[:16]
    return {"host": "an unknown host", "pid": "unknown", "token": token, "heartbeat": None, "unreadable": True}


def _token(raw: bytes | None) -> str | None:
    return None if raw is None else _parse(raw)["token"]


def _renewed(holder: dict[str, Any]) -> str:
    if holder["heartbeat"] is None:
        return ""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["heartbeat"]))
    return f", heartbeat last renewed at {at}, {time.time() - holder['heartbeat']:.0f} s ago"


def _gone(holder: dict[str, Any]) -> str | None:
    """Why the holder no longer holds its lock, or None if it does."""
    if holder.get("unreadable"):
        return "it cannot be read"
    try:
        if holder["host"] == socket.gethostname() and holder.get("pid_ns") in (None, _pid_namespace()):
            start = _start_time(int(holder["pid"]))
            if start is None:
                return "its process is dead"
            if holder.get("start") is not None and start != holder["start"]:
                return "its pid belongs to another process now"
            return None
        silent = time.time() - float(holder["heartbeat"])
        if silent > LEASE_S:
            return f"its lease expired: no heartbeat for {silent:.0f} s (lease {LEASE_S:.0f} s)"
        return None
    except (TypeError, ValueError):
        return "it cannot be read"


def _pid_namespace() -> str | None:
    """The boot and pid namespace a pid of this process lives in: the same host name elsewhere (another machine, a
    container) or after a reboot has other processes under the same pids."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _start_time(pid: int) -> int | float | None:
    """When process `pid` started (clock ticks since boot on Linux), or None if there is no such live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        if os.path.exists("/proc/self/stat"):
            return None
        import psutil  # no /proc: macOS

        try:
            return psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            return None
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited
