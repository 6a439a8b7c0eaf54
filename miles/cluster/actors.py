"""Ray start/attach, actor placement, and restarting an actor that died."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray._private import ray_constants

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 30.0


def ensure_ray(address: str | None, actors: int) -> None:
    """Attach to `address`, or start a local Ray sized so that every actor of the run gets a CPU slot.

    A local Ray is always a new one (never a cluster recorded on the machine or named by RAY_ADDRESS), listens on
    loopback only, and none of its processes outlives this one, however this one ends."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    mark = f"{RUN_MARK}={uuid.uuid4().hex}"
    _start_reaper(mark)
    with _local_ray_environment(mark):
        ray.init(
            address="local",  # None would attach to a cluster recorded in /tmp/ray or named by RAY_ADDRESS
            num_cpus=max(os.cpu_count() or 1, actors),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )


RUN_MARK = "MILES_RAY_RUN"  # NAME=id in the environment of every process of one local Ray: what its reaper kills
CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def _local_ray_environment(mark: str) -> Iterator[None]:
    """While Ray starts: the run's mark in the environment its processes inherit, and Ray's cluster mode off.

    With cluster mode on (Linux's default) Ray replaces a loopback node address by the machine's external one, and
    its servers bind the node address (gRPC on every interface unless that address is loopback). Off, the node
    address is loopback. Ray reads the flag at import: it is set in this process's copy and in the environment of
    the processes Ray starts."""
    name, value = mark.split("=", 1)
    changes = {name: value, CLUSTER_MODE: "0"}
    saved = {name: os.environ.get(name) for name in changes}
    saved_cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(changes)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_cluster_mode
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Ray kills the processes the driver starts itself (GCS, raylet, monitors) when the driver dies, but not those the
# raylet starts: its dashboard and runtime-env agents outlive a SIGKILLed driver by a minute or more (hung reporting
# the raylet's death to the dead GCS), and so would anything an actor started. The reaper, in a session of its own,
# notes the driver's descendants (pid and start time) while it waits for the driver to die, then kills them and every
# process whose environment carries the run's mark, whoever its parent is by then (a process title may overwrite
# the environment a process shows in /proc, so the mark alone misses some). It polls its parent's id rather than
# waiting for a pipe's end: a child the driver forks would hold the pipe open.
_REAPER = r"""
import os, signal, sys, time
driver, mark = int(sys.argv[1]), b"\0" + sys.argv[2].encode() + b"\0"

def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[1]), fields[19]  # parent, start time

def processes():
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found[int(pid)] = stat(pid)
        except (OSError, IndexError, ValueError):
            pass
    return found

seen = {}  # pid -> start time of the driver's descendants, as last seen
while os.getppid() == driver:
    table = processes()
    tree = {driver}
    for _ in range(8):  # the tree is shallow: driver, raylet, agents and workers, their children
        tree |= {pid for pid, (parent, _) in table.items() if parent in tree}
    seen.update({pid: table[pid][1] for pid in tree - {driver, os.getpid()} if pid in table})
    time.sleep(0.5)
for _ in range(100):
    found = False
    for pid, (_, started) in processes().items():
        if pid == os.getpid():
            continue
        try:
            if seen.get(pid) != started:
                with open(f"/proc/{pid}/environ", "rb") as environ:
                    if mark not in b"\0" + environ.read():
                        continue
            os.kill(pid, signal.SIGKILL)
            found = True
        except OSError:
            pass
    if not found:
        break
    time.sleep(0.1)
"""
_reapers: list[subprocess.Popen] = []  # held: a running child's Popen that is collected warns


def _start_reaper(mark: str) -> None:
    if not sys.platform.startswith("linux"):  # it reads /proc
        return
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid()), mark],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the driver's process group or terminal does not reach it
    )
    _reapers.append(reaper)


