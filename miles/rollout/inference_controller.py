"""InferenceController: owns the engine actors, shards requests over them, pushes versioned weights.

Any number of callers (the generations of the fully-async flow, an evaluation beside a generation, the adapters
of the multi-LoRA flow) call `generate` at once: each engine batches whatever reaches it (continuous batching).
A weight or adapter push does not wait for the generations in flight: the engines pause them between two decode
steps, load, and continue them on the new weights (each token records its version). Flows that must not train
off-policy order their pushes after their generations.

An engine call that fails because an engine died (its actor, or its server: EngineUnavailable), or that
outlasts `timeout_s` on an engine that then fails its health check, health-checks every engine, restarts the dead
or hung ones with the current weights and adapters at their versions, and raises EngineRestarted: the caller's
retry then runs on a whole engine set. A call on a healthy engine is waited for however long it takes (a long
generation is not a hang). No partial batch is ever returned.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import ray

from miles.cluster.actors import ENGINE_CONCURRENCY, HEALTH_TIMEOUT_S, actor_options, first_line
from miles.cluster.placement import ColocatedBundles, Location, engine_options, location_of
from miles.config import AdapterConfig, RolloutConfig
from miles.engines import resolve_engine
from miles.engines.base import (
    KV_CACHE,
    WEIGHTS,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    GenerationProgress,
    RolloutEngine,
    check_adapters_loaded,
)
from miles.rollout.weight_transport import WeightPush
from miles.weights.check import WeightProbe

log = logging.getLogger(__name__)

# A generation that runs longer than this reports its progress, and again every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 10.0
PROGRESS_EVERY_S = 30.0


class EngineRestarted(RuntimeError):
    """Engines died or hung during a call; they were restarted with the current weights, so a retry can succeed."""


class InferenceController:
    """`rollout.num_engines` engines of kind `rollout.engine`, started from `model_dir` at `weight_version`.
    `adapters` are the LoRA adapters the engines may be asked to serve (an SGLang server sizes its LoRA pool by them).
    Colocated (`colocated`: engine i on trainer rank i's GPU, a rank keeping `trainer_resident_bytes` there between
    steps), the engines give their memory back while the trainer steps: `release_memory`, and the next push resumes
    it."""

    def __init__(
        self,
        model_dir: str,
        weight_version: int,
        rollout: RolloutConfig,
        adapters: list[AdapterConfig] = (),
        colocated: ColocatedBundles | None = None,
        trainer_resident_bytes: float | None = None,
    ):
        self.engine_class = resolve_engine(rollout.engine)
        self._rollout, self._adapter_configs = rollout, list(adapters)
        self._trainer_resident_bytes = trainer_resident_bytes if colocated is not None else None
        self._engine_args = self._launch_args(model_dir, weight_version)
        self.ranks_per_engine = self.engine_class.ranks(rollout)
        self._colocated = colocated  # engine i in pair i's bundle, else GPUs of its own
        self._engine_options = actor_options(rollout.device, self.ranks_per_engine, ENGINE_CONCURRENCY)
        if self._engine_options.get("num_gpus") and not ray.cluster_resources().get("GPU"):
            # Ray would keep the engines pending, silently, until a GPU joins the cluster.
            raise ValueError(
                f"rollout.device={rollout.device}: the Ray cluster has no GPU (its resources: {ray.cluster_resources()})"
            )
        self.timeout_s = rollout.engine_timeout_s
        self._weight_version = weight_version
        self._push: WeightPush | None = None  # the last full-weight push, for engines restarted after it
        self._held: str | None = None  # the trainer's fingerprint of the weights the engines hold (None: unknown)
        # A push failed part way: engines may hold some of its weights beside the last version's, until a push lands.
        self._partly_pushed = False
        # The engines' checksums when the last push landed: the next push's "before", unless an engine restarted or a
        # push failed since (None: taken anew), so that a push hashes the served weights once, not twice.
        self._landed_checksums: dict[int, str | None] | None = None
        self._adapters: dict[str, tuple[ray.ObjectRef, dict, int]] = {}  # name -> (tensors, PEFT config, version)
        # Held by a push or a restart: one at a time, so that a restarted engine is given the weights of the last
        # push that landed. Reentrant: a push whose engine died restarts it.
        self._engines_lock = threading.RLock()
        # Released memory per engine (MEMORY_TAGS); generations in flight, counted so that memory is released only
        # between them: both under _memory_lock.
        self._released: dict[int, set[str]] = {i: set() for i in range(rollout.num_engines)}
        self._generating = 0
        self._memory_lock = threading.Lock()
        self.engines = [self._start_engine(i) for i in range(rollout.num_engines)]

    def _launch_args(self, model_dir: str, weight_version: int) -> dict:
        return self.engine_class.launch_args(
            model_dir, weight_version, self._rollout, self._adapter_configs, self._trainer_resident_bytes
        )

    def _start_engine(self, index: int) -> ray.actor.ActorHandle:
        options = engine_options(self._engine_options, index, self._colocated)
        return ray.remote(self.engine_class).options(**options).remote(**self._engine_args)

    def locations(self) -> list[Location]:
        """Where each engine runs, as Ray assigned it."""
        return [location_of(engine) for engine in self.engines]

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order; engines that released their KV cache take it back first."""
        check_adapters_loaded(requests, self._adapters)
        if any(self._released.values()):
            with self._engines_lock, self._memory_lock:  # in this order everywhere: a resume may restart an engine
                self._resume({i: tags for i, tags in self._released.items() if tags}, [KV_CACHE])
        with self._memory_lock:
            if any(self._released.values()):
                raise RuntimeError(
                    "the engines released their weights for a train step: push weights before generating"
                )
            self._generating += 1
        try:
            return self._generate_on_engines(requests)
        finally:
            with self._memory_lock:
                self._generating -= 1

    def release_memory(self, weights: bool) -> None:
        """Colocated: every engine releases its KV cache, and its weights when `weights`, for the trainer beside it;
        a schedule asks it where no generation runs until the next push (`weights`) or the next generation (which
        takes the KV cache back). Not colocated, the engines keep their memory."""
        if self._trainer_resident_bytes is None:
            return
        tags = [KV_CACHE, WEIGHTS] if weights else [KV_CACHE]
        with self._engines_lock, self._memory_lock:
            if self._generating:  # a server asserts it is idle: its scheduler would die
                raise RuntimeError(f"release_memory with {self._generating} generations in flight")
            calls = {i: ([tag for tag in tags if tag not in held],) for i, held in self._released.items()}
            calls = {i: args for i, args in calls.items() if args[0]}
            if calls:
                self._on_engines(RolloutEngine.release_memory, calls)
                for i, (released,) in calls.items():
                    self._released[i].update(released)

    def _resume(self, released: dict[int, set[str]], tags: list[str]) -> None:
        """Engines in `released` take back the memory of `tags`; called holding _memory_lock."""
        calls = {i: ([tag for tag in tags if tag in held],) for i, held in released.items()}
        calls = {i: args for i, args in calls.items() if args[0]}
        if calls:
            self._on_engines(RolloutEngine.resume_memory, calls)
            for i, (resumed,) in calls.items():
                self._released[i].difference_update(resumed)

    def _generate_on_engines(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Contiguous shards, one per engine; per-request seeds make the result independent of the split."""
        shard = -(-len(requests) // len(self.engines))
        shards = {i: requests[i * shard : (i + 1) * shard] for i in range(len(self.engines))}
        calls = {i: (part,) for i, part in shards.items() if part}
        parts = self._on_engines(RolloutEngine.generate, calls, requests=len(requests))
        return [result for part in parts for result in part]

    def _on_every_engine(self, method: Callable, *args) -> list:
        return self._on_engines(method, dict.fromkeys(range(len(self.engines)), args))

    def _on_engines(
        self, method: Callable, args_by_engine: dict[int, tuple], alongside=None, requests: int | None = None
    ) -> list:
        """Run `engines[i].<method>(*args)` for each `i: args` and return the results in order; `method` is the
        RolloutEngine method (e.g. `RolloutEngine.generate`). `alongside()` runs here while the engines'
        calls are in flight (the sender of a weight broadcast). A generation of `requests` requests reports its
        progress while it runs long (`GenerationReport`).

        When an engine died or gave no answer within timeout_s, the dead and hung engines are restarted and
        EngineRestarted is raised; any other error (a rejected request, a failed argument) is raised as it is.
        """
        what = method.__name__
        used = {i: self.engines[i] for i in args_by_engine}
        report = GenerationReport(used, requests) if requests is not None else None
        refs = {i: getattr(used[i], what).remote(*args) for i, args in args_by_engine.items()}
        sender_error = None
        if alongside is not None:
            try:
                alongside()
            except Exception as exc:  # noqa: BLE001 - the engines' side ends too, and an engine's death comes first
                sender_error = exc
        hung = self._wait_while_healthy(refs, used, report)
        cause = None
        if hung:
            reason = f"engines {sorted(hung)} gave no answer within {self.timeout_s:g} s and failed their health check"
        else:
            try:
                results = ray.get(list(refs.values()))
            except (ray.exceptions.RayActorError, EngineUnavailable) as exc:
                cause, reason = (
                    exc,
                    _start_failure(exc) if getattr(exc, "actor_init_failed", False) else first_line(exc),
                )
            except Exception as exc:
                raise exc from sender_error
            else:
                if sender_error is not None:
                    raise sender_error
                return results
        restarted = self._restart_engines(hung, used)
        if not restarted:  # every engine passes its health check: the failure was not theirs (e.g. an argument's)
            raise cause
        raise EngineRestarted(
            f"{what} failed ({reason}); restarted engines {restarted} with weight version {self._weight_version}"
            f" and adapters {self.adapter_versions()}; a retry runs on the restarted engines"
        ) from cause

    def _wait_while_healthy(
        self,
        refs: dict[int, ray.ObjectRef],
        used: dict[int, ray.actor.ActorHandle],
        report: GenerationReport | None = None,
    ) -> set[int]:
        """Wait for every call. Each time `timeout_s` passes, the engines whose calls have not finished are
        health-checked: the healthy ones (a long batch) are waited for again, and those that fail are hung. A
        `report` is given its turns in between."""
        pending = dict(refs)
        health_check_at = time.monotonic() + self.timeout_s
        while pending:
            wake_at = health_check_at if report is None else min(health_check_at, report.due_at)
            _, not_ready = ray.wait(
                list(pending.values()), num_returns=len(pending), timeout=max(0.0, wake_at - time.monotonic())
            )
            pending = {i: ref for i, ref in pending.items() if ref in not_ready}
            if not pending:
                break
            if report is not None and time.monotonic() >= report.due_at:
                report.log()
            if time.monotonic() >= health_check_at:
                hung = {i for i in pending if not _healthy(used[i], min(HEALTH_TIMEOUT_S, self.timeout_s))}
                if hung:
                    return hung
                health_check_at = time.monotonic() + self.timeout_s
        return set()

    def _restart_engines(self, hung: set[int], used: dict[int, ray.actor.ActorHandle]) -> list[int]:
        """Replace the engines in `hung` and those that fail a health check; returns the replaced indices, with those
        another caller replaced since `used` (the engines the failed call went to) were taken."""
        with self._engines_lock:
            return self._replace_engines(hung, used)

    def _replace_engines(self, hung: set[int], used: dict[int, ray.actor.ActorHandle]) -> list[int]:
        replaced_before = [i for i, engine in used.items() if self.engines[i] is not engine]
        restarted = []
        for i, engine in enumerate(self.engines):
            if i not in replaced_before and (i in hung or not _healthy(engine)):
                log.warning("restarting engine %d", i)
                if i not in hung:  # a live actor stops its server first, so the new one finds the GPU memory free
                    _try_shutdown(engine)
                ray.kill(engine)
                self.engines[i] = self._start_engine(i)
                self._released[i] = set()
                restarted.append(i)
        if restarted:
            self._landed_checksums = None
        # A fresh engine holds the weights it was started from: give it the current weights and adapters.
        if restarted and self._push is not None:
            push, targets = self._push.refill(restarted, len(self.engines))
            for calls in push.rounds(targets):
                refs = {i: getattr(self.engines[i], push.method.__name__).remote(*args) for i, args in calls.items()}
                try:
                    push.send()
                finally:
                    results = dict(zip(refs, ray.get(list(refs.values())), strict=True))
                push.check(results)
            if push.probe is not None:
                served = ray.get([self.engines[i].sequence_logprobs.remote(push.probe.token_ids) for i in targets])
                push.probe.check_all(dict(zip(targets, served, strict=True)), push.version)
            self._push, self._weight_version = push, push.version
            known = push.probe is not None and not self._partly_pushed  # the others may hold part of a failed push
            self._held = push.probe.fingerprint if known else None
        for i in restarted:
            for name, (tensors_ref, config, version) in self._adapters.items():
                ray.get(self.engines[i].load_adapter.remote(name, tensors_ref, config, version))
        return sorted([*replaced_before, *restarted])

    def adapter_versions(self) -> dict[str, int]:
        return {name: version for name, (_, _, version) in self._adapters.items()}

    def weight_version(self) -> int:
        return self._weight_version

    def serves(self, version: int) -> bool:
        """Every engine holds weights `version`, in memory (none released its weights since)."""
        return (
            version == self._weight_version
            and not self._partly_pushed
            and not any(WEIGHTS in tags for tags in self._released.values())
        )

    def update_weights(self, push: WeightPush) -> None:
        """Push full weights to every engine as `push.version` (a push of the version they serve is skipped). Engines
        that released their memory take back their weights' first and their KV cache after: the push's buffers and
        the trainer's still fit beside the weights alone."""
        if self.serves(push.version):
            return
        with self._engines_lock:
            engines = range(len(self.engines))
            with self._memory_lock:
                released = {i: set(tags) for i, tags in self._released.items() if tags}
            before = (self._landed_checksums or self._checksums(released)) if push.probe is not None else {}
            self._landed_checksums = None
            with self._memory_lock:
                self._resume(released, [WEIGHTS])
            pushed = list(self.engines)
            try:
                for calls in push.rounds(engines):
                    results = self._on_engines(push.method, calls, alongside=push.send)
                    push.check(dict(zip(calls, results, strict=True)))
            except BaseException:
                self._stopped_part_way(push, [engine for engine in pushed if engine in self.engines])
                raise
            with self._memory_lock:
                self._resume(released, [KV_CACHE])
            after = self._checksums() if push.probe is not None else None
            if push.probe is not None:
                push.probe.check_moved(self._held, before, after, push.version)
                served = self._on_every_engine(RolloutEngine.sequence_logprobs, push.probe.token_ids)
                push.probe.check_all(dict(enumerate(served)), push.version)
            self._push, self._weight_version, self._partly_pushed = push, push.version, False
            self._held = push.probe.fingerprint if push.probe is not None else None
            self._landed_checksums = after
        push.landed()

    def _stopped_part_way(self, push: WeightPush, survivors: list[ray.actor.ActorHandle]) -> None:
        """A push failed with its weights loaded on some engines, or some of its rounds on all: what they hold is
        unknown until a push lands (the next goes to every engine, and its check cannot ask that the weights moved).
        The engines it reached that were not restarted end a push of several rounds, so that they generate again."""
        self._partly_pushed, self._held = True, None
        if push.close is None:
            return
        for engine in survivors:
            try:
                ray.get(getattr(engine, push.close.__name__).remote(), timeout=HEALTH_TIMEOUT_S)
            except (ray.exceptions.RayError, EngineUnavailable) as exc:  # a dead engine restarts at its next call
                log.warning("an engine could not end the stopped push: %s", first_line(exc))

    def _checksums(self, released: dict[int, set[str]] | None = None) -> dict[int, str | None]:
        """Each engine's weights checksum; None for those that released their weights (and hold none to hash)."""
        asked = {i: () for i in range(len(self.engines)) if WEIGHTS not in (released or {}).get(i, ())}
        answers = dict(zip(asked, self._on_engines(RolloutEngine.weights_checksum, asked), strict=True))
        return {i: answers.get(i) for i in range(len(self.engines))}

    def hold(self, probe: WeightProbe) -> None:
        """The engines serve the weights `probe` was taken of (they started from the trainer's checkpoint): the next
        push is checked to move them."""
        self._held = probe.fingerprint

    def load_adapter(self, name: str, tensors_ref: ray.ObjectRef, config: dict, version: int) -> None:
        """Load or replace LoRA adapter `name` on every engine as `version`; the other adapters are untouched,
        and a push of the version the engines hold is skipped."""
        if name in self._adapters and self._adapters[name][2] == version:
            return
        with self._engines_lock:
            self._on_every_engine(RolloutEngine.load_adapter, name, tensors_ref, config, version)
            self._adapters[name] = (tensors_ref, config, version)

    def unload_adapter(self, name: str) -> None:
        with self._engines_lock:
            self._on_every_engine(RolloutEngine.unload_adapter, name)
            self._adapters.pop(name, None)

    def start_again(self, model_dir: str, weight_version: int) -> None:
        """After `shutdown`: as many engines as before, started from `model_dir` at `weight_version`, with the adapters
        they served."""
        with self._engines_lock:
            args = self._launch_args(model_dir, weight_version)
            self._released = {i: set() for i in range(self._rollout.num_engines)}
            self._engine_args, self._push, self._weight_version, self._held = args, None, weight_version, None
            self._partly_pushed = False
            self._landed_checksums = None
            self.engines = [self._start_engine(i) for i in range(self._rollout.num_engines)]
            for name, (tensors_ref, config, version) in self._adapters.items():
                self._on_every_engine(RolloutEngine.load_adapter, name, tensors_ref, config, version)

    def shutdown(self) -> None:
        for engine in self.engines:
            _try_shutdown(engine)
            ray.kill(engine)
        self.engines = []


def _start_failure(exc: ray.exceptions.RayActorError) -> str:
    """An engine that failed to start: its own error (for SGLang, the server's log tail), without Ray's traceback."""
    lines = str(exc).splitlines()
    errors = [i for i, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception): ", line)]
    return "failed to start: " + "\n".join(lines[errors[-1] :] if errors else lines[:1])


def _try_shutdown(engine: ray.actor.ActorHandle) -> None:
    try:
        ray.get(engine.shutdown.remote(), timeout=HEALTH_TIMEOUT_S)
    except (ray.exceptions.RayError, EngineUnavailable):
        pass  # dead or hung: ray.kill ends it, and its server dies with it


class GenerationReport:
    """A log line on a generation that runs long: PROGRESS_AFTER_S after it began, then every PROGRESS_EVERY_S. It
    counts what the engines it runs on finished since it began (their `progress`; a concurrent caller's requests on
    the same engines count too) against its own number of requests."""

    def __init__(self, engines: dict[int, ray.actor.ActorHandle], requests: int):
        self.engines = engines
        self.requests = requests
        self.started = time.monotonic()
        self.due_at = self.started + PROGRESS_AFTER_S
        self._baseline = [engine.progress.remote() for engine in engines.values()]  # read when first needed

    def log(self) -> None:
        self.due_at = time.monotonic() + PROGRESS_EVERY_S
        try:
            now = ray.get([engine.progress.remote() for engine in self.engines.values()], timeout=HEALTH_TIMEOUT_S)
            then = ray.get(self._baseline, timeout=HEALTH_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            log.info(
                "generating %d requests for %.0f s; engine progress unavailable: %s",
                self.requests,
                time.monotonic() - self.started,
                first_line(exc),
            )
            return
        done = sum(now, GenerationProgress()) - sum(then, GenerationProgress())
        elapsed = time.monotonic() - self.started
        log.info(
            "generating: %d of %d requests done, %d tokens (%.0f tokens/s) in %.0f s",
            min(done.requests_finished, self.requests),
            self.requests,
            done.tokens_generated,
            done.tokens_generated / elapsed,
            elapsed,
        )


def _healthy(engine: ray.actor.ActorHandle, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        return bool(ray.get(engine.health.remote(), timeout=timeout_s))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
