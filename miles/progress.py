"""Per-iteration progress: a rich bar and one line per rollout on a terminal, log lines elsewhere."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def format_record(record: dict, total: int) -> str:
    return (
        f"rollout {record['rollout_id'] + 1}/{total}  reward {record['reward_mean']:.3f}  "
        f"len {record['response_length_mean']:.2f}  gen {record['time_generate']:.2f}s  "
        f"train {record['time_train']:.2f}s  sync {record['time_sync']:.2f}s"
    )


class IterationReporter:
    def __init__(self, total: int, done: int):
        self.total = total
        self.progress = None
        if sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"), console=Console(), transient=False,
            )
            self.task = self.progress.add_task("", total=total, completed=done)
            self.progress.start()

    def update(self, record: dict) -> None:
        line = format_record(record, self.total)
        if self.progress is None:
            print(line, flush=True)
            return
        self.progress.console.print(line)
        self.progress.update(self.task, completed=record["rollout_id"] + 1, description=f"reward {record['reward_mean']:.3f}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
