"""InferenceController: owns the engine actors, spreads requests over them and pushes versioned weights."""

from __future__ import annotations

import ray

from miles.cluster import actor_options
from miles.engines.base import GenerateRequest, GenerateResult
from miles.engines.torch_engine import TorchEngine


class InferenceController:
    def __init__(self, model_dir: str, weight_version: int, num_engines: int, num_threads: int):
        engine_cls = ray.remote(TorchEngine)
        self.engines = [
            engine_cls.options(**actor_options()).remote(model_dir, weight_version=weight_version, num_threads=num_threads)
            for _ in range(num_engines)
        ]
        self._weight_version = weight_version

    def generate(self, requests: list[GenerateRequest], seed: int) -> list[GenerateResult]:
        """Split the batch into contiguous shards, one per engine, and return results in request order."""
        shard = -(-len(requests) // len(self.engines))
        calls = [
            engine.generate.remote(requests[i * shard : (i + 1) * shard], seed + i)
            for i, engine in enumerate(self.engines)
            if requests[i * shard : (i + 1) * shard]
        ]
        return [result for part in ray.get(calls) for result in part]

    def update_weights(self, weights_ref: ray.ObjectRef, version: int) -> None:
        """Push weights to every engine; the caller guarantees that no generation is in flight."""
        if version == self._weight_version:
            return
        ray.get([engine.update_weights.remote(weights_ref, version) for engine in self.engines])
        self._weight_version = version

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)
        self.engines = []
