"""The weight-version rule, in one place: version 0 is the run's starting model; training rollout `rollout_id` makes
version `rollout_id + 1`, which the trainer holds from then on and the engines hold once it is synced to them.

Every sample records the version that generated it, so staleness, resume and the checkpoints' state.json all read
versions through `trained_version`; the driver's record of the trainer's version is `Iterations.trainer_version`,
and of the engines' the InferenceController's `weight_version()`.
"""


def trained_version(rollout_id: int) -> int:
    """The weight version that training `rollout_id` makes (`trained_version(-1)` is the starting model's, 0)."""
    return rollout_id + 1
