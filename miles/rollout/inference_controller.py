"""InferenceController: owns the engine actors, batches concurrent callers together, pushes versioned weights.

Several callers (the branches of the multi-LoRA flow) may call `generate` at once: calls that arrive while a
batch is on the engines are merged into the next batch, so requests of different adapters share one forward
pass. Weight and adapter pushes wait for the batch on the engines; a generation never sees weights change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import ray

from miles.cluster import actor_options
from miles.engines.base import GenerateRequest, GenerateResult
from miles.engines.torch_engine import TorchEngine


@dataclass
class _Call:
    requests: list[GenerateRequest]
    results: list[GenerateResult] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class InferenceController:
    def __init__(self, model_dir: str, weight_version: int, num_engines: int, num_threads: int, device: str = "cpu"):
        engine_cls = ray.remote(TorchEngine)
        self.engines = [
            engine_cls.options(**actor_options(device)).remote(
                model_dir, weight_version=weight_version, device=device, num_threads=num_threads
            )
            for _ in range(num_engines)
        ]
        self._weight_version = weight_version
        self._adapter_versions: dict[str, int] = {}
        self._pending: list[_Call] = []
        self._pending_lock = threading.Lock()
        self._engines_busy = threading.Lock()  # held while a batch or a weight push is on the engines

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order. The caller that gets the engines first generates every pending call."""
        unknown = sorted({r.adapter for r in requests if r.adapter is not None and r.adapter not in self._adapter_versions})
        if unknown:  # refused before merging, so that a bad caller never fails the callers batched with it
            raise ValueError(f"requests name adapters that are not loaded: {unknown}; loaded: {sorted(self._adapter_versions)}")
        call = _Call(requests)
        with self._pending_lock:
            self._pending.append(call)
        with self._engines_busy:
            if not call.done.is_set():
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._run_batch(batch)
        if call.error is not None:
            raise call.error
        return call.results

    def _run_batch(self, batch: list[_Call]) -> None:
        requests = [r for call in batch for r in call.requests]
        try:
            results = self._generate_on_engines(requests)
        except BaseException as exc:
            for call in batch:
                call.error = exc
                call.done.set()
            return
        start = 0
        for call in batch:
            call.results = results[start : start + len(call.requests)]
            start += len(call.requests)
            call.done.set()

    def _generate_on_engines(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Contiguous shards, one per engine; per-request seeds make the result independent of the split."""
        shard = -(-len(requests) // len(self.engines))
        calls = [
            engine.generate.remote(requests[i * shard : (i + 1) * shard])
            for i, engine in enumerate(self.engines)
            if requests[i * shard : (i + 1) * shard]
        ]
        return [result for part in ray.get(calls) for result in part]

    def update_weights(self, weights_ref: ray.ObjectRef, version: int) -> None:
        """Push full weights to every engine as `version` (a push of the version they hold is skipped)."""
        if version == self._weight_version:
            return
        with self._engines_busy:
            ray.get([engine.update_weights.remote(weights_ref, version) for engine in self.engines])
        self._weight_version = version

    def load_adapter(self, name: str, tensors_ref: ray.ObjectRef, config: dict, version: int) -> None:
        """Load or replace LoRA adapter `name` on every engine as `version`; the other adapters are untouched,
        and a push of the version the engines hold is skipped."""
        if self._adapter_versions.get(name) == version:
            return
        with self._engines_busy:
            ray.get([engine.load_adapter.remote(name, tensors_ref, config, version) for engine in self.engines])
        self._adapter_versions[name] = version

    def unload_adapter(self, name: str) -> None:
        with self._engines_busy:
            ray.get([engine.unload_adapter.remote(name) for engine in self.engines])
        self._adapter_versions.pop(name, None)

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)
        self.engines = []
