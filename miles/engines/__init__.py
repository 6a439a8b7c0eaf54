"""Rollout engines behind one protocol; the InferenceController speaks only that protocol."""

from miles.engines.base import EngineUnavailable, GenerateRequest, GenerateResult, RolloutEngine, SamplingParams

__all__ = ["EngineUnavailable", "GenerateRequest", "GenerateResult", "RolloutEngine", "SamplingParams"]