def free_address() -> tuple[str, int]:
    """This node's address as the other nodes reach it, and a port free on it: a rendezvous for a process group
    (run where its rank 0 runs)."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((host, 0))
        return host, probe.getsockname()[1]


ENGINE_CONCURRENCY = 64  # calls an engine actor takes at once: generations of every caller, pushes, health checks


def actor_options(device: str = "cpu", gpus: int = 1, concurrency: int = 1) -> dict:
    # One logical CPU per actor: Ray schedules, torch.set_num_threads decides the real threads. A CUDA actor asks for
    # whole GPUs: Ray puts a fractional request on the fullest GPU that still fits, so engines asking for slivers would
    # all land on one device (colocation is asked for, miles.cluster.placement).
    options = {"num_cpus": 1, "max_concurrency": concurrency}
    if device.startswith("cuda"):
        options["num_gpus"] = gpus
    return options


class ActorLost(RuntimeError):
    """The actor died during a call; the next call starts it again, so a retry of the work can succeed."""


class ActorGroup:
    """Ray actors that take every call together, in rank order: the ranks of one SPMD program (a trainer's workers),
    or a single actor. A call's result is rank 0's. When one rank fails the others may wait forever in a
    collective, so a failure kills every member (and `release`s what the group holds, e.g. its placement group)."""

    def __init__(self, handles: list[ray.actor.ActorHandle], release: Callable[[], None] | None = None):
        self.handles = handles
        self._release = release

    def submit(self, method: Callable, *args: Any) -> list[ray.ObjectRef]:
        """`method` (the actor class's, e.g. `TrainActor.train`) on every member; one ref per rank."""
        return [getattr(handle, method.__name__).remote(*args) for handle in self.handles]

    def results(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Every rank's result; the first failure (in completion order) kills a group of several and is raised."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except ray.exceptions.RayError:
                if len(self.handles) > 1:
                    self.kill()
                raise
        return ray.get(refs)

    def call(self, method: Callable, *args: Any) -> Any:
        return self.results(self.submit(method, *args))[0]

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
        if self._release is not None:
            self._release()
            self._release = None


class RestartableActor:
    """A proxy for an ActorGroup that is started again after it dies, rebuilt from the run directory by `start()`.

    `proxy.call(Actor.method, *args)` calls the method on every member and returns rank 0's result. The call that meets a
    member's death raises ActorLost (the task's retry repeats the work); the next call first runs `start()`, which
    returns a new group with the state rebuilt (e.g. the latest checkpoint plus the ledger). Thread-safe: concurrent
    callers that meet one death trigger one restart.
    """

    def __init__(self, name: str, start: Callable[[], ActorGroup]):
        self.name = name
        self._start = start
        self._lock = threading.Lock()
        self._lost = False
        self.group = start()

    @property
    def handles(self) -> list[ray.actor.ActorHandle]:
        return self.group.handles

    def call(self, method: Callable, *args: Any) -> Any:
        """`method` (the actor class's, e.g. `TrainActor.train`) on every member; rank 0's result."""
        return ray.get(self._finished(method, *args)[0])

    def hand_over(self, method: Callable, *args: Any, to: Callable[[ray.ObjectRef], Any]) -> Any:
        """`to(ref)` with `ref` rank 0's result of the actor's `method` (e.g. `TrainActor.weights`), for another actor
        to consume without a copy here. The result is complete (every rank done) before `to` sees it: a consumer never
        waits on a group that lost a member."""
        return to(self._finished(method, *args)[0])

    def hand_over_each(self, method: Callable, *args: Any) -> list[ray.ObjectRef]:
        """Every rank's result of `method`, as refs for other actors to consume (rank i's for the engine paired with
        it), complete as `hand_over`'s."""
        return self._finished(method, *args)

    def _finished(self, method: Callable, *args: Any) -> list[Any]:
        """The refs of `method`'s finished results, one per rank; ActorLost when a member died meanwhile."""
        group = self._live()
        refs = group.submit(method, *args)
        try:
            group.results(refs)
        except ray.exceptions.RayActorError as exc:
            self._mark_lost(group)
            raise ActorLost(
                f"the {self.name} died during {method.__name__} ({first_line(exc)}); it restarts on the next call"
            ) from exc
        except ray.exceptions.RayError:
            if len(group.handles) > 1:  # killed by results(): the next call starts the group again
                self._mark_lost(group)
            raise
        return refs

    def _live(self) -> ActorGroup:
        with self._lock:
            if self._lost:
                log.warning("restarting the %s", self.name)
                self.group = self._start()
                self._lost = False
            return self.group

    def _mark_lost(self, group: ActorGroup) -> None:
        with self._lock:
            if group is self.group:  # not a stale group from before the last restart
                group.kill()
                self._lost = True

    def release(self) -> None:
        """Stop the group now; the next call starts it again, rebuilt from the run directory."""
        self._mark_lost(self.group)

    def kill(self) -> None:
        self.group.kill()


def actor_error(exc: BaseException) -> BaseException:
    """For an error raised inside an actor, the actor's own error; else `exc`."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return exc.cause
    return exc


def first_line(exc: BaseException) -> str:
    """The first line of an error's message; for an error raised inside an actor, of the actor's error."""
    exc = actor_error(exc)
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
