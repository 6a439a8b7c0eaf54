"""What every RL flow shows in the UI: progress, a per-iteration metrics table, a markdown summary with the reward
curve and each eval data set's curve drawn in it (data-URI PNGs, so the UI needs no file server). The evaluate task
makes each eval data set's table."""

from __future__ import annotations

from typing import Any

from prefect import runtime
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from control.events import IterationEvents
from miles.multi_lora.run import AdapterRun
from miles.observe.plots import data_uri
from miles.run import RLRun
from tasks.artifacts import table_rows
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
    """The UI side of one policy's iterations in a flow run (the full model, or one adapter): progress, events
    (logging.events), and the tables and summary written at the end of a flow run that did not fail."""

    def __init__(self, run: RLRun | AdapterRun, flow_name: str):
        self.run = run
        self.flow_name = flow_name
        self.records: list[dict[str, Any]] = []
        self.events = IterationEvents(run) if run.config.logging.events else None
        self.shown = int(100 * run.rollout_ids().start / self.total)
        self.progress = create_progress_artifact(
            progress=float(self.shown), key=f"{flow_name}-progress", description=f"rollouts of {run.config.run_dir}"
        )

    @property
    def total(self) -> int:
        """The run's rollouts, as its config's changes leave it."""
        return self.run.config.final.num_rollout

    def __enter__(self) -> RunReport:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.events is not None:
            self.events.close()
        if exc_type is None:
            self.finish()

    def iteration_done(self, rollout_id: int) -> None:
        record = self.run.finish_iteration(rollout_id)
        self.records.append(record)
        if self.events is not None:
            self.events.iteration(record)
        percent = min(100, int(100 * (rollout_id + 1) / self.total))
        if percent > self.shown:  # one update per whole percent keeps API writes off the hot path
            update_progress_artifact(artifact_id=self.progress, progress=float(percent))
            self.shown = percent

    def finish(self) -> None:
        """Write the metrics table and the markdown summary with the curves (nothing when no iteration ran)."""
        if not self.records:
            return
        last = self.records[-1]["rollout_id"]
        create_table_artifact(
            key=f"{self.flow_name}-metrics",
            table=table_rows(self.records, TABLE_COLUMNS.__contains__),
            description=f"per-iteration metrics of {self.run.config.run_dir}",
        )
        run_dir = self.run.run_dir
        curves = self.run.iterations.plot_curves()
        curve = curves.pop("reward_curve")
        lines = [
            f"# {self.flow_name}: rollouts {self.records[0]['rollout_id']}..{last} of {self.total}",
            "",
            "| | |",
            "|---|---|",
            f"| final reward (rollout {last}) | {self.records[-1]['reward_mean']:.3f} |",
            f"| mean reward, this flow run | {sum(r['reward_mean'] for r in self.records) / len(self.records):.3f} |",
            *(
                f"| eval {dataset} at rollout {r['rollout_id']} | {_eval_line(r)} |"
                for dataset, evaluations in self.evaluations().items()
                for r in _first_and_last(evaluations)
            ),
            f"| checkpoint | `{run_dir.checkpoint(last).resolve()}` |",
            f"| rollouts (Arrow IPC) | `{run_dir.rollouts.resolve()}` |",
            f"| metrics | `{run_dir.metrics_path.resolve()}` |",
            f"| reward curve | `{curve.resolve()}` |",
            "",
            f"![reward curve of {run_dir.path.name}]({data_uri(curve)})",
            *(f"\n![{key.replace('/', ' ')} of {run_dir.path.name}]({data_uri(png)})" for key, png in curves.items()),
        ]
        create_markdown_artifact(key=f"{self.flow_name}-summary", markdown="\n".join(lines), description="run summary")

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": self.run.config.run_dir,
            "rollouts_trained": len(self.records),
            "final_reward_mean": self.records[-1]["reward_mean"] if self.records else None,
            "task_runs": finished_task_runs(runtime.flow_run.id),  # of the whole flow run
            "eval": self.evaluations(),
        }

    def evaluations(self) -> dict[str, list[dict[str, Any]]]:
        """Each eval data set's evaluations in the run so far (every start), in rollout order."""
        found: dict[str, list[dict[str, Any]]] = {}
        for record in self.run.run_dir.evaluations():
            found.setdefault(record["eval"], []).append(record)
        return found


def _first_and_last(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return records if len(records) <= 2 else [records[0], records[-1]]


def _eval_line(record: dict[str, Any]) -> str:
    return ", ".join(
        f"{key.replace('_at_', '@')} {value:.3f}"
        for key, value in record.items()
        if key == "reward_mean" or key.startswith("pass_at_")
    )
