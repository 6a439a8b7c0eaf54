"""What every RL flow shows in the UI: progress, a per-iteration metrics table, a markdown summary, the reward curve."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.runtime import wait_for_task_history
from miles.run import RLRun
from tasks import evaluate

TABLE_COLUMNS = ("rollout_id", "reward_mean", "response_length_mean", "failed_samples", "loss", "grad_norm", "clip_fraction",
                 "entropy", "staleness_mean", "time_generate", "time_get", "time_train", "time_sync")


class RunReport:
    """Used as `with RunReport(run, name) as report:`; leaving the block waits until the API holds the task history."""

    def __init__(self, run: RLRun, flow_name: str):
        self.run = run
        self.flow_name = flow_name
        self.records: list[dict[str, Any]] = []
        self.task_runs = 0
        self.total = run.config.num_rollout
        self.shown = int(100 * run.start_rollout_id / self.total)
        self.progress = create_progress_artifact(
            progress=float(self.shown), key=f"{flow_name}-progress", description=f"rollouts of {run.config.run_dir}"
        )
        self.evaluation: dict[str, float] = {}

    def iteration_done(self, rollout_id: int) -> None:
        self.records.append(self.run.finish_iteration(rollout_id))
        percent = int(100 * (rollout_id + 1) / self.total)
        if percent > self.shown:  # one update per whole percent keeps API writes off the hot path
            update_progress_artifact(artifact_id=self.progress, progress=float(percent))
            self.shown = percent

    def finish(self) -> None:
        """Evaluate the final checkpoint; write the metrics table, the markdown summary and the reward curve."""
        if not self.records:
            return
        last = self.records[-1]["rollout_id"]
        self.evaluation = evaluate(self.run, last)
        self.task_runs += 1
        create_table_artifact(
            key=f"{self.flow_name}-metrics",
            table=[{k: round(v, 4) if isinstance(v := r.get(k), float) else v for k in TABLE_COLUMNS} for r in self.records],
            description=f"per-iteration metrics of {self.run.config.run_dir}",
        )
        run_dir = self.run.run_dir.resolve()
        curve = self.run.plot_reward_curve()
        lines = [
            f"# {self.flow_name}: rollouts {self.records[0]['rollout_id']}..{last} of {self.total}",
            "",
            "| | |",
            "|---|---|",
            f"| final reward (rollout {last}) | {self.records[-1]['reward_mean']:.3f} |",
            f"| mean reward, this flow run | {sum(r['reward_mean'] for r in self.records) / len(self.records):.3f} |",
            *(f"| {k.replace('_', ' ')} | {v:.3f} |" for k, v in self.evaluation.items()),
            f"| checkpoint | `{run_dir / 'checkpoints' / str(last)}` |",
            f"| rollouts (Arrow IPC) | `{run_dir / 'rollouts'}` |",
            f"| metrics | `{run_dir / 'metrics.jsonl'}` |",
            f"| reward curve | `{curve.resolve()}` |",
        ]
        create_markdown_artifact(key=f"{self.flow_name}-summary", markdown="\n".join(lines), description="run summary")

    def __enter__(self) -> "RunReport":
        return self

    def __exit__(self, *exc) -> None:
        wait_for_task_history(self.task_runs)  # also after a failure: the failed run's history is what people read

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.config.run_dir,
            "rollouts_trained": len(self.records),
            "final_reward_mean": self.records[-1]["reward_mean"] if self.records else None,
            "task_runs": self.task_runs,
            **self.evaluation,
        }
