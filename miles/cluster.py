"""Ray start/attach, actor placement, and restarting an actor that died."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import ray

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 30.0


def ensure_ray(address: str | None, actors: int) -> None:
    """Attach to `address`, or start a local Ray sized so that every actor of the run gets a CPU slot."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, actors),
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )


def free_address() -> tuple[str, int]:
    """This node's address as the other nodes reach it, and a port free on it: a rendezvous for a process group
    (run where its rank 0 runs)."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((host, 0))
        return host, probe.getsockname()[1]


ENGINE_CONCURRENCY = 64  # calls an engine actor takes at once: generations of every caller, pushes, health checks


def actor_options(device: str = "cpu", gpus: int = 1, concurrency: int = 1) -> dict:
    # One logical CPU per actor: Ray schedules, torch.set_num_threads decides the real threads. A one-GPU CUDA actor
    # asks for a sliver of a GPU, so that Ray exposes one to it and the engine and trainer can share it; a
    # tensor-parallel server asks for its whole GPUs.
    options = {"num_cpus": 1, "max_concurrency": concurrency}
    if device.startswith("cuda"):
        options["num_gpus"] = 0.01 if gpus == 1 else gpus
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

    def kill(self) -> None:
        self.group.kill()


def first_line(exc: BaseException) -> str:
    """The first line of an error's message; for an error raised inside an actor, of the actor's error."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
