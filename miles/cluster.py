"""Ray start/attach, actor placement, and restarting an actor that died."""

from __future__ import annotations

import logging
import os
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


def actor_options(device: str = "cpu", gpus: int = 1) -> dict:
    # One logical CPU per actor: Ray schedules, torch.set_num_threads decides the real threads. A one-GPU CUDA actor
    # asks for a sliver of a GPU, so that Ray exposes one to it and the engine and trainer can share it; a
    # tensor-parallel server asks for its whole GPUs.
    options = {"num_cpus": 1, "max_concurrency": 1}
    if device.startswith("cuda"):
        options["num_gpus"] = 0.01 if gpus == 1 else gpus
    return options


class ActorLost(RuntimeError):
    """The actor died during a call; the next call starts it again, so a retry of the work can succeed."""


class RestartableActor:
    """A proxy for a Ray actor that is started again after it dies, rebuilt from the run directory by `start()`.

    `proxy.method(*args)` calls the actor's method and returns its result. The call that meets the actor's death
    raises ActorLost (the task's retry repeats the work); the next call first runs `start()`, which returns a new
    handle with the state rebuilt (e.g. the latest checkpoint plus the ledger). Thread-safe: concurrent callers that
    meet one death trigger one restart.
    """

    def __init__(self, name: str, start: Callable[[], ray.actor.ActorHandle]):
        self.name = name
        self._start = start
        self._lock = threading.Lock()
        self._lost = False
        self.handle = start()

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):  # copy, pickle and friends probe for dunders: not actor methods
            raise AttributeError(method)

        def call(*args: Any) -> Any:
            handle = self._live()
            try:
                return ray.get(getattr(handle, method).remote(*args))
            except ray.exceptions.RayActorError as exc:
                self._mark_lost(handle)
                raise self._lost_error(method, exc) from exc

        return call

    def hand_over(self, method: Callable, *args: Any, to: Callable[[ray.ObjectRef], Any]) -> Any:
        """`to(ref)` with `ref` the pending result of the actor's `method` (e.g. `TrainActor.weights`), for another
        actor to consume without a copy here. If that fails with an actor error and this actor is the one that died,
        raise ActorLost."""
        handle = self._live()
        try:
            return to(getattr(handle, method.__name__).remote(*args))
        except ray.exceptions.RayActorError as exc:
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=HEALTH_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._mark_lost(handle)
                raise self._lost_error(method.__name__, exc) from exc
            raise

    def _lost_error(self, method: str, exc: BaseException) -> ActorLost:
        return ActorLost(f"the {self.name} died during {method} ({first_line(exc)}); it restarts on the next call")

    def _live(self) -> ray.actor.ActorHandle:
        with self._lock:
            if self._lost:
                log.warning("restarting the %s", self.name)
                ray.kill(self.handle)
                self.handle = self._start()
                self._lost = False
            return self.handle

    def _mark_lost(self, handle: ray.actor.ActorHandle) -> None:
        with self._lock:
            if handle is self.handle:  # not a stale handle from before the last restart
                self._lost = True

    def kill(self) -> None:
        ray.kill(self.handle)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message; for an error raised inside an actor, of the actor's error."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
