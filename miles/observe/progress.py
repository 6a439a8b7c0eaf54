"""Progress of long work: a rich bar on a terminal, plain lines elsewhere (logs, CI, Prefect workers)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def format_record(record: dict, total: int) -> str:
    failed = f"  failed {record['failed_samples']}" if record.get("failed_samples") else ""
    return (
        f"rollout {record['rollout_id'] + 1}/{total}  reward {record['reward_mean']:.3f}  "
        f"len {record['response_length_mean']:.2f}{failed}  gen {record['time_generate']:.2f}s  "
        f"train {record['time_train']:.2f}s  sync {record['time_sync']:.2f}s"
    )


class ProgressLine:
    """A bar of `total` steps with a status text; `note` prints a line above it (or alone, off a terminal).

    Off a terminal, `echo_updates` prints each update's status as a line of its own.
    """

    def __init__(self, label: str, total: int, done: int = 0, echo_updates: bool = True):
        self.label = label
        self.echo_updates = echo_updates
        self.completed = done
        self.progress = None
        if sys.stdout.isatty():
            self.progress = Progress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=Console(),
            )
            self.task = self.progress.add_task("", total=total, completed=done)
            self.progress.start()

    def extend(self, steps: int) -> None:
        """`steps` more to go (work that joined since the start)."""
        if self.progress is not None:
            self.progress.update(self.task, total=self.progress.tasks[0].total + steps)

    def update(self, completed: int, status: str = "") -> None:
        self.completed = completed
        if self.progress is not None:
            self.progress.update(self.task, completed=completed, description=status)
        elif self.echo_updates and status:
            print(f"{self.label} {status}", flush=True)

    def note(self, line: str) -> None:
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.console.print(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class IterationReporter(ProgressLine):
    def __init__(self, total: int, done: int):
        super().__init__("RL", total, done, echo_updates=False)
        self.total = total

    def update_record(self, record: dict) -> None:
        self.note(format_record(record, self.total))
        self.update(record["rollout_id"] + 1, f"reward {record['reward_mean']:.3f}")


class AdapterReporter:
    """One adapter's iteration lines on the multi-LoRA run's shared bar (one step per trained rollout)."""

    def __init__(self, bar: ProgressLine, name: str, total: int):
        self.bar = bar
        self.name = name
        self.total = total

    def update_record(self, record: dict) -> None:
        self.bar.note(f"[{self.name}] {format_record(record, self.total)}")
        self.bar.update(self.bar.completed + 1, f"{self.name} reward {record['reward_mean']:.3f}")
