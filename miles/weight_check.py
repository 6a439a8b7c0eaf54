"""Checking that a weight push landed: the engines' log-probs of one fixed token sequence against the trainer's.

An engine can report a load successful and not serve the weights sent: SGLang loads tensors by name and skips, with
a warning, every name its model does not know. Reading the weights back (SGLang's `/get_weights_by_name`) works only
for the model classes that implement it, which Qwen's do not, so every push to such a model would fail. What works
for any model is what the weights are for: the trainer scores `probe_ids` with the weights it pushes, every engine
scores them with the weights it then serves, and the two agree within `rollout.push_check_atol` (mean absolute
difference per token, which covers the rounding of a bf16 engine and its kernels). A push whose weights differ from
the version before by less than that tolerance cannot be told from a lost one; the check catches the drift once it
grows past it.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_TOKENS = 16
_STRIDE = 7919  # a prime: consecutive probe tokens are far apart in any vocabulary


def probe_ids(vocab_size: int, length: int = PROBE_TOKENS) -> list[int]:
    """The fixed sequence every push of every run is checked on: it strides through the vocabulary."""
    return [(1 + i * _STRIDE) % vocab_size for i in range(length)]


@dataclass(frozen=True)
class WeightProbe:
    """The trainer's log-probs of `token_ids[1:]`, each given the tokens before it, under the pushed weights."""

    token_ids: list[int]
    logprobs: list[float]
    atol: float

    def check(self, served: list[float], engine: str, version: int) -> None:
        """Raise ValueError when `served` (an engine's log-probs of the same tokens) is not the trainer's."""
        if len(served) != len(self.logprobs):
            raise ValueError(
                f"{engine} scored {len(served)} tokens of the {len(self.logprobs)}-token push check of weights "
                f"version {version}"
            )
        gap = sum(abs(a - b) for a, b in zip(served, self.logprobs, strict=True)) / len(served)
        if not gap <= self.atol:  # a NaN fails too
            raise ValueError(
                f"{engine} reported weights version {version} loaded, but does not serve them: its log-probs of the "
                f"push-check sequence differ from the trainer's by {gap:.3g} per token (rollout.push_check_atol="
                f"{self.atol:g}); SGLang skips the tensor names its model does not know, so check that the trainer's "
                f"names are the model's"
            )

    def check_all(self, served: dict[int, list[float]], version: int) -> None:
        """`check` for each engine's log-probs (engine index -> its log-probs)."""
        for index, logprobs in sorted(served.items()):
            self.check(logprobs, f"engine {index}", version)
