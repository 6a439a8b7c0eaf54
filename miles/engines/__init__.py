"""Rollout engines behind one protocol; the InferenceController speaks only that protocol."""

from miles.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams

__all__ = ["GenerateRequest", "GenerateResult", "RolloutEngine", "SamplingParams"]
