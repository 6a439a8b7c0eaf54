"""The run's state on disk: the run directory (the source of truth) and its lock, atomic writes, checkpoints, and
every seed derived from the run's."""
