"""Prefect events of an RL flow run, and the automations that act on them.

Events (the resource is the flow run, `prefect.flow-run.<id>`, labelled with the run directory; each event's id is
derived from the run directory and rollout, so a retried step's event is the same event):
- `miles.iteration.finished`: every iteration, with its metrics (reward, loss, grad norm, KL, entropy, staleness,
  phase times, failed samples; a value that is not finite as null) and what is unhealthy about it;
- `miles.iteration.unhealthy`: a value that is not finite, or a reward failing on many samples (miles.observe.alerts);
- `miles.reward.collapsed`: the reward's latest window mean fell below alerts.reward_collapse_drop of its best;
- `miles.checkpoint.saved`: a checkpoint (its resource, labelled with its path, kind (model or adapter), rollout,
  run directory and the flow run that saved it): rl-eval's trigger.

Automations: control/automations.py ships those that pause a run on either alert; each flow run keeps one of its own that flags it Stalled (a Running state of that name) when neither an iteration nor a
change of its state has come for alerts.stall_factor times its median iteration time (at least alerts.min_stall_s),
and deletes it at its end; a crashed flow process is flagged so too. They need an API whose triggers
service runs (`prefect server start`); the embedded API runs none.
"""

from __future__ import annotations

import logging
import math
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import NAMESPACE_URL, UUID, uuid5

from prefect import runtime
from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.events import emit_event

from miles.observe.alerts import RewardCollapse, unhealthy
from miles.state.checkpoint import MODEL_DIR

log = logging.getLogger(__name__)

ITERATION = "miles.iteration.finished"
UNHEALTHY = "miles.iteration.unhealthy"
COLLAPSED = "miles.reward.collapsed"
CHECKPOINT = "miles.checkpoint.saved"
STALLED = "Stalled"

PAYLOAD = (
    "rollout_id",
    "adapter",
    "reward_mean",
    "response_length_mean",
    "samples",
    "failed_samples",
    "loss",
    "pg_loss",
    "grad_norm",
    "kl_ref",
    "entropy",
    "clip_fraction",
    "staleness_mean",
    "lr",
    "time_generate",
    "time_get",
    "time_train",
    "time_sync",
    "finished_at",
)
# Iterations whose times a stall window is measured on; the window is set again when it would change by half.
STALL_AFTER_ITERATIONS = 3


def _event_id(*parts: Any) -> UUID:
    return uuid5(NAMESPACE_URL, "/".join(map(str, parts)))


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class IterationEvents:
    """The events of one policy's iterations in this flow run (the full model, or one adapter), and its stall
    automation."""

    def __init__(self, run: Any):
        context = FlowRunContext.get()
        self.flow_run = context.flow_run
        self.run_dir = str(run.run_dir.path)
        self.alerts = run.config.alerts
        self.resource = {
            "prefect.resource.id": f"prefect.flow-run.{self.flow_run.id}",
            "prefect.resource.name": self.flow_run.name,
            "miles.run-dir": self.run_dir,
            "miles.flow": context.flow.name,
        }
        history = [r["reward_mean"] for r in run.run_dir.metrics()]
        self.collapse = RewardCollapse(self.alerts, history)
        self.finished_at: list[float] = []
        self.stall_window_s: float | None = None
        self.stall_automation: Automation | None = None
        adapter = getattr(run, "name", None)  # an adapter's run; each adapter of a flow run keeps its own
        self.watched = f"{self.flow_run.name} ({adapter})" if adapter else self.flow_run.name

    def iteration(self, record: dict[str, Any]) -> None:
        rollout_id = record["rollout_id"]
        problems = unhealthy(record, self.alerts)
        payload = {key: _json_number(record[key]) for key in PAYLOAD if key in record}
        self._emit(ITERATION, rollout_id, {**payload, "unhealthy": problems})
        if problems:
            self._emit(UNHEALTHY, rollout_id, {"rollout_id": rollout_id, "problems": problems})
        collapse = self.collapse.update(record["reward_mean"])
        if collapse is not None:
            self._emit(COLLAPSED, rollout_id, {"rollout_id": rollout_id, **collapse})
        self.finished_at.append(record["finished_at"])
        self._watch_for_stalls()

    def _emit(self, event: str, rollout_id: int, payload: dict[str, Any]) -> None:
        emit_event(event, self.resource, payload=payload, id=_event_id(self.run_dir, event, rollout_id))

    def _watch_for_stalls(self) -> None:
        if len(self.finished_at) <= STALL_AFTER_ITERATIONS:
            return
        times = [b - a for a, b in zip(self.finished_at, self.finished_at[1:], strict=False)]
        window = max(self.alerts.min_stall_s, self.alerts.stall_factor * statistics.median(times))
        if self.stall_window_s is not None and abs(window - self.stall_window_s) < self.stall_window_s / 2:
            return
        self.stall_window_s = window
        automation = _stall_automation(self.flow_run.id, self.watched, window, self.alerts.stall_factor)
        try:
            if self.stall_automation is None:
                self.stall_automation = automation.create()
            else:
                automation.id = self.stall_automation.id
                automation.update()
        except Exception as exc:  # noqa: BLE001 - the run goes on without the flag; the API says why
            log.warning("the stall automation of %s could not be written: %s", self.watched, exc)

    def close(self) -> None:
        """A run that ends stops being watched for stalls."""
        if self.stall_automation is not None:
            try:
                self.stall_automation.delete()
            except Exception as exc:  # noqa: BLE001 - an automation left behind flags nothing: no iteration follows
                log.warning("the stall automation of %s was not deleted: %s", self.watched, exc)


def _stall_automation(flow_run_id: UUID, watched: str, window_s: float, factor: float) -> Automation:
    resource_id = f"prefect.flow-run.{flow_run_id}"
    return Automation(
        name=f"miles: {watched} stalled",
        description=f"flags flow run {watched} when no iteration finishes for {window_s:.0f} s "
        f"({factor:g}x its median iteration time)",
        trigger=EventTrigger(
            match={"prefect.resource.id": resource_id},
            after={ITERATION},
            # Any state change of the flow run counts too: a run paused by its user, or ended, is not stalled.
            expect={ITERATION, "prefect.flow-run.*"},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=window_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.RUNNING,
                name=STALLED,
                message=f"no iteration finished for {window_s:.0f} s ({factor:g}x the median iteration time)",
                force=True,
            )
        ],
    )


def emit_checkpoint(run: Any, rollout_id: int, path: str) -> None:
    """The event of a checkpoint just saved (an `rl-eval` deployment's trigger)."""
    emit_event(
        CHECKPOINT,
        {
            "prefect.resource.id": f"miles.checkpoint.{path}",
            "prefect.resource.name": f"{run.run_dir.path.name} checkpoint {rollout_id}",
            "miles.checkpoint-path": path,
            "miles.checkpoint-kind": "model" if (Path(path) / MODEL_DIR).is_dir() else "adapter",
            "miles.rollout-id": str(rollout_id),
            "miles.run-dir": str(run.run_dir.path),
            "miles.flow-run-id": str(runtime.flow_run.id),
        },
        payload={"rollout_id": rollout_id, "path": path},
        id=_event_id(path, CHECKPOINT),
    )
