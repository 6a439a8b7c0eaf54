"""Built-in verifiable tasks: each is a prompt/label table plus the reward that grades it."""

from miles.envs.arithmetic import TASKS, task_rows

__all__ = ["TASKS", "task_rows"]
