"""What every RL flow shows in the UI: progress, a per-iteration metrics table, a markdown summary with the reward
curve drawn in it (a data-URI PNG, so the UI needs no file server)."""

from __future__ import annotations

from typing import Any

from prefect import runtime
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from miles.multi_lora import AdapterRun
from miles.plots import data_uri
from miles.run import RLRun
from tasks.history import finished_task_runs

TABLE_COLUMNS = (
    "rollout_id",
    "reward_mean",
    "response_length_mean",
    "failed_samples",
    "loss",
    "grad_norm",
    "clip_fraction",
    "entropy",
    "staleness_mean",
    "time_generate",
    "time_get",
    "time_train",
    "time_sync",
)


class RunReport:
    """The UI side of one policy's iterations in a flow run (the full model, or one adapter)."""

    def __init__(self, run: RLRun | AdapterRun, flow_name: str):
        self.run = run
        self.flow_name = flow_name
        self.records: list[dict[str, Any]] = []
        self.evaluation: dict[str, float] = {}
        self.total = run.config.num_rollout
        self.shown = int(100 * run.rollout_ids().start / self.total)
        self.progress = create_progress_artifact(
            progress=float(self.shown), key=f"{flow_name}-progress", description=f"rollouts of {run.config.run_dir}"
        )

    def iteration_done(self, rollout_id: int) -> None:
        self.records.append(self.run.finish_iteration(rollout_id))
        percent = int(100 * (rollout_id + 1) / self.total)
        if percent > self.shown:  # one update per whole percent keeps API writes off the hot path
            update_progress_artifact(artifact_id=self.progress, progress=float(percent))
            self.shown = percent

    def finish(self, evaluation: dict[str, float]) -> None:
        """Write the metrics table, the markdown summary (with `evaluation`) and the reward curve."""
        self.evaluation = evaluation
        last = self.records[-1]["rollout_id"]
        create_table_artifact(
            key=f"{self.flow_name}-metrics",
            table=[{key: _rounded(record.get(key)) for key in TABLE_COLUMNS} for record in self.records],
            description=f"per-iteration metrics of {self.run.config.run_dir}",
        )
        run_dir = self.run.run_dir
        curve = self.run.iterations.plot_reward_curve()
        lines = [
            f"# {self.flow_name}: rollouts {self.records[0]['rollout_id']}..{last} of {self.total}",
            "",
            "| | |",
            "|---|---|",
            f"| final reward (rollout {last}) | {self.records[-1]['reward_mean']:.3f} |",
            f"| mean reward, this flow run | {sum(r['reward_mean'] for r in self.records) / len(self.records):.3f} |",
            *(f"| {k.replace('_', ' ')} | {v:.3f} |" for k, v in evaluation.items()),
            f"| checkpoint | `{run_dir.checkpoint(last).resolve()}` |",
            f"| rollouts (Arrow IPC) | `{run_dir.rollouts.resolve()}` |",
            f"| metrics | `{run_dir.metrics_path.resolve()}` |",
            f"| reward curve | `{curve.resolve()}` |",
            "",
            f"![reward curve of {run_dir.path.name}]({data_uri(curve)})",
        ]
        create_markdown_artifact(key=f"{self.flow_name}-summary", markdown="\n".join(lines), description="run summary")

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.config.run_dir,
            "rollouts_trained": len(self.records),
            "final_reward_mean": self.records[-1]["reward_mean"] if self.records else None,
            "task_runs": finished_task_runs(runtime.flow_run.id),  # of the whole flow run
            **self.evaluation,
        }


def _rounded(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value
